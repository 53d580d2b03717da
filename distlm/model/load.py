"""A trained model from a checkpoint, in one process, for eval, generate, predict and export.

One loader for both tasks: the checkpoint's saved config says which module to build (a GPT,
or a classifier with its label count from the run's labels.json), it is built on the meta
device, allocated on the target device and filled from the (any-layout) DCP checkpoint.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from distlm.config import Config, config_from_dict
from distlm.data import read_json


@dataclass
class Loaded:
    model: nn.Module      # in eval mode
    cfg: Config
    folder: Path          # the checkpoint folder used
    labels: dict = field(default_factory=dict)  # classify: labels.json (labels, max_len, tokenizer)


def checkpoint_task(path: str | Path) -> str:
    """The task a checkpoint was trained for ("lm" for runs older than the task section)."""
    from distlm.checkpoint import store as ckpt
    meta = ckpt.read_meta(ckpt.resolve_checkpoint(path))
    return (meta.get("config", {}).get("task") or {}).get("name", "lm")


def load_model(path: str | Path, device: torch.device | str = "cpu") -> tuple[nn.Module, Config, Path]:
    """The public API: RUN_OR_CKPT of a language model -> (model in eval mode, config, folder)."""
    loaded = load_trained(path, device, task="lm")
    return loaded.model, loaded.cfg, loaded.folder


def load_trained(path: str | Path, device: torch.device | str = "cpu", task: Optional[str] = None) -> Loaded:
    """RUN_OR_CKPT -> the model in eval mode. ``task`` ("lm" or "classify"), when given, is
    what the caller can use: another kind of checkpoint is refused with a one-line error."""
    from distlm.checkpoint import store as ckpt
    folder = ckpt.resolve_checkpoint(path)
    cfg = config_from_dict(ckpt.read_meta(folder)["config"])
    if task is not None and cfg.task.name != task:
        use = "distlm eval / distlm predict" if cfg.task.name == "classify" else "distlm eval / generate / export"
        raise ckpt.CheckpointError(f"{folder}: a {cfg.task.name} checkpoint, not a "
                                   f"{'language model' if task == 'lm' else 'classifier'} (use {use})")
    labels = label_info(folder, cfg) if cfg.task.name == "classify" else {}
    with torch.device("meta"):
        model = _module(cfg, labels)
    model.to_empty(device=device)
    model.init_buffers(torch.device(device))
    ckpt.load_checkpoint(folder, model)
    return Loaded(model.eval(), cfg, folder, labels)


def _module(cfg: Config, labels: dict) -> nn.Module:
    if cfg.task.name == "classify":
        from distlm.model.classifier import Classifier
        return Classifier(cfg.model, len(labels["labels"]), cfg.task.pooling, cfg.task.attention)
    from distlm.model.gpt import GPT
    return GPT(cfg.model)


def label_info(folder: Path, cfg: Config) -> dict:
    from distlm.config import ConfigError
    for candidate in (Path(folder).parent.parent / "labels.json", Path(cfg.data.dir or "") / "labels.json"):
        info = read_json(candidate)
        if info and "labels" in info:
            return info
    raise ConfigError(f"{folder}: no labels.json in its run folder or in data.dir={cfg.data.dir}")


def load_run_tokenizer(folder: Path, cfg: Config):
    """The tokenizer saved in the run folder; else the one beside the training data."""
    from distlm.data.tokenizer import load_tokenizer
    run_dir = Path(folder).parent.parent
    meta_file = run_dir / "tokenizer" / "tokenizer.meta.json"
    if meta_file.is_file():
        name = json.loads(meta_file.read_text())["name"]
        return load_tokenizer(name, run_dir / "tokenizer")
    if cfg.data.dir:
        from distlm.data import load_manifest
        return load_tokenizer(load_manifest(Path(cfg.data.dir))["tokenizer"]["name"], Path(cfg.data.dir))
    return load_tokenizer("gpt2")


def run_tokenizer_record(folder: Path) -> Optional[dict]:
    """The tokenizer record (name, vocab_size, fingerprint) saved with a run, if any."""
    return read_json(Path(folder).parent.parent / "tokenizer" / "tokenizer.meta.json")
