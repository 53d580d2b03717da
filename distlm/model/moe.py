"""Mixture of experts: the MLP of an MoE block (``model.moe.*``).

Each token's router scores (a sigmoid of one logit per expert, in fp32) pick its top-k
experts; their outputs are summed with the chosen scores, normalised to sum to one and
multiplied by ``moe.route_scale``, plus the shared experts' output. Routing is token choice
and dropless: every chosen (token, expert) pair is computed, however uneven the load.

Balance without an auxiliary loss (DeepSeek-V3): a per-expert bias is added to the scores
for the choice only, never to the weights. It is a buffer, not a parameter: after each
optimizer step ``ExpertBalance.step`` moves it by ``moe.bias_rate`` toward an even load,
up for an expert that got fewer than the mean of the tokens, down for one that got more.
``moe.aux_loss`` adds the usual auxiliary loss instead of (or beside) it:
E / (k N) x sum_i count_i x mean score_i, 1 when the load and the scores are even.

The experts' weights are 3-D, one matrix per expert: ``w_in`` and ``w_gate`` (E, d, f),
``w_out`` (E, f, d), each used as ``x @ w[e]``. The tokens are sorted by expert and the
three matmuls run in one of three forms (``moe.kernel``), the same numbers in fp32:

  grouped  torch._grouped_mm with the group offsets: one kernel per matmul, no padding, no
           host sync (the GPU form, in bf16; torch >= 2.8 has it, eager on CPUs in fp32 too)
  bmm      every expert's tokens padded to the whole batch, one torch.bmm: static shapes,
           E/k times the useful FLOPs
  loop     one matmul per expert, split by the counts read on the host (a sync per layer)

Muon orthogonalises each expert's matrix on its own (distlm/optim/muon.py), and
``flops_per_token`` counts only the active experts (distlm/model/gpt.py).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from distlm.config import ConfigError, ModelConfig
from distlm.local_shard import local_shard

KERNELS = ("grouped", "bmm", "loop")


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    e = cfg.moe
    return e.enabled and layer >= e.first_dense and (layer - e.first_dense) % e.every == 0


def moe_layers(cfg: ModelConfig) -> list[int]:
    return [i for i in range(cfg.n_layer) if is_moe_layer(cfg, i)]


def expert_width(cfg: ModelConfig) -> int:
    return cfg.moe.d_ff or cfg.d_ff


def inactive_params(cfg: ModelConfig) -> int:
    """Parameters of the routed experts a token does not use: (E - k) experts per MoE block."""
    if not cfg.moe.enabled:
        return 0
    f, d = expert_width(cfg), cfg.d_model
    per_expert = (3 if cfg.mlp == "swiglu" else 2) * d * f + (f + d if cfg.bias else 0)
    return len(moe_layers(cfg)) * (cfg.moe.experts - cfg.moe.top_k) * per_expert


def grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


def resolve_kernel(kernel: str, x: torch.Tensor) -> str:
    """auto: grouped where it has its fast kernel (CUDA, bf16, as under autocast), else the loop.
    (torch's grouped matmul takes fp32 on CPUs eagerly, but its compile-time shape function
    insists on bf16, as CUDA's kernel does.)"""
    if kernel == "auto":
        fast = x.device.type == "cuda" and _compute_dtype(x) == torch.bfloat16
        return "grouped" if fast and grouped_mm_available() else "loop"
    if kernel == "grouped" and not grouped_mm_available():
        raise ConfigError(f"model.moe.kernel=grouped needs torch._grouped_mm, which torch {torch.__version__} "
                          f"lacks; use model.moe.kernel=bmm or loop")
    return kernel


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


class Experts:
    """The three matmul forms over tokens sorted by expert: ``counts`` (E,) int64 tokens per
    expert, ``xs`` (sum(counts), d_in), ``w`` (E, d_in, d_out)."""

    @staticmethod
    def grouped(xs: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        # Autocast has no rule for the grouped matmul: both sides in the autocast dtype, as
        # torch.mm would get them.
        dtype = _compute_dtype(xs)
        return torch._grouped_mm(xs.to(dtype), w.to(dtype), offs=offsets)

    @staticmethod
    def loop(xs: torch.Tensor, w: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        parts = [piece @ w[e] for e, piece in enumerate(xs.split(sizes)) if sizes[e]]
        return torch.cat(parts) if parts else xs.new_zeros(0, w.shape[-1])


def expert_mlp(xs: torch.Tensor, expert_ids: torch.Tensor, counts: torch.Tensor, w_in: torch.Tensor,
               w_gate, w_out: torch.Tensor, act: str, kernel: str, capacity: int | None = None) -> torch.Tensor:
    """Every routed copy's expert MLP: ``xs`` (M, d) sorted by expert, ``expert_ids`` (M,)
    its expert, ``counts`` (E,) copies per expert. Returns (M, d) in the same order.
    ``capacity``: bmm's rows per expert, at least the largest count (default M)."""
    E = w_in.shape[0]

    def activate(h, g):
        if act == "swiglu":
            return F.silu(g) * h
        if act == "relu2":
            return F.relu(h).square()
        return F.gelu(h, approximate="tanh")

    if kernel == "bmm":
        # Each expert's copies at their rank within the expert, in an (E, capacity, d) batch. The
        # MoE block passes its token count: a token picks k distinct experts, so no expert gets
        # more, nothing is dropped, and no shape depends on the data.
        M = xs.shape[0]
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(M, device=xs.device) - starts[expert_ids]
        padded = xs.new_zeros(E, capacity or M, xs.shape[1])
        padded[expert_ids, slot] = xs
        h = torch.bmm(padded, w_in)
        g = torch.bmm(padded, w_gate) if w_gate is not None else None
        return torch.bmm(activate(h, g), w_out)[expert_ids, slot]
    if kernel == "grouped":
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        mm = lambda a, w: Experts.grouped(a, w, offsets)  # noqa: E731
    else:
        sizes = counts.tolist()
        mm = lambda a, w: Experts.loop(a, w, sizes)  # noqa: E731
    h = mm(xs, w_in)
    g = mm(xs, w_gate) if w_gate is not None else None
    return mm(activate(h, g), w_out)


class ExpertWeights(nn.Module):
    """The routed experts' weights, (E, d, f) and (E, f, d), and their MLP over copies sorted by
    expert (``expert_mlp``): a module of its own, so that a parallel layout can place it apart
    from the rest of the block, and an FSDP2 unit gathers it around this forward
    (distlm/parallel/expert.py). Sharded by expert, it runs the experts this rank holds."""

    def __init__(self, n: int, d: int, f: int, gated: bool):
        super().__init__()
        self.w_in = nn.Parameter(torch.empty(n, d, f))
        self.w_gate = nn.Parameter(torch.empty(n, d, f)) if gated else None
        self.w_out = nn.Parameter(torch.empty(n, f, d))

    def forward(self, xs: torch.Tensor, expert_ids: torch.Tensor, counts: torch.Tensor, act: str, kernel: str,
                capacity: int | None = None, prepare=None) -> torch.Tensor:
        """``prepare``: applied to each local weight before use (expert parallelism's gradient
        scaling and averaging, distlm/parallel/expert.py)."""
        weights = [None if p is None else local_shard(p) for p in (self.w_in, self.w_gate, self.w_out)]
        if prepare is not None:
            weights = [None if w is None else prepare(w) for w in weights]
        return expert_mlp(xs, expert_ids, counts, *weights, act, kernel, capacity)


class MoE(nn.Module):
    """The MLP of an MoE block: (B, T, d) -> (B, T, d)."""

    def __init__(self, cfg: ModelConfig, shared: nn.Module | None = None):
        """``shared``: the shared experts, one MLP of their summed width (moe.shared x moe.d_ff)."""
        super().__init__()
        e = cfg.moe
        d, f = cfg.d_model, expert_width(cfg)
        self.n_experts, self.top_k, self.route_scale = e.experts, e.top_k, e.route_scale
        self.aux_weight, self.act, self.kernel = e.aux_loss, cfg.mlp, e.kernel
        self.router = nn.Linear(d, e.experts, bias=False)
        self.experts = ExpertWeights(e.experts, d, f, gated=cfg.mlp == "swiglu")
        self.shared = shared
        self.drop = nn.Dropout(cfg.dropout)
        # Persistent: checkpointed with the weights, so a resumed run routes as it would have.
        self.register_buffer("expert_bias", torch.zeros(e.experts), persistent=True)
        # Routed copies per expert since the last balance step: a plain tensor, not a buffer,
        # so DDP's buffer broadcast never overwrites one rank's counts with another's.
        # ExpertBalance.attach sets it where the model runs; None: nothing is counted.
        self.meter = None
        # The auxiliary loss of the latest training forward (moe.aux_loss > 0), read by GPT.
        self.aux_loss = None
        # Set by expert parallelism: it runs the experts of copies spread over ranks.
        self.dispatch = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(top-k expert ids (N, k), their gate weights (N, k) fp32, all scores (N, E) fp32)."""
        logits = F.linear(x.float(), self.router.weight.float())
        scores = torch.sigmoid(logits)
        chosen = torch.topk(scores + self.expert_bias.float(), self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, chosen)
        # The same normalisation as DeepSeek-V3's and Glm4Moe's routers (the export's exactness).
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * self.route_scale
        return chosen, weights, scores

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        N, E, k = x.shape[0], self.n_experts, self.top_k
        chosen, weights, scores = self.route(x)
        flat = chosen.reshape(-1)
        # A scatter rather than bincount: its output's shape does not depend on the data.
        counts = flat.new_zeros(E).scatter_add_(0, flat, torch.ones_like(flat))
        if self.training and self.meter is not None:
            self.meter.add_(counts.to(self.meter.dtype))
        if self.training and self.aux_weight:
            share = scores / scores.sum(-1, keepdim=True)
            self.aux_loss = self.aux_weight * E / (k * N) * (counts.to(share.dtype) * share.mean(0)).sum()
        order = torch.argsort(flat, stable=True)
        token = order // k
        kernel = resolve_kernel(self.kernel, x)
        if self.dispatch is not None:  # the experts spread over ranks (distlm/parallel/expert.py)
            out = self.dispatch(x[token], counts, self.experts, self.act, kernel)
        else:
            out = self.experts(x[token], flat[order], counts, self.act, kernel, capacity=N)
        out = out * weights.reshape(-1)[order, None].to(out.dtype)
        y = torch.zeros_like(x, dtype=out.dtype).index_add_(0, token, out).to(x.dtype)
        if self.shared is not None:
            y = y + self.shared(x)
        return self.drop(y).reshape(shape)


def moe_modules(model: nn.Module) -> list[tuple[str, MoE]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def layer_of(name: str) -> str:
    parts = name.split(".")
    return parts[parts.index("blocks") + 1] if "blocks" in parts else name


class ExpertBalance:
    """The per-expert routing biases' update after each optimizer step, and the load each MoE
    block saw in it (for the log). The counts are summed over every rank first (each saw other
    tokens), so the biases stay the same on every rank; under activation checkpointing the
    recomputed forward counts again, every expert alike, which neither the sign rule nor
    max/mean sees."""

    def __init__(self, model: nn.Module, rate: float):
        self.layers = moe_modules(model)
        self.rate = rate
        self.stats = None

    @classmethod
    def of(cls, model: nn.Module, cfg: ModelConfig):
        """None for a dense model."""
        if not cfg.moe.enabled:
            return None
        balance = cls(model, cfg.moe.bias_rate)
        return balance if balance.layers else None

    def attach(self) -> "ExpertBalance":
        for _, m in self.layers:
            m.meter = torch.zeros(m.n_experts, device=m.expert_bias.device)
        return self

    @torch.no_grad()
    def step(self) -> None:
        if not self.layers:
            return
        import torch.distributed as dist
        loads = torch.stack([m.meter for _, m in self.layers])  # (layers, E)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(loads)
        mean = loads.mean(1, keepdim=True)
        for i, (_, m) in enumerate(self.layers):
            if self.rate:
                m.expert_bias.add_(torch.sign(mean[i] - loads[i]), alpha=self.rate)
            m.meter.zero_()
        # Kept on the device; read only when a log row is written.
        biases = torch.stack([m.expert_bias.float() for _, m in self.layers])
        self.stats = torch.stack([loads.max(1).values / mean[:, 0].clamp_min(1e-9),
                                  loads.min(1).values / mean[:, 0].clamp_min(1e-9),
                                  biases.max(1).values - biases.min(1).values], 1)

    def metrics(self) -> dict:
        """Per MoE block: max/mean and min/mean tokens per expert in the last step, the spread
        of its biases; and the worst block's max/mean (the console's ``moe``)."""
        if self.stats is None:
            return {}
        rows = self.stats.tolist()
        out = {}
        for (name, _), (hi, lo, spread) in zip(self.layers, rows):
            layer = layer_of(name)
            out[f"moe/{layer}/load_max_over_mean"] = hi
            out[f"moe/{layer}/load_min_over_mean"] = lo
            out[f"moe/{layer}/bias_spread"] = spread
        out["moe_load_max_over_mean"] = max(r[0] for r in rows)
        return out


__all__ = ["ExpertBalance", "KERNELS", "MoE", "expert_mlp", "expert_width", "inactive_params", "is_moe_layer",
           "moe_layers", "moe_modules"]
