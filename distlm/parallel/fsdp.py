"""FSDP2 (``fully_shard``): parameters, gradients and optimizer state sharded over dp_shard.

    torchrun --nproc_per_node 4 -m distlm train model=gpt2-124m parallel.dp_shard=4
    torchrun --nproc_per_node 4 -m distlm train model=gpt2-124m parallel.dp_replicate=2 parallel.dp_shard=2  # HSDP

Applied to a model still on the meta device: each rank then allocates only its shards
(``to_empty``) and ``GPT.init_weights`` fills them from the whole-tensor draw, so the
initial weights equal the single-process ones whatever the layout.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from distlm.config import ParallelConfig
from distlm.parallel.dims import ParallelDims


def fsdp_mesh(dims: ParallelDims):
    """The shard dimension alone (dp_shard), or the 2-D (replicate, shard) mesh: HSDP
    shards within a group (a node, say) and all-reduces gradients across groups. The
    dimensions are the layout's gradient roles (Layout.replicate_axes, Layout.shard_axes)."""
    shard = dims.role_dim(dims.shard_axes)
    if dims.replicate_degree > 1:
        return dims.mesh[dims.role_dim(dims.replicate_axes), shard]
    return dims.mesh[shard]


def precision_policy(pcfg: ParallelConfig, device_type: str) -> MixedPrecisionPolicy:
    # bf16 all-gathers halve the traffic; gradients are reduced in fp32 so the sum over
    # many ranks keeps its digits, unless parallel.grad_reduce_dtype=bf16 asks for half the
    # bytes. On CPU the parameters stay fp32 so tests compare exactly.
    bf16_reduce = pcfg.grad_reduce_dtype == "bf16"
    if pcfg.mixed_precision and device_type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                    reduce_dtype=torch.bfloat16 if bf16_reduce else torch.float32)
    return MixedPrecisionPolicy(reduce_dtype=torch.bfloat16 if bf16_reduce else None)  # None: the grads' own


def offload_policy(pcfg: ParallelConfig, device_type: str) -> OffloadPolicy:
    if pcfg.cpu_offload:
        return CPUOffloadPolicy(pin_memory=device_type == "cuda")
    return OffloadPolicy()


def apply_fsdp(model: nn.Module, dims: ParallelDims, pcfg: ParallelConfig, roots=None) -> nn.Module:
    """One FSDP unit per block, then the root, in place. Under pipeline parallelism the
    roots are the rank's stage views (``roots``): the schedule runs them, not the model.

    The root unit owns everything outside the blocks, in particular ``tok_emb`` and
    ``head``: with tied embeddings they are one parameter, and FSDP2 can keep a shared
    parameter only inside a single unit (it is all-gathered once and set on both
    modules). ``GPT.to_empty`` re-ties them after allocation.
    """
    mesh = fsdp_mesh(dims)
    kw = dict(mesh=mesh, mp_policy=precision_policy(pcfg, mesh.device_type),
              offload_policy=offload_policy(pcfg, mesh.device_type))
    blocks = list(model.blocks.values())
    for i, block in enumerate(blocks):
        # The last block's backward starts right after the forward ends, so resharding
        # it would only all-gather the same weights again.
        last = i == len(blocks) - 1
        fully_shard(block, reshard_after_forward=pcfg.reshard_after_forward and not last, **kw)
    # FSDP2 never reshards the root after forward (its weights are needed first in backward).
    for root in roots or [model]:
        fully_shard(root, reshard_after_forward=pcfg.reshard_after_forward, **kw)
    return model
