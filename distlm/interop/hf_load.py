"""Start a distlm model from a local Hugging Face GPT-2 or Llama folder (no hub access).

Two steps, because the architecture must be known before the model is built (possibly
on the meta device and sharded) and the weights can only be copied after:

    model_cfg = apply_hf_model_config(cfg.model, path)   # before GPT(model_cfg)
    load_hf_into(model, path)                # after init_weights()

Weights are read lazily (safetensors) or with ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import dataclasses

import json
import math
from pathlib import Path

import torch

from distlm.config import ModelConfig
from distlm.interop.hf import InteropError, inexpressible, weight_pairs

# transformers 4.x omits fields equal to the class default from config.json.
_DEFAULTS = {
    "gpt2": {"n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
             "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "vocab_size": 50257,
             "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False,
             "tie_word_embeddings": True},
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "hidden_act": "silu",
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False},
}
# Buffers some checkpoints carry that distlm derives from the config instead.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def _read_config(path: Path) -> tuple[str, dict]:
    f = Path(path) / "config.json"
    try:
        raw = json.loads(f.read_text())
    except FileNotFoundError:
        raise InteropError(f"{f}: missing; init.from_hf needs a local Hugging Face model folder") from None
    except (OSError, ValueError) as e:
        raise InteropError(f"{f}: cannot read ({e})") from None
    kind = raw.get("model_type")
    if kind not in _DEFAULTS:
        raise InteropError(f"{f}: model_type={kind!r} is not supported (gpt2 or llama)")
    return kind, {**_DEFAULTS[kind], **{k: v for k, v in raw.items() if v is not None or k not in _DEFAULTS[kind]}}


def model_config_from_hf(path) -> dict:
    """The ModelConfig fields that describe the HF model at ``path``. InteropError naming the
    HF field when the model is something distlm cannot reproduce exactly."""
    kind, c = _read_config(path)
    where = Path(path) / "config.json"

    def refuse(field, why):
        raise InteropError(f"{where}: {field}={c.get(field)!r} is not supported: {why}")

    if kind == "gpt2":
        if c["activation_function"] not in ("gelu_new", "gelu_pytorch_tanh"):
            refuse("activation_function", "distlm's MLP uses tanh-approximated gelu (gelu_new)")
        for field, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                            ("add_cross_attention", False)):
            if bool(c[field]) != want:
                refuse(field, f"distlm attention needs {want}")
        out = {"n_layer": c["n_layer"], "n_head": c["n_head"], "d_model": c["n_embd"],
               "d_ff": c["n_inner"] or 4 * c["n_embd"], "block_size": c["n_positions"], "position": "learned",
               "norm": "layernorm", "mlp": "gelu", "bias": True, "norm_eps": float(c["layer_norm_epsilon"])}
    else:
        heads = c["num_attention_heads"]
        if c["num_key_value_heads"] not in (None, heads):
            refuse("num_key_value_heads", f"grouped-query attention (heads={heads}) is not implemented in distlm")
        if c["head_dim"] not in (None, c["hidden_size"] // heads):
            refuse("head_dim", "distlm needs head_dim = hidden_size / num_attention_heads")
        if c["hidden_act"] != "silu":
            refuse("hidden_act", "distlm's swiglu uses silu")
        if bool(c["attention_bias"]) != bool(c["mlp_bias"]):
            refuse("mlp_bias", f"distlm has one bias flag and attention_bias={c['attention_bias']}")
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            refuse("rope_parameters" if "rope_parameters" in c else "rope_scaling", "only plain rope is implemented")
        out = {"n_layer": c["num_hidden_layers"], "n_head": heads, "d_model": c["hidden_size"],
               "d_ff": c["intermediate_size"], "block_size": c["max_position_embeddings"], "position": "rope",
               "norm": "rmsnorm", "mlp": "swiglu", "bias": bool(c["attention_bias"]),
               "norm_eps": float(c["rms_norm_eps"]), "rope_theta": float(rope.get("rope_theta", c["rope_theta"]))}
    out.update(vocab_size=c["vocab_size"], tie_embeddings=bool(c["tie_word_embeddings"]))
    if out["d_model"] % out["n_head"]:
        refuse("n_embd" if kind == "gpt2" else "hidden_size", "not divisible by the head count")
    return out


def apply_hf_model_config(model_cfg: ModelConfig, path, block_size: int | None = None) -> ModelConfig:
    """``model_cfg`` with its architecture fields taken from the HF folder (a new, frozen config).

    block_size: keep a shorter context than the HF model's (its learned position table is
    cut to fit); None takes the HF value. Fields not about architecture (dropout,
    vocab_pad_multiple, init_std) are left as they are.
    """
    fields = model_config_from_hf(path)
    _refuse_modern_options(model_cfg, path)
    if block_size is not None:
        if block_size > fields["block_size"] and fields["position"] == "learned":
            raise InteropError(f"model.block_size={block_size} exceeds the {fields['block_size']} positions "
                               f"learned by {path}")
        fields["block_size"] = block_size
    return dataclasses.replace(model_cfg, **fields)


def _refuse_modern_options(model_cfg: ModelConfig, path) -> None:
    """An HF GPT-2/Llama is a model with the modern-block options off. Starting from it
    with QK-norm, a soft-cap, value embeddings or skips on would be another function of
    the same weights (or need weights HF lacks), so those are refused, not silently
    dropped. Attention masks are allowed: the weights map exactly and a document mask or
    window is a choice of what to attend to when training on, not of the parameters."""
    options = inexpressible(model_cfg, allow=("attn_mask", "attn_window"))
    if options:
        raise InteropError(f"init.from_hf={path}: {', '.join(options)} is not part of a Hugging Face GPT-2/Llama "
                           f"model; turn it off to start from one")


class _Weights:
    """HF tensors by name, read on demand from one or many (sharded) files."""

    def __init__(self, path: Path, kind: str):
        self._open: dict[Path, object] = {}
        raw: dict[str, Path] = {}
        for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            if (path / index).is_file():
                raw = {k: path / f for k, f in json.loads((path / index).read_text())["weight_map"].items()}
                break
        else:
            for fname in ("model.safetensors", "pytorch_model.bin"):
                if (path / fname).is_file():
                    raw = {k: path / fname for k in self._handle(path / fname).keys()}
                    break
            else:
                raise InteropError(f"{path}: no model.safetensors or pytorch_model.bin")
        # GPT2Model checkpoints (the original hub files among them) lack the "transformer." prefix.
        bare = kind == "gpt2"
        self.where = {("transformer." + k if bare and not k.startswith(("transformer.", "lm_head.")) else k): (f, k)
                      for k, f in raw.items()}

    def _handle(self, f: Path):
        if f not in self._open:
            if f.suffix == ".safetensors":
                from safetensors import safe_open
                self._open[f] = safe_open(str(f), framework="pt")
            else:
                self._open[f] = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        return self._open[f]

    def get(self, key: str) -> torch.Tensor:
        f, raw = self.where[key]
        h = self._handle(f)
        return h.get_tensor(raw) if hasattr(h, "get_tensor") else h[raw]


@torch.no_grad()
def load_hf_into(model, path) -> int:
    """Copy the HF weights at ``path`` into the distlm GPT ``model`` in place; returns the
    number of parameters written. The model must have been built from a config set by
    ``apply_hf_model_config`` (checked). Padding rows of the vocabulary become zeros;
    distlm cuts logits to vocab_size before use, so they never reach a real token.

    Parameters may be DTensors (FSDP2/TP): each rank copies only its own shard. Pipeline
    stages that dropped some blocks load the blocks they kept.
    """
    from distlm.model.gpt import _copy_shard
    cfg = model.cfg
    want = model_config_from_hf(path)
    _refuse_modern_options(cfg, path)
    kind = "gpt2" if want["position"] == "learned" else "llama"
    wrong = [f"model.{k}={getattr(cfg, k)} (HF {want[k]})" for k, v in want.items()
             if k != "block_size" and (not math.isclose(getattr(cfg, k), v) if isinstance(v, float)
                                       else getattr(cfg, k) != v)]
    if cfg.block_size > want["block_size"] and kind == "gpt2":
        wrong.append(f"model.block_size={cfg.block_size} (HF {want['block_size']})")
    if wrong:
        raise InteropError(f"the model does not match {path}: {', '.join(wrong)}; call apply_hf_model_config first")
    weights = _Weights(Path(path), kind)
    full: dict[str, torch.Tensor] = {}
    used = set()
    for hf, ours, conv, vocab in weight_pairs(kind, cfg):
        if hf not in weights.where:
            raise InteropError(f"{path}: has no tensor '{hf}'")
        t = weights.get(hf)
        used.add(hf)
        if conv:
            t = t.t()
        if vocab:
            if t.shape[0] != cfg.vocab_size:
                raise InteropError(f"{path}: '{hf}' has {t.shape[0]} rows but vocab_size is {cfg.vocab_size}")
            t = torch.cat([t, t.new_zeros(cfg.padded_vocab_size - t.shape[0], *t.shape[1:])])
        for name, piece in zip(ours, t.chunk(len(ours), 0)):
            full[name] = piece
    extra = [k for k in weights.where if k not in used and not k.endswith(_IGNORED_SUFFIXES)
             and not (k == "lm_head.weight" and cfg.tie_embeddings)]
    if extra:
        raise InteropError(f"{path}: tensors distlm has no place for: {', '.join(sorted(extra)[:5])}")
    n = 0
    for name, p in model.named_parameters():
        leaf = name.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", "")
        if leaf not in full:
            raise InteropError(f"{path}: nothing maps to distlm parameter '{leaf}'")
        src = full[leaf]
        if leaf == "pos_emb.weight":
            src = src[:p.shape[0]]
        if tuple(src.shape) != tuple(p.shape):
            raise InteropError(f"{path}: '{leaf}' is {list(src.shape)} in HF but {list(p.shape)} in the model")
        _copy_shard(p, src.to(p.dtype))
        n += 1
    return n
