"""Whether this rank can draw text samples while the model trains (log.samples).

Generation needs the whole model in one process: one process, DDP and Horovod have it.
Under FSDP2, tensor or pipeline parallelism a rank holds a shard or a stage; gathering the
whole model onto the main rank at every evaluation would cost the memory and traffic the
layout was chosen to avoid (and under PP a gather across stages), so those runs note once
that they skip samples, and `distlm generate` samples their checkpoints (it loads any layout
into one process). The samples themselves are drawn and laid out by distlm/report/samples.py.
"""
from __future__ import annotations

from typing import Optional

import torch


def why_not(gpt: torch.nn.Module, dims) -> Optional[str]:
    """Why this rank cannot sample from ``gpt`` alone (None: it can)."""
    from torch.distributed.tensor import DTensor
    if dims.pp > 1:
        return "under pipeline parallelism each rank holds a stage, not the whole model"
    if any(isinstance(p, DTensor) for p in gpt.parameters()):
        return "under FSDP2 or tensor parallelism each rank holds shards of the weights, not the whole model"
    return None
