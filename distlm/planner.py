"""`distlm plan`: memory and communication per GPU for every layout of N GPUs, ranked.

    distlm plan --config gpt2-1.5b --gpus 4 --gpu-mem-gb 80 --global-batch 64 --micro-batch 8

Estimates, per GPU, the largest pipeline stage's (memory in GiB, as `distlm bench` reports it):
  parameters, gradients (fp32) and AdamW state (2 x fp32), divided by tp for the split
  matrices and by dp_shard under FSDP2; the FSDP2 all-gather buffers (two blocks, bf16);
  activations saved for backward, counted tensor by tensor for this model's blocks (see
  ``block_saved_elements``), times the microbatches a schedule keeps in flight, or only
  each block's input with full activation checkpointing; the logits and their gradient.
Communication per step is the bytes each GPU sends in its collectives (ring algorithms).
The ranking uses a simple time model (compute at a fixed fraction of peak, the pipeline
bubble, communication not hidden by compute); it is a guide to what to measure first,
not a promise. tests/test_planner.py checks the memory estimate against the tensors a
real training step holds.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from distlm.config import ModelConfig

GIB = 2 ** 30   # memory, as torch.cuda.max_memory_allocated / 2**30 reports it (bench)
GB = 1e9        # communication volume and link speed


@dataclass
class Layout:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    ac: str = "none"          # none | full
    schedule: str = "1f1b"

    @property
    def name(self) -> str:
        parts = [f"{k}{v}" for k, v in (("ddp", self.dp_replicate), ("fsdp", self.dp_shard), ("tp", self.tp),
                                         ("pp", self.pp)) if v > 1] or ["single"]
        return "x".join(parts) + ("+ac" if self.ac == "full" else "")

    def overrides(self) -> str:
        out = [f"parallel.{k}={v}" for k, v in (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard),
                                                ("tp", self.tp), ("pp", self.pp)) if v > 1]
        if self.ac == "full":
            out.append("parallel.activation_checkpoint=full")
        return " ".join(out)


@dataclass
class Estimate:
    layout: Layout
    params_gb: float
    grads_gb: float
    optim_gb: float
    buffers_gb: float
    activations_gb: float
    total_gb: float
    comm_gb: float
    step_s: float
    bubble: float
    fits: bool

    @property
    def tokens_per_s(self) -> float:
        return self._tokens / self.step_s if self.step_s else 0.0


def block_params(m: ModelConfig) -> tuple[int, int]:
    """(parameters split by TP, parameters replicated under TP) of one block."""
    d, ff, b = m.d_model, m.d_ff, int(m.bias)
    n_in = 3 if m.mlp == "swiglu" else 2
    split = 4 * d * d + 3 * d * b + n_in * d * ff + (n_in - 1) * ff * b  # q/k/v/MLP-in biases split too
    replicated = 2 * d * b + 2 * d * (1 + (b if m.norm == "layernorm" else 0))  # row-parallel biases, norms
    return split, replicated


def end_params(m: ModelConfig) -> tuple[int, int, int]:
    """(embedding matrix, head matrix if untied, position table + final norm)."""
    V, d = m.padded_vocab_size, m.d_model
    pos = m.block_size * d if m.position == "learned" else 0
    return V * d, 0 if m.tie_embeddings else V * d, pos + d * (2 if m.norm == "layernorm" and m.bias else 1)


def block_saved_elements(m: ModelConfig, tp: int, sp: bool) -> tuple[float, float]:
    """Elements per token that one block keeps for backward, as (fp32-held, compute-dtype).

    Attention: the norm's input (the fp32 residual stream) and output, q, k, v, the SDPA
    output and its reshaped copy (the out-projection's input). MLP: the norm's input and
    output, then gelu's input and output (2 x d_ff) or swiglu's gate, up, silu(gate) and
    product (4 x d_ff). Under TP the per-head and d_ff tensors are split; with sequence
    parallelism the norm inputs are too, but the gathered norm outputs (the column-parallel
    layers' inputs) are whole."""
    d, ff = m.d_model, m.d_ff
    k = 4 if m.mlp == "swiglu" else 2
    fp32 = 2 * d / (tp if sp else 1)
    split = (3 * d + d + d + k * ff) / tp
    normed = 2 * d
    return fp32, split + normed


def layer_split(m: ModelConfig, pp: int) -> int:
    """Blocks on the busiest stage (the split distlm.parallel.pp makes)."""
    if pp == 1:
        return m.n_layer
    from distlm.parallel.pp import split_layers
    return max(len(s) for s in split_layers(m, pp))


def estimate(m: ModelConfig, lay: Layout, global_batch: int, micro_batch: int, gpu_mem_gb: float,
             compute_bytes: int = 2, peak_tflops: float = 989.0, link_gbs: float = 150.0,
             mfu: float = 0.45, sequence_parallel: bool = True, loss_parallel: bool = True) -> Estimate:
    """Memory per GPU on the busiest stage, communication and a step-time guess.
    compute_bytes: 2 for bf16 autocast on GPUs, 4 for fp32 (CPU)."""
    T, d, V = m.block_size, m.d_model, m.padded_vocab_size
    dp = lay.dp_replicate * lay.dp_shard
    t, shard = lay.tp, lay.dp_shard
    local_batch = global_batch // dp
    n_mb = max(1, local_batch // micro_batch)
    b = micro_batch
    # parameters on the busiest stage: its blocks plus the larger end (embedding or head)
    bs, br = block_params(m)
    emb, head, extra = end_params(m)
    L = layer_split(m, lay.pp)
    ends = emb + head + extra if lay.pp == 1 else max(emb + extra, head or emb)
    n_local = (L * bs + ends) / t + L * br
    p_bytes = 4 * n_local / shard
    params_gb, grads_gb, optim_gb = p_bytes / GIB, p_bytes / GIB, 2 * p_bytes / GIB
    buffers_gb = (2 * compute_bytes * (bs / t + br) / GIB) if shard > 1 else 0.0
    # activations of one microbatch on this stage, times those in flight
    fp32_el, cd_el = block_saved_elements(m, t, sequence_parallel and t > 1)
    per_layer = b * T * (4 * fp32_el + compute_bytes * cd_el)
    in_flight = 1 if lay.pp == 1 else (n_mb if lay.schedule in ("gpipe", "naive") else min(lay.pp, n_mb))
    # logits, their fp32 copy and gradient; model.loss_chunk holds one chunk of them (it applies
    # where the model computes its own loss: no TP, no pipeline)
    rows = min(b * T, m.loss_chunk) if m.loss_chunk and t == 1 and lay.pp == 1 else b * T
    logits = rows * V / (t if loss_parallel else 1) * (compute_bytes + 4 + 4)
    if lay.ac == "full":
        # Only each block's input is kept; one block's tensors come back during its
        # recompute, by which time the logits are gone: the peak is the larger of the two.
        kept = b * T * 4 * d / (t if sequence_parallel and t > 1 else 1) * L
        activations_gb = (kept * in_flight + max(logits, per_layer)) / GIB
    else:
        activations_gb = (per_layer * L * in_flight + logits) / GIB
    total = params_gb + grads_gb + optim_gb + buffers_gb + activations_gb
    # communication per GPU per step (bytes sent), ring algorithms: 2(n-1)/n for all-reduce
    comm = 0.0
    if lay.dp_replicate > 1:
        comm += 2 * (lay.dp_replicate - 1) / lay.dp_replicate * 4 * n_local / shard
    if shard > 1:
        gathers = 2 * n_mb if lay.pp == 1 else 2  # kept unsharded across a step's microbatches under PP
        comm += (shard - 1) / shard * n_local * (compute_bytes * gathers + 4)
    if t > 1:  # 2 collectives forward + 2 backward per block, on the residual stream
        comm += 4 * L * n_mb * 2 * (t - 1) / t * b * T * d * compute_bytes
    if lay.pp > 1:
        comm += 2 * n_mb * b * T * d * compute_bytes / (t if sequence_parallel and t > 1 else 1)
    # time: compute at a fixed MFU, the bubble, then TP/PP traffic exposed and DP traffic
    # half hidden behind the backward pass
    n_total = m.n_layer * (bs + br) + emb + head
    flops = (6 * n_total + 12 * m.n_layer * d * T) * global_batch * T
    compute_s = flops / (dp * t * lay.pp) / (peak_tflops * 1e12 * mfu)
    if lay.ac == "full":
        compute_s *= 4 / 3  # the forward again
    bubble = 0.0 if lay.pp == 1 else (lay.pp - 1) / (n_mb + lay.pp - 1) if lay.schedule != "naive" \
        else (lay.pp - 1) / lay.pp
    tp_pp_bytes = (4 * L * n_mb * 2 * (t - 1) / t * b * T * d * compute_bytes if t > 1 else 0)
    exposed = tp_pp_bytes / (link_gbs * GB) + 0.5 * (comm - tp_pp_bytes) / (link_gbs * GB)
    step_s = compute_s / (1 - bubble) + exposed
    est = Estimate(lay, params_gb, grads_gb, optim_gb, buffers_gb, activations_gb, total, comm / GB, step_s, bubble,
                   total <= 0.92 * gpu_mem_gb)
    est._tokens = global_batch * T
    return est


def layouts(gpus: int, m: ModelConfig) -> list[Layout]:
    """Every (dp_replicate, dp_shard, tp, pp) with product = gpus that the model allows,
    each with and without full activation checkpointing."""
    out = []
    for tp, pp in itertools.product(range(1, gpus + 1), repeat=2):
        if gpus % (tp * pp) or m.n_head % tp or m.d_ff % tp or (pp > 1 and pp > m.n_layer):
            continue
        dp = gpus // (tp * pp)
        for shard in [s for s in range(1, dp + 1) if dp % s == 0 and s in (1, dp)]:
            for ac in ("none", "full"):
                out.append(Layout(dp // shard, shard, tp, pp, ac))
    return out


def skipped_layouts(gpus: int, m: ModelConfig) -> list[str]:
    """Why degrees that divide the GPU count are missing from the table, one line each (a
    silent gap reads as if the planner had not considered them)."""
    degrees = [k for k in range(2, gpus + 1) if gpus % k == 0]
    notes = []
    heads = [t for t in degrees if m.n_head % t]
    if heads:
        notes.append(f"{', '.join(f'tp={t}' for t in heads)} skipped: {m.n_head} heads do not split by "
                     f"{', '.join(map(str, heads))}{_head_count_hint(m, heads)}")
    ff = [t for t in degrees if t not in heads and m.d_ff % t]
    if ff:
        notes.append(f"{', '.join(f'tp={t}' for t in ff)} skipped: d_ff {m.d_ff} does not split by "
                     f"{', '.join(map(str, ff))}")
    deep = [p for p in degrees if p > m.n_layer]
    if deep:
        notes.append(f"{', '.join(f'pp={p}' for p in deep)} skipped: {m.n_layer} layers cannot fill "
                     f"{deep[0]} pipeline stages")
    return notes


def _head_count_hint(m: ModelConfig, tps: list[int]) -> str:
    """The head count closest to the model's that every skipped degree splits and that
    divides the width (gpt2-1.5b: 25 heads of 64 -> 20 heads of 80, the same size)."""
    step = math.lcm(*tps)
    fits = [h for h in range(step, m.d_model + 1, step) if m.d_model % h == 0]
    if not fits:
        return ""
    best = min(fits, key=lambda h: (abs(h - m.n_head), h))
    return f" (model.n_head={best} would)"


def step_ms(seconds: float) -> str:
    """Milliseconds, to three significant digits below 100 ms: a small model's step is a
    fraction of a millisecond on a GPU, and a whole-number format would print 0."""
    ms = seconds * 1e3
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.3g}"


def plan(m: ModelConfig, gpus: int, gpu_mem_gb: float, global_batch: int, micro_batch: int, **kw) -> list[Estimate]:
    """All layouts, the ones that fit first, each group fastest first."""
    ests = []
    for lay in layouts(gpus, m):
        dp = lay.dp_replicate * lay.dp_shard
        if global_batch % (dp * micro_batch):
            continue
        ests.append(estimate(m, lay, global_batch, micro_batch, gpu_mem_gb, **kw))
    return sorted(ests, key=lambda e: (not e.fits, e.step_s))


def explain(best: Estimate, ests: list[Estimate], gpu_mem_gb: float) -> str:
    lay = best.layout
    why = [f"recommended: {lay.name} ({lay.overrides() or 'no parallel.* settings'})"]
    why.append(f"  fits: {best.total_gb:.1f} GiB of {gpu_mem_gb:.0f} GiB per GPU "
               f"(params {best.params_gb:.1f}, grads {best.grads_gb:.1f}, AdamW {best.optim_gb:.1f}, "
               f"activations {best.activations_gb:.1f})")
    fits = [e for e in ests if e.fits]
    if len(fits) > 1:
        nxt = fits[1]
        why.append(f"  fastest estimate among the {len(fits)} that fit: {step_ms(best.step_s)} ms/step vs "
                   f"{step_ms(nxt.step_s)} for {nxt.layout.name}")
    if lay.pp > 1:
        why.append(f"  pipeline bubble {best.bubble:.0%}: more microbatches (smaller train.micro_batch_size) shrink it")
    if lay.ac == "full":
        why.append("  activation checkpointing recomputes the forward (~33% more compute) to fit")
    if lay.dp_shard > 1 and lay.dp_replicate == 1:
        why.append("  FSDP2 shards parameters, gradients and AdamW state, so each GPU holds 1/N of them")
    return "\n".join(why)


def format_table(ests: list[Estimate]) -> str:
    head = ("| layout | fits | params | grads | AdamW | FSDP buf | activations | total GiB | comm GB/step "
            "| bubble | est. ms/step | est. tok/s |")
    rows = [head, "|" + "---|" * 12]
    for e in ests:
        rows.append(f"| {e.layout.name} | {'yes' if e.fits else 'no'} | {e.params_gb:.2f} | {e.grads_gb:.2f} | "
                    f"{e.optim_gb:.2f} | {e.buffers_gb:.2f} | {e.activations_gb:.2f} | {e.total_gb:.2f} | "
                    f"{e.comm_gb:.2f} | {e.bubble:.0%} | {step_ms(e.step_s)} | {e.tokens_per_s:,.0f} |")
    return "\n".join(rows)

