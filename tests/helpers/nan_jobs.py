"""`distlm train` runs with a NaN put into one gradient at chosen steps (tests/train/test_nan_skip.py).

    python tests/helpers/nan_jobs.py PLAN.json

PLAN.json: {"nan_at": [5, 9], "cuda_kernels": true, "jobs": [[ARG, ...]]}: the one job runs
through the command line's own entry point, whose exit code the process returns (the test reads
its exit status and its lines through a pipe). ``run`` is the same run as a scenario of kind "nan"
for tests/helpers/world.py, and in the test's own process.
``nan_at``: 1-based steps at which a gradient holds a NaN (the loss stays finite). ``cuda_kernels``:
the optimizers are built as on a GPU (torch's fused AdamW kernel, which also runs on the CPU), the
build whose step takes the found_inf flag.
"""
from __future__ import annotations

import contextlib
import json
import sys


@contextlib.contextmanager
def cuda_kernels(on: bool = True):
    """The optimizers as a GPU builds them, on the CPU, while inside; put back after."""
    import distlm.optim.adamw as adamw
    import distlm.optim.muon as muon
    from distlm.optim.groups import elementwise_kernel
    saved = adamw.elementwise_kernel, muon.elementwise_kernel
    if on:
        adamw.elementwise_kernel = muon.elementwise_kernel = \
            lambda groups, device_type: elementwise_kernel(groups, "cuda")
    try:
        yield
    finally:
        adamw.elementwise_kernel, muon.elementwise_kernel = saved


def poison(trainer, steps: set) -> None:
    """At ``steps``, the first element of this rank's part of the first gradient becomes NaN once
    the gradients are reduced, before the norm is taken (a hook on a parameter would not see
    FSDP2's gradients, which belong to the unsharded parameter)."""
    clip = trainer.stepper.clip

    def poisoned_clip(max_norm):
        if trainer.step + 1 in steps:
            g = next(p.grad for p in trainer.model.parameters() if p.grad is not None)
            (g.to_local() if hasattr(g, "to_local") else g).view(-1)[0] = float("nan")
        return clip(max_norm)
    trainer.stepper.clip = poisoned_clip


def poison_every_trainer(steps: set) -> None:
    """``poison`` for the Trainer the command line builds, at its first step."""
    from distlm.train.trainer import Trainer
    inner = Trainer.train_step

    def train_step(self, *args, **kwargs):
        if not getattr(self, "_poisoned", False):
            self._poisoned = True
            poison(self, steps)
        return inner(self, *args, **kwargs)

    Trainer.train_step = train_step


def run(job: dict) -> dict:
    """A Trainer of ``distlm train OVERRIDES`` with NaN gradients at ``nan_at``."""
    from distlm.config import load_config
    from distlm.train.trainer import Trainer
    with cuda_kernels(job.get("cuda_kernels", False)):
        trainer = Trainer(load_config(None, job["overrides"]))
        inner = trainer.train_step

        def first_step(*args, **kwargs):  # as on the command line: poisoned once training starts
            trainer.train_step = inner
            poison(trainer, set(job.get("nan_at", [])))
            return inner(*args, **kwargs)
        trainer.train_step = first_step
        trainer.train()
    return {"nan_skips": trainer.nan_skips}


def main(plan_path: str) -> int:
    plan = json.loads(open(plan_path).read())
    poison_every_trainer(set(plan.get("nan_at", [])))
    from distlm.cli import main as cli
    [args] = plan["jobs"]
    with cuda_kernels(plan.get("cuda_kernels", False)):
        return cli(["train", *args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
