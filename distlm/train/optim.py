"""AdamW with weight decay only on matrices that are not embeddings."""
from __future__ import annotations

import torch
import torch.nn as nn

from distlm.config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    # Decay shrinks weights toward zero; on norms and biases that only fights the
    # optimizer, and on embeddings it penalises rare tokens (GPT-3 / nanoGPT practice).
    no_decay_ids = set()
    for mod in model.modules():
        if isinstance(mod, nn.Embedding):
            no_decay_ids.add(id(mod.weight))
    decay, no_decay, seen = [], [], set()
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


def build_optimizer(model: nn.Module, cfg: TrainConfig, device_type: str) -> torch.optim.AdamW:
    groups = param_groups(model, cfg.weight_decay)
    # Fused AdamW is one kernel per step on CUDA. Its kernel, and the foreach path, refuse a
    # group that mixes plain tensors with DTensors (under TP a learned position table stays
    # a plain replicated tensor; first seen on 2x H200): such layouts step tensor by tensor.
    homogeneous = one_mesh_per_group(groups)
    kw = dict(fused=True) if device_type == "cuda" and homogeneous else {} if homogeneous else dict(foreach=False)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kw)
