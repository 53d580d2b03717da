"""Data-parallel engines: who forms the process group, reduces gradients and writes checkpoints.

``torch``: torch.distributed under torchrun. DDP and FSDP2 reduce gradients inside the
backward, so the optimizer steps as is, and every rank writes its part of a checkpoint.

``horovod``: Horovod under horovodrun. Its DistributedOptimizer starts the allreduce in
the backward and must be finished (``synchronize``) before clipping; then the step must
not synchronise again. Replicas are identical, so rank 0 writes the whole checkpoint.

The Trainer calls the same methods on either; the differences live here. Either steps the
one optimizer the Trainer built over this rank's parameters (its shards under FSDP2 / TP, its
stages' under PP), and hands it the Trainer's ``found_inf`` flag (see ``flagged``).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional, TypeVar

import torch

from distlm.config import ParallelConfig

T = TypeVar("T")


class TorchEngine:
    name = "torch"

    def init(self, pcfg: ParallelConfig, device_type: str, lap: Callable[[str], None] = lambda name: None):
        """The topology; ``lap("device and process group")`` once the world group is up, before the mesh."""
        from distlm.parallel.dims import init_distributed
        return init_distributed(pcfg, device_type, lap)

    def comm(self, dims):
        from distlm.parallel.comm import TorchComm
        return TorchComm(dims)

    def wrap_optimizer(self, optimizer, model, accum_steps: int, pcfg: ParallelConfig):
        return optimizer

    def finish_grad_reduction(self, optimizer) -> None:
        """DDP and FSDP2 have reduced the gradients by the end of the backward; what TP
        leaves as partial sums (see ``reduce_partial_grads``) is reduced here, once."""
        from distlm.parallel.grad import reduce_partial_grads
        reduce_partial_grads(p for group in optimizer.param_groups for p in group["params"])

    def optimizer_step(self, optimizer, found_inf: Optional[torch.Tensor] = None) -> None:
        with flagged(optimizer, found_inf):
            optimizer.step()

    def save(self, dims, comm, write: Callable[[bool], T], skipped: Callable[[], T]) -> T:
        """Every rank writes its own shards; ``write(async_allowed)``."""
        return write(True)


class HorovodEngine:
    name = "horovod"

    def init(self, pcfg: ParallelConfig, device_type: str, lap: Callable[[str], None] = lambda name: None):
        from distlm.parallel.horovod import init_horovod
        dims = init_horovod(pcfg, device_type)
        lap("device and process group")  # Horovod has no mesh
        return dims

    def comm(self, dims):
        from distlm.parallel.horovod import HorovodComm
        return HorovodComm()

    def wrap_optimizer(self, optimizer, model, accum_steps: int, pcfg: ParallelConfig):
        # After the resume: rank 0's loaded state is broadcast to the others.
        from distlm.parallel.horovod import wrap_optimizer
        return wrap_optimizer(optimizer, model, accum_steps, pcfg.fp16_compression)

    def finish_grad_reduction(self, optimizer) -> None:
        optimizer.synchronize()  # clipping must see the averaged gradients

    def optimizer_step(self, optimizer, found_inf: Optional[torch.Tensor] = None) -> None:
        with optimizer.skip_synchronize(), flagged(optimizer, found_inf):
            optimizer.step()

    def save(self, dims, comm, write: Callable[[bool], T], skipped: Callable[[], T]) -> T:
        """Rank 0 writes the state alone, synchronously (a background save would race the
        barrier the other ranks wait on); the others wait for it."""
        try:
            return write(False) if dims.is_main else skipped()
        finally:
            comm.barrier()


@contextlib.contextmanager
def flagged(optimizer, found_inf: Optional[torch.Tensor]):
    """``found_inf`` (a 0-d float32 tensor on the device, 1.0: leave this step out) set on the
    optimizer for one step, as torch's GradScaler hands it to an optimizer whose step takes it
    (distlm/optim/base.py); None sets nothing. Every rank holds the same flag (it is made from
    the global gradient norm and the mean loss), so every rank takes the step or none does."""
    if found_inf is None:
        yield
        return
    optimizer.grad_scale, optimizer.found_inf = None, found_inf
    try:
        yield
    finally:
        del optimizer.grad_scale, optimizer.found_inf


ENGINES = {"torch": TorchEngine, "horovod": HorovodEngine}


def make_engine(name: str):
    return ENGINES[name]()


def seed_for_rank(seed: int, dims) -> None:
    """Dropout differs per data-parallel rank and pipeline stage, by design, but not across
    a TP group: its ranks hold the same replicated activations (tp is the mesh's innermost
    axis, so rank // tp numbers the other coordinates)."""
    torch.manual_seed(seed + dims.rank // dims.tp)
