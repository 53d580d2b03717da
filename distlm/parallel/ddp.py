"""DDP: every rank holds the whole model; gradients are all-reduced in buckets.

    torchrun --nproc_per_node 4 -m distlm train model=gpt2-124m parallel.dp_replicate=4

Accumulation micro-steps skip the all-reduce through ``no_sync()`` (distlm.parallel.grad).
``parallel.grad_reduce_dtype=bf16`` all-reduces the buckets in bf16 (half the bytes).
"""
from __future__ import annotations

import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from distlm.config import ConfigError, ParallelConfig
from distlm.parallel.dims import ParallelDims


def apply_ddp(model: nn.Module, dims: ParallelDims, pcfg: ParallelConfig) -> DDP:
    """Wrap an allocated, initialised model. Not on meta: the constructor broadcasts rank
    0's weights and binds its gradient buckets to the parameters' storage, so it must
    come after ``to_empty`` + ``init_weights`` (parallelize's ``materialize`` step)."""
    if dims.tp > 1:
        raise ConfigError(f"parallel.dp_replicate={dims.dp_replicate} with parallel.tp={dims.tp}: DDP cannot "
                          f"replicate DTensor parameters; use parallel.dp_shard (FSDP2/HSDP) with TP")
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("apply_ddp needs materialised parameters; pass parallelize(..., materialize=...)")
    device = next(model.parameters()).device
    group = dims.mesh[dims.role_dim(dims.replicate_axes)].get_group()  # the replicas: Layout.replicate_axes
    ddp = DDP(model, process_group=group, device_ids=[device.index] if device.type == "cuda" else None,
              bucket_cap_mb=pcfg.ddp_bucket_mb,
              # Gradients live inside the communication buckets: no second copy of them.
              gradient_as_bucket_view=True)
    if pcfg.grad_reduce_dtype == "bf16":
        # torch's own hook: each bucket is divided by the world size, cast to bf16,
        # all-reduced, and written back into the fp32 bucket. Half the bytes on the wire.
        ddp.register_comm_hook(group, _bf16_average)
    return ddp


def _bf16_average(group, bucket):
    # torch's bf16_compress_hook under another name: DDP refuses that hook by name off CUDA,
    # although gloo all-reduces bf16, and the CPU tests check this path against one process.
    return default_hooks.bf16_compress_hook(group, bucket)
