"""Reading training runs back, and the single-process reference, for the layout tests.

Every parallel run trains on the same global batches as one process (the loader is a pure
function of (seed, step, global batch)), so its per-step losses and grad norms, read from
metrics.csv, must match the reference's to fp32 rounding.
"""
from __future__ import annotations

import csv
import math
from pathlib import Path

import torch

TOL = dict(rtol=1e-5, atol=1e-5)


def ckpt(root: Path, name: str, step: int) -> Path:
    return root / name / "checkpoints" / f"step_{step:07d}"


def trace(run_dir: Path) -> dict[int, tuple[float, float]]:
    """step -> (loss, grad_norm), from the run's metrics.csv."""
    with open(run_dir / "metrics.csv", newline="") as f:
        return {int(r["step"]): (float(r["loss"]), float(r["grad_norm"])) for r in csv.DictReader(f) if r["loss"]}


def assert_matches(run_dir: Path, reference: dict, steps=None) -> None:
    """The run logged exactly ``steps`` (default: the reference's) with the reference's numbers."""
    steps = sorted(reference) if steps is None else list(steps)
    got = trace(run_dir)
    assert sorted(got) == steps, f"{run_dir.name}: logged steps {sorted(got)}"
    for s in steps:
        for what, a, b in zip(("loss", "grad_norm"), got[s], reference[s]):
            assert math.isclose(a, b, rel_tol=TOL["rtol"], abs_tol=TOL["atol"]), \
                f"{run_dir.name} step {s} {what}: {a!r} vs reference {b!r}"


def train_here(args: list[str]):
    """One process, in this one. A single intra-op thread: on a shared, loaded box the
    default two spin in OpenMP barriers and a step gets 30x slower (torchrun sets 1 too)."""
    from distlm.config import load_config
    from distlm.train.trainer import Trainer
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = Trainer(load_config(None, args))
        trainer.train()
    finally:
        torch.set_num_threads(threads)
    return trainer
