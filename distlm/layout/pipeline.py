"""Pipeline parallelism: the blocks cut into stages over ``pp`` ranks (distlm/parallel/pp.py),
a schedule running microbatches through them.
"""
from __future__ import annotations

from distlm.errors import ConfigError
from distlm.layout.axis import Axis, token_id_extras


class Pipeline(Axis):
    name, label = "pp", "pp"
    splits_forward = True
    loss_outside_model = True  # the schedule computes the loss on the last stage
    partial_model = "under pipeline parallelism each rank holds a stage, not the whole model"

    def check_model(self, m, p, degree: int) -> None:
        if degree == 1:
            return
        if p.pp_virtual_stages < 1:
            raise ConfigError(f"parallel.pp_virtual_stages must be positive, got {p.pp_virtual_stages}")
        # A pipeline stage receives only the residual stream: not the token ids that document
        # masks and value embeddings are computed from, nor the first half's outputs that
        # U-net skips add, nor a window mask (the stages call the blocks directly).
        crossing = token_id_extras(m)
        if crossing:
            raise ConfigError(f"parallel.pp={degree} does not support {', '.join(crossing)}: they need the token ids "
                              f"or earlier blocks' outputs inside every stage; use data or tensor parallelism")

    def supports(self, cfg, layout) -> None:
        p, t = cfg.parallel, cfg.train
        degree = layout.pp
        if degree == 1:
            return
        dp = layout.dp_size
        # An auto micro-batch is a divisor of the local batch (distlm/train/fast_defaults.py):
        # 1 stands for it here, so what is checked is that the local batch is whole.
        micro = 1 if t.micro_batch_size is None else t.micro_batch_size
        local = t.global_batch_size // dp if t.global_batch_size % dp == 0 else 0
        n_mb = p.pp_microbatches or (local // micro if local else 0)
        if not local or n_mb <= 0 or local % n_mb:
            raise ConfigError(f"parallel.pp_microbatches={p.pp_microbatches}: the local batch "
                              f"(train.global_batch_size={t.global_batch_size} / data-parallel degree {dp}) must "
                              f"split into equal microbatches")
        if p.engine != "torch":
            raise ConfigError(f"parallel.engine={p.engine} does data parallelism only; tp and pp need engine=torch")
        if t.seq_warmup_steps:
            raise ConfigError(f"train.seq_warmup_steps={t.seq_warmup_steps} does not support parallel.pp={degree}: a "
                              f"pipeline's stages are built for one input shape (model.block_size); use data or "
                              f"tensor parallelism, or train.seq_warmup_steps=0")
        if cfg.task.name == "classify":
            raise ConfigError(f"task.name=classify does not support parallel.pp={degree}: "
                              f"use data parallelism (parallel.dp_replicate or parallel.dp_shard)")

    def micro_batch_sizes(self, sizes: list[int], local: int, cfg, degree: int) -> list[int]:
        if degree == 1:
            return sizes
        if cfg.parallel.pp_microbatches:
            # The schedule cuts the local batch into pp_microbatches pieces whatever the loader
            # hands it: micro-batches of that size are the ones that run.
            return [local // cfg.parallel.pp_microbatches]
        # Fewer microbatches than stages leaves stages idle for most of the step, and the
        # interleaved schedules take a multiple of the stage count.
        return [d for d in sizes if (local // d) % degree == 0] or sizes
