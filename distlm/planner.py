"""`distlm plan`: memory and communication per GPU for every layout of N GPUs, ranked.

    distlm plan --config gpt2-1.5b --gpus 4 --gpu-mem-gb 80 --global-batch 64 --micro-batch 8

Estimates, per GPU, the largest pipeline stage's (memory in GiB, as `distlm bench` reports it):
  parameters, gradients (fp32) and the optimizer's state as it declares it per parameter
  (distlm/optim/: AdamW 2 x fp32; Muon 1 x fp32 for the blocks' matrices, AdamW's for the
  rest; the larger of the activations and the step's own temporaries), divided as the axes
  divide them; the buffers their collectives hold; activations saved for backward, counted
  tensor by tensor for this model's blocks (see ``block_saved_elements``), times the
  microbatches a schedule keeps in flight, or only each block's input with full activation
  checkpointing; the logits and their gradient.
Each axis's terms are its own (distlm/layout/<axis>.py, the methods of ``Axis``): how it
divides the tokens of a row, the split weights, the activations and the logits, what it adds
to the activations (cp's gathered keys and values), the bytes its collectives send per step,
whether the compute waits for them, its host time and its bubble. ``estimate`` counts the
model, asks every axis, and sums; it names none of them.
Communication per step is the bytes each GPU sends in its collectives (ring algorithms),
on a two-level network: the mesh's axes are ordered (``MESH_ORDER``), tp innermost, so with
G GPUs per node an axis whose group spans more than G consecutive ranks crosses nodes, and
its collectives run at the inter-node bandwidth (see ``crossing_axes``).
The ranking uses a simple time model (compute at a fixed fraction of peak, the pipeline
bubble, the optimizer step, communication not hidden by compute, and the host's time where
the GPU waits for it; the constants below and the axes' own, fitted to
tests/fixtures/planner_measurements.json); it is a guide to what to measure first, not a
promise. tests/test_planner.py checks the memory estimate against the tensors a real
training step holds and the time estimate against the recorded throughputs;
tests/test_planner_grid.py holds the whole output of a grid of layouts to a recorded one.
"""
from __future__ import annotations

import itertools
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional

from distlm.config import Config, ModelConfig, ParallelConfig
from distlm.errors import ConfigError
from distlm.layout import (AXES, MESH_ORDER, PARTS, Layout, SplitRefusal, Work, axis_named, check_model_split,
                           check_split, model_kind)
from distlm.model.memory import GIB, block_params, end_params
from distlm.optim import MATRIX, OTHER, REGISTRY, Spec

GB = 1e9        # communication volume and link speed

# The time model's constants, fitted to tests/fixtures/planner_measurements.json (gpt2-1.5b on
# 2 x H100, 2 x H200 and 4 x H200; gpt2-124m on two 1-GPU "nodes"); tests/test_planner.py
# fails when an estimate drifts more than 20% from a recorded throughput (entries marked
# "superseded" measured code that has since changed, and are not held to it), so change
# them together with that file.
MFU = 0.50
# ^ what an unsplit layout's forward + backward reaches of dense peak on its matmul-bound work,
#   before the fixed cost of each block call below. Fitted together with BLOCK_CALL_S: FSDP2 of
#   gpt2-1.5b on 2 x H100 ran at 36.9% MFU all-in at micro-batch 8 and 45.2% at 16 (the same
#   FLOPs in half the block calls); the 0.40 this replaced charged both the same.
BLOCK_CALL_S = 6e-4
# ^ what each call of a block costs beyond its FLOPs, forward and backward, per micro-step:
#   kernel launches and the small kernels around the matmuls, FSDP2's hooks. 0.6 ms puts the
#   FSDP2 pair above at 1.00x and 0.90x of measured and keeps every record within 20%;
#   under TP the host's own time per block (TP_HOST_S_PER_BLOCK, distlm/layout/tensor.py) is what
#   the GPU waits for.
DP_EXPOSED = 0.75
# ^ FSDP/DDP and pipeline traffic overlaps the backward pass, but not all of it: the first
#   all-gather and the last reduce-scatter of a step have nothing to hide behind, and the
#   overlapped part takes SMs and memory bandwidth from the matmuls. Measured where the
#   bytes dominate: DDP2 of gpt2-124m across two "nodes" at 2.0 GB/s left 188.7 ms of its
#   249 ms all-reduce (0.50 GB / 2.0 GB/s) exposed, 0.76. On NVLink the term is at most 8%
#   of a recorded step (FSDP2's 15.6 GB per step), and 0.75 keeps every record within 20%
#   (0.5, the earlier guess, put that two-node run at 1.26x its throughput).
STEP_OVERHEAD_S = 0.02
# ^ what every step pays whatever its batch: gradient clipping's global norm (a host sync),
#   the loss and metrics reduction, the Python around the micro-step loop. Partly a fit: the
#   runs with the least work per step bound it, FSDP4 on 4 GPUs and above all gpt2-124m DDP2
#   on NVLink (a 53.6 ms step, of which 10 ms exposed communication the bandwidth term does
#   not see), which leaves the 20% band without it and again at 0.03 s.
OPTIMIZER_S_PER_PARAM = 3.9e-11
# ^ fused AdamW is memory-bound (read and write parameter, gradient, two moments): 30.6 ms
#   for the 0.78B parameters an H100 holds under FSDP2 (torch 2.11, the call that measured
#   TP2's optimizer, TP_OPTIMIZER_SLOWDOWN; an earlier FSDP2 record measured 22.3 ms).
# TP's own constants (its host time per block, its optimizer's slowdown) are its costs:
# distlm/layout/tensor.py.


@dataclass(kw_only=True)
class Candidate(Layout):
    """A layout the planner weighs (the degrees: distlm/layout/), with activation
    checkpointing and a pipeline schedule."""
    ac: str = "none"          # none | full
    schedule: str = "1f1b"

    @property
    def name(self) -> str:
        return super().name + ("+ac" if self.ac == "full" else "")

    def overrides(self) -> str:
        out = [super().overrides()] if super().overrides() else []
        if self.ac == "full":
            out.append("parallel.activation_checkpoint=full")
        return " ".join(out)


@dataclass
class Estimate:
    layout: Candidate
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
    inter_gb: float = 0.0                 # of comm_gb, what crosses nodes
    inter_axes: tuple[str, ...] = ()      # mesh axes whose collectives cross nodes
    sent_gb: dict = field(default_factory=dict)   # comm_gb by mesh axis
    nodes: int = 1
    time_ms: dict = field(default_factory=dict)   # the step-time estimate's terms
    micro_batch: int = 0                          # sequences per forward the estimate is for
    optimizer: str = "adamw"                      # whose state optim_gb counts
    step_temporaries_gb: float = 0.0              # the optimizer step's own temporaries (not in total_gb
                                                  # when the activations, gone by then, are larger)

    @property
    def tokens_per_s(self) -> float:
        return self._tokens / self.step_s if self.step_s else 0.0


def block_matrix_params(m: ModelConfig) -> int:
    """The 2-D weights of one block (attention's four projections, the MLP's matrices): the
    parameters a matrix optimizer such as Muon takes (distlm/optim/groups.py), all split by TP."""
    return 4 * m.d_model * m.d_model + (3 if m.mlp == "swiglu" else 2) * m.d_model * m.d_ff


def block_saved_elements(m: ModelConfig, split: int, residual: int) -> tuple[float, float]:
    """Elements per token that one block keeps for backward, as (fp32-held, compute-dtype).

    Attention: the norm's input (the fp32 residual stream) and output, q, k, v, the SDPA
    output and its reshaped copy (the out-projection's input). MLP: the norm's input and
    output, then gelu's input and output (2 x d_ff) or swiglu's gate, up, silu(gate) and
    product (4 x d_ff). The per-head and d_ff tensors are divided ``split`` ways (TP), the
    norm inputs ``residual`` ways (sequence parallelism); the gathered norm outputs (the
    column-parallel layers' inputs) are whole."""
    d, ff = m.d_model, m.d_ff
    k = 4 if m.mlp == "swiglu" else 2
    fp32 = 2 * d / residual
    split = (3 * d + d + d + k * ff) / split
    normed = 2 * d
    return fp32, split + normed


def layer_split(m: ModelConfig, pp: int) -> int:
    """Blocks on the busiest stage (the split distlm.parallel.pp makes)."""
    if pp == 1:
        return m.n_layer
    from distlm.parallel.pp import split_layers
    return max(len(s) for s in split_layers(m, pp))


MESH_AXES_INNER_FIRST = tuple(reversed(MESH_ORDER))  # the mesh distlm.parallel.dims builds, innermost first


def crossing_axes(lay: Layout, gpus_per_node: int) -> tuple[str, ...]:
    """The mesh axes whose groups leave a node. Ranks fill nodes in order and tp is the
    innermost axis, so an axis's group spans its size times the sizes of the axes inside it
    in consecutive ranks; past gpus_per_node (or straddling a node boundary) it crosses."""
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node={gpus_per_node} must be at least 1")
    out, inner = [], 1
    for axis in MESH_AXES_INNER_FIRST:
        k = getattr(lay, axis)
        span = inner * k
        if k > 1 and (span > gpus_per_node or gpus_per_node % span):
            out.append(axis)
        inner = span
    return tuple(out)


def estimate(m: ModelConfig, lay: Candidate, global_batch: int, micro_batch: int, gpu_mem_gb: float,
             compute_bytes: int = 2, peak_tflops: float = 989.0, intra_gbs: float = 150.0,
             inter_gbs: float = 25.0, gpus_per_node: Optional[int] = None, mfu: float = MFU,
             sequence_parallel: bool = True, loss_parallel: bool = True,
             optimizer: Optional[Spec] = None,
             fused_loss: bool = False) -> Estimate:
    """Memory per GPU on the busiest stage, communication and a step-time guess.
    compute_bytes: 2 for bf16 autocast on GPUs, 4 for fp32 (CPU). intra_gbs / inter_gbs:
    bus bandwidth per GPU inside a node (NVLink) and between nodes (its share of the NICs:
    25 for 200 Gb/s per GPU); gpus_per_node defaults to every GPU of the layout in one node.
    optimizer: the registry's spec whose declared
    state is counted (distlm/optim/; default AdamW). fused_loss: the head and the
    cross-entropy run as one compiled graph (train.compile where the model computes its own
    loss), so no fp32 copy of the logits is ever made."""
    for name, value in (("intra_gbs", intra_gbs), ("inter_gbs", inter_gbs), ("peak_tflops", peak_tflops),
                        ("mfu", mfu)):
        if not value > 0:
            raise ValueError(f"{name}={value} must be positive")
    T, d, V = m.block_size, m.d_model, m.padded_vocab_size
    dp = lay.dp_size
    shard = lay.shard_degree  # the shard role's axes (FSDP2's group: the data shards, cp, ep under FSDP2)
    local_batch = global_batch // dp
    n_mb = max(1, local_batch // micro_batch)
    b = micro_batch
    bs, br = block_params(m)
    emb, head, extra = end_params(m)
    moe = _moe_terms(m, lay)
    axes = [(a, lay.degree(a)) for a in AXES]
    w = Work(layout=lay, micro_batch=b, n_mb=n_mb, block_size=T, d_model=d, compute_bytes=compute_bytes,
             sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, block_split=bs, block_whole=br,
             emb=emb, head=head, extra=extra,
             # model.value_embeds: more token tables beside the embedding (refused under PP), held and
             # updated like it (by AdamW, whatever the optimizer of the matrices)
             tables=m.value_embeds * m.padded_vocab_size * d, n_layer=m.n_layer,
             stage_blocks=lambda n: layer_split(m, n), moe_layers=moe["layers"],
             top_k=m.moe.top_k if m.moe.enabled else 0, experts=moe["experts"])
    w.divisors = {part: math.prod(a.divides(part, k, w) for a, k in axes) for part in PARTS}
    w.rows = T / w.divisor("rows")
    # parameters on the busiest stage: its blocks plus the larger end (embedding or head)
    w.blocks, ends = m.n_layer, emb + head + extra + w.tables
    for a, k in axes:
        stage = a.busiest_stage(w, k)
        if stage is not None:
            w.blocks, ends = stage
    L, Tl = w.blocks, w.rows
    n_local = (L * bs + ends) / w.divisor("matrices") + L * br
    # A mixture of experts: its blocks' MLPs are the router, the shared and the routed experts;
    # the routed ones divided by the axes that hold them apart (n_experts: this GPU's), the rest
    # sharded like any weight.
    n_local += moe["other"] - moe["dense_mlps"]
    w.n_local = n_local
    w.n_experts = n_experts = moe["experts"] / w.divisor("experts")
    p_bytes = 4 * (n_local / shard + n_experts)
    # The optimizer's state as it declares it per parameter: the blocks' matrices (all split
    # like them) may be kept otherwise than the rest (Muon: one momentum against AdamW's two moments).
    spec = optimizer or REGISTRY["adamw"]
    n_matrix = L * block_matrix_params(m) / w.divisor("matrices") + moe["other"] - moe["dense_mlps"]
    by_kind = {MATRIX: n_matrix / shard + n_experts, OTHER: (n_local - n_matrix) / shard}
    optim_gb = sum(spec.state_bytes(kind) * n for kind, n in by_kind.items()) / GIB
    step_temporaries_gb = sum(4 * spec.step_temporaries.get(kind, 0.0) * n for kind, n in by_kind.items()) / GIB
    params_gb, grads_gb = p_bytes / GIB, p_bytes / GIB
    buffers_gb = sum(a.buffer_bytes(w, k) for a, k in axes) / GIB
    # activations of one microbatch on this stage, times those in flight
    fp32_el, cd_el = block_saved_elements(m, w.divisor("matrices"), w.divisor("residual"))
    cd_el += moe["saved_per_token"]  # averaged over the blocks
    per_layer = b * Tl * (4 * fp32_el + compute_bytes * cd_el)
    per_layer += sum(a.saved_per_layer(w, k) for a, k in axes)
    in_flight = max(a.in_flight(w, k) for a, k in axes)
    # logits, their fp32 copy and gradient; model.loss_chunk holds one chunk of them (it applies
    # where the model computes its own loss: no TP, no pipeline)
    rows = min(b * Tl, m.loss_chunk) if m.loss_chunk and lay.model_computes_loss else b * Tl
    # Eager: the logits, their fp32 copy and its gradient. Compiled with the loss (head_loss,
    # distlm/parallel/parallelize.py): the softmax's fp32 work stays in registers, and what
    # is held is the logits and their gradient in the compute dtype, plus, with a soft cap,
    # the capped logits in fp32 (read by both the log-sum-exp and the gradient, so they are
    # written out once). Fitted to peaks measured on one H200 (compiled,
    # loss_chunk 8192): gpt2-124m-1024 at micro-batch 8, where the eager count was 44-48% too
    # high for AdamW, Muon and Lion alike, and speedrun-124m (soft cap 30) at micro-batch 32;
    # tests/model/test_memory.py holds the planner to them.
    fused = fused_loss and lay.model_computes_loss
    per_logit = 2 * compute_bytes + (4 if m.logit_softcap else 0) if fused else compute_bytes + 4 + 4
    logits = rows * V / w.divisor("vocab") * per_logit
    if lay.ac == "full":
        # Only each block's input is kept; one block's tensors come back during its
        # recompute, by which time the logits are gone: the peak is the larger of the two.
        kept = b * Tl * 4 * d / w.divisor("residual") * L
        activations_gb = (kept * in_flight + max(logits, per_layer)) / GIB
    else:
        activations_gb = (per_layer * L * in_flight + logits) / GIB
    # The optimizer step runs after the backward pass, when the activations are freed.
    total = params_gb + grads_gb + optim_gb + buffers_gb + max(activations_gb, step_temporaries_gb)
    # communication per GPU per step (bytes sent) on each axis's collectives
    sent = {a.name: v for a, k in axes if (v := a.bytes_sent(w, k)) is not None}
    comm = sum(sent.values())
    gpn = gpus_per_node or lay.size
    crossing = crossing_axes(lay, gpn)
    crosses = {name for name in sent if axis_named(name).traffic_axis(lay) in crossing}
    # a collective runs at the pace of the slowest link its group crosses
    link_s = {axis: v / ((inter_gbs if axis in crosses else intra_gbs) * GB) for axis, v in sent.items()}
    # time: a pipeline stage's work per step is its compute plus the traffic the compute waits
    # for; the bubble stretches all of it. Then the optimizer, and the rest of the traffic
    # partly hidden behind the backward pass.
    n_total = m.n_layer * (bs + br) + emb + head + moe["other"] - moe["dense_mlps"] + moe["active_experts"]
    flops = (6 * n_total + 12 * m.n_layer * d * T) * global_batch * T
    compute_s = flops / lay.size / (peak_tflops * 1e12 * mfu) + L * n_mb * BLOCK_CALL_S
    if lay.ac == "full":
        compute_s *= 4 / 3  # the forward again
    compute_s /= math.prod(a.compute_efficiency(k) for a, k in axes)
    critical = [a.name for a in AXES if a.critical_path]
    device_s = compute_s + sum(link_s.get(a, 0.0) for a in critical)
    host = {a.name: a.host_s(w, k) for a, k in axes if a.paces_host}
    host_s = sum(host.values())
    host_wait_s = max(0.0, host_s - device_s)  # the part of the host's time the GPU waits for
    bubble = max(a.bubble(w, k) for a, k in axes)
    stage_s = (device_s + host_wait_s) / (1 - bubble)
    optimizer_s = p_bytes / 4 * OPTIMIZER_S_PER_PARAM * math.prod(a.optimizer_slowdown(k) for a, k in axes)
    hidden_s = DP_EXPOSED * sum(v for axis, v in link_s.items() if axis not in critical)
    step_s = stage_s + optimizer_s + hidden_s + STEP_OVERHEAD_S
    est = Estimate(lay, params_gb, grads_gb, optim_gb, buffers_gb, activations_gb, total, comm / GB, step_s, bubble,
                   total <= 0.92 * gpu_mem_gb, inter_gb=sum(sent[a] for a in crosses) / GB,
                   inter_axes=tuple(a for a in sent if a in crosses),
                   sent_gb={a: v / GB for a, v in sent.items()},
                   nodes=max(1, math.ceil(lay.size / gpn)),
                   time_ms={"compute": compute_s * 1e3,
                            **{f"{a}_comm": link_s.get(a, 0.0) * 1e3 for a in critical},
                            **{f"{a}_host": (host_wait_s * (v / host_s) if host_s else 0.0) * 1e3
                               for a, v in host.items()},
                            "bubble": (stage_s * bubble) * 1e3,
                            "optimizer": optimizer_s * 1e3, "dp_pp_exposed": hidden_s * 1e3,
                            "per_step": STEP_OVERHEAD_S * 1e3}, micro_batch=micro_batch,
                   optimizer=spec.name, step_temporaries_gb=step_temporaries_gb)
    est._tokens = global_batch * T
    return est


def _moe_terms(m: ModelConfig, lay: Layout) -> dict:
    """A mixture of experts' parameters and saved activations, per whole model (0 when dense):
    ``dense_mlps`` the MLP weights block_params counts in its MoE blocks, ``other`` what they
    hold instead besides the routed experts (router, shared experts), ``experts`` the routed
    experts, ``active_experts`` those a token runs (top_k per block), ``saved_per_token`` the
    compute-dtype elements per token and block the MoE MLP keeps beyond a dense one's (the
    routed copies in and out, the experts' hidden activations), averaged over the blocks."""
    from distlm.model.moe import expert_width, moe_layers
    n = len(moe_layers(m)) if m.moe.enabled else 0
    zero = dict(layers=0, dense_mlps=0, other=0, experts=0, active_experts=0, saved_per_token=0.0)
    if not n:
        return zero
    d, f, e = m.d_model, expert_width(m), m.moe
    gated = 3 if m.mlp == "swiglu" else 2
    hidden = 4 if m.mlp == "swiglu" else 2  # saved per hidden unit, as block_saved_elements counts
    saved = e.top_k * (2 * d + hidden * f) + e.shared * hidden * f - hidden * m.d_ff
    return dict(layers=n, dense_mlps=n * gated * d * m.d_ff, other=n * (e.experts * d + e.shared * gated * d * f),
                experts=n * e.experts * gated * d * f, active_experts=n * e.top_k * gated * d * f,
                saved_per_token=saved * n / m.n_layer)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _weighed_degrees(gpus: int, gpus_per_node: Optional[int]):
    """The degrees the planner weighs for ``gpus`` (its choice; what the axes refuse of them is
    theirs): every degree of every axis but the data-parallel ones whose product divides
    ``gpus``, the rest of the ranks data-parallel: DDP or FSDP2 over all of them or, on several
    nodes, HSDP (the data shards filling the rest of a node, replicas across). An axis whose
    ranks are FSDP2 shards themselves (cp) takes part of the FSDP2 degree: no replicas beside it."""
    data = [a for a in AXES if a.data_parallel]
    split = [a for a in AXES if not a.data_parallel]
    replicate, shard_axis = (next(a for a in data if a.gradients == role) for role in ("replicate", "shard"))
    for degrees in itertools.product(_divisors(gpus), repeat=len(split)):
        if gpus % math.prod(degrees):
            continue
        dp = gpus // math.prod(degrees)
        named = {a.name: k for a, k in zip(split, degrees)}
        # the ranks inside the data shards in the mesh: a node's GPUs over them is what HSDP shards over
        inner = math.prod(k for a, k in zip(split, degrees) if a.mesh_rank > shard_axis.mesh_rank)
        in_node = gpus_per_node // inner if gpus_per_node and gpus_per_node % inner == 0 else 0
        shards = [dp] if any(k > 1 and a.gradients == "shard" for a, k in zip(split, degrees)) else \
            [s for s in _divisors(dp) if s in (1, dp, in_node)]
        for s in shards:
            yield {replicate.name: dp // s, shard_axis.name: s, **named}


def _why_not(m: ModelConfig, degrees: dict) -> Optional[str]:
    """Why the layout ``degrees`` is not weighed for ``m``: what an axis refuses (the rules
    config validation runs, ``check_split``, on a config of this model and these degrees), or
    an axis's own ``not_weighed``; None: it is weighed."""
    try:
        check_split(Config(model=m, parallel=ParallelConfig(**degrees)))
    except ConfigError as e:
        return str(e)
    return next((why for a in AXES if (why := a.not_weighed(m, degrees.get(a.name, 1)))), None)


def layouts(gpus: int, m: ModelConfig, gpus_per_node: Optional[int] = None) -> list[Candidate]:
    """Every layout of ``gpus`` the planner weighs (``_weighed_degrees``) that the axes run
    for this model, each with and without full activation checkpointing."""
    return [Candidate(**degrees, ac=ac) for degrees in _weighed_degrees(gpus, gpus_per_node)
            if _why_not(m, degrees) is None for ac in ("none", "full")]


def skipped_layouts(gpus: int, m: ModelConfig) -> list[str]:
    """Why degrees that divide the GPU count are missing from the table, one line per axis and
    reason, the axes' own (a silent gap reads as if the planner had not considered them). An
    axis this kind of model has no use for (ep for a dense model, tp for a mixture of experts)
    goes unmentioned."""
    degrees = [k for k in range(2, gpus + 1) if gpus % k == 0]
    notes = []
    for a in AXES:
        if model_kind(m) not in a.model_kinds:
            continue
        refused: dict = defaultdict(list)  # the model's setting in the way -> [(degree, refusal)]
        for k in degrees:
            try:
                check_model_split(m, ParallelConfig(**{a.name: k}))
            except SplitRefusal as e:
                refused[e.field].append((k, e))
                continue
            why = a.not_weighed(m, k)
            if why:
                refused[None].append((k, why))
        for setting, got in refused.items():
            ks = [k for k, _ in got]
            first = got[0][1]
            if setting == "model.n_head":
                why = f"{first.value} heads do not split by {', '.join(map(str, ks))}{_head_count_hint(m, ks)}"
            elif setting == "model.d_ff":
                why = f"d_ff {first.value} does not split by {', '.join(map(str, ks))}"
            else:
                why = str(first)
            notes.append(f"{', '.join(f'{a.name}={k}' for k in ks)} skipped: {why}")
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


def plan(m: ModelConfig, gpus: int, gpu_mem_gb: float, global_batch: int, micro_batch: Optional[int],
         gpus_per_node: Optional[int] = None,
         resolve: Optional[Callable[[Candidate], tuple[ModelConfig, int]]] = None, **kw) -> list[Estimate]:
    """All layouts, the ones that fit first, each group fastest first. gpus_per_node: GPUs
    that share a node's fast links (default: all); the rest of ``kw`` goes to ``estimate``.
    resolve: the model and micro-batch for a layout, where they depend on it (an auto
    micro-batch: `distlm plan` passes distlm.train.fast_defaults' choice, which this module
    cannot import); it replaces ``m`` and ``micro_batch``, and is asked only about layouts
    whose data-parallel degree divides the global batch."""
    if resolve is None and not micro_batch:
        raise ValueError("micro_batch is required unless resolve picks one per layout")
    if gpus < 1:
        raise ValueError(f"gpus={gpus} must be at least 1")
    if gpus_per_node is not None and (gpus_per_node < 1 or gpus % gpus_per_node):
        raise ValueError(f"gpus_per_node={gpus_per_node} must divide gpus={gpus} (whole nodes)")
    ests = []
    for lay in layouts(gpus, m, gpus_per_node):
        dp = lay.dp_size
        if global_batch % dp:
            continue
        model, micro = resolve(lay) if resolve is not None else (m, micro_batch)
        if global_batch % (dp * micro):
            continue
        ests.append(estimate(model, lay, global_batch, micro, gpu_mem_gb, gpus_per_node=gpus_per_node, **kw))
    return sorted(ests, key=lambda e: (not e.fits, e.step_s))


COLLECTIVES = {a.name: f"{a.collective} ({a.name})" for a in AXES}


def network_lines(e: Estimate) -> list[str]:
    """Which of a layout's collectives cross nodes and which stay on a node's links."""
    if e.nodes == 1 or not e.sent_gb:
        return []
    inside = [a for a in e.sent_gb if a not in e.inter_axes]
    fmt = lambda axes: ", ".join(f"{COLLECTIVES[a]} {e.sent_gb[a]:.2f} GB" for a in axes)
    out = [f"  across nodes: {fmt(e.inter_axes)} per GPU per step" if e.inter_axes
           else f"  nothing crosses nodes: every collective stays inside a node of {e.nodes}"]
    if inside:
        out.append(f"  inside a node: {fmt(inside)}")
    return out


def explain(best: Estimate, ests: list[Estimate], gpu_mem_gb: float) -> str:
    lay = best.layout
    why = [f"recommended: {lay.name} ({lay.overrides() or 'no parallel.* settings'})"]
    why.append(f"  fits: {best.total_gb:.1f} GiB of {gpu_mem_gb:.0f} GiB per GPU at micro-batch {best.micro_batch} "
               f"(params {best.params_gb:.1f}, grads {best.grads_gb:.1f}, {best.optimizer} state {best.optim_gb:.1f}, "
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
        why.append("  FSDP2 shards parameters, gradients and optimizer state, so each GPU holds 1/N of them")
    if lay.dp_shard > 1 and lay.dp_replicate > 1:
        why.append(f"  HSDP: FSDP2 over dp_shard={lay.dp_shard} inside a node, and only the all-reduce of each "
                   f"GPU's 1/{lay.dp_shard} of the gradients over dp_replicate={lay.dp_replicate} crosses nodes")
    why.extend(network_lines(best))
    flat = next((e for e in ests if e.layout == Candidate(1, lay.dp_replicate * lay.dp_shard, lay.tp, lay.pp,
                                                           ac=lay.ac, schedule=lay.schedule)), None)
    if lay.dp_replicate > 1 and lay.dp_shard > 1 and flat is not None:
        why.append(f"  flat {flat.layout.name} would send {flat.inter_gb:.2f} GB per GPU per step across nodes "
                   f"(vs {best.inter_gb:.2f}): {step_ms(flat.step_s)} ms/step")
    return "\n".join(why)


def format_table(ests: list[Estimate]) -> str:
    head = ("| layout | micro-batch | fits | params | grads | optim state | FSDP buf | activations | total GiB "
            "| comm GB/step | inter-node GB/step | bubble | est. ms/step | est. tok/s |")
    rows = [head, "|" + "---|" * 14]
    for e in ests:
        # the axes named, so the column says which collectives pay the slow links
        inter = f"{e.inter_gb:.2f} ({', '.join(e.inter_axes)})" if e.inter_axes else "0"
        rows.append(f"| {e.layout.name} | {e.micro_batch} | {'yes' if e.fits else 'no'} | {e.params_gb:.2f} | "
                    f"{e.grads_gb:.2f} | {e.optim_gb:.2f} | {e.buffers_gb:.2f} | {e.activations_gb:.2f} | "
                    f"{e.total_gb:.2f} | {e.comm_gb:.2f} | {inter} | {e.bubble:.0%} | {step_ms(e.step_s)} | "
                    f"{e.tokens_per_s:,.0f} |")
    return "\n".join(rows)

