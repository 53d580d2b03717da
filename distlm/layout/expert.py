"""Expert parallelism: an MoE block's routed experts spread over ``ep`` ranks, E/ep each
(distlm/parallel/expert.py). The ranks read different rows, like data-parallel ones: every
weight outside the routed experts is replicated over them (DDP's all-reduce) or, under FSDP2,
sharded over them with the data shards, while each token's copies travel to the ranks that hold its experts
and back, two all-to-alls per MoE block forward and two backward.

Costs, per MoE block and micro-batch on each rank: the all-to-all moves tokens x top_k x
d_model activations each way, forward and backward, of which (ep-1)/ep leave the rank, and
the compute waits for it; the experts' weights and optimizer state are 1/ep of an unsharded
model's.
"""
from __future__ import annotations

from distlm.errors import ConfigError
from distlm.layout.axis import Axis, SplitRefusal


class Expert(Axis):
    name, label = "ep", "ep"
    help = "expert-parallel degree: an MoE block's routed experts spread over this many ranks, which read " \
           "different rows (distlm/parallel/expert.py)"
    # inside the data shards: an FSDP2 unit over dp_shard holding experts sharded over ep lays
    # them out on the (dp_shard, ep) mesh, in that order
    mesh_rank = 40
    collective = "token all-to-all"
    feeds_data = True
    gradients = "replicate"  # everything but the routed experts (distlm/parallel/expert.py)
    averages_loss = True
    model_kinds = ("moe",)
    partial_model = "under expert parallelism each rank holds some of the experts, not the whole model"
    critical_path = True

    def gradient_role(self, layout):
        # Under FSDP2 everything but the routed experts is sharded over (dp_shard, ep), as one
        # dimension; under DDP replicated over (dp_replicate, ep).
        return "shard" if layout.dp_shard > 1 else "replicate"

    def refuse_kind(self, m, degree: int) -> str:
        return f"parallel.ep={degree} spreads a mixture of experts over ranks; set model.moe.experts"

    def check_model(self, m, p, degree: int) -> None:
        if degree == 1 or not m.moe.enabled:
            return
        if m.moe.experts % degree:
            raise SplitRefusal(f"parallel.ep={degree} does not divide model.moe.experts={m.moe.experts}: each rank "
                               f"holds a whole number of experts", "model.moe.experts", m.moe.experts)

    def supports(self, cfg, layout) -> None:
        degree = layout.ep
        if degree == 1:
            return
        if layout.dp_replicate > 1 and layout.dp_shard > 1:
            raise ConfigError(f"parallel.ep={degree} with parallel.dp_replicate={layout.dp_replicate} and "
                              f"parallel.dp_shard={layout.dp_shard}: expert parallelism composes with DDP or with "
                              f"FSDP2, not with both (HSDP)")

    # -- costs -----------------------------------------------------------------------------------
    def divides(self, part, degree, w):
        return degree if part == "experts" else 1

    def bytes_sent(self, w, degree):
        if degree == 1:
            return None
        # Every MoE block: each token's top_k copies out and back (dispatch, combine), forward and
        # backward, (ep-1)/ep of them to other ranks.
        return 4 * w.moe_layers * w.n_mb * (degree - 1) / degree * w.micro_batch * w.rows * w.top_k * w.d_model \
            * w.compute_bytes
