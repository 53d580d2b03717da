"""The two data-parallel axes: replicas (DDP, Horovod) and shards (FSDP2).

Both read different rows of the global batch and average the gradients; ``dp_shard``
also cuts every parameter, gradient and optimizer state in pieces (distlm/parallel/fsdp.py),
``dp_replicate`` keeps whole copies (distlm/parallel/ddp.py; over FSDP2's outer dimension
when another axis splits the model: HSDP).
"""
from __future__ import annotations

from distlm.errors import ConfigError
from distlm.layout.axis import Axis


class DataReplicate(Axis):
    name, label = "dp_replicate", "ddp"
    feeds_data = True
    gradients = "replicate"
    averages_loss = True

    def supports(self, cfg, layout) -> None:
        p = cfg.parallel
        # The dtype of the gradient all-reduce is torch's (DDP's hook, FSDP2's reduce dtype).
        if p.grad_reduce_dtype != "fp32" and p.engine != "torch":
            raise ConfigError(f"parallel.grad_reduce_dtype={p.grad_reduce_dtype} is for engine=torch (DDP, FSDP2); "
                              f"Horovod compresses with parallel.fp16_compression=true")


class DataShard(Axis):
    name, label = "dp_shard", "fsdp"
    feeds_data = True
    gradients = "shard"
    averages_loss = True
    splits_forward = True  # FSDP2 gathers each block's weights around its forward and backward
    partial_model = "under FSDP2 or tensor parallelism each rank holds shards of the weights, not the whole model"
