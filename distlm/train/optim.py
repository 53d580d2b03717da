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
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: TrainConfig, device_type: str) -> torch.optim.AdamW:
    # fused AdamW is one kernel per step on CUDA; on CPU the foreach path is the fast one.
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr,
                             betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             fused=device_type == "cuda" or None)
