"""A run's config resolved in one pass, before anything is built: what the data, the device, the
layout and the optimizer decide, made values, so that the Trainer (and the model, the optimizer,
the loader, the evaluation it builds) reads values only and config.yaml records what ran.

``resolve_run(cfg, device, dims, task, comm)`` takes, in this order:

    the data        task.resolve: the vocabulary and what else only the prepared folder says
    the device      train.dtype=auto: bf16 autocast on CUDA, fp32 elsewhere (dtype_for)
    device+layout   the fast defaults (distlm/train/fast_defaults.py): train.compile,
                    train.compile_scope, model.loss_chunk, train.micro_batch_size
    the optimizer   its own device-dependent settings (Spec.resolve: Muon's Newton-Schulz dtype)
    the run         log.every=auto for the run's length (distlm/train/logger.py: log_interval)

and returns the frozen config with each line rank 0 prints about what it chose. An explicit
value is kept everywhere. Collective (every rank calls it): the least free memory over the
ranks decides the micro-batch, and Muon's dtype is the same on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from distlm.config import Config, updated
from distlm.optim import spec_for
from distlm.train.fast_defaults import Choice, dtype_for, fast_defaults
from distlm.train.logger import DEFAULT_LOG_EVERY, log_interval


@dataclass(frozen=True)
class ResolvedRun:
    cfg: Config                          # every auto a value
    manifest: dict                       # the data's manifest ({} for synthetic data)
    data_dir: Optional[Path]
    fast: Choice                         # the fast defaults' choice, its estimate and line
    lines: list[str] = field(default_factory=list)  # rank 0 prints these at set-up, in order
    log_line: Optional[str] = None       # said when training starts: what log.every=auto became


def resolve_run(cfg: Config, device: torch.device, dims, task, comm, probe=None) -> ResolvedRun:
    """The config of a run of ``task`` on ``device`` with the layout ``dims`` (a ParallelDims),
    every auto a value (see the module docstring). ``probe``: what measures the device for the
    optimizer (distlm/optim/matmul_dtype.py), for a test to give its own."""
    data = task.resolve(cfg, comm, dims.is_main)
    cfg = updated(data.cfg, train={"dtype": dtype_for(data.cfg.train, device.type)})
    fast = fast_defaults(cfg, device, dims, comm)
    lines = [fast.line] if fast.line else []
    cfg, said = spec_for(fast.cfg).resolve(fast.cfg, device, comm, probe)
    if said:
        lines.append(said)
    log_line = None
    if cfg.log.every is None:
        every = log_interval(None, cfg.train.max_steps)
        if every != DEFAULT_LOG_EVERY:  # said once, not done quietly
            log_line = (f"log.every=auto: a row every {'step' if every == 1 else f'{every} steps'}, so that this "
                        f"{cfg.train.max_steps}-step run draws about 20 points (a number given for log.every is kept)")
        cfg = updated(cfg, log={"every": every})
    return ResolvedRun(cfg, data.manifest, data.data_dir, fast, lines, log_line)
