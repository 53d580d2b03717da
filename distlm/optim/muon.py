"""Muon: momentum whose update for each hidden weight matrix is orthogonalised.

For a weight matrix W (out x in) and its Nesterov momentum M, Muon steps along
``orth(M) = U V^T`` (M = U S V^T): the same directions as the momentum, every singular
value set to about 1. A plain gradient step is dominated by a few large directions;
the orthogonalised one moves all of them at the same rate. ``orth`` is approximated with
a few Newton-Schulz iterations (matmuls only, so bf16 tensor cores run it; on a CPU without
a fast bf16 path they run in fp32: optim.muon.ns_dtype, distlm/optim/matmul_dtype.py).

One optimizer object holds two kinds of parameter groups, tagged ``group["kind"]``:
  - ``"muon"``: 2-D matrices (the transformer blocks' linear weights);
  - ``"adamw"``: everything else (embeddings, head, norms, biases), stepped by torch's
    own AdamW kernels (fused on CUDA) with the same state keys as ``torch.optim.AdamW``.
So the Trainer, ``get_state_dict``/``set_state_dict`` and DCP see one ordinary
``torch.optim.Optimizer`` whose state is per parameter: Muon's momentum buffer has the
parameter's own layout (a DTensor shard under FSDP2/TP), and reshards like AdamW's moments.

Distributed. Newton-Schulz needs whole matrices, and each matrix is orthogonalised by one
rank only: distlm/parallel/whole_matrix.py deals the momenta out as whole matrices (DDP,
FSDP2, TP and their products), and each rank then updates its own shard; with no one to
share the work (one process, pipeline stages without data parallelism, Horovod) every rank
orthogonalises the matrices it holds.

The step works a stack at a time, not a matrix at a time: one foreach pass updates the
momenta of every matrix, Newton-Schulz runs once per stack of matrices of one shape (on CUDA
with its sums folded into the matmuls: ``newton_schulz_folded``), and one foreach pass per
stack adds the updates. The AdamW groups run first, on the same stream.

``MuonSpec`` is its entry in the optimizer registry (optim.name=muon): the blocks' matrices
to Muon, everything else to AdamW in the same object.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Optional

import torch
import torch.nn as nn
from torch.optim.adamw import adamw as adamw_update

from distlm.config import Config, ConfigError, updated
from distlm.local_shard import local_shard
from distlm.optim.adamw import ADAMW_STATE
from distlm.optim.base import MATRIX, OTHER, BuildContext, Spec, StateTensor, skip_flag
from distlm.optim.groups import elementwise_kernel, embedding_tables, matrix_params, param_groups
from distlm.parallel.whole_matrix import WholeMatrices

# Newton-Schulz. One step maps X = U S V^T to p(X) = aX + b(XX^T)X + c(XX^T)^2 X
# = U p(S) V^T: the singular vectors stay, each singular value s becomes
# p(s) = a s + b s^3 + c s^5. Dividing by the Frobenius norm first puts every s in (0, 1].
# What we want of p:
#   - a = p'(0) large: a small singular value grows about a-fold per step, so after k
#     steps every s above about a^-k (of the Frobenius norm) is of order 1;
#   - a band [lo, hi] around 1 that p maps into itself, so a value that arrives stays;
#   - a margin above hi: p(s) <= hi up to some top > hi. bf16 rounding nudges values
#     past hi, and where p crosses hi it is steep (slope ~6): without a margin, 1.22
#     comes out near 1.32 (measured: 1.36 after 5 bf16 steps on a 96x96 matrix).
# Exact convergence to 1 is not wanted: the update's direction is what matters, bf16
# could not hold it anyway, and a tighter band costs a smaller a (more steps). We take
# [lo, hi] = [0.7, 1.2] and top = 1.3. For these, a is largest when p equioscillates:
# its local maximum (at x1) touches hi, its local minimum (at x2) touches lo, and
# p(top) = hi. Writing p'(x) = 5c (x^2 - x1^2)(x^2 - x2^2) gives a = 5c x1^2 x2^2 and
# b = -(5/3) c (x1^2 + x2^2); the three conditions then fix c, x1 and x2. Solved
# numerically: x1 = 0.579, x2 = 1.090, and the coefficients below. In exact arithmetic
# 5 steps take every s >= 2.0e-3 (of the Frobenius norm) into [0.70, 1.20] (4 steps:
# s >= 6.4e-3, 6 steps: s >= 5.9e-4); in bf16 we measured [0.68, 1.21].
NS_COEFFS = (3.2924, -4.1922, 1.6510)
NS_BAND = (0.7, 1.2)


def newton_schulz(g: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16,
                  coeffs: tuple[float, float, float] = NS_COEFFS, eps: float = 1e-7) -> torch.Tensor:
    """Approximately orthogonalise the last two dims of ``g`` (a matrix or a batch of
    them): singular vectors kept, singular values pushed into NS_BAND. Returns ``dtype``.

    No data-dependent Python branches (the transpose depends on the shape only), so it
    traces under torch.compile; the matmuls run in ``dtype`` (bf16: tensor cores; fp32 on
    CPUs where bf16 is slow: the result agrees with bf16's to bf16's rounding).
    """
    a, b, c = coeffs
    # The Gram matrix X X^T is the costly part: form it on the short side.
    tall = g.size(-2) > g.size(-1)
    x = g.mT if tall else g
    # Normalise in the input precision (fp32), then drop to ``dtype``: the norm of a large
    # matrix summed in bf16 would lose digits for nothing.
    x = (x / (torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True) + eps)).to(dtype)
    for _ in range(steps):
        gram = x @ x.mT
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    return x.mT if tall else x


def newton_schulz_folded(g: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16,
                         coeffs: tuple[float, float, float] = NS_COEFFS, eps: float = 1e-7) -> torch.Tensor:
    """``newton_schulz`` with each step's two sums done inside its matmuls: b G + c G G and
    a X + P X are ``baddbmm``'s beta/alpha, so the sum happens in the matmul's epilogue, on
    the fp32 accumulator. Same polynomial, same step count; per step three kernels instead of
    eight, and one rounding to ``dtype`` per product instead of three (in bf16 the result is
    closer to exact arithmetic than ``newton_schulz``'s). In fp32 on a CPU the two differ in the
    last bits only (tests/optim/test_muon_batched.py), which is why CPUs keep ``newton_schulz``: a CPU
    run keeps the bits it had before the folded form existed."""
    a, b, c = coeffs
    tall = g.size(-2) > g.size(-1)
    x = g.mT if tall else g
    x = (x / (torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True) + eps)).to(dtype)
    batch = x.shape[:-2]
    x = x.reshape(-1, *x.shape[-2:])  # baddbmm takes exactly one batch dim
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    x = x.reshape(*batch, *x.shape[-2:])
    return x.mT if tall else x


# The Newton-Schulz form per device type: on CUDA the folded one (tensor cores sum in the
# epilogue); elsewhere the unfolded one, whose bits runs recorded on CPUs were made with.
NEWTON_SCHULZ = {"cuda": newton_schulz_folded}


def update_scale(rows: int, cols: int) -> float:
    """An orthogonalised (rows x cols) matrix has min(rows, cols) unit singular values,
    so its element RMS is 1/sqrt(max(rows, cols)): a tall matrix (rows > cols, e.g. an
    MLP's input projection, out x in) would get a smaller step per element than a square
    or wide one for no reason. Scaling by sqrt(max(1, rows/cols)) makes the RMS
    1/sqrt(cols) = 1/sqrt(fan_in) for every shape, and its spectral norm
    sqrt(fan_out/fan_in) for tall matrices (1 otherwise), the size at which a matrix
    changes its output's RMS by the same amount whatever its aspect ratio."""
    return math.sqrt(max(1.0, rows / cols))


class Muon(torch.optim.Optimizer):
    """Muon for groups of kind "muon" (the default), AdamW for groups of kind "adamw".

    Muon group keys: ``lr``, ``lr_scale`` (the step uses lr * lr_scale, so one schedule
    that sets every group's ``lr`` drives both kinds), ``momentum``, ``nesterov``,
    ``weight_decay`` (decoupled: p <- p (1 - lr lr_scale wd)), ``ns_steps``, ``split``
    (a fused q/k/v weight is ``split=3``: its three row blocks are orthogonalised
    separately, as the three matrices they are).
    AdamW group keys: ``lr``, ``lr_scale`` (as for Muon; optim.muon.embed_lr), ``betas``, ``eps``,
    ``weight_decay``, ``foreach``, ``fused``.

    ``process_group``: the DDP group whose ranks hold replicated plain-tensor parameters
    (None: each rank orthogonalises what it holds). DTensor parameters bring their own
    mesh. ``ns_dtype``: the Newton-Schulz precision (bf16; fp32 for exact comparisons and
    on CPUs without a fast bf16 path: MuonSpec picks it from optim.muon.ns_dtype).
    """

    def __init__(self, params: Iterable, lr: float = 0.02, momentum: float = 0.95, weight_decay: float = 0.0,
                 ns_steps: int = 5, lr_scale: float = 1.0, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, *, process_group=None, ns_dtype: torch.dtype = torch.bfloat16):
        # Defaults per kind, applied in add_param_group, so a group carries only its own keys.
        self._kind_defaults = {
            "muon": dict(lr_scale=lr_scale, momentum=momentum, nesterov=True, weight_decay=weight_decay,
                         ns_steps=ns_steps, split=1),
            "adamw": dict(lr_scale=1.0, betas=betas, eps=eps, weight_decay=0.0, foreach=None, fused=None),
        }
        self.process_group = process_group
        self.ns_dtype = ns_dtype
        # Whole momenta stacked and sent in the Newton-Schulz dtype.
        self.whole = WholeMatrices(process_group, wire_dtype=ns_dtype)
        # How many matrices this rank orthogonalised in the last step (tests check the
        # work is spread, not repeated).
        self.last_orthogonalised = 0
        super().__init__(params, dict(lr=lr))
        # Its step honours ``found_inf`` (distlm/optim/base.py) when its AdamW groups run torch's
        # fused kernel, the one that takes the flag (MuonSpec.skips_on_device).
        self._step_supports_amp_scaling = all(g["fused"] for g in self.param_groups if g["kind"] == "adamw")

    def add_param_group(self, param_group: dict) -> None:
        kind = param_group.setdefault("kind", "muon")
        if kind not in self._kind_defaults:
            raise ValueError(f"Muon: param group kind must be 'muon' or 'adamw', got {kind!r}")
        for key, value in self._kind_defaults[kind].items():
            param_group.setdefault(key, value)
        super().add_param_group(param_group)
        if kind == "muon":
            for p in self.param_groups[-1]["params"]:
                if p.ndim not in (2, 3) or (p.ndim == 3 and param_group["split"] != 1):
                    raise ValueError(f"Muon updates matrices (or stacks of them, split=1); got a parameter of "
                                     f"shape {tuple(p.shape)} (put it in a group of kind 'adamw')")
                if p.shape[0] % param_group["split"]:
                    raise ValueError(f"Muon: split={param_group['split']} does not divide the rows of "
                                     f"{tuple(p.shape)}")

    def load_state_dict(self, state_dict: dict) -> None:
        # A loaded group replaces the current one whole. Keep any key the loaded one lacks
        # (a checkpoint from before a key existed, or a group whose hyperparameters the
        # distributed state-dict path did not carry), so "kind" can never go missing.
        current = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, before in zip(self.param_groups, current):
            for key, value in before.items():
                group.setdefault(key, value)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["kind"] == "adamw":
                self._adamw_step(group)
        self._muon_step([g for g in self.param_groups if g["kind"] == "muon"])
        return loss

    # ---- AdamW ------------------------------------------------------------------------
    def _adamw_step(self, group: dict) -> None:
        """One AdamW group's update, its state made on first use."""
        # State as torch.optim.AdamW keeps it (same keys, `step` where its kernels want
        # it), so checkpoints read the same and the fused/foreach kernels apply unchanged.
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32,
                                            device=p.device if group["fused"] else torch.device("cpu"))
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw_update(params, grads, exp_avgs, exp_avg_sqs, [], steps,
                     foreach=group["foreach"], fused=group["fused"], amsgrad=False, beta1=beta1, beta2=beta2,
                     lr=group["lr"] * group["lr_scale"], weight_decay=group["weight_decay"], eps=group["eps"],
                     maximize=False, grad_scale=None, found_inf=getattr(self, "found_inf", None))

    # ---- Muon -------------------------------------------------------------------------
    def _muon_step(self, groups: list[dict]) -> None:
        # 1. Momentum and weight decay, element-wise on each rank's own shard, one foreach
        #    pass over the matrices of every group that shares the settings (one in practice).
        # 2. Orthogonalise whole matrices, stacked by shape, each on one rank (see the
        #    module docstring).
        # 3. p -= lr * lr_scale * update_scale * orth(momentum), on the shard: one foreach
        #    pass per stack.
        work = []  # (param, step size, split, ns_steps), in group order
        by_momentum: dict = {}  # (momentum, nesterov) -> indices into work
        by_decay: dict = {}  # weight-decay factor -> indices into work
        flags: dict = {}  # found_inf (a step left out) as a bool, per device
        for group in groups:
            lr = group["lr"] * group["lr_scale"]
            split = group["split"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                by_momentum.setdefault((group["momentum"], group["nesterov"]), []).append(len(work))
                if group["weight_decay"]:
                    by_decay.setdefault(1.0 - lr * group["weight_decay"], []).append(len(work))
                if p.ndim == 3:
                    # An MoE block's experts, (E, in, out), each used as x @ w[e]: E matrices
                    # whose rows are the inputs, the transpose of nn.Linear's (out, in).
                    rows, cols = p.shape[2], p.shape[1]
                else:
                    rows, cols = p.shape[0] // split, p.shape[1]
                work.append((p, lr * update_scale(rows, cols), split, group["ns_steps"]))
        moms: list = [None] * len(work)
        for (mu, nesterov), idx in by_momentum.items():
            bufs = [local_shard(self.state[work[i][0]]["momentum_buffer"]) for i in idx]
            grads = [local_shard(work[i][0].grad) for i in idx]
            skip = skip_flag(self, bufs[0].device, flags)
            if skip is not None:
                # A step left out: each gradient (dropped after the step) becomes its buffer, so
                # the buffer and the Nesterov momentum come out as the buffer, NaN-free; the decay
                # factor is 1 and ``apply`` adds nothing.
                for g, b in zip(grads, bufs):
                    torch.where(skip, b, g, out=g)
            # An average of past gradients (buf <- mu buf + (1 - mu) g) rather than a sum:
            # the orthogonalisation divides out the scale, and an average keeps the buffer
            # the size of a gradient.
            torch._foreach_lerp_(bufs, grads, 1.0 - mu)
            # Nesterov: step along the gradient pulled toward the updated average.
            for i, m in zip(idx, torch._foreach_lerp(grads, bufs, mu) if nesterov else bufs):
                moms[i] = m
        for factor, idx in by_decay.items():
            targets = [local_shard(work[i][0]) for i in idx]
            skip = skip_flag(self, targets[0].device, flags)
            torch._foreach_mul_(targets, factor if skip is None else torch.where(skip, 1.0, factor))
        self.whole.wire_dtype = self.ns_dtype

        def apply(indices: list[int], updates: torch.Tensor) -> None:
            # One conversion of the stack to the parameters' dtype and layout (bf16 -> fp32 is
            # exact, so p + s u is the same number either way), then one foreach add per step
            # size (one per stack unless groups of one shape differ in rate).
            targets = [local_shard(work[i][0]) for i in indices]
            updates = updates.to(dtype=targets[0].dtype, memory_format=torch.contiguous_format)
            skip = skip_flag(self, updates.device, flags)
            if skip is not None:
                updates = torch.where(skip, torch.zeros((), dtype=updates.dtype, device=skip.device), updates)
            by_size: dict = {}
            for k, i in enumerate(indices):
                by_size.setdefault(work[i][1], []).append(k)
            for size, ks in by_size.items():
                torch._foreach_add_([targets[k] for k in ks], [updates[k] for k in ks], alpha=-size)

        self.last_orthogonalised = self.whole.map(
            [(p, m, (split, ns_steps)) for (p, _, split, ns_steps), m in zip(work, moms)], self._orthogonalise, apply)

    def _orthogonalise(self, stack: torch.Tensor, tag: tuple[int, int]) -> torch.Tensor:
        # A stack of matrices (n, rows, cols), or of 3-D parameters (n, E, rows, cols): each of
        # the n * split (or n * E) matrices orthogonalised on its own.
        split, steps = tag
        rows, cols = stack.shape[-2:]
        orthogonalise = NEWTON_SCHULZ.get(stack.device.type, newton_schulz)
        out = orthogonalise(stack.reshape(-1, rows // split, cols), steps, self.ns_dtype)
        return out.reshape(stack.shape)


# The largest share of a model's matrices that one Newton-Schulz stack holds (see MuonSpec).
LARGEST_STACK = 1 / 3


# optim.muon.ns_dtype's values.
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class MuonSpec(Spec):
    """optim.name=muon: one Muon object with groups [AdamW decay, AdamW no decay, (AdamW
    embedding tables with optim.muon.embed_lr,) Muon, Muon fused q/k/v], the empty ones left
    out. The AdamW groups take optim.adamw.* (the settings AdamW alone takes), the Muon groups
    optim.muon.*. Group 0 is AdamW's, so ``param_groups[0]["lr"]`` is the schedule's value from
    optim.adamw.lr; the other peaks are ``lr_scale`` times it (muon.lr / adamw.lr, embed_lr /
    adamw.lr), so one schedule moves every group alike."""
    name = "muon"
    state = {MATRIX: (StateTensor("momentum_buffer"),), OTHER: ADAMW_STATE}
    # What the step holds at its peak beyond the state, in fp32 copies of the matrices: the
    # Nesterov momenta of every matrix (1.0, made in one pass before any is orthogonalised),
    # plus three times the stack being orthogonalised (its fp32 stack, and the bf16 iterate
    # before and after a step, with what the matmul needs beside them). Counted by tracking
    # every tensor a step allocates (on a CPU, the folded form CUDA runs, bf16): 1 + 3 stacks;
    # the unfolded form peaks at 1 + 4. A stack holds the matrices of one shape: in a GPT
    # block at most a third of them (the MLP's input or output projection, d_ff = 4 d_model).
    # tests/optim/test_muon_batched.py measures the peak on a GPU against this.
    step_temporaries = {MATRIX: 1.0 + 3 * LARGEST_STACK, OTHER: 0.0}

    def skips_on_device(self, optimizer: torch.optim.Optimizer) -> bool:
        return bool(getattr(optimizer, "_step_supports_amp_scaling", False))

    def peak_lr(self, cfg: Config) -> float:
        return cfg.optim.adamw.lr

    def check(self, cfg: Config) -> None:
        a, m = cfg.optim.adamw, cfg.optim.muon
        if a.lr <= 0 or m.lr <= 0:
            raise ConfigError(f"optim.name=muon needs optim.adamw.lr > 0 and optim.muon.lr > 0 "
                              f"(got {a.lr} and {m.lr}): Muon's groups run at adamw.lr x muon.lr/adamw.lr")
        if not 0.0 <= m.momentum < 1.0:
            raise ConfigError(f"optim.muon.momentum must be in [0, 1), got {m.momentum}")
        if m.ns_steps < 1:
            raise ConfigError(f"optim.muon.ns_steps must be at least 1, got {m.ns_steps}")
        if m.weight_decay < 0:
            raise ConfigError(f"optim.muon.weight_decay must be >= 0, got {m.weight_decay}")

    def resolve(self, cfg: Config, device: torch.device, comm=None, probe=None) -> tuple[Config, Optional[str]]:
        """optim.muon.ns_dtype=auto made bf16 or fp32, as ``probe`` (a MatmulDtypeProbe) measures
        this device: bf16 on CUDA, on a CPU the faster of the two. With ``comm`` (collective) every
        rank takes the same: the Newton-Schulz stacks are redistributed between them, and fp32
        wins where any rank measured bf16 slower, as the slowest rank sets the pace. The line says
        what was measured (a CPU); None where nothing was."""
        if cfg.optim.muon.ns_dtype != "auto":
            return cfg, None
        from distlm.optim.matmul_dtype import MatmulDtypeProbe
        device = torch.device(device)
        choice = (probe or MatmulDtypeProbe()).choose(device)
        fp32 = choice.dtype == torch.float32
        if comm is not None:
            fp32 = bool(float(comm.max(torch.tensor([float(fp32)], device=device))[0]))
        name = "fp32" if fp32 else "bf16"
        line = (f"optim.muon.ns_dtype=auto: {name} for Newton-Schulz ({choice.describe()} on this CPU)"
                if choice.seconds else None)
        return updated(cfg, optim={"muon": dataclasses.replace(cfg.optim.muon, ns_dtype=name)}), line

    def build(self, model: nn.Module, cfg: Config, ctx: BuildContext) -> torch.optim.Optimizer:
        a, m = cfg.optim.adamw, cfg.optim.muon
        if m.ns_dtype == "auto":  # built without the Trainer's resolution: this process measures alone
            cfg = self.resolve(cfg, torch.device(ctx.device_type))[0]
            m = cfg.optim.muon
        plain, fused = matrix_params(model)
        # optim.muon.embed_lr: the embedding tables get their own AdamW group and rate. A table row
        # moves only when its token occurs, so at the head's rate the tables learn slowly
        # (the public speedrun gives them ~75x the head's rate).
        tables = embedding_tables(model) if m.embed_lr else []
        adamw_groups = param_groups(model, a.weight_decay, exclude={id(p) for p in plain + fused + tables})
        if tables:
            adamw_groups.append({"params": tables, "weight_decay": 0.0, "lr_scale": m.embed_lr / a.lr})
        kernel = elementwise_kernel(adamw_groups, ctx.device_type)
        groups = [dict(g, kind="adamw", betas=(a.beta1, a.beta2), eps=a.eps,
                       foreach=kernel.get("foreach"), fused=kernel.get("fused")) for g in adamw_groups]
        muon = dict(kind="muon", lr_scale=m.lr / a.lr, momentum=m.momentum,
                    weight_decay=m.weight_decay, ns_steps=m.ns_steps)
        groups += [dict(muon, params=plain, split=1), dict(muon, params=fused, split=3)]
        # Empty groups are left out (AdamW's decay group is empty when the head is tied, the
        # fused q/k/v group when the model has none). get_state_dict keys groups by their
        # parameters' names, and set_state_dict gives an empty group's hyperparameters to no
        # one (torch 2.13: it comes back as {}). Which groups exist depends on the architecture
        # (and under PP on the stage), never on the data/tensor-parallel layout.
        groups = [g for g in groups if g["params"]]
        return Muon(groups, lr=a.lr, process_group=ctx.process_group, ns_dtype=NS_DTYPES[m.ns_dtype])
