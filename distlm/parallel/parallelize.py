"""parallelize(model, dims, cfg): every parallelism applied in one place, in one order.

Pipeline split (each rank keeps its stages), then TP, then activation checkpointing,
then torch.compile per block, then FSDP2, then allocation + init (``materialize``),
then DDP. Returns the plan (distlm/parallel/applied.py): the model to train, the step engine
that drives it (distlm/parallel/step.py), and what the step needs of the layout: the
Trainer never asks which layout it runs.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn

from distlm.config import Config
from distlm.model.float8 import apply_float8
from distlm.parallel.dims import ParallelDims
from distlm.parallel.applied import BatchHook, ParallelPlan
from distlm.parallel.step import PipelineStep, PlainStep


def apply_compile(model: nn.Module, scope: str = "block", mode: str = "default", static: bool = False) -> None:
    """Per block by default: blocks are identical, so one graph is compiled and reused,
    and FSDP2's per-block hooks stay outside the compiled region. ``scope="model"``
    compiles the whole forward as one graph (embedding, blocks, head), so the compiler can
    fuse across block edges too; one GPU or DDP only (config validation says so).
    ``static``: one graph per input shape, for inputs whose shape changes on purpose (the
    sequence warm-up's rows)."""
    kw = {} if mode == "default" else {"mode": mode}
    if static:
        # Else dynamo's "automatic dynamic" recompiles the second shape it sees with a symbolic
        # sequence length, and every later step, the full-length ones included, runs kernels
        # that are not specialised for it.
        kw["dynamic"] = False
    if scope == "model":
        model.compile(**kw)
        return
    for name, block in model.blocks.named_children():
        block.compile(**kw)
    if getattr(model, "head", None) is not None and hasattr(model, "head_loss"):
        # the final norm, head and cross-entropy: one graph, so the fp32 softmax statistics
        # are computed in registers instead of through fp32 copies of the logits
        model.head_loss = torch.compile(model.head_loss, **kw)
    # The embeddings and U-net skips between the blocks: small graphs, each compiled once.
    # Not under TP, whose module hooks lay out these modules' DTensors (left eager, as before).
    if not any(hasattr(p, "device_mesh") for p in model.parameters()):
        for name in getattr(model, "compiled_regions", ()):
            setattr(model, name, torch.compile(getattr(model, name), **kw))


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    for i, (name, block) in enumerate(list(model.blocks.named_children())):
        if mode == "full" or (mode == "selective" and i % 2 == 0):
            model.blocks.register_module(name, checkpoint_wrapper(block, preserve_rng_state=True))


def parallelize(model: nn.Module, dims: ParallelDims, cfg: Config,
                materialize: Optional[Callable[[nn.Module], None]] = None, *,
                device: torch.device = torch.device("cpu"), amp_dtype: Optional[torch.dtype] = None) -> ParallelPlan:
    """Returns the plan: the model to train (a DDP wrapper, or ``model`` itself sharded in
    place), the plain module inside, and the step engine: a ``PipelineStep`` over the
    rank's stages under pipeline parallelism, else a ``PlainStep``. ``device`` and
    ``amp_dtype``: where and in which autocast dtype the plan's compute context runs.

    The order, written once: pipeline split (prune to this rank's stages), TP, the context
    split's per-batch hook, activation checkpointing, compile, EP, FSDP2, allocation + init, DDP. ``materialize(model)``
    allocates and initialises a meta-device model: after the sharding steps, so each rank
    allocates only its shards, and before DDP, whose constructor needs real tensors. An
    axis whose ranks need each micro-batch changed adds its per-batch hook to ``hooks``
    where it is applied (distlm/layout/__init__.py says how an axis is added).
    """
    pcfg = cfg.parallel
    # the blocks' linear layers, before any wrapper
    apply_float8(model, cfg.train.fp8)
    parts = None
    hooks: list[BatchHook] = []
    if dims.pp > 1:
        from distlm.parallel.pp import build_pipeline
        parts = build_pipeline(model, dims, pcfg, cfg.model)
        model = parts.model
    inner = model
    if dims.tp > 1:
        from distlm.parallel.tp import apply_tp
        apply_tp(model, dims.mesh["tp"], pcfg)
    if dims.cp > 1:  # the model is unchanged: each micro-batch is cut, and the forward told where it sits
        from distlm.parallel.context import apply_context
        hooks.append(apply_context(dims))
    if pcfg.activation_checkpoint != "none":
        apply_activation_checkpointing(model, pcfg.activation_checkpoint)
    if cfg.train.compile:
        apply_compile(model, cfg.train.compile_scope, cfg.train.compile_mode, static=cfg.train.seq_warmup_steps > 0)
    if parts is not None:
        parts.refresh_views()  # the views must hold the wrapped blocks
    # Expert parallelism holds part of the model but runs whole blocks: it leaves its experts
    # out of DDP (or gives them an FSDP2 unit of their own) and lets DDP replicate the rest.
    ep_ddp = dims.ep > 1 and not dims.shards_parameters
    if dims.ep > 1:
        from distlm.parallel.expert import apply_ep
        apply_ep(model, dims, pcfg)
    # With TP or PP, replication goes through FSDP2 too (a (dp_replicate, dp_shard) mesh
    # whose shard axis may be 1): DDP cannot hold DTensors, nor drive a pipeline stage.
    if dims.shards_parameters or (dims.replicate_degree > 1 and not dims.holds_whole_model and not ep_ddp):
        from distlm.parallel.fsdp import apply_fsdp
        apply_fsdp(model, dims, pcfg, roots=parts.views if parts is not None else None)
    if materialize is not None:
        materialize(model)
    # DDP where every rank holds the whole model and runs whole blocks (whether or not its
    # rows are cut): it all-reduces the gradients over the replicate dimension.
    ddp = dims.replicate_degree > 1 and (dims.holds_whole_model or ep_ddp) and not dims.splits_forward \
        and pcfg.engine == "torch"
    if ddp:
        from distlm.parallel.ddp import apply_ddp
        model = apply_ddp(model, dims, pcfg)  # Horovod reduces itself
    step = PipelineStep(model, parts) if parts is not None else PlainStep(model)
    return ParallelPlan(model, inner, step, dims, device, amp_dtype,
                        loss_parallel=dims.distributes_logits and pcfg.loss_parallel, batch_hooks=tuple(hooks),
                        compiler_settings=compiler_settings(cfg, ddp))


def compiler_settings(cfg: Config, ddp: bool) -> tuple[tuple[str, object], ...]:
    """The torch._dynamo settings the plan's compute context holds while the model runs.

    Under DDP dynamo cuts every graph it compiles at the edges of DDP's gradient buckets
    (its "DDPOptimizer"), so that a bucket's all-reduce can start while the rest of the graph's
    backward runs. With one graph per block, the block edges give that already. The cuts then
    only add graphs: a block graph past DDP's 1 MB first bucket is cut at least once, and each
    piece is a graph to compile cold and to load warm, in the first step. In the CPU test
    (tests/parallel/test_parallelize.py) the cuts took a 4-block model from 8 graphs to 10; on 4 GPUs
    speedrun-124m's first step loaded 22 graphs where one GPU's loaded 10. So DDP leaves whole
    blocks whole. A whole-model graph (compile_scope=model) keeps the cuts: without
    them its all-reduces would wait for the whole backward."""
    if ddp and cfg.train.compile and cfg.train.compile_scope == "block":
        return (("optimize_ddp", False),)
    return ()
