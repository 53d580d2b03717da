"""The two data-parallel axes: replicas (DDP, Horovod) and shards (FSDP2).

Both read different rows of the global batch and average the gradients; ``dp_shard``
also cuts every parameter, gradient and optimizer state in pieces (distlm/parallel/fsdp.py),
``dp_replicate`` keeps whole copies (distlm/parallel/ddp.py; over FSDP2's outer dimension
when another axis splits the model: HSDP).

Costs: the gradient all-reduce of the replicate role (dp_replicate, and ep under DDP) and
FSDP2's all-gathers and reduce-scatter over the shard role (dp_shard, cp, and ep under FSDP2)
are reported here, by the axis whose role it is, whatever the other axes of the group. The
routed experts, already divided over ep, are gathered and reduced over the data axes alone.
"""
from __future__ import annotations

from distlm.errors import ConfigError
from distlm.layout.axis import Axis


class DataReplicate(Axis):
    name, label = "dp_replicate", "ddp"
    help = "DDP degree (replicas)"
    mesh_rank = 20  # outside the shards: HSDP's all-reduce of each rank's shard is the one that crosses nodes
    collective = "gradient all-reduce"
    data_parallel = True
    feeds_data = True
    gradients = "replicate"
    averages_loss = True
    engines = ("torch", "horovod")

    def supports(self, cfg, layout) -> None:
        p = cfg.parallel
        # The dtype of the gradient all-reduce is torch's (DDP's hook, FSDP2's reduce dtype).
        if p.grad_reduce_dtype != "fp32" and p.engine != "torch":
            raise ConfigError(f"parallel.grad_reduce_dtype={p.grad_reduce_dtype} is for engine=torch (DDP, FSDP2); "
                              f"Horovod compresses with parallel.fp16_compression=true")

    def bytes_sent(self, w, degree):
        lay = w.layout
        r = lay.replicate_degree  # under DDP with ep, dp_replicate x ep: the weights outside the routed experts
        if r == 1:
            return None
        # under HSDP only the 1/dp_shard of the gradients each GPU owns; the routed experts
        # all-reduced over dp_replicate alone
        return 2 * (r - 1) / r * 4 * w.n_local / lay.shard_degree \
            + 2 * (degree - 1) / degree * 4 * w.n_experts


class DataShard(Axis):
    name, label = "dp_shard", "fsdp"
    help = "FSDP2 degree (shards)"
    mesh_rank = 30  # inside the replicas: HSDP's shards on a node's links
    collective = "FSDP all-gather + reduce-scatter"
    data_parallel = True
    feeds_data = True
    gradients = "shard"
    averages_loss = True
    splits_forward = True  # FSDP2 gathers each block's weights around its forward and backward
    partial_model = "under FSDP2 or tensor parallelism each rank holds shards of the weights, not the whole model"

    def divides(self, part, degree, w):
        return degree if part == "experts" else 1  # the rest is divided by the shard role (Layout.shard_degree)

    def buffer_bytes(self, w, degree):
        # two blocks' weights gathered at a time (the one running, the next prefetched), in the
        # compute dtype
        if w.layout.shard_degree == 1:
            return 0.0
        return 2 * w.compute_bytes * (w.block_split / w.divisor("matrices") + w.block_whole)

    def bytes_sent(self, w, degree):
        lay = w.layout
        shard = lay.shard_degree
        if shard == 1:
            return None
        # gathered for the forward and again for the backward of every micro-batch; under a
        # pipeline schedule kept unsharded across a step's micro-batches
        gathers = 2 if lay.schedules_microbatches else 2 * w.n_mb
        ep = w.divisor("experts") // degree  # the ways the routed experts are divided before FSDP2
        # the gathers in the compute dtype, the gradients' reduce-scatter in fp32
        return ((shard - 1) / shard * w.n_local + (degree - 1) / degree * w.experts / ep) \
            * (w.compute_bytes * gathers + 4)

    def traffic_axis(self, layout):
        # FSDP2's group is the shard role's axes flattened: it leaves a node where its
        # outermost axis does
        return next((n for n in layout.shard_axes if getattr(layout, n) > 1), self.name)
