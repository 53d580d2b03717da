"""DDP: every rank holds the whole model; gradients are all-reduced in buckets.

    torchrun --nproc_per_node 4 -m distlm train model=gpt2-124m parallel.dp_replicate=4

Accumulation micro-steps skip the all-reduce through ``no_sync()`` (distlm.parallel.grad).
"""
from __future__ import annotations

import torch.nn as nn
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
    return DDP(model, process_group=dims.mesh["dp_replicate"].get_group(),
               device_ids=[device.index] if device.type == "cuda" else None,
               bucket_cap_mb=pcfg.ddp_bucket_mb,
               # Gradients live inside the communication buckets: no second copy of them.
               gradient_as_bucket_view=True)
