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
    # One group per (decay, device mesh): fused AdamW runs one kernel per group and refuses
    # a group that mixes plain tensors with DTensors (under TP a learned position table or
    # a norm stays a plain, replicated tensor) or DTensors of different meshes.
    groups: dict = {}
    seen = set()
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        decay = not (p.ndim < 2 or id(p) in no_decay_ids)
        groups.setdefault((decay, id(getattr(p, "device_mesh", None))), []).append(p)
    keys = sorted(groups, key=lambda k: not k[0])  # decayed groups first, as before
    return [{"params": groups[k], "weight_decay": weight_decay if k[0] else 0.0} for k in keys]


def build_optimizer(model: nn.Module, cfg: TrainConfig, device_type: str) -> torch.optim.AdamW:
    # fused AdamW is one kernel per step on CUDA; on CPU the foreach path is the fast one.
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr,
                             betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             fused=device_type == "cuda" or None)
