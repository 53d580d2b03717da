"""Context parallelism: every row split over ``cp`` ranks (distlm/parallel/context.py).

The ranks of a cp group read the same rows and each keeps its part of them (a head and a
tail chunk, for the causal mask's balance); attention gathers the keys and values of the
whole row. They hold different tokens of the same rows, so the loss's mean and the
gradients' average run over them as over data ranks, and FSDP2 shards the parameters over
the data shards and the cp ranks together.
"""
from __future__ import annotations

from distlm.errors import ConfigError
from distlm.layout.axis import Axis


class Context(Axis):
    name, label = "cp", "cp"
    gradients = "shard"
    averages_loss = True
    splits_forward = True    # FSDP2's per-block gathers, and attention's all-gather of K and V
    splits_sequence = True
    partial_model = "under context parallelism each rank holds FSDP2 shards of the weights, not the whole model"

    def supports(self, cfg, layout) -> None:
        degree = layout.cp
        if degree == 1:
            return
        p, t, m = cfg.parallel, cfg.train, cfg.model
        if layout.pp > 1:
            raise ConfigError(f"parallel.cp={degree} does not support parallel.pp={layout.pp}: a pipeline stage "
                              f"passes only the residual stream, not the positions and the attention of a row's "
                              f"part; use parallel.tp or parallel.dp_shard beside parallel.cp")
        if p.engine != "torch":
            raise ConfigError(f"parallel.engine={p.engine} does data parallelism only; cp needs engine=torch")
        if cfg.task.name == "classify":
            raise ConfigError(f"task.name=classify does not support parallel.cp={degree}: its pooling needs whole "
                              f"rows on one rank; use data parallelism")
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
