"""The Trainer's optimizer: the one ``optim.name`` picks from the registry (distlm/optim/),
built over the wrapped model with what only the Trainer knows (the device, the DDP group),
and the resume rule for its hyperparameters. Its settings that depend on the device are
resolved before this, with the rest of the config (distlm/train/resolve.py)."""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from distlm.config import Config
from distlm.optim import BuildContext, spec_for


def build_optimizer(model: nn.Module, cfg: Config, device_type: str) -> torch.optim.Optimizer:
    """The registered optimizer ``optim.name`` names, over ``model``."""
    spec = spec_for(cfg)
    spec.check(cfg)
    # Under DDP the parameters are replicated plain tensors: a matrix optimizer spreads its
    # whole-matrix work over the group the wrapper names (DDP's process_group, its replicas).
    # FSDP2/TP parameters are DTensors and carry their own mesh; an unwrapped model names none.
    group = getattr(model, "process_group", None)
    return spec.build(model, cfg, BuildContext(device_type, group))


@contextlib.contextmanager
def config_hyperparameters(optimizer: torch.optim.Optimizer):
    """Loading an optimizer's state brings back the hyperparameters its groups were saved
    with (torch's load_state_dict replaces each group whole). A resume may change them
    (betas, Muon's rate and momentum, optim.muon.embed_lr, ...: MAY_CHANGE in resume_check.py),
    and a GPU checkpoint's fused-kernel flags must not follow it onto a CPU: around the
    load, the groups keep this run's values and take only the state."""
    before = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    yield
    for group, mine in zip(optimizer.param_groups, before):
        group.update(mine)
