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
# The data-parallel runs (tests/layout/test_data.py, tests/optim/test_lion.py): tiny and fast, but every
# part that parallelism touches: tied embeddings, learned positions (a root parameter besides the
# tie), biases, norms, and clipping that is active on every step (grad norms here are ~0.5), so a
# wrong global norm shows up.
STEPS, SAVE_AT = 6, 3
DP_RUN = ["model.n_layer=2", "model.n_head=4", "model.d_model=64", "model.d_ff=256", "model.block_size=32",
          "model.vocab_size=256", "model.position=learned", "data.source=synthetic",
          f"train.max_steps={STEPS}", "train.global_batch_size=16", "train.micro_batch_size=4",
          "optim.adamw.lr=3e-2", "train.min_lr_ratio=0.1", "train.warmup_steps=2", "train.grad_clip=0.3",
          "train.eval_every=0", f"train.checkpoint_every={SAVE_AT}", "train.keep_last=5",
          "log.every=1", "log.progress=false", "log.tensorboard=false", "parallel.timeout_s=60"]


# A small run on the GPT-2 tokenizer and the tiny prepared data set, for the tests that read a run back.
TINY_RUN = ["model.n_layer=2", "model.n_head=2", "model.d_model=32", "model.d_ff=64", "model.block_size=16",
            "train.global_batch_size=8", "train.micro_batch_size=4", "train.eval_every=2", "train.eval_batches=2",
            "log.every=1", "log.progress=false", "log.tensorboard=false"]


def tiny_run(root: Path, data: Path, steps: int, *extra: str) -> Path:
    """Train TINY_RUN for ``steps`` steps into root/r; the run's folder."""
    from distlm.config import load_config
    from distlm.train.trainer import Trainer
    Trainer(load_config("tiny", TINY_RUN + [f"data.dir={data}", f"train.max_steps={steps}", f"log.root={root}",
                                            "log.name=r", *extra])).train()
    return root / "r"


def dp_overrides(root: Path, name: str, *extra: str) -> list[str]:
    return DP_RUN + [f"log.root={root}", f"log.name={name}", *extra]


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
