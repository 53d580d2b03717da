"""Pipeline parallelism: the blocks cut into stages over ``pp`` ranks (distlm/parallel/pp.py),
a schedule running microbatches through them.

Costs: the busiest stage's blocks (the split distlm/parallel/pp.py makes) and the larger of
the embedding and the head; the activations of as many micro-batches as the schedule keeps
in flight; the bubble, the part of a step a stage waits; each micro-batch's residual stream
sent to the next stage forward and its gradient back.
"""
from __future__ import annotations

from distlm.errors import ConfigError
from distlm.layout.axis import Axis, SplitRefusal, token_id_extras


class Pipeline(Axis):
    name, label = "pp", "pp"
    help = "pipeline-parallel degree"
    mesh_rank = 10  # outermost: a stage boundary sends once per micro-batch, the slowest links suffice
    collective = "pipeline send/recv"
    splits_forward = True
    loss_outside_model = True  # the schedule computes the loss on the last stage
    schedules_microbatches = True
    plans_for_lm_head = True   # the stages are the GPT's blocks, the last one ending in the head's loss
    model_kinds = ("dense",)
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
            raise SplitRefusal(f"parallel.pp={degree} does not support {', '.join(crossing)}: they need the token "
                               f"ids or earlier blocks' outputs inside every stage; use data or tensor parallelism",
                               crossing[0].split("=")[0], crossing[0].split("=")[1])

    def supports(self, cfg, layout) -> None:
        t = cfg.train
        degree = layout.pp
        if degree == 1:
            return
        if t.seq_warmup_steps:
            raise ConfigError(f"train.seq_warmup_steps={t.seq_warmup_steps} does not support parallel.pp={degree}: a "
                              f"pipeline's stages are built for one input shape (model.block_size); use data or "
                              f"tensor parallelism, or train.seq_warmup_steps=0")

    def check_batch(self, cfg, layout) -> None:
        p, t = cfg.parallel, cfg.train
        if layout.pp == 1:
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

    # -- costs -----------------------------------------------------------------------------------
    def not_weighed(self, m, degree):
        # distlm/parallel/pp.py runs up to two stages more than blocks (the embedding's and the
        # head's alone), which add a bubble and save little memory
        if degree > m.n_layer:
            return f"{m.n_layer} layers cannot fill {degree} pipeline stages"
        return None

    def busiest_stage(self, w, degree):
        if degree == 1:
            return None
        return w.stage_blocks(degree), max(w.emb + w.extra, w.head or w.emb)

    def in_flight(self, w, degree):
        if degree == 1:
            return 1
        # GPipe (and the naive schedule) runs every forward before any backward; 1F1B keeps
        # at most one micro-batch per stage in flight
        return w.n_mb if w.layout.schedule in ("gpipe", "naive") else min(degree, w.n_mb)

    def bubble(self, w, degree) -> float:
        """The part of a step a stage waits, at the pipeline's start and end."""
        if degree == 1:
            return 0.0
        return (degree - 1) / (w.n_mb + degree - 1) if w.layout.schedule != "naive" else (degree - 1) / degree

    def bytes_sent(self, w, degree):
        if degree == 1:
            return None
        # each micro-batch's activations forward and their gradient back, sequence-sharded under SP
        return 2 * w.n_mb * w.micro_batch * w.block_size * w.d_model * w.compute_bytes / w.divisor("residual")
