"""The process-group helpers saving and verifying share: who is rank 0, an OR over ranks,
and agreeing on a failure so that no rank is left waiting in the next collective."""
from __future__ import annotations

import datetime
from typing import Optional

import torch
import torch.distributed as dist

from distlm.checkpoint.errors import CheckpointSaveError


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world() -> int:
    return dist.get_world_size() if _distributed() else 1


def _flag_device() -> torch.device:
    # NCCL reduces CUDA tensors only; gloo (and "cpu:gloo,cuda:nccl") reduce CPU ones.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _any_rank(flags: list[bool]) -> list[bool]:
    """Element-wise OR of boolean flags over all ranks (collective when a group is up)."""
    if not _distributed():
        return list(flags)
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=_flag_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def _agree(error: Optional[BaseException], what: str) -> None:
    """Collective, in place of a barrier: if any rank failed, every rank raises. A rank
    that raised alone would leave the others waiting in the next collective until the timeout."""
    if _any_rank([error is not None])[0]:
        if error is not None:
            raise error
        raise CheckpointSaveError(f"{what}: failed on another rank (its output names the cause)",
                                  "failed on another rank")


def background_save_group(timeout_s: float) -> Optional[dist.ProcessGroup]:
    """A gloo group of every rank for DCP's background saves (train.async_checkpoint), or None
    on one process. Collective: every rank makes it, at the same point of the set-up.

    dcp.async_save runs its collectives from a thread of its own while training goes on. On
    the world group they would interleave with the training's (the stop check's, the loss's),
    in an order that need not be the same on every rank; and it refuses a group without a CPU
    backend, which a GPU run's NCCL world group is."""
    if not _distributed():
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
