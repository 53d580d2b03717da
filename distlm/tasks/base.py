"""What a task supplies to the one Trainer.

The Trainer runs the same loop for every task: accumulation, gradient sync, clipping,
NaN handling, checkpoints, resume, signals, logging. A task says what is trained and on
what: it resolves the config against its data (vocabulary, label count, a trunk's shape),
builds the model on the meta device, serves batches, computes the loss, evaluates, and
writes the files a run folder needs besides checkpoints.

    distlm/tasks/lm.py                next-token prediction (the default)
    distlm/tasks/classify/task.py     text classification on the same trunk
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Protocol

import torch
import torch.nn as nn

from distlm.config import Config


@dataclass(frozen=True)
class Resolved:
    """The config with everything the data or a checkpoint decides filled in (frozen from
    here on), and where the data is."""
    cfg: Config
    manifest: dict
    data_dir: Optional[Path]


class Task(Protocol):
    name: str

    def resolve(self, cfg: Config, comm, is_main: bool) -> Resolved:
        """Read (or, for a default data set, prepare) the data and fill the config from it."""

    def build_model(self, cfg: Config) -> nn.Module:
        """The module to train, built under ``torch.device("meta")`` by the caller."""

    def after_init(self, model: nn.Module, cfg: Config) -> None:
        """Weights that come from elsewhere (an LM trunk), loaded after initialisation."""

    def build_loader(self, cfg: Config, dims, device: torch.device):
        """This rank's batches: ``next()``, ``accum_steps``, ``state_dict()``/``load_state_dict()``."""

    def loss_fn(self, cfg: Config, dims) -> Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]:
        """``loss(model, x, y)``, the mean loss of one micro-batch, as the plain step computes it."""

    def pipeline_loss(self, cfg: Config) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """``loss(logits, y)`` on the last pipeline stage."""

    def evaluate(self, trainer) -> float:
        """The validation loss (collective); may log more (accuracy, confusion)."""

    def eval_metrics(self) -> dict:
        """Figures of the latest evaluation besides the loss, for the log (per-source losses,
        accuracy)."""

    def describe_eval(self) -> str:
        """What the validation loss is measured on, for the log line."""

    def write_run_files(self, run_dir: Path) -> None:
        """Files a run folder needs to be used without the data (tokenizer, labels)."""

    def bench_fields(self, trainer, step_s: float) -> dict:
        """Task-specific figures `distlm bench` adds to its result."""
