"""The Trainer's optimizer: the one ``optim.name`` picks from the registry (distlm/optim/),
built over the wrapped model, with what only the Trainer knows (the device, the DDP group,
the Newton-Schulz dtype it measured), and the resume rule for its hyperparameters."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn as nn

from distlm.config import Config, updated
from distlm.optim import BuildContext, spec_for
from distlm.train.matmul_dtype import DtypeChoice, MatmulDtypeProbe

NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def ns_dtype_for(cfg: Config, device: torch.device, probe: Optional[MatmulDtypeProbe] = None) -> DtypeChoice:
    """optim.muon_ns_dtype as a torch dtype: an explicit bf16/fp32 as given; auto as the
    probe measures this device (bf16 on CUDA; on a CPU the faster of the two)."""
    if cfg.optim.muon_ns_dtype != "auto":
        return DtypeChoice(NS_DTYPES[cfg.optim.muon_ns_dtype], {})
    return (probe or MatmulDtypeProbe()).choose(device)


def resolve_ns_dtype(cfg: Config, device: torch.device, comm,
                     probe: MatmulDtypeProbe) -> tuple[Config, Optional[str]]:
    """optim.muon_ns_dtype=auto made a value before the optimizer is built, so config.yaml
    records what ran. Every rank must use the same dtype (the Newton-Schulz stacks are
    redistributed between them): fp32 when any rank measured bf16 slower, as the slowest
    rank sets the pace. Collective. Returns the config and, where something was measured
    (a CPU), the line that says what."""
    if not spec_for(cfg).orthogonalises or cfg.optim.muon_ns_dtype != "auto":
        return cfg, None
    choice = probe.choose(device)
    wants_fp32 = comm.max(torch.tensor([float(choice.dtype == torch.float32)], device=device))
    name = "fp32" if float(wants_fp32[0]) else "bf16"
    line = f"optim.muon_ns_dtype=auto: {name} for Newton-Schulz ({choice.describe()} on this CPU)" if choice.seconds else None
    return updated(cfg, optim={"muon_ns_dtype": name}), line


def build_optimizer(model: nn.Module, cfg: Config, device_type: str,
                    ns_dtype: Optional[torch.dtype] = None) -> torch.optim.Optimizer:
    """The registered optimizer ``optim.name`` names, over ``model``. ``ns_dtype``: Muon's
    Newton-Schulz dtype as the caller chose it (the Trainer: once, the same on every rank);
    None: from optim.muon_ns_dtype here."""
    spec = spec_for(cfg)
    spec.check(cfg)
    # Under DDP the parameters are replicated plain tensors: a matrix optimizer spreads its
    # whole-matrix work over the group the wrapper names (DDP's process_group, its replicas).
    # FSDP2/TP parameters are DTensors and carry their own mesh; an unwrapped model names none.
    group = getattr(model, "process_group", None)
    if ns_dtype is None and spec.orthogonalises:
        ns_dtype = ns_dtype_for(cfg, torch.device(device_type)).dtype
    return spec.build(model, cfg, BuildContext(device_type, group, ns_dtype))


@contextlib.contextmanager
def config_hyperparameters(optimizer: torch.optim.Optimizer):
    """Loading an optimizer's state brings back the hyperparameters its groups were saved
    with (torch's load_state_dict replaces each group whole). A resume may change them
    (betas, Muon's rate and momentum, optim.embed_lr, ...: MAY_CHANGE in resume_check.py),
    and a GPU checkpoint's fused-kernel flags must not follow it onto a CPU: around the
    load, the groups keep this run's values and take only the state."""
    before = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    yield
    for group, mine in zip(optimizer.param_groups, before):
        group.update(mine)
