"""The few collectives the Trainer itself needs (metric means, stop flags, barriers),
behind one small interface so the torch engine and the Horovod engine share one loop."""
from __future__ import annotations

import torch
import torch.distributed as dist


class TorchComm:
    def __init__(self, dims):
        self.dims = dims

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        """Average over the ranks the loss is a mean over (Layout.loss_axes: the data-parallel
        ranks; every rank of a TP/PP group holds the same value)."""
        if self.dims.loss_size == 1:
            return t
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.AVG, group=self.dims.loss_mesh.get_group())
        return t

    def max(self, t: torch.Tensor) -> torch.Tensor:
        if not self.dims.is_distributed:
            return t
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def barrier(self) -> None:
        if self.dims.is_distributed:
            dist.barrier()

    def broadcast_object(self, obj, src: int = 0):
        if not self.dims.is_distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]
