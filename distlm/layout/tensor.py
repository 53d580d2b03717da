"""Tensor parallelism: every block's matrices split by heads and FF width over ``tp`` ranks
(distlm/parallel/tp.py), the vocabulary too; with sequence parallelism the norms run on a
slice of each row.

Costs, per rank: the split weights and the per-head and FF activations are 1/tp of the
whole (the residual stream too under sequence parallelism, the logits under loss parallel);
two collectives forward and two backward per block on the residual stream, which the
matmuls wait for; and the host's time per wrapped block call, which at small micro-batches
is what the GPU waits for. The constants below are fitted to
tests/fixtures/planner_measurements.json with the planner's (distlm/planner.py): change
them together with that file.
"""
from __future__ import annotations

import math

from distlm.errors import ConfigError
from distlm.layout.axis import Axis, SplitRefusal

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
TP_OPTIMIZER_SLOWDOWN = 2.0
# ^ TP2's optimizer step took 62.3 ms against FSDP2's 30.6 in the same call, for the same
#   parameter count per GPU: TP steps each matrix's shard and the replicated norms and
#   biases as separate DTensors (more, smaller tensors than FSDP2's flat half). Since the
#   partial-sum gradients are reduced once in the backward, the step issues no collective;
#   before that it took 185.7-209.5 ms (the old 9.4, from the superseded records).
TP_SPLIT_EFFICIENCY = 1.0
# ^ compute efficiency kept per halving of the matmuls' width. The same profile shows none
#   lost at TP2 (width 1600 -> 800): matmul, attention and element-wise kernels took 807 ms,
#   where this model's unsplit compute is 851 ms (the earlier 0.8 was a fit that the
#   collective cost now carries). Unmeasured at tp >= 4, where narrower matmuls may lose some.


class Tensor(Axis):
    name, label = "tp", "tp"
    help = "tensor-parallel degree"
    mesh_rank = 60  # innermost: its collectives, several per block, on consecutive ranks (a node's fast links)
    collective = "TP all-gather + reduce-scatter"
    splits_forward = True
    distributes_logits = True   # the head's output stays vocabulary-sharded for loss_parallel
    loss_outside_model = True
    plans_for_lm_head = True    # the plans name the GPT's modules, the head's vocabulary rows included
    model_kinds = ("dense",)
    partial_model = "under FSDP2 or tensor parallelism each rank holds shards of the weights, not the whole model"
    critical_path = True
    paces_host = True

    def check_model(self, m, p, degree: int) -> None:
        """Tensor parallelism splits heads, FF width and vocabulary rows; each must be whole."""
        if degree == 1:
            return
        if m.n_head % degree:
            raise SplitRefusal(f"parallel.tp={degree} does not divide model.n_head={m.n_head}: each rank must "
                               f"hold whole heads", "model.n_head", m.n_head)
        if m.d_ff % degree:
            raise SplitRefusal(f"parallel.tp={degree} does not divide model.d_ff={m.d_ff}", "model.d_ff", m.d_ff)
        if m.vocab_size is not None and m.padded_vocab_size % degree:
            raise SplitRefusal(f"parallel.tp={degree} does not divide the padded vocabulary ({m.padded_vocab_size}); "
                               f"set model.vocab_pad_multiple to a multiple of {degree}", "model.vocab_pad_multiple",
                               m.vocab_pad_multiple)

    def supports(self, cfg, layout) -> None:
        t = cfg.train
        degree = layout.tp
        if degree == 1:
            return
        s, divisor = t.seq_warmup_start, self.sequence_divisor(cfg, degree)
        if t.seq_warmup_steps and s % divisor:
            raise ConfigError(f"train.seq_warmup_start={s} is not divisible by parallel.tp={degree}: sequence "
                              f"parallelism splits every row over the TP ranks; use a multiple of {degree}")
        if t.fp8 != "off":
            raise ConfigError(f"train.fp8={t.fp8} does not support parallel.tp={degree}: tensor parallelism shards the "
                              f"linear layers as DTensors, which the float8 matmul does not take; use FSDP2 "
                              f"(parallel.dp_shard) or DDP")

    def sequence_divisor(self, cfg, degree: int) -> int:
        return degree if cfg.parallel.sequence_parallel else 1

    # -- costs -----------------------------------------------------------------------------------
    def divides(self, part, degree, w):
        if part in ("matrices", "heads"):
            return degree
        if part == "residual":  # sequence parallelism: the norms' inputs and the stream between blocks
            return degree if w.sequence_parallel and degree > 1 else 1
        if part == "vocab":     # loss parallel: the logits stay vocabulary-sharded
            return degree if w.loss_parallel else 1
        return 1

    def bytes_sent(self, w, degree):
        if degree == 1:
            return None
        # 2 collectives forward + 2 backward per block, on the residual stream
        return 4 * w.blocks * w.n_mb * 2 * (degree - 1) / degree * w.micro_batch * w.rows * w.d_model \
            * w.compute_bytes

    def compute_efficiency(self, degree):
        return TP_SPLIT_EFFICIENCY ** math.log2(degree)

    def host_s(self, w, degree):
        if degree == 1:
            return 0.0
        return w.blocks * w.n_mb * TP_HOST_S_PER_BLOCK \
            * (1 + (FSDP_HOST_SHARE_UNDER_TP if w.layout.shard_degree > 1 else 0.0))

    def optimizer_slowdown(self, degree):
        return TP_OPTIMIZER_SLOWDOWN if degree > 1 else 1
