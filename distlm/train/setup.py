"""Building what the Trainer trains: the autocast dtype, the model and its parallel plan
(the device: distlm/device.py; the compute context is the plan's: distlm/parallel/plan.py).

Kept apart from the loop so eval, bench and export can build the same pieces.
"""
from __future__ import annotations

import contextlib
import importlib
import threading
import time
from typing import Optional, Sequence

import torch

from distlm.config import Config, ConfigError
from distlm.parallel import ParallelDims, ParallelPlan, parallelize


def autocast_dtype(cfg: Config, device: torch.device) -> Optional[torch.dtype]:
    if cfg.train.dtype == "bf16" or (cfg.train.dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


# What torch.compile's first use imports: dynamo, AOTAutograd, inductor (and triton on a GPU):
# 1.8 s on the 2-core box, 3.7-4.5 s on an H200 host (2026-11-27). compile_fx pulls in the rest.
COMPILER_MODULES = ("torch._dynamo", "torch._inductor.compile_fx")


class BackgroundImport:
    """Imports modules on a thread of its own while the set-up does other work, and is joined
    before the first thing that needs them.

    Python runs one thread at a time, so the import overlaps only the set-up's work that
    releases the GIL: the process group's rendezvous, CUDA's context, weight draws and their
    copies to the GPU, the data check's reads, the Newton-Schulz probe's matmuls. What it
    imports is what the same process would import anyway, in the same order; an import that
    fails is raised again by ``join``, in the set-up, as it would have been without the thread.
    The thread is a daemon: a set-up that fails before joining does not wait for it.
    """

    def __init__(self, modules: Sequence[str], name: str = "compiler import") -> None:
        self.modules, self.name = tuple(modules), name
        self.seconds: Optional[float] = None    # the import's own wall time, once done
        self.waited: Optional[float] = None     # how long join() blocked the set-up
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=f"distlm {name}", daemon=True)

    def start(self) -> "BackgroundImport":
        self._thread.start()
        return self

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            for module in self.modules:
                importlib.import_module(module)
        except BaseException as e:  # kept for join(): raised in the set-up's thread, not lost here
            self._error = e
        finally:
            self.seconds = time.perf_counter() - t0

    def join(self) -> float:
        """Wait for the import; returns the seconds waited (0 when it had finished)."""
        if self.waited is None:
            t0 = time.perf_counter()
            self._thread.join()
            self.waited = time.perf_counter() - t0
        if self._error is not None:
            raise self._error
        return self.waited

    def describe(self) -> str:
        """For the set-up line: the import's own time and what of it the set-up waited for."""
        return f"{self.name} {self.seconds or 0.0:.1f} s in the background, waited {self.waited or 0.0:.1f} s"


def start_compiler_import(compiles: bool, device: torch.device) -> Optional[BackgroundImport]:
    """The compiler's import, started now on a thread of its own, for a compiled run on a GPU:
    there the set-up's next phases (process group, CUDA's context, data and memory checks) wait
    without the GIL, so the import runs beside them. None elsewhere: on a CPU the set-up holds
    the GIL throughout and the Newton-Schulz probe times matmuls the import would slow, so
    build_model imports the compiler itself, as before."""
    return BackgroundImport(COMPILER_MODULES).start() if compiles and device.type == "cuda" else None


def build_model(cfg: Config, dims: ParallelDims, device: torch.device, task, clock=None,
                compiler: Optional[BackgroundImport] = None) -> ParallelPlan:
    """Meta device -> split/shard -> allocate -> init -> DDP: no rank ever holds the whole
    model when it is sharded. Returns the parallel plan: (the wrapped model to train, the
    plain module inside (under PP this rank's pruned part), the step engine that drives it,
    ...: distlm/parallel/plan.py). ``clock`` (a SetupClock) gets four laps: the compiler's
    import (when compiling; with ``compiler``, started earlier, the wait for it), the model's structure with its parallel plans and compile
    wrappers, the weights' allocation and init, and the data-parallel wrapper (DDP's
    constructor broadcasts rank 0's weights: the first collective, so NCCL connects there)."""
    lap = clock.lap if clock is not None else (lambda name: None)
    if cfg.train.compile:
        # torch.compile's first use imports the compiler: a lap of its own, so "model plan" is
        # the plan alone. Started in the background (``compiler``), only the wait is a lap.
        if compiler is not None:
            compiler.join()
            lap("compiler import wait")
        else:
            for module in COMPILER_MODULES:
                importlib.import_module(module)  # not `import torch...`: that binds a local torch
            lap("compiler import")
    else:
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

    plan = parallelize(inner, dims, cfg, materialize, device=device, amp_dtype=autocast_dtype(cfg, device))
    lap("data-parallel wrap")
    return plan
