"""Export distlm checkpoints as Hugging Face ``transformers`` folders.

Only exact mappings are written: learned or sinusoidal positions + layernorm + gelu
become ``GPT2LMHeadModel``, rope + rmsnorm + swiglu become ``LlamaForCausalLM``.
Any other combination raises ExportError rather than producing a model whose logits
differ from the checkpoint's, and so do the modern-block options neither class can
express (``inexpressible``). ``model.zero_init_proj`` is only an initialisation and
exports like any other model. The folder is built without importing ``transformers``
(config.json is written by hand), so a training box can export without it.

The tensor-name table (``weight_pairs``) is shared with the import side
(``distlm.interop.hf_load``) so both directions cannot drift apart.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Annotated, Literal

import torch

from distlm.config import ConfigError, ModelConfig
from distlm.io import atomic_write_dir

EOT = "<|endoftext|>"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class InteropError(ConfigError):
    """A model or folder that cannot be mapped exactly; one line naming the field at fault."""


class ExportError(InteropError):
    pass


# Options GPT2LMHeadModel and LlamaForCausalLM have no field for, with what each changes.
# (model.mlp=relu2 is refused by hf_architecture: neither class's MLP has that activation.)
_INEXPRESSIBLE = (
    ("qk_norm", False, "no norm on queries and keys"),
    ("logit_softcap", 0.0, "no logit soft-cap"),
    ("value_embeds", 0, "no value embeddings"),
    ("skip_connections", False, "no U-net skips"),
    ("attn_mask", "causal", "attention crosses end-of-text tokens"),
    ("attn_window", 0, "no sliding window"),
)


def inexpressible(cfg: ModelConfig, allow: tuple[str, ...] = ()) -> list[str]:
    """'model.FIELD=VALUE (what HF lacks)' for each option set that the HF classes cannot
    express, except those in ``allow``."""
    return [f"model.{k}={getattr(cfg, k)} ({why})" for k, off, why in _INEXPRESSIBLE
            if k not in allow and getattr(cfg, k) != off]


def hf_architecture(cfg: ModelConfig) -> str:
    """'gpt2' or 'llama'; ExportError naming the fields that rule out both."""
    options = inexpressible(cfg)
    if options:
        raise ExportError(f"{', '.join(options)}: Hugging Face GPT-2 and Llama cannot express "
                          f"{'this option' if len(options) == 1 else 'these options'}; the exported model "
                          f"would compute other logits")
    if cfg.position in ("learned", "sinusoidal"):
        wrong = [f"model.{k}={getattr(cfg, k)}" for k, want in (("norm", "layernorm"), ("mlp", "gelu"))
                 if getattr(cfg, k) != want]
        if not wrong:
            return "gpt2"
        need = "GPT-2 needs norm=layernorm, mlp=gelu"
    else:
        wrong = [f"model.{k}={getattr(cfg, k)}" for k, want in (("norm", "rmsnorm"), ("mlp", "swiglu"))
                 if getattr(cfg, k) != want]
        if not wrong:
            return "llama"
        need = "Llama needs norm=rmsnorm, mlp=swiglu"
    raise ExportError(f"{', '.join(wrong)} with model.position={cfg.position} has no exact Hugging Face "
                      f"equivalent ({need}; rope+rmsnorm+swiglu exports as Llama)")


def weight_pairs(arch: str, cfg: ModelConfig) -> list[tuple[str, tuple[str, ...], bool, bool]]:
    """(HF name, distlm names concatenated along dim 0 to make it, conv1d, vocab rows).

    conv1d: GPT-2's Conv1D keeps weights as (in, out), the transpose of nn.Linear.
    vocab: the rows are the vocabulary, padded in distlm and not in HF.
    """
    pairs = []

    def add(hf, ours, conv=False, vocab=False, bias=True):
        pairs.append((hf + ".weight", tuple(o + ".weight" for o in ours), conv, vocab))
        if bias:
            pairs.append((hf + ".bias", tuple(o + ".bias" for o in ours), False, False))

    if arch == "gpt2":
        add("transformer.wte", ["tok_emb"], vocab=True, bias=False)
        add("transformer.wpe", ["pos_emb"], bias=False)
        for i in range(cfg.n_layer):
            h, b = f"transformer.h.{i}.", f"blocks.{i}."
            add(h + "ln_1", [b + "attn_norm"])
            add(h + "attn.c_attn", [b + "attn.wq", b + "attn.wk", b + "attn.wv"], conv=True)
            add(h + "attn.c_proj", [b + "attn.wo"], conv=True)
            add(h + "ln_2", [b + "mlp_norm"])
            add(h + "mlp.c_fc", [b + "mlp.w_in"], conv=True)
            add(h + "mlp.c_proj", [b + "mlp.w_out"], conv=True)
        add("transformer.ln_f", ["norm"])
    else:
        add("model.embed_tokens", ["tok_emb"], vocab=True, bias=False)
        for i in range(cfg.n_layer):
            h, b = f"model.layers.{i}.", f"blocks.{i}."
            add(h + "input_layernorm", [b + "attn_norm"], bias=False)
            for hf, ours in (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv"), ("o_proj", "wo")):
                add(h + "self_attn." + hf, [b + "attn." + ours], bias=cfg.bias)
            add(h + "post_attention_layernorm", [b + "mlp_norm"], bias=False)
            for hf, ours in (("gate_proj", "w_gate"), ("up_proj", "w_in"), ("down_proj", "w_out")):
                add(h + "mlp." + hf, [b + "mlp." + ours], bias=cfg.bias)
        add("model.norm", ["norm"], bias=False)
    if not cfg.tie_embeddings:
        add("lm_head", ["head"], vocab=True, bias=False)
    return pairs


def hf_config(arch: str, cfg: ModelConfig, eos_id: int, dtype: str = "fp32") -> dict:
    # Every field is written out, never left to a class default, so the folder reads
    # the same in transformers 4.x and 5.x.
    common = {"vocab_size": cfg.vocab_size, "initializer_range": cfg.init_std, "use_cache": True,
              "bos_token_id": eos_id, "eos_token_id": eos_id, "tie_word_embeddings": cfg.tie_embeddings,
              "torch_dtype": _DTYPE_NAMES[dtype]}
    if arch == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_positions": cfg.block_size,
                "n_embd": cfg.d_model, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": cfg.d_ff,
                "activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                "summary_first_dropout": 0.0, "layer_norm_epsilon": cfg.norm_eps, "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False, **common}
    # rope_theta at the top level is what 4.x reads; 5.x moved it into rope_parameters.
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.d_model,
            "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
            "num_key_value_heads": cfg.n_head, "head_dim": cfg.head_dim, "hidden_act": "silu",
            "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "attention_bias": cfg.bias, "mlp_bias": cfg.bias, "attention_dropout": 0.0, "pretraining_tp": 1,
            **common}


def hf_state_dict(model, arch: str, dtype: str = "fp32") -> dict[str, torch.Tensor]:
    """The distlm model's weights under HF names, vocabulary padding cut off."""
    from distlm.model.gpt import sinusoid_scale, sinusoid_table
    cfg = model.cfg
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    if cfg.position == "sinusoidal":  # GPT-2's learned table holding the fixed sinusoid is exact
        sd["pos_emb.weight"] = sinusoid_table(cfg.block_size, cfg.d_model) * sinusoid_scale(cfg)
    out = {}
    for hf, ours, conv, vocab in weight_pairs(arch, cfg):
        parts = []
        for name in ours:
            if name in sd:
                parts.append(sd[name].float().cpu())
            elif name.endswith(".bias"):  # bias=False: GPT-2 always has biases, and zeros are exact
                parts.append(torch.zeros(sd[name[:-4] + "weight"].shape[0]))
            else:
                raise ExportError(f"checkpoint has no tensor '{name}' needed for {hf}")
        t = torch.cat(parts, 0)
        if vocab:
            t = t[:cfg.vocab_size]
        if conv:
            t = t.t()
        out[hf] = t.to(DTYPES[dtype]).contiguous().clone()
    return out


def _write_tokenizer(tok, out: Path, model_cfg: ModelConfig) -> None:
    from distlm.data.tokenizer import GPT2_DIR
    specials = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT, "model_max_length": model_cfg.block_size,
                "clean_up_tokenization_spaces": False}
    if tok.name == "gpt2":
        # HF's gpt2 vocab.json/merges.txt are these very files under other names.
        shutil.copyfile(GPT2_DIR / "encoder.json", out / "vocab.json")
        shutil.copyfile(GPT2_DIR / "vocab.bpe", out / "merges.txt")
        conf = {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, "add_bos_token": False, **specials}
    else:
        tok.save(out)  # tokenizer.json
        conf = {"tokenizer_class": "PreTrainedTokenizerFast", **specials}
    (out / "tokenizer_config.json").write_text(json.dumps(conf, indent=2) + "\n")


def export_hf(run_or_ckpt, out_dir, *, dtype: str = "fp32", overwrite: bool = False) -> dict:
    """Write RUN_OR_CKPT as a folder that ``AutoModelForCausalLM.from_pretrained`` and
    ``AutoTokenizer.from_pretrained`` load offline. Returns a summary dict.

    The folder appears whole or not at all: it is built beside OUT and renamed into place.
    """
    from safetensors.torch import save_file

    from distlm.model.load import load_model, load_run_tokenizer
    if dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not overwrite)):
        raise ExportError(f"{out}: already exists and is not empty; choose another folder or pass --force")
    model, cfg, folder = load_model(run_or_ckpt, "cpu")
    arch = hf_architecture(cfg.model)
    tok = load_run_tokenizer(folder, cfg)
    if tok.vocab_size > cfg.model.vocab_size:
        raise ExportError(f"tokenizer {tok.name} has {tok.vocab_size} tokens but model.vocab_size is "
                          f"{cfg.model.vocab_size}")
    tensors = hf_state_dict(model, arch, dtype)
    del model

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        # safetensors writes its file 0600 whatever the umask: give it the mode of the other
        # files, so a server running as another user can read the model it can read the config of.
        (tmp / "model.safetensors").chmod(0o666 & ~_umask())
        (tmp / "config.json").write_text(json.dumps(hf_config(arch, cfg.model, tok.eos_id, dtype), indent=2) + "\n")
        gen = {"bos_token_id": tok.eos_id, "eos_token_id": tok.eos_id, "_from_model_config": True}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        _write_tokenizer(tok, tmp, cfg.model)

    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_dir(out, fill)
    names = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
    return {"out": str(out), "checkpoint": str(folder), "architecture": names[arch], "tokenizer": tok.name,
            "dtype": dtype, "tensors": len(tensors)}


def _umask() -> int:
    mask = os.umask(0)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return mask


def export(
    checkpoint: str, out: Annotated[str, "the folder to write"], /, *,
    format: Annotated[Literal["hf"], "hf: a Hugging Face transformers folder"] = "hf",
    dtype: Annotated[Literal["fp32", "bf16", "fp16"], "weight dtype"] = "fp32",
    force: Annotated[bool, "replace OUT if it exists"] = False,
) -> int:
    """Write a checkpoint as a Hugging Face transformers folder, weights in one file.

    Checkpoints are DCP folders (a file per rank); this is the way to one file:
    OUT/model.safetensors (safetensors.torch.load_file gives the state dict, no distlm
    needed), with config.json and the tokenizer, so transformers' from_pretrained loads OUT.
    GPT2LMHeadModel for learned/sinusoidal positions + layernorm + gelu, LlamaForCausalLM
    for rope + rmsnorm + swiglu; other combinations are refused, never exported approximately.
    """
    s = export_hf(checkpoint, out, dtype=dtype, overwrite=force)
    print(f"exported {s['checkpoint']} as {s['architecture']} ({s['dtype']}, tokenizer {s['tokenizer']}) "
          f"to {s['out']}")
    return 0
