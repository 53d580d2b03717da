"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"): the sign of an
interpolated momentum, for every parameter.

    c = beta1 m + (1 - beta1) g        the update's direction, of which only the sign is used
    p <- p (1 - lr wd) - lr sign(c)    decoupled weight decay, as AdamW's
    m <- beta2 m + (1 - beta2) g       the one state tensor

Why Lion is the third optimizer here (beside AdamW and Muon; schedule-free AdamW and SOAP were
the other candidates):
  - it is the one users ask for to save memory: one fp32 state tensor per parameter against
    AdamW's two, so a model that is short of memory gains a parameter's worth of bytes per
    parameter; it shows the planner counting a declared state that is not AdamW's;
  - its state is element-wise and shaped like the parameter, so it shards under FSDP2 / TP and
    checkpoints and reshards through DCP exactly as AdamW's moments do, with no new machinery;
  - schedule-free AdamW keeps a second copy of the weights that evaluation and checkpoints must
    swap in (a change to evaluation, not only a new optimizer), and SOAP keeps per-matrix
    preconditioners and eigenbases whose shapes are not the parameter's (their resharding would
    need the whole-matrix machinery for state, not only for updates).

Lion's settings are its own, optim.lion.*: it wants a rate 3-10x smaller than AdamW's and a
weight decay 3-10x larger (the paper's advice), and the learning-rate schedule scales
optim.lion.lr as it scales any optimizer's peak. Decay applies to AdamW's decay group only
(matrices that are not embeddings).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

from distlm.config import Config
from distlm.local_shard import local_shard
from distlm.optim.base import MATRIX, OTHER, BuildContext, Spec, StateTensor, skip_flag
from distlm.optim.groups import param_groups


class Lion(torch.optim.Optimizer):
    """Lion over any parameters. Group keys: ``lr``, ``betas`` (beta1: the update's
    interpolation, beta2: the momentum's), ``weight_decay`` (decoupled). The state of each
    parameter is ``exp_avg``, of its shape and layout; the step works on each rank's local
    shard (the update is element-wise), so plain tensors and DTensors of any mesh may share
    a group."""

    def __init__(self, params: Iterable, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))
        # Its step honours ``found_inf`` (distlm/optim/base.py), as GradScaler expects of such an optimizer.
        self._step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        flags: dict = {}
        for group in self.param_groups:
            ps = [p for p in group["params"] if p.grad is not None]
            if not ps:
                continue
            for p in ps:
                if not self.state[p]:
                    self.state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params = [local_shard(p) for p in ps]
            grads = [local_shard(p.grad) for p in ps]
            moms = [local_shard(self.state[p]["exp_avg"]) for p in ps]
            beta1, beta2 = group["betas"]
            lr = group["lr"]
            skip = skip_flag(self, params[0].device, flags)
            if skip is not None:
                # A step left out: each gradient (dropped after the step) becomes its momentum,
                # so both interpolations below give the momentum back unchanged, and a NaN in it
                # reaches nothing; the update is zeroed below and the decay factor is 1.
                for g, m in zip(grads, moms):
                    torch.where(skip, m, g, out=g)
            if group["weight_decay"]:
                decay = 1.0 - lr * group["weight_decay"]
                torch._foreach_mul_(params, decay if skip is None else torch.where(skip, 1.0, decay))
            update = torch._foreach_lerp(moms, grads, 1.0 - beta1)
            torch._foreach_sign_(update)
            if skip is not None:
                zero = torch.zeros((), dtype=update[0].dtype, device=skip.device)
                for u in update:
                    torch.where(skip, zero, u, out=u)
            torch._foreach_add_(params, update, alpha=-lr)
            del update
            torch._foreach_lerp_(moms, grads, 1.0 - beta2)
        return loss


class LionSpec(Spec):
    """optim.name=lion: Lion for every parameter, in AdamW's two groups (decay, no decay)."""
    name = "lion"
    state = {MATRIX: (StateTensor("exp_avg"),), OTHER: (StateTensor("exp_avg"),)}
    # The interpolated update, one fp32 copy of every parameter, made before any is applied.
    step_temporaries = {MATRIX: 1.0, OTHER: 1.0}

    def peak_lr(self, cfg: Config) -> float:
        return cfg.optim.lion.lr

    def build(self, model: nn.Module, cfg: Config, ctx: BuildContext) -> torch.optim.Optimizer:
        o = cfg.optim.lion
        return Lion(param_groups(model, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2))

    def skips_on_device(self, optimizer: torch.optim.Optimizer) -> bool:
        return True
