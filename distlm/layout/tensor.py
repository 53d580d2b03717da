"""Tensor parallelism: every block's matrices split by heads and FF width over ``tp`` ranks
(distlm/parallel/tp.py), the vocabulary too; with sequence parallelism the norms run on a
slice of each row.
"""
from __future__ import annotations

from distlm.errors import ConfigError
from distlm.layout.axis import Axis


class Tensor(Axis):
    name, label = "tp", "tp"
    splits_forward = True
    distributes_logits = True   # the head's output stays vocabulary-sharded for loss_parallel
    loss_outside_model = True
    partial_model = "under FSDP2 or tensor parallelism each rank holds shards of the weights, not the whole model"

    def check_model(self, m, p, degree: int) -> None:
        """Tensor parallelism splits heads, FF width and vocabulary rows; each must be whole."""
        if degree == 1:
            return
        if m.n_head % degree:
            raise ConfigError(f"parallel.tp={degree} does not divide model.n_head={m.n_head}: each rank must "
                              f"hold whole heads")
        if m.d_ff % degree:
            raise ConfigError(f"parallel.tp={degree} does not divide model.d_ff={m.d_ff}")
        if m.vocab_size is not None and m.padded_vocab_size % degree:
            raise ConfigError(f"parallel.tp={degree} does not divide the padded vocabulary ({m.padded_vocab_size}); "
                              f"set model.vocab_pad_multiple to a multiple of {degree}")

    def supports(self, cfg, layout) -> None:
        p, t = cfg.parallel, cfg.train
        degree = layout.tp
        if degree == 1:
            return
        if p.engine != "torch":
            raise ConfigError(f"parallel.engine={p.engine} does data parallelism only; tp and pp need engine=torch")
        s, divisor = t.seq_warmup_start, self.sequence_divisor(cfg, degree)
        if t.seq_warmup_steps and s % divisor:
            raise ConfigError(f"train.seq_warmup_start={s} is not divisible by parallel.tp={degree}: sequence "
                              f"parallelism splits every row over the TP ranks; use a multiple of {degree}")
        if t.fp8 != "off":
            raise ConfigError(f"train.fp8={t.fp8} does not support parallel.tp={degree}: tensor parallelism shards the "
                              f"linear layers as DTensors, which the float8 matmul does not take; use FSDP2 "
                              f"(parallel.dp_shard) or DDP")
        # The classifier's pooled head needs every position of a sequence on one rank, and
        # TP's plans are written for the LM head.
        if cfg.task.name == "classify":
            raise ConfigError(f"task.name=classify does not support parallel.tp={degree}: "
                              f"use data parallelism (parallel.dp_replicate or parallel.dp_shard)")

    def sequence_divisor(self, cfg, degree: int) -> int:
        return degree if cfg.parallel.sequence_parallel else 1
