"""parallelize(model, dims, cfg): every parallelism applied in one place, in one order.

TP, then activation checkpointing, then torch.compile per block, then FSDP2, then
allocation + init (``materialize``), then DDP.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch.nn as nn

from distlm.config import Config
from distlm.parallel.dims import ParallelDims


def apply_compile(model: nn.Module) -> None:
    # Per block, not the whole model: blocks are identical, so one graph is compiled and
    # reused, and FSDP2's per-block hooks stay outside the compiled region.
    for name, block in model.blocks.named_children():
        block.compile()


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    for i, (name, block) in enumerate(list(model.blocks.named_children())):
        if mode == "full" or (mode == "selective" and i % 2 == 0):
            model.blocks.register_module(name, checkpoint_wrapper(block, preserve_rng_state=True))


def parallelize(model: nn.Module, dims: ParallelDims, cfg: Config,
                materialize: Optional[Callable[[nn.Module], None]] = None) -> nn.Module:
    """Returns the model to train (a DDP wrapper, or ``model`` itself sharded in place).

    ``materialize(model)`` allocates and initialises a meta-device model. It runs after
    the sharding steps, so each rank allocates only its shards, and before DDP, whose
    constructor needs real tensors. Without it the caller materialises afterwards, and
    DDP is refused on a meta model.
    """
    if cfg.parallel.activation_checkpoint != "none":
        apply_activation_checkpointing(model, cfg.parallel.activation_checkpoint)
    if cfg.train.compile:
        apply_compile(model)
    if dims.dp_shard > 1:
        from distlm.parallel.fsdp import apply_fsdp
        apply_fsdp(model, dims, cfg.parallel)
    if materialize is not None:
        materialize(model)
    if dims.dp_replicate > 1 and dims.dp_shard == 1 and cfg.parallel.engine == "torch":  # Horovod reduces itself
        from distlm.parallel.ddp import apply_ddp
        model = apply_ddp(model, dims, cfg.parallel)
    return model
