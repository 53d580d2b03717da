"""How the Trainer runs a model for evaluation: which graphs, which grad mode, which module.

torch.compile guards on the grad mode and on every module's training flag, so evaluating a
compiled model under ``no_grad`` in eval mode is another graph, compiled at the first
evaluation: 7.6 s of a 94 s `speedrun-124m` run on an H100 (docs/results/time-to-loss.md), for
three evaluations that then take about a second each. Three ways to evaluate:

``NoGradEval``       eval mode, no autograd; compiled graphs of its own when the run evaluates
                     often enough to pay for them (EVAL_COMPILE_FROM), else eager: what any
                     model and layout can do.
``TrainingGraphEval`` the training graphs themselves: train mode, autograd recording, each
                     micro-batch's loss detached at once so its graph is freed with it. Only
                     for a model without dropout, which computes the same function in either
                     mode, whose task evaluates with its training loss on training-sized
                     micro-batches (the language model), and where the plan says the forward
                     is not split (one process or DDP: FSDP2, TP and pipeline stages keep
                     their own per-forward state for a backward).
                     It costs a training forward's activations for one micro-batch (the step
                     already holds as much) and a forward slower than a no-grad graph's; it
                     saves the compile.

``evaluation_for(cfg, plan, task)`` picks one; a compiled run prints its choice (an
``evaluation:`` line). The validation loss is the same either way (tests/train/test_trainer.py).
"""
from __future__ import annotations

import contextlib

import torch


class NoGradEval:
    def __init__(self, eager: bool):
        self.eager = eager
        self.describe = "eager, no grad" if eager else "no-grad graphs"

    @contextlib.contextmanager
    def __call__(self, model):
        model.eval()
        stance = torch.compiler.set_stance("force_eager") if self.eager else contextlib.nullcontext()
        try:
            with torch.no_grad(), stance:
                yield
        finally:
            model.train()


class TrainingGraphEval:
    describe = "the training graphs (no dropout: train mode computes the same losses)"

    @contextlib.contextmanager
    def __call__(self, model):
        # DDP prepares its reducer for a backward after a forward that records autograd;
        # no_sync() skips that, and the forward is still the one its graphs were traced in.
        with torch.enable_grad(), getattr(model, "no_sync", contextlib.nullcontext)():
            yield


# A no-grad graph of its own costs a compile at the first evaluation (7.6 s per-block, 12 s
# whole-model for speedrun-124m on an H100) and saves 1.7-2.6 s on each evaluation after it (the
# 1.1M validation tokens: 3.0-3.4 s eager, 0.8-1.3 s compiled; docs/results/time-to-loss.md).
# It pays from about four evaluations on; a run with fewer evaluates eagerly.
EVAL_COMPILE_FROM = 4


def evaluations(t) -> int:
    """How many validation passes a run of ``t`` (a TrainConfig) makes: every eval_every steps,
    and one at the end when max_steps is not a multiple of it (or eval_every is 0)."""
    every = t.eval_every
    return (t.max_steps // every if every else 0) + (0 if every and t.max_steps % every == 0 else 1)


def evaluation_for(cfg, plan, task):
    """``plan``: the ParallelPlan (distlm/parallel/applied.py), whether its layout lets the
    training graphs evaluate."""
    t = cfg.train
    if (t.compile and cfg.model.dropout == 0 and plan.evaluates_through_training_graph
            and task.evaluates_with_training_loss(cfg)):
        return TrainingGraphEval()
    return NoGradEval(eager=bool(t.compile) and evaluations(t) < EVAL_COMPILE_FROM)
