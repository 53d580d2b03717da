"""`distlm train` runs with a NaN put into one gradient at chosen steps (tests/test_nan_device.py).

    python tests/nan_worker.py PLAN.json
    torchrun --standalone --nproc_per_node 2 tests/nan_worker.py PLAN.json

PLAN.json: {"nan_at": [5, 9], "cuda_kernels": true, "cli": false, "jobs": [[ARG, ...], ...]}. Each
job is a Trainer of ``distlm train ARGS``, run one after the other in this process (one launch
pays the start-up once); with "cli": true, the one job runs through the command line's own entry
point, whose exit code the process returns.
``nan_at``: 1-based steps at which a gradient holds a NaN (the loss stays finite). ``cuda_kernels``: the optimizers are built as on a GPU (torch's fused AdamW kernel,
which also runs on the CPU), the build whose step takes the found_inf flag.
"""
from __future__ import annotations

import json
import sys

import torch


def use_cuda_kernels() -> None:
    import distlm.optim.adamw as adamw
    import distlm.optim.muon as muon
    from distlm.optim.groups import elementwise_kernel
    adamw.elementwise_kernel = muon.elementwise_kernel = lambda groups, device_type: elementwise_kernel(groups, "cuda")


def poison_gradients(steps: set) -> None:
    """Every Trainer: at ``steps``, the first element of this rank's part of the first gradient
    becomes NaN once the gradients are reduced, before the norm is taken (a hook on a parameter
    would not see FSDP2's gradients, which belong to the unsharded parameter)."""
    from distlm.train.trainer import Trainer
    inner = Trainer.train_step

    def train_step(self, *args, **kwargs):
        if not getattr(self, "_poisoned", False):
            self._poisoned, clip = True, self.stepper.clip

            def poisoned_clip(max_norm):
                if self.step + 1 in steps:
                    g = next(p.grad for p in self.model.parameters() if p.grad is not None)
                    (g.to_local() if hasattr(g, "to_local") else g).view(-1)[0] = float("nan")
                return clip(max_norm)
            self.stepper.clip = poisoned_clip
        return inner(self, *args, **kwargs)

    Trainer.train_step = train_step


def main(plan_path: str) -> int:
    plan = json.loads(open(plan_path).read())
    if plan.get("cuda_kernels"):
        use_cuda_kernels()
    poison_gradients(set(plan.get("nan_at", [])))
    if plan.get("cli"):  # one job, through the command line's entry point (its exit codes, its error line)
        from distlm.cli import main as cli
        [args] = plan["jobs"]
        return cli(["train", *args])
    from distlm.config import load_config
    from distlm.train.trainer import Trainer
    for args in plan["jobs"]:  # one process group for all (as tests/dist_worker.py)
        Trainer(load_config(None, args)).train()
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
