"""Export distlm checkpoints as Hugging Face ``transformers`` folders.

Only exact mappings are written. Learned or sinusoidal positions + layernorm + gelu become
``GPT2LMHeadModel``. RoPE + rmsnorm become one of four Llama-family classes, chosen by the
MLP and by QK-norm (``ROPE_ARCHS``): Llama (swiglu), Qwen3 (swiglu + a norm on each head's
queries and keys), Arcee (ReLU^2, not gated) and Apertus (ReLU^2 + per-head QK-norm). Their
per-head q/k norms carry a learned gain that distlm's QK-norm lacks: it is written as ones,
which is exact. Any other combination raises ExportError rather than producing a model whose
logits differ from the checkpoint's, and so do the modern-block options no class can express
(``inexpressible``). ``model.zero_init_proj`` is only an initialisation and exports like any
other model. A mixture of experts (``model.moe``) becomes ``Glm4MoeForCausalLM``: the one class
with both the Llama attention and DeepSeek-V3's routing (sigmoid scores, a per-expert bias for
the choice only, normalised top-k weights, shared experts, the first blocks dense), so the
routing biases the run balanced with are exported as they are. The folder is built without importing ``transformers`` (config.json is written
by hand), so a training box can export without it.

The tensor-name table (``weight_pairs``) is shared with the import side
(``distlm.interop.hf_load``) so both directions cannot drift apart.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from distlm.config import ConfigError, ModelConfig
from distlm.io import atomic_write_dir
from distlm.model.moe import expert_width, is_moe_layer, moe_layers

EOT = "<|endoftext|>"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class InteropError(ConfigError):
    """A model or folder that cannot be mapped exactly; one line naming the field at fault."""


class ExportError(InteropError):
    pass


# Options with what each one gives the model, for the messages that refuse them. QK-norm is
# expressible on export (Qwen3, Apertus) but not by the GPT-2/Llama folders import reads; the
# others no exported class has. (model.mlp is checked by hf_architecture.)
_INEXPRESSIBLE = (
    ("qk_norm", False, "RMS norm on each head's queries and keys"),
    ("logit_softcap", 0.0, "logits soft-capped by tanh"),
    ("value_embeds", 0, "value-embedding tables"),
    ("skip_connections", False, "U-net skips between blocks"),
    ("attn_mask", "causal", "attention stops at end-of-text tokens"),
    ("attn_window", 0, "sliding-window attention"),
)
_EXPORT_CLASSES = "GPT-2, Llama, Qwen3, Arcee, Apertus or Glm4Moe"


def inexpressible(cfg: ModelConfig, allow: tuple[str, ...] = ()) -> list[str]:
    """'model.FIELD=VALUE (what the model has)' for each option set that the HF classes
    cannot express, except those in ``allow``."""
    return [f"model.{k}={getattr(cfg, k)} ({why})" for k, off, why in _INEXPRESSIBLE
            if k not in allow and getattr(cfg, k) != off]


@dataclass(frozen=True)
class RopeArch:
    """One Llama-family transformers class: what its block computes and how it names it."""
    model_type: str
    cls: str
    hidden_act: str
    gated: bool                 # down(act(gate(x)) * up(x)) rather than down(act(up(x)))
    qk_norm: bool               # RMSNorm with a gain over each head's q and k, before RoPE
    norms: tuple[str, str]      # the block's attention and MLP norms
    mlp_bias: bool              # the class has an MLP bias flag (Qwen3's and Apertus' MLPs have none)


ROPE_ARCHS = {
    ("swiglu", False): RopeArch("llama", "LlamaForCausalLM", "silu", True, False,
                                ("input_layernorm", "post_attention_layernorm"), True),
    ("swiglu", True): RopeArch("qwen3", "Qwen3ForCausalLM", "silu", True, True,
                               ("input_layernorm", "post_attention_layernorm"), False),
    ("relu2", False): RopeArch("arcee", "ArceeForCausalLM", "relu2", False, False,
                               ("input_layernorm", "post_attention_layernorm"), True),
    ("relu2", True): RopeArch("apertus", "ApertusForCausalLM", "relu2", False, True,
                              ("attention_layernorm", "feedforward_layernorm"), False),
}
_BY_TYPE = {a.model_type: a for a in ROPE_ARCHS.values()}
CLASS_NAMES = {"gpt2": "GPT2LMHeadModel", **{t: a.cls for t, a in _BY_TYPE.items()},
               "glm4_moe": "Glm4MoeForCausalLM"}
MOE_ARCH = RopeArch("glm4_moe", "Glm4MoeForCausalLM", "silu", True, True,
                    ("input_layernorm", "post_attention_layernorm"), False)


def _moe_architecture(cfg: ModelConfig) -> str:
    """Glm4Moe, or ExportError naming what it cannot express."""
    e = cfg.moe
    wrong = [f"model.{k}={getattr(cfg, k)}" for k, ok in (("position", cfg.position == "rope"),
                                                            ("norm", cfg.norm == "rmsnorm"),
                                                            ("mlp", cfg.mlp == "swiglu"), ("bias", not cfg.bias))
             if not ok]
    if e.every != 1:
        wrong.append(f"model.moe.every={e.every}")
    if e.experts < 2:
        wrong.append(f"model.moe.experts={e.experts}")
    if wrong:
        raise ExportError(f"{', '.join(wrong)}: a mixture of experts exports as Glm4MoeForCausalLM, which needs "
                          f"position=rope, norm=rmsnorm, mlp=swiglu, bias=false, moe.every=1 (dense blocks only "
                          f"first, moe.first_dense) and at least 2 experts")
    return MOE_ARCH.model_type


def hf_architecture(cfg: ModelConfig) -> str:
    """The HF model_type the model exports as ('gpt2', 'llama', 'qwen3', 'arcee', 'apertus');
    ExportError naming the fields that rule out every class."""
    options = inexpressible(cfg, allow=("qk_norm",))
    if cfg.moe.enabled and not options:
        return _moe_architecture(cfg)
    if options:
        raise ExportError(f"{', '.join(options)}: no Hugging Face class distlm exports to ({_EXPORT_CLASSES}) "
                          f"has {'this option' if len(options) == 1 else 'these options'}; the exported model "
                          f"would compute other logits")
    if cfg.position in ("learned", "sinusoidal"):
        wrong = [f"model.{k}={getattr(cfg, k)}" for k, want in (("qk_norm", False), ("norm", "layernorm"),
                                                                ("mlp", "gelu")) if getattr(cfg, k) != want]
        if not wrong:
            return "gpt2"
        need = "GPT-2 needs norm=layernorm, mlp=gelu, qk_norm=false"
    else:
        arch = ROPE_ARCHS.get((cfg.mlp, cfg.qk_norm))
        if cfg.norm != "rmsnorm" or arch is None:
            wrong = [f"model.{k}={getattr(cfg, k)}" for k, ok in (("norm", cfg.norm == "rmsnorm"),
                                                                  ("mlp", cfg.mlp in ("swiglu", "relu2"))) if not ok]
            need = "RoPE needs norm=rmsnorm with mlp=swiglu (Llama, Qwen3) or relu2 (Arcee, Apertus)"
        elif cfg.bias and not arch.mlp_bias:
            wrong = [f"model.bias=True with model.qk_norm={cfg.qk_norm}, model.mlp={cfg.mlp}"]
            need = f"{arch.cls}'s MLP has no bias"
        else:
            return arch.model_type
    raise ExportError(f"{', '.join(wrong)} with model.position={cfg.position} has no exact Hugging Face "
                      f"equivalent ({need})")


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
        ra = MOE_ARCH if arch == MOE_ARCH.model_type else _BY_TYPE[arch]
        mlp = (("gate_proj", "w_gate"),) if ra.gated else ()
        add("model.embed_tokens", ["tok_emb"], vocab=True, bias=False)
        for i in range(cfg.n_layer):
            h, b = f"model.layers.{i}.", f"blocks.{i}."
            add(h + ra.norms[0], [b + "attn_norm"], bias=False)
            for hf, ours in (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv"), ("o_proj", "wo")):
                add(h + "self_attn." + hf, [b + "attn." + ours], bias=cfg.bias)
            add(h + ra.norms[1], [b + "mlp_norm"], bias=False)
            if is_moe_layer(cfg, i):
                # The routed experts' 3-D weights are moe_tensors'; the router and the shared
                # experts (one MLP of their summed width) are plain matrices.
                add(h + "mlp.gate", [b + "mlp.router"], bias=False)
                if cfg.moe.shared:
                    for hf, ours in mlp + (("up_proj", "w_in"), ("down_proj", "w_out")):
                        add(h + "mlp.shared_experts." + hf, [b + "mlp.shared." + ours], bias=False)
                continue
            for hf, ours in mlp + (("up_proj", "w_in"), ("down_proj", "w_out")):
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
    if arch == MOE_ARCH.model_type:
        return _moe_config(cfg, common)
    ra = _BY_TYPE[arch]
    # rope_theta at the top level is what 4.x reads; 5.x moved it into rope_parameters (which must
    # be written: Apertus' default is llama3 scaling). pad_token_id too: Apertus' default is 3.
    conf = {"architectures": [ra.cls], "model_type": ra.model_type, "hidden_size": cfg.d_model,
            "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
            "num_key_value_heads": cfg.n_head, "head_dim": cfg.head_dim, "hidden_act": ra.hidden_act,
            "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "attention_bias": cfg.bias, "attention_dropout": 0.0, "pad_token_id": None, **common}
    if ra.mlp_bias:
        conf["mlp_bias"] = cfg.bias
    if arch == "llama":
        conf["pretraining_tp"] = 1
    if arch == "qwen3":  # every layer full attention
        conf.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layer,
                    layer_types=["full_attention"] * cfg.n_layer)
    return conf


def _moe_config(cfg: ModelConfig, common: dict) -> dict:
    e = cfg.moe
    # Glm4Moe rotates half of each head by default (partial_rotary_factor 0.5): written as 1.
    # Its shared MLP is n_shared_experts x moe_intermediate_size wide; its group-limited
    # routing is off with one group. No multi-token-prediction layers.
    return {"architectures": [MOE_ARCH.cls], "model_type": MOE_ARCH.model_type, "hidden_size": cfg.d_model,
            "intermediate_size": cfg.d_ff, "moe_intermediate_size": expert_width(cfg),
            "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_head,
            "head_dim": cfg.head_dim, "hidden_act": "silu", "max_position_embeddings": cfg.block_size,
            "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "partial_rotary_factor": 1.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": 1.0},
            "attention_bias": False, "attention_dropout": 0.0, "use_qk_norm": cfg.qk_norm,
            "n_routed_experts": e.experts, "num_experts_per_tok": e.top_k, "n_shared_experts": e.shared,
            "routed_scaling_factor": e.route_scale, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
            "first_k_dense_replace": e.first_dense, "num_nextn_predict_layers": 0, "pad_token_id": None, **common}


def moe_tensors(sd: dict, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The routed experts in Glm4Moe's layout: gate_up_proj (E, 2f, d), gate first, and down_proj
    (E, d, f), nn.Linear's (out, in) per expert, the transposes of distlm's x @ w[e]; the routing
    biases as e_score_correction_bias."""
    out = {}
    for i in moe_layers(cfg):
        h, b = f"model.layers.{i}.mlp.", f"blocks.{i}.mlp."
        w_gate, w_in, w_out = (sd[b + n].float().cpu().transpose(1, 2) for n in ("experts.w_gate", "experts.w_in", "experts.w_out"))
        out[h + "experts.gate_up_proj"] = torch.cat((w_gate, w_in), 1)
        out[h + "experts.down_proj"] = w_out
        out[h + "gate.e_score_correction_bias"] = sd[b + "expert_bias"].float().cpu()
        if not cfg.moe.shared:  # Glm4Moe always has a shared MLP: at width 0 it adds nothing
            d = cfg.d_model
            out.update({h + "shared_experts.gate_proj.weight": torch.zeros(0, d),
                        h + "shared_experts.up_proj.weight": torch.zeros(0, d),
                        h + "shared_experts.down_proj.weight": torch.zeros(d, 0)})
    return out


def fixed_tensors(arch: str, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF tensors with no distlm counterpart, at the value that makes them a no-op: the gains
    of Qwen3's, Apertus' and Glm4Moe's per-head q/k norms (distlm's QK-norm has none, i.e. ones)."""
    if arch == MOE_ARCH.model_type:
        if not cfg.qk_norm:
            return {}
    elif arch == "gpt2" or not _BY_TYPE[arch].qk_norm:
        return {}
    return {f"model.layers.{i}.self_attn.{n}.weight": torch.ones(cfg.head_dim)
            for i in range(cfg.n_layer) for n in ("q_norm", "k_norm")}


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
    out.update({k: v.to(DTYPES[dtype]) for k, v in fixed_tensors(arch, cfg).items()})
    if arch == MOE_ARCH.model_type:
        # The router and its biases stay fp32, as Glm4Moe computes its routing in fp32.
        out.update({k: v.contiguous() if k.endswith("e_score_correction_bias") else v.to(DTYPES[dtype]).contiguous()
                    for k, v in moe_tensors(sd, cfg).items()})
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
    return {"out": str(out), "checkpoint": str(folder), "architecture": CLASS_NAMES[arch], "tokenizer": tok.name,
            "dtype": dtype, "tensors": len(tensors)}


def _umask() -> int:
    mask = os.umask(0)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return mask
