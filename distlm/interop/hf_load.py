"""Start a distlm model from a local Hugging Face GPT-2 or Llama folder (no hub access).

Two steps, because the architecture must be known before the model is built (possibly
on the meta device and sharded) and the weights can only be copied after:

    model_cfg = apply_hf_model_config(cfg.model, path)   # before GPT(model_cfg)
    load_hf_into(model, path)                # after init_weights()

Weights are read lazily (safetensors) or with ``torch.load(weights_only=True)``.

An HF folder may come from anyone, so before a byte of weights is read: every file an index
names must be a plain name inside the folder and resolve to a regular file (links are
followed, as in the HF cache's snapshot folders, but never to a device or a FIFO: reading an
index that names /dev/zero would never end); a safetensors header is checked in full
(its length, each tensor's dtype, shape and byte range, no overlaps) before safetensors maps
the file; a ``pytorch_model.bin`` is read with weights_only=True and never runs code. Every
refusal is one InteropError line naming the file and the tensor.
"""
from __future__ import annotations

import dataclasses

import json
import math
import os
import stat
import struct
from pathlib import Path, PurePosixPath

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


CONFIG_MAX_BYTES = 16 << 20  # an HF config.json is a few KB


def _read_config(path: Path) -> tuple[str, dict]:
    from distlm.data import read_regular_text
    f = Path(path) / "config.json"
    try:
        raw = json.loads(read_regular_text(f, CONFIG_MAX_BYTES, "the model config", InteropError))
    except FileNotFoundError:
        from distlm.folders import not_hf
        raise InteropError(f"{f}: missing; init.from_hf needs a local Hugging Face model folder{not_hf(path)}") from None
    except InteropError:
        raise
    except ValueError as e:
        raise InteropError(f"{f}: not JSON ({str(e)[:120]})") from None
    if not isinstance(raw, dict):
        raise InteropError(f"{f}: holds a JSON {type(raw).__name__}, not an object")
    kind = raw.get("model_type")
    if kind not in _DEFAULTS:
        raise InteropError(f"{f}: model_type={str(kind)[:40]!r} is not supported (gpt2 or llama)")
    c = {**_DEFAULTS[kind], **{k: v for k, v in raw.items() if v is not None or k not in _DEFAULTS[kind]}}
    _check_types(f, kind, c)
    return kind, c


def _check_types(f: Path, kind: str, c: dict) -> None:
    """Each field distlm reads has the JSON type of its default (a count a positive integer of
    sane size, a rate a finite number): a wrong one is a line naming the field, not a traceback
    from the model's constructor."""
    def bad(field, want):
        raise InteropError(f"{f}: {field}={json.dumps(c[field])[:40]} is not {want}")
    for field, default in _DEFAULTS[kind].items():
        v = c.get(field)
        if v is None and default is None:
            continue
        if isinstance(default, bool):
            if not isinstance(v, bool):
                bad(field, "true or false")
        elif isinstance(default, int) or field in ("num_key_value_heads", "head_dim", "n_inner"):
            if isinstance(v, bool) or not isinstance(v, int) or not 0 < v < 1 << 31:
                bad(field, "a positive integer")
        elif isinstance(default, float):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(field, "a finite number")
        elif isinstance(default, str) and not isinstance(v, str):
            bad(field, "a string")
    for field in ("rope_parameters", "rope_scaling"):
        if c.get(field) is not None and not isinstance(c[field], dict):
            bad(field, "an object")


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


def from_hf_settings(model_cfg: ModelConfig, path, given: set[str], resume: bool = False) -> str:
    """init.from_hf's line: what it loads from ``path`` and which model settings it takes from
    the folder. A model.* setting the user gave (``given``: field names, from the command line
    and the --config file) that the folder contradicts is refused: the architecture is the
    folder's, and overriding a value quietly would train another model than the one asked for.
    model.block_size may be shorter than the folder's (its first positions are kept)."""
    kind, _ = _read_config(path)
    fields = model_config_from_hf(path)

    def show(v):
        return str(v).lower() if isinstance(v, bool) else str(v)

    conflicts = [f"model.{k}={show(getattr(model_cfg, k))} (the folder's is {show(v)})" for k, v in fields.items()
                 if k != "block_size" and k in given and not (
                     math.isclose(getattr(model_cfg, k), v) if isinstance(v, float) else getattr(model_cfg, k) == v)]
    if conflicts:
        raise InteropError(f"init.from_hf={path}: {', '.join(conflicts)}; the architecture comes from the folder: "
                           f"drop the setting, or start from scratch without init.from_hf")
    taken = ", ".join(f"model.{k}={show(v)}" for k, v in fields.items() if k != "block_size")
    ctx, theirs = model_cfg.block_size, fields["block_size"]
    context = (f"model.block_size={ctx}, its first {ctx} of {theirs} positions (model.block_size={theirs} for all)"
               if ctx < theirs else f"model.block_size={ctx}")
    weights = "a resume keeps its checkpoint's weights" if resume else "its weights start the run"
    return (f"init.from_hf={path}: a Hugging Face {kind} model; {weights}; from its config.json: {taken}; "
            f"{context}")


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


_ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_ST_HEADER_LIMIT = 100 << 20  # what safetensors itself accepts


def _regular(f: Path, what: str) -> int:
    """The size of ``f``, a regular file (a link is followed, as the HF cache needs)."""
    try:
        st = os.stat(f)
    except OSError as e:
        raise InteropError(f"{f}: {what} cannot be read ({e.strerror or e.__class__.__name__})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "a device, FIFO or socket"
        raise InteropError(f"{f}: {what} is {kind}, not a regular file; refused")
    return st.st_size


def _shard(folder: Path, index: Path, name) -> Path:
    """A file an index names: a relative name that stays in the folder."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise InteropError(f"{index}: names the shard {name!r}, not a file name")
    parts = PurePosixPath(name).parts
    if PurePosixPath(name).is_absolute() or ".." in parts:
        raise InteropError(f"{index}: names the shard {name!r}, which is not inside {folder}; refused")
    return folder / name


def check_safetensors(f: Path) -> None:
    """The header of a safetensors file, checked whole before safetensors maps it: a sane
    length, and each tensor a known dtype whose shape fills exactly its byte range, the
    ranges inside the file and not overlapping."""
    size = _regular(f, "the weights file")
    with open(f, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise InteropError(f"{f}: not a safetensors file ({size} bytes)")
        n = struct.unpack("<Q", head)[0]
        if n > min(size - 8, _ST_HEADER_LIMIT):
            raise InteropError(f"{f}: its safetensors header claims {n} bytes, but the file has {size}; refused")
        raw = fh.read(n)
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise InteropError(f"{f}: its safetensors header is not JSON ({e.__class__.__name__})") from None
    if not isinstance(header, dict):
        raise InteropError(f"{f}: its safetensors header is not an object")
    data, spans = size - 8 - n, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"{f}: tensor {str(name)[:80]!r}"
        if not isinstance(entry, dict) or entry.get("dtype") not in _ST_ITEMSIZE:
            dtype = entry.get("dtype") if isinstance(entry, dict) else None
            raise InteropError(f"{where} has dtype {str(dtype)[:20]!r}, which distlm cannot read")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if (not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 1 << 48 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2
                or not all(type(o) is int and 0 <= o for o in offsets) or offsets[0] > offsets[1]):
            raise InteropError(f"{where} has no valid shape and data_offsets")
        if offsets[1] > data:
            raise InteropError(f"{where} ends at byte {offsets[1]} of a {data}-byte data section; refused")
        want = math.prod(shape) * _ST_ITEMSIZE[entry["dtype"]]
        if offsets[1] - offsets[0] != want:
            raise InteropError(f"{where}: {entry['dtype']} of shape {shape} needs {want} bytes, but its range holds "
                               f"{offsets[1] - offsets[0]} (a lying shape or dtype); refused")
        spans.append((offsets[0], offsets[1], str(name)))
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise InteropError(f"{f}: tensors {n0[:60]!r} and {n1[:60]!r} overlap (bytes {b1}..{e0}); refused")


def _read_bin(f: Path) -> dict:
    """A pytorch_model.bin through torch.load(weights_only=True): a pickle that names any
    global beyond tensors is refused, nothing is called. Zip files are mapped, not read."""
    from distlm.checkpoint.safe_dcp import pinned_weights_only, weights_only_reason
    _regular(f, "the weights file")
    try:
        import zipfile
        with pinned_weights_only():  # what it may construct: distlm's list, whatever is imported
            sd = torch.load(f, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(f))
    except Exception as e:  # UnpicklingError for a refused global; anything for a damaged file
        raise InteropError(f"{f}: refused to load ({weights_only_reason(e)}); "
                           f"a model.safetensors is the safe format") from None
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise InteropError(f"{f}: holds a {type(sd).__name__}, not a dict of named tensors")
    return sd


class _Weights:
    """HF tensors by name, read on demand from one or many (sharded) files."""

    def __init__(self, path: Path, kind: str):
        self._open: dict[Path, object] = {}
        raw: dict[str, Path] = {}
        for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            if (path / index).is_file():
                raw = self._read_index(path, path / index)
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

    @staticmethod
    def _read_index(path: Path, index: Path) -> dict[str, Path]:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InteropError(f"{index}: not a weight index ({e.__class__.__name__}: {str(e)[:80]})") from None
        if not isinstance(weight_map, dict):
            raise InteropError(f"{index}: 'weight_map' is not an object")
        return {str(k): _shard(path, index, f) for k, f in weight_map.items()}

    def _handle(self, f: Path):
        if f not in self._open:
            if f.suffix == ".safetensors":
                from safetensors import safe_open
                check_safetensors(f)
                try:
                    self._open[f] = safe_open(str(f), framework="pt")
                except Exception as e:  # SafetensorError: what the header check above did not foresee
                    raise InteropError(f"{f}: not a readable safetensors file ({str(e)[:120]})") from None
            else:
                self._open[f] = _read_bin(f)
        return self._open[f]

    def get(self, key: str) -> torch.Tensor:
        f, raw = self.where[key]
        h = self._handle(f)
        if raw not in h.keys():
            raise InteropError(f"{f}: has no tensor '{raw}', which its index places there")
        try:
            return h.get_tensor(raw) if hasattr(h, "get_tensor") else h[raw]
        except Exception as e:
            raise InteropError(f"{f}: tensor '{raw}' cannot be read ({str(e)[:120]})") from None


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
        if not t.is_floating_point():
            raise InteropError(f"{path}: '{hf}' is {t.dtype}, not a floating-point weight")
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
