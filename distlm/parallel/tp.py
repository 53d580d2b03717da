"""Tensor parallelism (Megatron-style) with optional sequence parallelism, as a DTensor plan.

    torchrun --nproc_per_node 4 -m distlm train model=gpt2-124m parallel.tp=4

Per block: q/k/v and the MLP's input (and gate) projections are split by columns, so
each rank computes whole heads and a slice of the hidden width; the output projections
are split by rows and their partial sums reduced. With ``sequence_parallel`` the norms
(and the dropouts after them) run on a slice of the sequence instead of repeating the
same work on every rank: the reduce after each row-parallel layer becomes a
reduce-scatter over the sequence, and the all-gather moves to the block's inputs.
The head is split over the vocabulary; with ``loss_parallel`` the cross-entropy is
computed on those shards, so no rank ever holds the full (B, T, V) logits.

The modern-block options: QK-norm (parameter-free, per head) and ReLU^2 need nothing, the
soft-capped head is element-wise on its vocabulary shard, and attention masks (documents,
windows) are per (batch, query, key), shared by every head, so each rank applies the same
mask to its own heads. Value-embedding tables are split by columns like wv, so each rank
looks up the slice of values its heads use; the scalar weights of value embeddings and
U-net skips are replicated, and their inputs declared sharded (see the plan).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)

from distlm.config import ParallelConfig


def full(t: torch.Tensor) -> torch.Tensor:
    """A loss computed under loss_parallel is a (replicated) DTensor; the loop wants a tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def apply_tp(model: nn.Module, tp_mesh, pcfg: ParallelConfig) -> nn.Module:
    """Shard a GPT (or a pipeline stage of one: a part whose tok_emb/head are None) in place.

    Works on a meta-device model; ``init_weights`` then fills each rank's shards.
    """
    sp = pcfg.sequence_parallel
    # Inside the blocks the residual stream is a plain local tensor: (B, T/tp, d) with
    # SP, (B, T, d) without. These are the layouts the block edges agree on.
    resid = Shard(1) if sp else Replicate()
    tied = model.cfg.tie_embeddings and getattr(model, "tok_emb", None) is not None \
        and getattr(model, "head", None) is not None
    top: dict = {}
    if model.tok_emb is not None:
        # Vocabulary-parallel embedding. Its output stays whole (Replicate) so that any
        # position scheme (learned, sinusoidal, rope) adds a full-length table as on one
        # process; the slice onto this rank's part of the sequence happens after dropout
        # and costs no communication.
        top["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if sp:
            top["drop"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
    if model.norm is not None and sp:
        top["norm"] = SequenceParallel()
    for name in (getattr(model, "value_embeds", None) or {}):
        # Column-split (embedding dim) as wv's output is: this rank's slice is the values
        # of its own heads. Indices arrive whole on every rank.
        top[f"value_embeds.{name}"] = ColwiseParallel()
    if getattr(model, "skip_weights", None) is not None and sp:
        # A scalar weight times a sharded input: the weight is replicated, and its gradient
        # (a sum over the input) is a partial sum on each rank, which DTensor reduces only if
        # the input is declared sharded. SequenceParallel is exactly "replicated parameters,
        # input sharded along a dim": the skip (the residual stream) is split over the
        # sequence under SP. Without SP the stream is whole on every rank and replicate_rest
        # below is right for these weights.
        for name in model.skip_weights:
            top[f"skip_weights.{name}"] = SequenceParallel(use_local_output=True)
    if model.head is not None:
        top["head"] = ColwiseParallel(
            input_layouts=resid,
            # loss_parallel wants the logits as a DTensor sharded over the vocabulary.
            output_layouts=Shard(-1) if pcfg.loss_parallel else Replicate(),
            use_local_output=not pcfg.loss_parallel)
    if tied:
        # One Parameter serves both modules. Both plans shard it by rows (vocabulary), so
        # it is distributed once, for the embedding, and handed to the head after.
        model.head.weight = nn.Parameter(model.head.weight.detach().clone(), requires_grad=True)
    parallelize_module(model, tp_mesh, top)
    if tied:
        model.head.weight = model.tok_emb.weight

    for block in model.blocks.values():
        plan = {
            # The gathered input stays a DTensor into q/k/v (and the MLP's input projections):
            # their partial input gradients then add up as one Partial and are reduced once,
            # by the gather's backward (a reduce-scatter with SP). Handed on as local tensors,
            # each projection all-reduced its own: 4 full all-reduces per block backward
            # instead of 2 reduce-scatters (tests/layout/test_tensor.py counts them).
            # Block passes (x, rope, cache, start_pos, attn_mask, causal, ve): only x is laid
            # out; the mask is per (batch, query, key) and serves every local head as is.
            "attn": PrepareModuleInput(input_layouts=(resid,) + (None,) * 6,
                                       desired_input_layouts=(Replicate(),) + (None,) * 6),
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseBiasAfterReduce(output_layouts=resid),
            "mlp": PrepareModuleInput(input_layouts=(resid,), desired_input_layouts=(Replicate(),)),
            "mlp.w_in": ColwiseParallel(), "mlp.w_out": RowwiseBiasAfterReduce(output_layouts=resid),
        }
        if block.mlp.w_gate is not None:
            plan["mlp.w_gate"] = ColwiseParallel()
        if sp:
            plan["attn_norm"] = SequenceParallel(use_local_output=True)
            plan["mlp_norm"] = SequenceParallel(use_local_output=True)
        for norm in (block.attn_norm, block.mlp_norm):
            norm.register_forward_hook(in_compute_dtype)
        # A scalar weight times a sharded input: see the U-net skips' weights above; the
        # value embedding is split over its last dim (the heads).
        if block.attn.ve_weight is not None:
            plan["attn.ve_weight"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(block, tp_mesh, plan)
        # Each rank holds the columns of its heads in wq, wk and wv separately; the fused
        # one-matmul path would concatenate shards of three tensors into no valid layout.
        block.attn.fused_qkv = False
    replicate_rest(model, tp_mesh)
    return model


class RowwiseBiasAfterReduce(RowwiseParallel):
    """A row-parallel linear whose bias is added after its partial sums are reduced.

    torch's RowwiseParallel adds the (replicated) bias to the partial product, before the
    reduce-scatter (all-reduce without SP). Async TP fuses a reduce-scatter only with the
    matmul that feeds it directly, so with a bias in between none of the two per block was
    fused (inductor logs "no producer matmul found for reduce scatter" for gpt2-1.5b; bias-free
    models are not affected). Here the layer multiplies without its bias
    and the output hook adds it to the reduced, sequence-sharded output: the same sum, the
    same parameter under the same name (checkpoints and exports do not change), and less work
    (the bias is added to 1/tp of the rows). Its gradient, a sum over this rank's rows, is a
    partial sum, reduced with the other sequence-parallel gradients (distlm.parallel.grad)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.__class__ = _LinearWithoutBias  # the same module and parameters, another forward
        return module

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts, async_op=True)
        if isinstance(mod, _LinearWithoutBias):
            outputs = outputs + mod.bias.to(outputs.dtype)  # under autocast: the dtype F.linear would give
        return outputs.to_local() if use_local_output else outputs


class _LinearWithoutBias(nn.Linear):
    """nn.Linear whose forward leaves the bias out: RowwiseBiasAfterReduce adds it later."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def in_compute_dtype(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    """Forward hook on each block's norms: under autocast their output is fp32, and the
    q/k/v and MLP projections cast it to bf16 anyway. Cast before the block's input is
    gathered, so the all-gather (and its gradient's reduce-scatter) moves bf16: half the
    bytes of half of TP's per-block collectives (they were the fp32 half in the gpt2-1.5b TP2
    profiles on 2 x H100, docs/results/model-parallel.md). The forward's numbers are the same; the backward's reduce-scatter now sums the
    ranks' partial input gradients in bf16, as Megatron does. Without autocast (fp32, the CPU
    tests) nothing changes."""
    device = output.device.type
    if torch.is_autocast_enabled(device):
        return output.to(torch.get_autocast_dtype(device))
    return output


def replicate_rest(model: nn.Module, tp_mesh) -> None:
    """Make every parameter the plan left plain (a learned position table; norms without
    SP) a replicated DTensor, computing on local tensors as before. Then every parameter is
    a DTensor on one mesh: fused AdamW and the foreach path refuse a group that mixes the
    two (first seen on 2x H200), and the gradient norm needs no special case.

    Each rank computes the same replicated values, so their gradients are already equal:
    ``to_local`` keeps Replicate in the backward and nothing is reduced."""
    from torch.distributed.tensor import DTensor, distribute_module

    def to_dtensor(mod, inputs, mesh):
        return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False)
                     if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t for t in inputs)

    def to_local(mod, out, mesh):
        return out.to_local() if isinstance(out, DTensor) else out

    for mod in model.modules():
        if any(not isinstance(p, DTensor) for p in mod.parameters(recurse=False)):
            distribute_module(mod, tp_mesh, input_fn=to_dtensor, output_fn=to_local)
