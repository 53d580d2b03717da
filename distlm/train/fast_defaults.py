"""The settings whose fastest value depends on the machine, chosen once the machine is known.

train.compile, train.compile_scope, model.loss_chunk and train.micro_batch_size default to
auto (None in the config tree: distlm/config.py ``auto``). A run's one resolution pass
(distlm/train/resolve.py) turns each auto into a value here, after the device and the layout
are known and before anything is built, so the run's config.yaml and its checkpoints record
what ran; an explicit value is kept. On one
H100 (torch 2.11), `distlm bench --config gpt2-124m-1024 data.source=synthetic` ran at 477k
tok/s with what auto picks there (the whole forward one graph, loss_chunk=8192, micro-batch
64, est. 27.1 GiB, peak 29.8 GiB) against 443k with what the same command plus
train.compile=true ran before (per-block graphs, whole logits, the preset's micro-batch 16).
On a CPU auto is what distlm did before auto existed (eager, whole logits, micro-batch 8),
so CPU results do not move.

``choose`` is the rule: a pure function of the config, a ``Device`` description and the
layout. ``fast_defaults`` measures the device (collective: the least free memory over the
ranks, so that every rank picks the same micro-batch) and returns the choice.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from distlm.config import Config, ConfigError, updated
from distlm.model.memory import GIB
from distlm.optim import spec_for
from distlm.planner import Candidate, Estimate, estimate

# docs/results/speed.md: with the whole forward compiled, as fast as 4096 and as the whole
# logits (within 0.4%), with 11-14% less peak memory; the best single-GPU figure used it.
LOSS_CHUNK = 8192
# The micro-batch of gpt2-124m-1024's fastest measurements on one GPU; nothing larger was
# measured faster, and a larger one only holds more activations.
GPU_MICRO_CAP = 64
# The default before auto: CPU runs keep their accumulation, and so their numbers.
CPU_MICRO_CAP = 8
# A micro-batch is taken when the planner's estimate is at most this share of the free
# memory: the estimate is within 25% of the measured peak (tests/test_planner.py), and the
# allocator's fragmentation and the compiler's workspaces are not in it.
HEADROOM = 0.75
# The vocabulary a synthetic run trains on, for an estimate made before it is known.
GPT2_VOCAB = 50257


@dataclass(frozen=True)
class Device:
    """What the choice needs to know of the device: its type, and on CUDA the GiB of memory
    this process may still use (after other processes and any per-process cap)."""
    type: str
    free_gib: float = 0.0

    @classmethod
    def measure(cls, device, comm=None) -> "Device":
        if device.type != "cuda":
            return cls(device.type)
        import torch
        free, total = torch.cuda.mem_get_info(device)
        # `distlm bench --memory-cap-gib` caps the allocator below what the card has free.
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)(device)
        usable = min(free, fraction * total) / GIB
        if comm is not None:
            usable = -float(comm.max(torch.tensor([-usable], device=device, dtype=torch.float64))[0])
        return cls("cuda", usable)


@dataclass(frozen=True)
class Choice:
    cfg: Config                                  # every auto replaced by a value
    chosen: dict[str, Any] = field(default_factory=dict)  # "section.key" -> value: the autos chosen
    estimate: Optional[Estimate] = None          # of the micro-batch chosen, on CUDA
    fits: bool = True                            # False: not even micro-batch 1 fits the estimate
    line: Optional[str] = None                   # what rank 0 prints; None when nothing was auto


def choose(cfg: Config, dev: Device, dims) -> Choice:
    """Each auto of ``cfg`` made a value for ``dev`` and the layout ``dims`` (a ParallelDims:
    a Layout, distlm/layout/, whose named questions decide, and its world_size):

        train.compile          on CUDA, off on CPU
        train.compile_scope    model (the whole forward one graph) on 1 GPU, DDP or Horovod;
                               block with FSDP2, TP or PP, which split the forward
        model.loss_chunk       LOSS_CHUNK on CUDA where the model computes its own loss (a
                               language model without TP or PP), else 0
        train.micro_batch_size the largest divisor of the local batch up to GPU_MICRO_CAP
                               whose memory estimate fits (under PP, one that gives a whole
                               number of microbatches per stage where one fits); on CPU the
                               largest up to CPU_MICRO_CAP
    """
    cuda = dev.type == "cuda"
    chosen: dict[str, Any] = {}
    t, m = cfg.train, cfg.model
    if t.compile is None:
        chosen["train.compile"] = cuda
    if t.compile_scope is None:
        chosen["train.compile_scope"] = "block" if dims.splits_forward else "model"
    if m.loss_chunk is None:
        own_loss = dims.model_computes_loss and cfg.task.name == "lm"
        chosen["model.loss_chunk"] = LOSS_CHUNK if cuda and own_loss else 0
    cfg = _with(cfg, chosen)
    est, fits = None, True
    if t.micro_batch_size is None:
        micro, est, fits = _micro_batch(cfg, dev, dims)
        chosen["train.micro_batch_size"] = micro
        cfg = _with(cfg, chosen)
    return Choice(cfg, chosen, est, fits, _line(chosen, dev, dims, est, fits) if chosen else None)


def dtype_for(t, device_type: str) -> str:
    """train.dtype, its auto made a value: bf16 autocast on CUDA, fp32 elsewhere."""
    return t.dtype if t.dtype != "auto" else "bf16" if device_type == "cuda" else "fp32"


def fast_defaults(cfg: Config, device, dims, comm=None) -> Choice:
    """The resolution pass's call (distlm/train/resolve.py), once the device and the layout are
    known and before the model is built. Collective (every rank must call it) when the
    micro-batch is auto on CUDA."""
    needs_memory = device.type == "cuda" and cfg.train.micro_batch_size is None
    dev = Device.measure(device, comm if dims.world_size > 1 else None) if needs_memory else Device(device.type)
    return choose(cfg, dev, dims)


def _with(cfg: Config, chosen: dict[str, Any]) -> Config:
    sections: dict[str, dict] = {}
    for key, value in chosen.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    return updated(cfg, **sections)


def _micro_batch(cfg: Config, dev: Device, dims) -> tuple[int, Optional[Estimate], bool]:
    t = cfg.train
    if t.global_batch_size % dims.dp_size:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} must be a multiple of the data-parallel "
                          f"degree {dims.dp_size}, so that every rank gets a whole local batch")
    local = t.global_batch_size // dims.dp_size
    if dev.type != "cuda":
        return max(d for d in range(1, min(local, CPU_MICRO_CAP) + 1) if local % d == 0), None, True
    # What the layout runs, best first: under PP a whole number of microbatches per stage
    # (distlm/layout/pipeline.py).
    sizes = dims.micro_batch_sizes([d for d in range(min(local, GPU_MICRO_CAP), 0, -1) if local % d == 0], local, cfg)
    est = None
    for micro in sizes:
        est = memory_estimate(cfg, dev, dims, micro)
        if est.total_gb <= HEADROOM * dev.free_gib:
            return micro, est, True
    return sizes[-1], est, False


def memory_estimate(cfg: Config, dev: Device, dims, micro: int) -> Estimate:
    """The planner's memory per GPU (distlm/planner.py) for this config, layout and micro-batch;
    ``cfg.model.loss_chunk`` must be a value (the logits held depend on it)."""
    p = cfg.parallel
    model = cfg.model if cfg.model.vocab_size else dataclasses.replace(cfg.model, vocab_size=GPT2_VOCAB)
    # selective checkpointing keeps half the blocks' activations: counted as none, the safe side
    lay = Candidate(**dims.degrees(), ac="full" if p.activation_checkpoint == "full" else "none",
                    schedule=p.pp_schedule)
    compute_bytes = 2 if dtype_for(cfg.train, dev.type) == "bf16" else 4
    return estimate(model, lay, cfg.train.global_batch_size, micro, dev.free_gib, compute_bytes=compute_bytes,
                    sequence_parallel=p.sequence_parallel, loss_parallel=p.loss_parallel,
                    optimizer=spec_for(cfg),  # the state optim.name declares (distlm/optim/)
                    fused_loss=bool(cfg.train.compile))


def _show(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def _line(chosen: dict[str, Any], dev: Device, dims, est: Optional[Estimate], fits: bool) -> str:
    n = dims.world_size
    unit = ("GPU", "GPUs") if dev.type == "cuda" else ("process", "processes")
    where = f"{dev.type}, {n} {unit[n > 1]}"
    if n > 1:
        where += ", " + dims.name
    text = f"fast defaults ({where}): " + ", ".join(f"{k}={_show(v)}" for k, v in chosen.items())
    if est is not None:
        text += f" (est. {est.total_gb:.1f} GiB of {dev.free_gib:.3g} GiB free)"
        if not fits:
            text += (f"; even this is more than {HEADROOM:.0%} of the free memory: `distlm plan` shows the layouts "
                     f"that fit")
    return text
