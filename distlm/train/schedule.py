"""Learning rate as a pure function of the step: nothing to checkpoint but the step."""
from __future__ import annotations

import math

from distlm.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr, then linear / cosine / WSD / constant decay to cfg.min_lr."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return cfg.lr
    total = max(1, cfg.max_steps - cfg.warmup_steps)
    t = min(1.0, (step - cfg.warmup_steps) / total)
    if cfg.decay == "linear":
        frac = 1.0 - t
    elif cfg.decay == "cosine":
        frac = 0.5 * (1.0 + math.cos(math.pi * t))
    else:  # wsd: warmup, stable at the peak, then a linear decay over the last fraction
        start = 1.0 - cfg.wsd_decay_fraction
        frac = 1.0 if t < start else 1.0 - (t - start) / max(cfg.wsd_decay_fraction, 1e-9)
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * frac
