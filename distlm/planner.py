"""`distlm plan`: memory and communication per GPU for every layout of N GPUs, ranked.

    distlm plan --config gpt2-1.5b --gpus 4 --gpu-mem-gb 80 --global-batch 64 --micro-batch 8

Estimates, per GPU, the largest pipeline stage's (memory in GiB, as `distlm bench` reports it):
  parameters, gradients (fp32) and the optimizer's state as it declares it per parameter
  (distlm/optim/: AdamW 2 x fp32; Muon 1 x fp32 for the blocks' matrices, AdamW's for the
  rest; the larger of the activations and the step's own temporaries), divided by tp for the split
  matrices and by dp_shard under FSDP2; the FSDP2 all-gather buffers (two blocks, bf16);
  activations saved for backward, counted tensor by tensor for this model's blocks (see
  ``block_saved_elements``), times the microbatches a schedule keeps in flight, or only
  each block's input with full activation checkpointing; the logits and their gradient.
Under context parallelism (cp) a GPU holds T / cp tokens of each row, plus the whole row's
keys and values in every layer (gathered for attention and kept for its backward; one
layer's at a time under full activation checkpointing).
Communication per step is the bytes each GPU sends in its collectives (ring algorithms),
on a two-level network: the mesh's axes are ordered (pp, dp_replicate, dp_shard, cp, tp), tp
innermost, so with G GPUs per node an axis whose group spans more than G consecutive ranks
crosses nodes, and its collectives run at the inter-node bandwidth (see ``crossing_axes``).
The ranking uses a simple time model (compute at a fixed fraction of peak, the pipeline
bubble, the optimizer step, communication not hidden by compute, and TP's per-collective
costs; the constants below, fitted to tests/fixtures/planner_measurements.json); it is a guide
to what to measure first, not a promise. tests/test_planner.py checks the memory estimate
against the tensors a real training step holds and the time estimate against the recorded
throughputs.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

from distlm.config import ModelConfig
from distlm.layout import MESH_ORDER, Layout
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
#   under TP the host's own time per block (TP_HOST_S_PER_BLOCK) is what the GPU waits for.
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
#   the TP2 optimizer below; an earlier FSDP2 record measured 22.3 ms).
TP_OPTIMIZER_SLOWDOWN = 2.0
# ^ TP2's optimizer step took 62.3 ms against FSDP2's 30.6 in the same call, for the same
#   parameter count per GPU: TP steps each matrix's shard and the replicated norms and
#   biases as separate DTensors (more, smaller tensors than FSDP2's flat half). Since the
#   partial-sum gradients are reduced once in the backward, the step issues no collective;
#   before that it took 185.7-209.5 ms (the old 9.4, from the superseded records).
TP_HOST_S_PER_BLOCK = 5.5e-3
# ^ under TP the host, not the GPU, sets the pace at small micro-batches. Each call of a
#   compiled block unwraps its DTensor parameters, wraps its outputs and gradients again and
#   runs the redistributions around it in Python: about 5.5 ms of CPU per block per
#   micro-step (forward and backward) on the H100 machines, where the GPU's own work for one
#   block of gpt2-1.5b at micro-batch 8 is about 2.9 ms. So 42% of the profiled TP2 step had
#   no kernel running, and NCCL's kernels, which include the wait for the other rank, looked
#   slow (0.33 ms for a 26 MB all-gather that takes 0.12 ms alone). Doubling the micro-batch
#   halves the calls for the same tokens: the step fell from 2,172 to 1,181 ms (30.2k to
#   55.5k tok/s; the term predicted 29.9k and 54.6k; with the per-block-call term, 29.9k and
#   57.2k). A stage therefore takes the longer of the device's time (compute and TP's bytes)
#   and the host's.
FSDP_HOST_SHARE_UNDER_TP = 0.75
# ^ composed with FSDP2 (a 2-D mesh), each block call also runs FSDP2's hooks on 2-D
#   DTensors: TP2 x FSDP2 of gpt2-1.5b on 4 x H100 (micro-batch 8, 4 micro-steps) took a
#   1,878 ms step, 9.6 ms per block call, 1.75x TP2's alone. One measurement: a fit.
TP_SPLIT_EFFICIENCY = 1.0
# ^ compute efficiency kept per halving of the matmuls' width. The same profile shows none
#   lost at TP2 (width 1600 -> 800): matmul, attention and element-wise kernels took 807 ms,
#   where this model's unsplit compute is 851 ms (the earlier 0.8 was a fit that the
#   collective cost now carries). Unmeasured at tp >= 4, where narrower matmuls may lose some.


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
    # cp: each GPU holds T / cp tokens of every row, and FSDP2 shards the parameters over the
    # data shards and the cp ranks together (distlm/layout/context.py); ep's ranks are data
    # shards too under FSDP2 (distlm/layout/expert.py)
    cp = lay.cp
    t, shard = lay.tp, lay.shard_degree
    Tl = T / cp
    local_batch = global_batch // dp
    n_mb = max(1, local_batch // micro_batch)
    b = micro_batch
    # parameters on the busiest stage: its blocks plus the larger end (embedding or head)
    bs, br = block_params(m)
    emb, head, extra = end_params(m)
    L = layer_split(m, lay.pp)
    # model.value_embeds: more token tables beside the embedding (refused under PP), held and
    # updated like it (by AdamW, whatever the optimizer of the matrices)
    tables = m.value_embeds * m.padded_vocab_size * d
    ends = emb + head + extra + tables if lay.pp == 1 else max(emb + extra, head or emb)
    n_local = (L * bs + ends) / t + L * br
    moe = _moe_terms(m, lay)
    # A mixture of experts: its blocks' MLPs are the router, the shared and the routed experts;
    # the routed ones spread over ep and then FSDP2's dp_shard (n_experts: this GPU's), the rest
    # sharded like any weight.
    n_local += moe["other"] - moe["dense_mlps"]
    n_experts = moe["experts"] / (lay.ep * lay.dp_shard)
    p_bytes = 4 * (n_local / shard + n_experts)
    # The optimizer's state as it declares it per parameter: the blocks' matrices (all split by
    # TP) may be kept otherwise than the rest (Muon: one momentum against AdamW's two moments).
    spec = optimizer or REGISTRY["adamw"]
    n_matrix = L * block_matrix_params(m) / t + moe["other"] - moe["dense_mlps"]
    by_kind = {MATRIX: n_matrix / shard + n_experts, OTHER: (n_local - n_matrix) / shard}
    optim_gb = sum(spec.state_bytes(kind) * n for kind, n in by_kind.items()) / GIB
    step_temporaries_gb = sum(4 * spec.step_temporaries.get(kind, 0.0) * n for kind, n in by_kind.items()) / GIB
    params_gb, grads_gb = p_bytes / GIB, p_bytes / GIB
    buffers_gb = (2 * compute_bytes * (bs / t + br) / GIB) if shard > 1 else 0.0
    # activations of one microbatch on this stage, times those in flight
    fp32_el, cd_el = block_saved_elements(m, t, sequence_parallel and t > 1)
    cd_el += moe["saved_per_token"]  # averaged over the blocks
    per_layer = b * Tl * (4 * fp32_el + compute_bytes * cd_el)
    # context parallelism: the gathered K and V of the whole row (this rank's heads), kept for backward
    kv_row = 2 * b * T * d / t * compute_bytes if cp > 1 else 0.0
    per_layer += kv_row
    in_flight = 1 if lay.pp == 1 else (n_mb if lay.schedule in ("gpipe", "naive") else min(lay.pp, n_mb))
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
    logits = rows * V / (t if loss_parallel else 1) * per_logit
    if lay.ac == "full":
        # Only each block's input is kept; one block's tensors come back during its
        # recompute, by which time the logits are gone: the peak is the larger of the two.
        kept = b * Tl * 4 * d / (t if sequence_parallel and t > 1 else 1) * L
        activations_gb = (kept * in_flight + max(logits, per_layer)) / GIB
    else:
        activations_gb = (per_layer * L * in_flight + logits) / GIB
    # The optimizer step runs after the backward pass, when the activations are freed.
    total = params_gb + grads_gb + optim_gb + buffers_gb + max(activations_gb, step_temporaries_gb)
    # communication per GPU per step (bytes sent) on each axis's collectives, ring algorithms:
    # 2(n-1)/n for all-reduce, (n-1)/n for all-gather and reduce-scatter
    sent = {}
    r = lay.replicate_degree  # under DDP with ep, dp_replicate x ep: the weights outside the routed experts
    if r > 1:  # under HSDP only the 1/dp_shard of the gradients each GPU owns
        # (the routed experts: all-reduced over dp_replicate alone)
        sent["dp_replicate"] = 2 * (r - 1) / r * 4 * n_local / shard \
            + 2 * (lay.dp_replicate - 1) / lay.dp_replicate * 4 * n_experts
    if lay.ep > 1:
        # Every MoE block: each token's top_k copies out and back (dispatch, combine), forward and
        # backward, (ep-1)/ep of them to other ranks.
        sent["ep"] = 4 * moe["layers"] * n_mb * (lay.ep - 1) / lay.ep * b * Tl * m.moe.top_k * d * compute_bytes
    if shard > 1:
        gathers = 2 * n_mb if lay.pp == 1 else 2  # kept unsharded across a step's microbatches under PP
        # the routed experts gathered over dp_shard alone
        sent["dp_shard"] = ((shard - 1) / shard * n_local + (lay.dp_shard - 1) / lay.dp_shard * moe["experts"] / lay.ep) \
            * (compute_bytes * gathers + 4)
    if t > 1:  # 2 collectives forward + 2 backward per block, on the residual stream
        sent["tp"] = 4 * L * n_mb * 2 * (t - 1) / t * b * Tl * d * compute_bytes
    if lay.pp > 1:
        sent["pp"] = 2 * n_mb * b * T * d * compute_bytes / (t if sequence_parallel and t > 1 else 1)
    if cp > 1:  # per block: K and V all-gathered (forward, again in a recompute), reduce-scattered (backward)
        passes = 3 if lay.ac == "full" else 2
        sent["cp"] = passes * L * n_mb * (cp - 1) / cp * kv_row
    comm = sum(sent.values())
    gpn = gpus_per_node or lay.size
    crossing = crossing_axes(lay, gpn)
    # FSDP2's group is the data shards x the cp ranks: it leaves a node where its outer axis does
    group_axis = {"dp_shard": "dp_shard" if lay.dp_shard > 1 else "cp"}
    crosses = {k for k in sent if group_axis.get(k, k) in crossing}
    # a collective runs at the pace of the slowest link its group crosses
    link_s = {axis: v / ((inter_gbs if axis in crosses else intra_gbs) * GB) for axis, v in sent.items()}
    # time: a pipeline stage's work per step is its compute plus what TP puts on its critical
    # path; the bubble stretches all of it. Then the optimizer, and DP/PP traffic partly
    # hidden behind the backward pass.
    n_total = m.n_layer * (bs + br) + emb + head + moe["other"] - moe["dense_mlps"] + moe["active_experts"]
    flops = (6 * n_total + 12 * m.n_layer * d * T) * global_batch * T
    compute_s = flops / lay.size / (peak_tflops * 1e12 * mfu) + L * n_mb * BLOCK_CALL_S
    if lay.ac == "full":
        compute_s *= 4 / 3  # the forward again
    compute_s /= TP_SPLIT_EFFICIENCY ** math.log2(t)
    # TP's collectives, cp's K/V gathers and ep's all-to-alls sit between the matmuls that need
    # them: not hidden
    critical = ("tp", "cp", "ep")
    device_s = compute_s + sum(link_s.get(a, 0.0) for a in critical)
    host_s = 0.0
    if t > 1:
        host_s = L * n_mb * TP_HOST_S_PER_BLOCK * (1 + (FSDP_HOST_SHARE_UNDER_TP if shard > 1 else 0.0))
    tp_host_s = max(0.0, host_s - device_s)  # the part of the host's time the GPU waits for
    bubble = 0.0 if lay.pp == 1 else (lay.pp - 1) / (n_mb + lay.pp - 1) if lay.schedule != "naive" \
        else (lay.pp - 1) / lay.pp
    stage_s = (device_s + tp_host_s) / (1 - bubble)
    optimizer_s = p_bytes / 4 * OPTIMIZER_S_PER_PARAM * (TP_OPTIMIZER_SLOWDOWN if t > 1 else 1)
    hidden_s = DP_EXPOSED * sum(v for axis, v in link_s.items() if axis not in critical)
    step_s = stage_s + optimizer_s + hidden_s + STEP_OVERHEAD_S
    est = Estimate(lay, params_gb, grads_gb, optim_gb, buffers_gb, activations_gb, total, comm / GB, step_s, bubble,
                   total <= 0.92 * gpu_mem_gb, inter_gb=sum(sent[a] for a in crosses) / GB,
                   inter_axes=tuple(a for a in sent if a in crosses),
                   sent_gb={a: v / GB for a, v in sent.items()},
                   nodes=max(1, math.ceil(lay.size / gpn)),
                   time_ms={"compute": compute_s * 1e3, "tp_comm": link_s.get("tp", 0.0) * 1e3,
                            "cp_comm": link_s.get("cp", 0.0) * 1e3, "ep_comm": link_s.get("ep", 0.0) * 1e3,
                            "tp_host": tp_host_s * 1e3, "bubble": (stage_s * bubble) * 1e3,
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


def layouts(gpus: int, m: ModelConfig, gpus_per_node: Optional[int] = None) -> list[Candidate]:
    """Every (dp_replicate, dp_shard, tp, pp) with product = gpus that the model allows,
    each with and without full activation checkpointing. Data parallelism is DDP or FSDP2
    over all of it, and on several nodes also HSDP: dp_shard filling the rest of a node
    (tp x dp_shard = gpus_per_node), dp_replicate across nodes. Context parallelism takes
    part of the FSDP2 degree (cp x dp_shard, no pipeline) where the row splits into 2 x cp
    chunks (x tp under sequence parallelism)."""
    out = []
    if m.moe.enabled:
        # Data parallelism, with or without expert parallelism (TP, PP and cp refuse an MoE model):
        # DDP or FSDP2 over the ranks that the ep degree leaves.
        for ep in (k for k in range(1, gpus + 1) if gpus % k == 0 and m.moe.experts % k == 0):
            dp = gpus // ep
            for shard in {1, dp}:
                for ac in ("none", "full"):
                    out.append(Candidate(dp // shard, shard, 1, 1, ep=ep, ac=ac))
        return out
    for tp in range(1, gpus + 1):
        if gpus % tp or m.n_head % tp or m.d_ff % tp:
            continue
        dp = gpus // tp
        for cp in (c for c in range(2, dp + 1) if dp % c == 0 and m.block_size % (2 * c * tp) == 0):
            for ac in ("none", "full"):
                out.append(Candidate(1, dp // cp, tp, 1, cp=cp, ac=ac))
    for tp, pp in itertools.product(range(1, gpus + 1), repeat=2):
        if gpus % (tp * pp) or m.n_head % tp or m.d_ff % tp or (pp > 1 and pp > m.n_layer):
            continue
        dp = gpus // (tp * pp)
        in_node = gpus_per_node // tp if gpus_per_node and gpus_per_node % tp == 0 else 0
        for shard in [s for s in range(1, dp + 1) if dp % s == 0 and s in (1, dp, in_node)]:
            for ac in ("none", "full"):
                out.append(Candidate(dp // shard, shard, tp, pp, ac=ac))
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


COLLECTIVES = {"dp_replicate": "gradient all-reduce (dp_replicate)",
               "dp_shard": "FSDP all-gather + reduce-scatter (dp_shard)",
               "tp": "TP all-gather + reduce-scatter (tp)", "pp": "pipeline send/recv (pp)",
               "cp": "K/V all-gather + reduce-scatter (cp)", "ep": "token all-to-all (ep)"}


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

