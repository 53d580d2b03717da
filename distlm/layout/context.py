"""Context parallelism: every row split over ``cp`` ranks (distlm/parallel/context.py).

The ranks of a cp group read the same rows and each keeps its part of them (a head and a
tail chunk, for the causal mask's balance); attention gathers the keys and values of the
whole row. They hold different tokens of the same rows, so the loss's mean and the
gradients' average run over them as over data ranks, and FSDP2 shards the parameters over
the data shards and the cp ranks together.

Costs: a rank holds T / cp tokens of each row, plus the whole row's keys and values in
every block (gathered for attention and kept for its backward; one block's at a time under
full activation checkpointing); per block they are all-gathered forward (again in a
recompute) and their gradients reduce-scattered backward, between the matmuls that need them.
"""
from __future__ import annotations

from distlm.errors import ConfigError
from distlm.layout.axis import Axis


class Context(Axis):
    name, label = "cp", "cp"
    help = "context-parallel degree: every row split over this many ranks, for long sequences " \
           "(distlm/parallel/context.py)"
    mesh_rank = 50  # next to tp: its all-gather runs in every attention layer, FSDP2's once per block
    collective = "K/V all-gather + reduce-scatter"
    gradients = "shard"
    averages_loss = True
    splits_forward = True    # FSDP2's per-block gathers, and attention's all-gather of K and V
    splits_sequence = True
    model_kinds = ("dense",)
    partial_model = "under context parallelism each rank holds FSDP2 shards of the weights, not the whole model"
    critical_path = True

    def supports(self, cfg, layout) -> None:
        degree = layout.cp
        if degree == 1:
            return
        t, m = cfg.train, cfg.model
        if layout.pp > 1:
            raise ConfigError(f"parallel.cp={degree} does not support parallel.pp={layout.pp}: a pipeline stage "
                              f"passes only the residual stream, not the positions and the attention of a row's "
                              f"part; use parallel.tp or parallel.dp_shard beside parallel.cp")
        divisor = layout.sequence_divisor(cfg)
        why = (f"each of the {degree} ranks holds 2 chunks of every row"
               + (f", split again over parallel.tp={layout.tp} by sequence parallelism" if divisor > 2 * degree
                  else ""))
        if m.block_size % divisor:
            raise ConfigError(f"model.block_size={m.block_size} is not divisible by {divisor}: {why}")
        if t.seq_warmup_steps and t.seq_warmup_start % divisor:
            raise ConfigError(f"train.seq_warmup_start={t.seq_warmup_start} is not divisible by {divisor}: {why}")

    def sequence_divisor(self, cfg, degree: int) -> int:
        return 2 * degree if degree > 1 else 1  # a head and a tail chunk per rank

    # -- costs -----------------------------------------------------------------------------------
    def divides(self, part, degree, w):
        return degree if part == "rows" else 1

    def _kv_row(self, w) -> float:
        """The gathered K and V of the whole row (this rank's heads), per block and micro-batch."""
        return 2 * w.micro_batch * w.block_size * w.d_model / w.divisor("heads") * w.compute_bytes

    def saved_per_layer(self, w, degree):
        return self._kv_row(w) if degree > 1 else 0.0

    def bytes_sent(self, w, degree):
        if degree == 1:
            return None
        passes = 3 if w.layout.ac == "full" else 2
        return passes * w.blocks * w.n_mb * (degree - 1) / degree * self._kv_row(w)
