"""Building what the Trainer trains: the device, the autocast dtype, the model and its
parallel plan (the compute context is the plan's: distlm/parallel/plan.py).

Kept apart from the loop so eval, bench and export can build the same pieces.
"""
from __future__ import annotations

from typing import Optional

import torch

from distlm.config import Config, ConfigError
from distlm.parallel import ParallelDims, ParallelPlan, parallelize


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but CUDA is not available on this machine (use train.device=auto or cpu)")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


def autocast_dtype(cfg: Config, device: torch.device) -> Optional[torch.dtype]:
    if cfg.train.dtype == "bf16" or (cfg.train.dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def build_model(cfg: Config, dims: ParallelDims, device: torch.device, task, clock=None) -> ParallelPlan:
    """Meta device -> split/shard -> allocate -> init -> DDP: no rank ever holds the whole
    model when it is sharded. Returns the parallel plan: (the wrapped model to train, the
    plain module inside (under PP this rank's pruned part), the step engine that drives it,
    ...: distlm/parallel/plan.py). ``clock`` (a
    SetupClock) gets three laps: the model's structure with its parallel plans and compile
    wrappers, the weights' allocation and init, and the data-parallel wrapper (DDP's
    constructor broadcasts rank 0's weights: the first collective, so NCCL connects there)."""
    lap = clock.lap if clock is not None else (lambda name: None)
    with torch.device("meta"):
        inner = task.build_model(cfg)

    def materialize(m) -> None:
        lap("model plan")
        # FSDP2's CPU offload wants the sharded parameters allocated in host memory; the
        # buffers (position tables) still go to the compute device.
        offload = cfg.parallel.cpu_offload and dims.shards_parameters
        m.to_empty(device=torch.device("cpu") if offload else device)
        m.init_weights(cfg.train.seed, device)
        task.after_init(m, cfg)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the copies to the GPU are asynchronous: count them here
        lap("weights")

    plan = parallelize(inner, dims, cfg, materialize, device=device, amp_dtype=autocast_dtype(cfg, device))
    lap("data-parallel wrap")
    return plan
