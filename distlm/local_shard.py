"""This rank's own piece of a tensor that may be a DTensor.

Gradient norms, finiteness checks, optimizer updates and weight initialisation all work on
the rank's local shard, and must work the same on a plain tensor (one process, DDP). A light
module of its own, with no import of torch.distributed, so the model and the checkpoint code
can use it without the parallel package."""
from __future__ import annotations

import torch


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view of its storage: writes land in the DTensor); a plain
    tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t
