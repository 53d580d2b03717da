"""Building what the Trainer trains: the autocast dtype, the model and its parallel plan
(the device: distlm/device.py; the compute context is the plan's: distlm/parallel/applied.py).

Kept apart from the loop so eval, bench and export can build the same pieces.
"""
from __future__ import annotations

import importlib
from typing import Optional

import torch

from distlm.config import Config
from distlm.parallel import ParallelDims, ParallelPlan, parallelize


def autocast_dtype(cfg: Config) -> Optional[torch.dtype]:
    """The autocast dtype of a resolved config (train.dtype bf16 or fp32: distlm/train/resolve.py)."""
    if cfg.train.dtype == "auto":
        raise ValueError("train.dtype=auto: build from a resolved config (distlm/train/resolve.py)")
    return torch.bfloat16 if cfg.train.dtype == "bf16" else None


# What torch.compile's first use imports: dynamo, AOTAutograd, inductor (and triton on a GPU):
# 1.8 s on the 2-core box, 3.7-4.5 s on an H200 host (2026-11-27). compile_fx pulls in the rest.
COMPILER_MODULES = ("torch._dynamo", "torch._inductor.compile_fx")


def build_model(cfg: Config, dims: ParallelDims, device: torch.device, task, clock=None) -> ParallelPlan:
    """``cfg``: resolved (distlm/train/resolve.py). Meta device -> split/shard -> allocate -> init -> DDP: no rank ever holds the whole
    model when it is sharded. Returns the parallel plan: (the wrapped model to train, the
    plain module inside (under PP this rank's pruned part), the step engine that drives it,
    ...: distlm/parallel/applied.py). ``clock`` (a SetupClock) gets four laps: the compiler's
    import (when compiling), the model's structure with its parallel plans and compile
    wrappers, the weights' allocation and init, and the data-parallel wrapper (DDP's
    constructor broadcasts rank 0's weights: the first collective, so NCCL connects there)."""
    lap = clock.lap if clock is not None else (lambda name: None)
    if cfg.train.compile:
        # torch.compile's first use imports the compiler: a lap of its own, so "model plan" is
        # the plan alone.
        for module in COMPILER_MODULES:
            importlib.import_module(module)  # not `import torch...`: that binds a local torch
    lap("compiler import")
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

    plan = parallelize(inner, dims, cfg, materialize, device=device, amp_dtype=autocast_dtype(cfg))
    lap("data-parallel wrap")
    return plan
