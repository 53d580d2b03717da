"""The Trainer's view of the run for its task (distlm/tasks/base.py, RunContext): built
afresh for each evaluation and each round of samples, so the step it names is current."""
from __future__ import annotations

from distlm.tasks import RunContext


def run_context(trainer) -> RunContext:
    why = trainer.plan.why_no_samples  # the layout's answer: does this rank hold the whole model?
    return RunContext(cfg=trainer.cfg, dims=trainer.dims, device=trainer.device, run_dir=trainer.run_dir,
                      step=trainer.step, model=trainer.model, compute=trainer.compute,
                      eval_losses=lambda batches: trainer.stepper.eval_losses(batches, trainer.compute),
                      mean=trainer.comm.mean, whole_model=trainer.module if why is None else None,
                      no_whole_model=why)
