"""AdamW (torch's) for every parameter: two groups, decay on the matrices that are not embeddings."""
from __future__ import annotations

import torch
import torch.nn as nn

from distlm.config import Config
from distlm.optim.base import MATRIX, OTHER, BuildContext, Spec, StateTensor
from distlm.optim.groups import elementwise_kernel, param_groups

# torch.optim.AdamW's state per parameter: two moments of its shape and a step count.
ADAMW_STATE = (StateTensor("exp_avg"), StateTensor("exp_avg_sq"), StateTensor("step", like_param=False))


class AdamWSpec(Spec):
    name = "adamw"
    state = {MATRIX: ADAMW_STATE, OTHER: ADAMW_STATE}
    step_temporaries = {MATRIX: 0.0, OTHER: 0.0}

    def peak_lr(self, cfg: Config) -> float:
        return cfg.optim.adamw.lr

    def build(self, model: nn.Module, cfg: Config, ctx: BuildContext) -> torch.optim.Optimizer:
        a = cfg.optim.adamw
        groups = param_groups(model, a.weight_decay)
        return torch.optim.AdamW(groups, lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps,
                                 **elementwise_kernel(groups, ctx.device_type))

    def skips_on_device(self, optimizer: torch.optim.Optimizer) -> bool:
        # torch's fused kernel (CUDA, and CPU) returns at once when found_inf is 1.0, and its
        # step counts are put back (+1, then -found_inf): parameters, moments and steps as they
        # were. The foreach and per-tensor paths refuse the flag (torch 2.11 and 2.13 alike).
        return bool(optimizer.defaults.get("fused"))
