"""Checkpoints made and crafted for the tests: a tiny model and its saved folder, a marker's
checksums rewritten as an attacker would, pickles that would call or change a global, and a run
folder as the Trainer leaves it."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from distlm.checkpoint import save_checkpoint
from distlm.checkpoint import store as ckpt
from distlm.config import load_config
from distlm.model.gpt import GPT

TINY = ["model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.d_ff=64", "model.block_size=16",
        "model.vocab_size=64", "data.source=synthetic", "train.device=cpu"]


def tiny_model(seed: int = 0, steps: int = 1):
    """The tiny GPT and an AdamW that has taken ``steps`` steps (so it has state)."""
    cfg = load_config(None, TINY)
    torch.manual_seed(seed)
    model = GPT(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        x = torch.randint(0, 64, (2, 16))
        model(x, targets=x).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def fresh_model():
    model, opt = tiny_model(seed=1, steps=0)
    return model, opt


def marker_meta(step: int) -> dict:
    return {"trainer": {"step": step}, "config": load_config(None, TINY).to_dict(), "world_size": 1}


def save(root: Path, step: int, model=None, opt=None) -> Path:
    if model is None:
        model, opt = tiny_model()
    return ckpt.save_checkpoint(root, step, model, opt, marker_meta(step))


def rehash(folder: Path) -> None:
    """Rewrite the marker's checksums to match the folder as it is now (what an attacker,
    who controls the whole folder, would do)."""
    meta = json.loads((folder / ckpt.MARKER).read_text())
    files = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and rel != ckpt.MARKER:
            files[rel] = {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
    meta["files"] = files
    (folder / ckpt.MARKER).write_text(ckpt.marker_text(meta))


def _s(text: str) -> bytes:  # pickle SHORT_BINUNICODE
    b = text.encode()
    assert len(b) < 256
    return b"\x8c" + bytes([len(b)]) + b


def call_global(module: str, name: str, *args: str) -> bytes:
    """A protocol-4 pickle of ``module.name(*args)``, the name looked up as STACK_GLOBAL does."""
    return b"\x80\x04" + _s(module) + _s(name) + b"\x93(" + b"".join(_s(a) for a in args) + b"tR."


def build_on_global(module: str, name: str, attr: str, value: str, slots: bool) -> bytes:
    """A pickle that BUILDs onto the global itself: sets ``attr`` on the class or function."""
    state = b"}" + _s(attr) + _s(value) + b"s"
    if slots:
        state = b"N" + state + b"\x86"  # (None, {attr: value}): setattr, even on a class
    return b"\x80\x04" + _s(module) + _s(name) + b"\x93" + state + b"b."


class _Reduce:
    """pickle.dumps(_Reduce(f, args)) is the classic payload: unpickling calls f(*args)."""

    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


@torch.no_grad()
def randomize(model, seed=0):
    # Init leaves biases at 0 and norm weights at 1: a swapped or dropped bias would pass.
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        p.copy_(1 + 0.1 * noise if "norm" in name and name.endswith("weight") else 0.05 * noise)
    return model


def make_run(root, tok=None, vocab_size=None, **model_kw):
    """A run folder as the Trainer leaves it: RUN/checkpoints/step_*/ and RUN/tokenizer/."""
    from distlm.config import Config, ModelConfig
    cfg = Config(model=ModelConfig(n_layer=2, n_head=4, d_model=32, d_ff=64, block_size=32,
                                   vocab_size=vocab_size or tok.vocab_size, **model_kw))
    model = randomize(GPT(cfg.model))
    if tok is not None:
        (root / "tokenizer").mkdir(parents=True)
        tok.save(root / "tokenizer")
        (root / "tokenizer" / "tokenizer.meta.json").write_text(json.dumps({"name": tok.name}))
    opt = torch.optim.AdamW(model.parameters())
    save_checkpoint(root / "checkpoints", 1, model, opt, {"trainer": {}, "config": cfg.to_dict()})
    return model.eval(), cfg
