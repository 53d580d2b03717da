"""The optimizer: AdamW (default), or Muon for the blocks' matrices with AdamW for the rest.

AdamW decays only matrices that are not embeddings. ``train.optimizer=muon`` hands the
2-D weights inside the transformer blocks to Muon (distlm/train/muon.py) and keeps AdamW,
with the same two groups, for embeddings, the head, norms, biases and scalars; with
``train.embed_lr`` the embedding tables have a third AdamW group at their own rate.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn as nn

from distlm.config import Config, ConfigError, TrainConfig, updated
from distlm.train.matmul_dtype import DtypeChoice, MatmulDtypeProbe

# Wrappers that insert a component into parameter names without being part of the model.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")
# A fused q/k/v projection: one (3d, d) weight holding three matrices.
FUSED_QKV_NAMES = ("qkv", "wqkv", "c_attn")


def embedding_tables(model: nn.Module) -> list:
    """The token and value embedding tables (each parameter once, in model order)."""
    out, seen = [], set()
    for m in model.modules():
        if isinstance(m, nn.Embedding) and m.weight.requires_grad and id(m.weight) not in seen:
            seen.add(id(m.weight))
            out.append(m.weight)
    return out


def param_groups(model: nn.Module, weight_decay: float, exclude=frozenset()) -> list[dict]:
    """AdamW's two groups; parameters whose id is in ``exclude`` (Muon's) are left out."""
    # Decay shrinks weights toward zero; on norms and biases that only fights the
    # optimizer, and on embeddings it penalises rare tokens (GPT-3 / nanoGPT practice).
    no_decay_ids = {id(p) for p in embedding_tables(model)}
    decay, no_decay, seen = [], [], set(exclude)
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (no_decay if p.ndim < 2 or id(p) in no_decay_ids else decay).append(p)
    # Two groups whatever the layout: a checkpoint's optimizer state loads only into the
    # same group structure, and it must load under any other layout.
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def one_mesh_per_group(groups: list[dict]) -> bool:
    # Meshes compare by value (two slices of one layout are equal objects, not the same one).
    return all(len({getattr(p, "device_mesh", None) for p in g["params"]}) <= 1 for g in groups)


def _path(name: str) -> list[str]:
    return [part for part in name.split(".") if part not in _WRAPPER_PARTS]


def muon_params(model: nn.Module) -> tuple[list, list]:
    """(matrices, fused q/k/v matrices) for Muon: the 2-D weights inside the transformer
    blocks (``blocks.*``), except embedding tables. Embeddings and the head stay with
    AdamW: a table row is updated only by its tokens' gradients, and the head's rows are
    per-token outputs; neither is a hidden linear map."""
    embedding_ids = {id(p) for p in embedding_tables(model)}
    plain, fused, seen = [], [], set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen or p.ndim != 2 or id(p) in embedding_ids:
            continue
        path = _path(name)
        if "blocks" not in path[:-1]:
            continue
        seen.add(id(p))
        (fused if len(path) >= 2 and path[-2] in FUSED_QKV_NAMES else plain).append(p)
    return plain, fused


def _check_muon(cfg: TrainConfig) -> None:
    if cfg.lr <= 0 or cfg.muon_lr <= 0:
        raise ConfigError(f"train.optimizer=muon needs train.lr > 0 and train.muon_lr > 0 "
                          f"(got {cfg.lr} and {cfg.muon_lr}): Muon's rate is lr x muon_lr/lr")
    if not 0.0 <= cfg.muon_momentum < 1.0:
        raise ConfigError(f"train.muon_momentum must be in [0, 1), got {cfg.muon_momentum}")
    if cfg.muon_ns_steps < 1:
        raise ConfigError(f"train.muon_ns_steps must be at least 1, got {cfg.muon_ns_steps}")
    if cfg.muon_weight_decay < 0:
        raise ConfigError(f"train.muon_weight_decay must be >= 0, got {cfg.muon_weight_decay}")


def _adamw_kernel(groups: list[dict], device_type: str) -> dict:
    # Fused AdamW is one kernel per step on CUDA. Its kernel, and the foreach path, refuse a
    # group that mixes plain tensors with DTensors (under TP a learned position table stays
    # a plain replicated tensor; first seen on 2x H200): such layouts step tensor by tensor.
    homogeneous = one_mesh_per_group(groups)
    return dict(fused=True) if device_type == "cuda" and homogeneous else {} if homogeneous else dict(foreach=False)


NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def ns_dtype_for(cfg: TrainConfig, device: torch.device, probe: Optional[MatmulDtypeProbe] = None) -> DtypeChoice:
    """train.muon_ns_dtype as a torch dtype: an explicit bf16/fp32 as given; auto as the
    probe measures this device (bf16 on CUDA; on a CPU the faster of the two)."""
    if cfg.muon_ns_dtype != "auto":
        return DtypeChoice(NS_DTYPES[cfg.muon_ns_dtype], {})
    return (probe or MatmulDtypeProbe()).choose(device)


def resolve_ns_dtype(cfg: Config, device: torch.device, comm,
                     probe: MatmulDtypeProbe) -> tuple[Config, Optional[str]]:
    """train.muon_ns_dtype=auto made a value before the optimizer is built, so config.yaml
    records what ran. Every rank must use the same dtype (the Newton-Schulz stacks are
    redistributed between them): fp32 when any rank measured bf16 slower, as the slowest
    rank sets the pace. Collective. Returns the config and, where something was measured
    (a CPU), the line that says what."""
    if cfg.train.optimizer != "muon" or cfg.train.muon_ns_dtype != "auto":
        return cfg, None
    choice = probe.choose(device)
    wants_fp32 = comm.max(torch.tensor([float(choice.dtype == torch.float32)], device=device))
    name = "fp32" if float(wants_fp32[0]) else "bf16"
    line = f"train.muon_ns_dtype=auto: {name} for Newton-Schulz ({choice.describe()} on this CPU)" if choice.seconds else None
    return updated(cfg, train={"muon_ns_dtype": name}), line


def build_optimizer(model: nn.Module, cfg: TrainConfig, device_type: str,
                    ns_dtype: Optional[torch.dtype] = None) -> torch.optim.Optimizer:
    """``train.optimizer=adamw``: torch's AdamW over param_groups (decay, no decay).
    ``muon``: one Muon object with groups [AdamW decay, AdamW no decay, Muon, Muon fused
    q/k/v], the empty ones left out; group 0 is AdamW's, so ``param_groups[0]["lr"]`` is
    still the schedule's lr.
    Every group's ``lr`` is the schedule's value; Muon's groups multiply it by
    ``lr_scale = muon_lr / lr``. ``ns_dtype``: Newton-Schulz's dtype, as the caller chose it
    (the Trainer: once, the same on every rank); None: from train.muon_ns_dtype here."""
    if cfg.optimizer != "muon":
        groups = param_groups(model, cfg.weight_decay)
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                 **_adamw_kernel(groups, device_type))
    _check_muon(cfg)
    from distlm.train.muon import Muon
    plain, fused = muon_params(model)
    # train.embed_lr: the embedding tables get their own AdamW group and rate. A table row
    # moves only when its token occurs, so at the head's rate the tables learn slowly
    # (the public speedrun gives them ~75x the head's rate).
    tables = embedding_tables(model) if cfg.embed_lr else []
    adamw_groups = param_groups(model, cfg.weight_decay, exclude={id(p) for p in plain + fused + tables})
    if tables:
        adamw_groups.append({"params": tables, "weight_decay": 0.0, "lr_scale": cfg.embed_lr / cfg.lr})
    kernel = _adamw_kernel(adamw_groups, device_type)
    groups = [dict(g, kind="adamw", betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                   foreach=kernel.get("foreach"), fused=kernel.get("fused")) for g in adamw_groups]
    muon = dict(kind="muon", lr_scale=cfg.muon_lr / cfg.lr, momentum=cfg.muon_momentum,
                weight_decay=cfg.muon_weight_decay, ns_steps=cfg.muon_ns_steps)
    groups += [dict(muon, params=plain, split=1), dict(muon, params=fused, split=3)]
    # Empty groups are left out (AdamW's decay group is empty when the head is tied, the
    # fused q/k/v group when the model has none). get_state_dict keys groups by their
    # parameters' names, and set_state_dict gives an empty group's hyperparameters to no
    # one (torch 2.13: it comes back as {}). Which groups exist depends on the architecture
    # (and under PP on the stage), never on the data/tensor-parallel layout.
    groups = [g for g in groups if g["params"]]
    # Under DDP the matrices are replicated plain tensors: the Newton-Schulz work is spread
    # over the group the wrapper names (DDP's process_group, its replicas). FSDP2/TP
    # parameters are DTensors and carry their own mesh; an unwrapped model names none.
    group = getattr(model, "process_group", None)
    if ns_dtype is None:
        ns_dtype = ns_dtype_for(cfg, torch.device(device_type)).dtype
    return Muon(groups, lr=cfg.lr, process_group=group, ns_dtype=ns_dtype)


@contextlib.contextmanager
def config_hyperparameters(optimizer: torch.optim.Optimizer):
    """Loading an optimizer's state brings back the hyperparameters its groups were saved
    with (torch's load_state_dict replaces each group whole). A resume may change them
    (betas, Muon's rate and momentum, train.embed_lr, ...: MAY_CHANGE in resume_check.py),
    and a GPU checkpoint's fused-kernel flags must not follow it onto a CPU: around the
    load, the groups keep this run's values and take only the state."""
    before = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    yield
    for group, mine in zip(optimizer.param_groups, before):
        group.update(mine)
