"""Expert parallelism: an MoE block's routed experts spread over ``ep`` ranks, E/ep each
(distlm/parallel/expert.py). The ranks read different rows, like data-parallel ones: every
weight outside the routed experts is replicated over them (DDP's all-reduce) or, under FSDP2,
sharded over them with the data shards, while each token's copies travel to the ranks that hold its experts
and back, two all-to-alls per MoE block forward and two backward.

Costs, per MoE block and micro-batch on each rank (the planner's terms): the all-to-all moves
tokens x top_k x d_model activations each way, forward and backward, of which (ep-1)/ep leave
the rank; the experts' weights and optimizer state are 1/ep of an unsharded model's.
"""
from __future__ import annotations

from distlm.errors import ConfigError
from distlm.layout.axis import Axis


class Expert(Axis):
    name, label = "ep", "ep"
    feeds_data = True
    gradients = "replicate"  # everything but the routed experts (distlm/parallel/expert.py)
    averages_loss = True

    def gradient_role(self, layout):
        # Under FSDP2 everything but the routed experts is sharded over (dp_shard, ep), as one
        # dimension; under DDP replicated over (dp_replicate, ep).
        return "shard" if layout.dp_shard > 1 else "replicate"
    partial_model = "under expert parallelism each rank holds some of the experts, not the whole model"

    def check_model(self, m, p, degree: int) -> None:
        if degree == 1:
            return
        if not m.moe.enabled:
            raise ConfigError(f"parallel.ep={degree} spreads a mixture of experts over ranks; set model.moe.experts")
        if m.moe.experts % degree:
            raise ConfigError(f"parallel.ep={degree} does not divide model.moe.experts={m.moe.experts}: each rank "
                              f"holds a whole number of experts")

    def supports(self, cfg, layout) -> None:
        degree = layout.ep
        if degree == 1:
            return
        if layout.dp_replicate > 1 and layout.dp_shard > 1:
            raise ConfigError(f"parallel.ep={degree} with parallel.dp_replicate={layout.dp_replicate} and "
                              f"parallel.dp_shard={layout.dp_shard}: expert parallelism composes with DDP or with "
                              f"FSDP2, not with both (HSDP)")
        if cfg.parallel.engine != "torch":
            raise ConfigError(f"parallel.ep={degree} needs parallel.engine=torch (torch.distributed's all-to-all)")
