"""Which parameters go where: AdamW's two groups (decay, no decay), the blocks' matrices a
matrix optimizer takes, and the embedding tables."""
from __future__ import annotations

import torch.nn as nn

# Wrappers that insert a component into parameter names without being part of the model.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")
# A fused q/k/v projection: one (3d, d) weight holding three matrices.
FUSED_QKV_NAMES = ("qkv", "wqkv", "c_attn")


def embedding_tables(model: nn.Module) -> list:
    """The token and value embedding tables (each parameter once, in model order)."""
    out, seen = [], set()
    for m in model.modules():
        if isinstance(m, nn.Embedding) and m.weight.requires_grad and id(m.weight) not in seen:
            seen.add(id(m.weight))
            out.append(m.weight)
    return out


def param_groups(model: nn.Module, weight_decay: float, exclude=frozenset()) -> list[dict]:
    """AdamW's two groups; parameters whose id is in ``exclude`` (a matrix optimizer's) are left out."""
    # Decay shrinks weights toward zero; on norms and biases that only fights the
    # optimizer, and on embeddings it penalises rare tokens (GPT-3 / nanoGPT practice).
    no_decay_ids = {id(p) for p in embedding_tables(model)}
    decay, no_decay, seen = [], [], set(exclude)
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (no_decay if p.ndim < 2 or id(p) in no_decay_ids else decay).append(p)
    # Two groups whatever the layout: a checkpoint's optimizer state loads only into the
    # same group structure, and it must load under any other layout.
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def one_mesh_per_group(groups: list[dict]) -> bool:
    # Meshes compare by value (two slices of one layout are equal objects, not the same one).
    return all(len({getattr(p, "device_mesh", None) for p in g["params"]}) <= 1 for g in groups)


def _path(name: str) -> list[str]:
    return [part for part in name.split(".") if part not in _WRAPPER_PARTS]


def matrix_params(model: nn.Module) -> tuple[list, list]:
    """(matrices, fused q/k/v matrices) for a matrix optimizer such as Muon: the 2-D weights
    inside the transformer blocks (``blocks.*``), except embedding tables, and the 3-D ones
    (an MoE block's experts, one matrix per expert). Embeddings and the
    head stay with AdamW: a table row is updated only by its tokens' gradients, and the head's
    rows are per-token outputs; neither is a hidden linear map."""
    embedding_ids = {id(p) for p in embedding_tables(model)}
    plain, fused, seen = [], [], set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen or p.ndim not in (2, 3) or id(p) in embedding_ids:
            continue
        path = _path(name)
        if "blocks" not in path[:-1]:
            continue
        seen.add(id(p))
        (fused if len(path) >= 2 and path[-2] in FUSED_QKV_NAMES else plain).append(p)
    return plain, fused


def elementwise_kernel(groups: list[dict], device_type: str) -> dict:
    """torch's fused / foreach choice for an element-wise optimizer over these groups."""
    # Fused AdamW is one kernel per step on CUDA. Its kernel, and the foreach path, refuse a
    # group that mixes plain tensors with DTensors (under TP a learned position table stays
    # a plain replicated tensor; first seen on 2x H200): such layouts step tensor by tensor.
    homogeneous = one_mesh_per_group(groups)
    return dict(fused=True) if device_type == "cuda" and homogeneous else {} if homogeneous else dict(foreach=False)
