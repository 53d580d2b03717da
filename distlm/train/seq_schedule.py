"""Sequence-length warm-up (train.seq_warmup_steps, train.seq_warmup_start).

The loader serves the same (B, T) blocks in the same order whatever this schedule says
(T = model.block_size, the order a pure function of (seed, step)). During the first
``seq_warmup_steps`` steps each micro-batch is cut into (B*T/L, L) rows, L doubling from
``seq_warmup_start`` to T/2 in equal shares of the warm-up, then T: the tokens of a step,
their order and the loss (the mean over those tokens) stay the same; only the context a
token attends to is shorter, and attention cheaper. Each row starts at position 0, and a
document mask (model.attn_mask=doc) is computed from the rows, so a row's start is a
boundary like any end-of-text token. L is a function of the step alone: a resumed run
cuts its rows as the run that never stopped did.

Few lengths, each its own compiled graph (config.py keeps them under dynamo's recompile
limit; parallelize.apply_compile compiles them static, so the full-length steps keep the
kernels specialised for T).

The logged MFU counts attention FLOPs at T (flops_per_token's 12 n_layer d_model T term)
during the warm-up too, so it reads high there: the attention of L-token rows costs L/T of
that (left so, as the throughput it reports is the one a full-length step is measured by).
"""
from __future__ import annotations

import torch

from distlm.config import Config, seq_warmup_lengths


class SeqSchedule:
    """``length(step)`` is the row length of step ``step`` (0-based, the step being trained);
    ``apply(step, x, y)`` cuts a micro-batch into rows of that length. Off (0 warm-up
    steps) every length is the block size and ``apply`` gives its inputs back."""

    def __init__(self, block_size: int, warmup_steps: int = 0, lengths: list[int] = ()):
        self.block_size, self.warmup_steps, self.lengths = block_size, warmup_steps, list(lengths)

    @classmethod
    def from_config(cls, cfg: Config) -> "SeqSchedule":
        t, T = cfg.train, cfg.model.block_size
        return cls(T, t.seq_warmup_steps, seq_warmup_lengths(t, T))

    def length(self, step: int) -> int:
        if step >= self.warmup_steps or not self.lengths:
            return self.block_size
        return self.lengths[step * len(self.lengths) // self.warmup_steps]

    def apply(self, step: int, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.length(step)
        if n == self.block_size:
            return x, y
        return x.reshape(-1, n), y.reshape(-1, n)

    def events(self, step: int) -> list[str]:
        """A line for the log when ``step`` trains on another row length than the step before,
        naming it as the log's rows do (step k: the k-th step, so ``step`` + 1)."""
        n = self.length(step)
        if not self.lengths or (step > 0 and n == self.length(step - 1)):
            return []
        if n == self.block_size:
            return [f"seq warm-up: step {step + 1:,} -> rows of {n} tokens, the whole block (warm-up done)"]
        return [f"seq warm-up: step {step + 1:,} -> rows of {n} tokens ({self.block_size // n} per block of "
                f"{self.block_size})"]
