"""The Horovod engine: data parallelism through Horovod instead of torch DDP.

    make horovod
    horovodrun -np 2 -H localhost:2 --gloo python -m distlm train parallel.engine=horovod ...

Horovod's classic data-parallel recipe, in the same Trainer: ``hvd.init``, ``DistributedOptimizer``
with ``backward_passes_per_step`` for accumulation (one allreduce per optimizer step),
``broadcast_parameters`` / ``broadcast_optimizer_state`` from rank 0, ``allreduce`` for
metric averaging, and rank-0 checkpoints. Checkpoints are the same DCP folders the torch
engine writes (rank 0 writes them as a single process: every replica holds the same
state), so a Horovod run resumes under DDP, FSDP2 or one process, and back.
"""
from __future__ import annotations

import torch

from distlm.config import ConfigError, ParallelConfig


def _hvd():
    try:
        import horovod.torch as hvd
    except ImportError:
        raise ConfigError("parallel.engine=horovod but horovod is not installed: run `make horovod` "
                          "(builds 0.28.1 with the C++17 patch into .venv)") from None
    return hvd


class HorovodComm:
    """The collectives the Trainer needs, spelled in Horovod."""

    def __init__(self):
        self.hvd = _hvd()

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        return self.hvd.allreduce(t, op=self.hvd.Average)

    def max(self, t: torch.Tensor) -> torch.Tensor:
        return self.hvd.allreduce(t, op=self.hvd.Max)

    def barrier(self) -> None:
        self.hvd.barrier()

    def broadcast_object(self, obj, src: int = 0):
        return self.hvd.broadcast_object(obj, root_rank=src)


def init_horovod(pcfg: ParallelConfig, device_type: str):
    """hvd.init and the topology: Horovod is pure data parallelism (dp_replicate = size)."""
    from distlm.parallel.dims import ParallelDims

    class HorovodDims(ParallelDims):
        # No DeviceMesh under Horovod: the data-parallel rank is the Horovod rank.
        @property
        def dp_rank(self) -> int:
            return self.rank

    hvd = _hvd()
    hvd.init()
    # An axis that does not run under Horovod (Axis.engines) was refused with the config.
    if pcfg.dp_replicate not in (1, hvd.size()):
        raise ConfigError(f"parallel.dp_replicate={pcfg.dp_replicate} but horovodrun started {hvd.size()} processes")
    if device_type == "cuda":
        torch.cuda.set_device(hvd.local_rank())
    dims = HorovodDims(dp_replicate=hvd.size(), world_size=hvd.size(), rank=hvd.rank(),
                        local_rank=hvd.local_rank())
    dims.engine, dims.comm = "horovod", HorovodComm()
    return dims


def wrap_optimizer(optimizer, model: torch.nn.Module, accum_steps: int, fp16_compression: bool):
    """DistributedOptimizer: gradients are averaged once per optimizer step, after the last
    of ``accum_steps`` backward passes; fp16 compression halves the bytes on the wire."""
    hvd = _hvd()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if fp16_compression else hvd.Compression.none
    return hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                    backward_passes_per_step=accum_steps, compression=compression,
                                    op=hvd.Average)
