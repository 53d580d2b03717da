"""Load a trained model and its tokenizer from a checkpoint, for eval and generation."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from distlm.config import config_from_dict
from distlm.model.gpt import GPT
from distlm.train import checkpoint as ckpt


def load_model(path: str | Path, device: torch.device | str = "cpu") -> tuple[GPT, object, Path]:
    """RUN_OR_CKPT -> (model in eval mode, config, the checkpoint folder used)."""
    folder = ckpt.resolve_checkpoint(path)
    meta = ckpt.read_meta(folder)
    cfg = config_from_dict(meta["config"])
    if cfg.task.name != "lm":
        raise ckpt.CheckpointError(f"{folder}: a {cfg.task.name} checkpoint, not a language model "
                                   f"(use distlm eval / distlm predict)")
    with torch.device("meta"):
        model = GPT(cfg.model)
    model.to_empty(device=device)
    model.init_buffers(torch.device(device))
    ckpt.load_checkpoint(folder, model)
    return model.eval(), cfg, folder


def load_run_tokenizer(folder: Path, cfg):
    """The tokenizer saved in the run folder; else the one beside the training data."""
    from distlm.data.tokenizer import load_tokenizer
    run_dir = Path(folder).parent.parent
    meta_file = run_dir / "tokenizer" / "tokenizer.meta.json"
    if meta_file.is_file():
        name = json.loads(meta_file.read_text())["name"]
        return load_tokenizer(name, run_dir / "tokenizer")
    if cfg.data.dir:
        from distlm.data.prepare import load_manifest
        return load_tokenizer(load_manifest(Path(cfg.data.dir))["tokenizer"]["name"], Path(cfg.data.dir))
    return load_tokenizer("gpt2")
