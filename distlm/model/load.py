"""A trained model from a checkpoint, in one process, for eval, generate, predict and export.

One loader for both tasks: the checkpoint's saved config says which module to build (a GPT,
or a classifier with its label count from the run's labels.json), it is built on the meta
device, allocated on the target device and filled from the (any-layout) DCP checkpoint.
"""
from __future__ import annotations

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


def load_trained(path: str | Path, device: torch.device | str = "cpu", task: Optional[str] = None,
                 samples: int = 0, new_tokens: int = 0) -> Loaded:
    """RUN_OR_CKPT -> the model in eval mode. ``task`` ("lm" or "classify"), when given, is
    what the caller can use: another kind of checkpoint is refused with a one-line error.
    ``samples`` and ``new_tokens``: what the caller will then sample at once, counted in the
    memory check made before anything is allocated."""
    from distlm.checkpoint import store as ckpt
    folder = ckpt.resolve_checkpoint(path)
    cfg = saved_config(folder, ckpt.read_meta(folder))
    if task is not None and cfg.task.name != task:
        use = "distlm eval / distlm predict" if cfg.task.name == "classify" else "distlm eval / generate / export"
        raise ckpt.CheckpointError(f"{folder}: a {cfg.task.name} checkpoint, not a "
                                   f"{'language model' if task == 'lm' else 'classifier'} (use {use})")
    labels = label_info(folder, cfg) if cfg.task.name == "classify" else {}
    check_model_fits(cfg, device, folder, samples, cfg.model.block_size + new_tokens if samples else 0)
    with torch.device("meta"):
        model = _module(cfg, labels)
    model.to_empty(device=device)
    model.init_buffers(torch.device(device))
    ckpt.load_checkpoint(folder, model)
    return Loaded(model.eval(), cfg, folder, labels)


def saved_config(folder: Path, meta: dict) -> Config:
    """The checkpoint's config, validated as a command line's is before anything is built
    from it: the marker is a JSON file anyone can edit, and its config decides the shapes
    allocated (a ConfigError names the marker, the field and the value)."""
    from distlm.checkpoint.files import MARKER
    return config_from_dict(meta.get("config"), origin=str(Path(folder) / MARKER))


def check_model_fits(cfg: Config, device: torch.device | str, folder: Path, batch: int = 0,
                     kept_tokens: int = 0) -> None:
    """Refuse, before allocating, a model (and, with ``batch``, the KV cache and logits of
    that many samples) that needs more than ``device`` has free: the weights and position
    tables are what loading allocates, not an estimate, so there is no override."""
    from distlm import host
    from distlm.model.memory import check_fits, inference_bytes
    device = torch.device(device)
    if device.type == "cuda":
        have = torch.cuda.mem_get_info(device)[0]
        where = f"{device}"
    else:
        have, where = host.host_available_bytes(), "this machine's RAM"
    m = cfg.model
    what = f"{folder}: model.n_layer={m.n_layer} x model.d_model={m.d_model}, model.block_size={m.block_size}"
    if batch:
        what += f", {batch} samples at once"
    check_fits(inference_bytes(m, batch, kept_tokens), have, what, where,
               "load it on a machine with more memory" + (", or ask for fewer samples" if batch else ""))


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
    from distlm.data.tokenizer import load_recorded_tokenizer, load_tokenizer, read_tokenizer_record
    run_dir = Path(folder).parent.parent
    meta_file = run_dir / "tokenizer" / "tokenizer.meta.json"
    if meta_file.exists() or meta_file.is_symlink():
        # Checked against its own record on every load: a swapped id in tokenizer.json would
        # otherwise decode every sample wrong without a word.
        return load_recorded_tokenizer(read_tokenizer_record(meta_file), run_dir / "tokenizer", meta_file)
    if cfg.data.dir:
        from distlm.data import load_manifest
        data_dir = Path(cfg.data.dir)
        record = load_manifest(data_dir).get("tokenizer")
        return load_recorded_tokenizer(record, data_dir, data_dir / "manifest.json")
    return load_tokenizer("gpt2")


def run_tokenizer_record(folder: Path) -> Optional[dict]:
    """The tokenizer record (name, vocab_size, fingerprint) saved with a run, if any."""
    from distlm.data.tokenizer import read_tokenizer_record
    meta_file = Path(folder).parent.parent / "tokenizer" / "tokenizer.meta.json"
    return read_tokenizer_record(meta_file) if meta_file.exists() or meta_file.is_symlink() else None
