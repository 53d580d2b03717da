"""One typed config tree (model / data / train / optim / parallel / log / init / task).

Loaded from YAML, overridden by dotted ``key=value`` strings, validated with the
offending field and value named. ``model=NAME`` (or ``--config NAME``) picks a
preset from ``configs/``.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from distlm.bounded_yaml import read_yaml_file
from distlm.errors import ConfigError
from distlm.layout import AXES, Layout, check_layout, token_id_extras, with_degrees

PRESET_DIR = Path(__file__).resolve().parent / "configs"


def choice(default, *options, help=""):
    return field(default=default, metadata={"choices": options, "help": help})


def doc(default, help=""):
    return field(default=default, metadata={"help": help})


AUTO = "auto"


def auto(*options, help=""):
    """A setting whose best value depends on the device and the layout. It holds None until
    distlm/train/fast_defaults.py picks the value, before the model is built; "auto" (or null)
    in YAML and on the command line. None rather than the string: code that reads the tree
    without resolving it (a GPT built from a preset, the planner) sees a false value and
    takes the plain path, as it did before these settings had an auto."""
    meta = {"auto": True, "help": help}
    if options:
        meta["choices"] = options
    return field(default=None, metadata=meta)


@dataclass(frozen=True)
class MoEConfig:
    """``model.moe``: a mixture of experts in place of the MLP of some blocks (distlm/model/moe.py).
    Off while ``experts`` is 0."""
    experts: int = doc(0, "routed experts per MoE block; 0 = a dense model")
    top_k: int = doc(2, "experts each token is routed to (token choice, dropless)")
    d_ff: int = doc(0, "each expert's hidden width; below model.d_ff for fine-grained experts; 0 = model.d_ff")
    shared: int = doc(0, "shared experts every token also passes through, each of width moe.d_ff")
    every: int = doc(1, "an MoE block every this many blocks, from moe.first_dense on; the others dense")
    first_dense: int = doc(0, "the first this many blocks keep a dense MLP")
    bias_rate: float = doc(1e-3, "balancing without an auxiliary loss: after each step every expert's routing "
                                 "bias moves by this much toward an even load (up if under-loaded, down if "
                                 "over); 0 = off")
    aux_loss: float = doc(0.0, "weight of the auxiliary load-balancing loss (experts x sum of load fraction x "
                               "mean score) added to the training loss; 0 = off")
    route_scale: float = doc(1.0, "the top-k gate weights (normalised to sum to 1) are multiplied by this")
    kernel: str = choice("auto", "auto", "grouped", "bmm", "loop",
                         help="the experts' matmuls: grouped = torch._grouped_mm over the tokens sorted by "
                              "expert; bmm = every expert padded to the whole batch; loop = one matmul per "
                              "expert; auto = grouped on CUDA, loop elsewhere")

    @property
    def enabled(self) -> bool:
        return self.experts > 0


@dataclass(frozen=True)
class ModelConfig:
    n_layer: int = doc(2, "transformer blocks")
    n_head: int = doc(4, "attention heads")
    d_model: int = doc(128, "residual width")
    d_ff: int = doc(512, "MLP hidden width")
    block_size: int = doc(128, "context length in tokens")
    vocab_size: Optional[int] = doc(None, "null = take it from the data manifest")
    vocab_pad_multiple: int = doc(64, "embedding rows are padded to a multiple of this for speed")
    position: str = choice("sinusoidal", "sinusoidal", "learned", "rope")
    norm: str = choice("layernorm", "layernorm", "rmsnorm")
    mlp: str = choice("gelu", "gelu", "swiglu", "relu2", help="relu2 = relu(x)^2")
    tie_embeddings: bool = True
    bias: bool = True
    dropout: float = 0.0
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02
    loss_chunk: Optional[int] = auto(help="training: head + cross-entropy this many tokens at a time, gradients "
                                          "formed in the forward, so the whole logits tensor never exists; 0 = all "
                                          "at once; auto = 8192 on CUDA where the model computes its own loss "
                                          "(no TP, no PP), else 0")
    qk_norm: bool = doc(False, "RMS-normalise queries and keys per head (no learned scale) before RoPE")
    zero_init_proj: bool = doc(False, "attention and MLP output projections start at zero (each block starts "
                                      "as the identity)")
    logit_softcap: float = doc(0.0, "logits = cap * tanh(logits / cap); 0 = off")
    value_embeds: int = doc(0, "extra token tables mixed into the attention values: table i feeds blocks i "
                               "and n_layer-1-i, each through a learned scalar; 0 = off")
    skip_connections: bool = doc(False, "U-net: the stream after block i is added, with a learned scalar, "
                                        "into the input of block n_layer-1-i (first half into second)")
    attn_mask: str = choice("causal", "causal", "doc",
                            help="doc = causal attention that stops at end-of-text tokens (model.eot_id)")
    attn_window: int = doc(0, "sliding window: a token sees at most this many positions, itself included; 0 = all")
    eot_id: Optional[int] = doc(None, "end-of-text token for attn_mask=doc; null = the tokenizer's")
    moe: MoEConfig = field(default_factory=MoEConfig, metadata={"help": "mixture of experts: the model.moe.* "
                                                                        "fields below"})

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        m = self.vocab_pad_multiple
        return -(-self.vocab_size // m) * m


@dataclass(frozen=True)
class DataConfig:
    dir: Optional[str] = doc(None, "a folder written by `distlm prepare`")
    source: str = choice("tokens", "tokens", "synthetic", help="synthetic = random tokens, for benchmarks")
    verify_checksums: bool = doc(True, "check shard sha256 against the manifest at start-up")
    mix: str = doc("", "train on a weighted mixture of prepared folders instead of data.dir: one string, "
                       "'[NAME=]FOLDER:WEIGHT' entries separated by commas, e.g. "
                       "data.mix=web=data/owt:0.7,books=data/gut:0.2,code=data/code:0.1 on the command line and "
                       "`mix: web=data/owt:0.7,books=data/gut:0.2,code=data/code:0.1` in YAML; NAME defaults to the "
                       "folder's name, weights are positive numbers or fractions (1/3), normalised; all folders "
                       "must share one tokenizer; empty = data.dir")


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 1337
    max_steps: int = 200
    global_batch_size: int = doc(32, "sequences per optimizer step, fixed whatever the world size (a preset may "
                                     "give another for a data-parallel degree: its data_parallel table)")
    micro_batch_size: Optional[int] = auto(help="sequences per forward pass per data-parallel rank; auto = the "
                                                "largest divisor of the local batch that fits: on CUDA at most 64, "
                                                "by the planner's memory estimate, on CPU at most 8")
    # The learning-rate schedule. It is the run's, not an optimizer's: it counts this section's
    # steps (max_steps, like eval_every) and moves every optimizer and every part of one (Muon's
    # matrices and its AdamW groups) together, each from its own peak, optim.NAME.lr.
    warmup_steps: int = doc(20, "learning-rate warm-up: linear from 0 to each peak over this many steps")
    decay: str = choice("linear", "linear", "cosine", "wsd", "constant",
                        help="after the warm-up, from each peak down to min_lr_ratio x that peak at max_steps")
    wsd_decay_fraction: float = doc(0.2, "WSD: the last fraction of steps that decays")
    min_lr_ratio: float = doc(0.1, "where the decay ends, as a fraction of each optimizer's peak rate "
                                   "(optim.adamw.lr, optim.muon.lr, ...)")
    grad_clip: float = doc(1.0, "max global grad norm; 0 disables")
    eval_every: int = doc(100, "steps between validation passes; 0 = only at the end")
    eval_batches: int = doc(20, "micro-batches per validation pass, over all ranks, spread across the whole "
                                "val split; 0 = the whole split")
    checkpoint_every: int = doc(0, "steps between checkpoints; 0 = only at the end")
    keep_last: int = doc(2, "checkpoints kept besides the best")
    async_checkpoint: bool = doc(False, "write checkpoints in the background (dcp.async_save)")
    resume: str = doc("never", "never | auto (newest complete checkpoint) | PATH")
    device: str = choice("auto", "auto", "cpu", "cuda")
    dtype: str = choice("auto", "auto", "fp32", "bf16", help="auto = bf16 autocast on CUDA, fp32 on CPU")
    compile: Optional[bool] = auto(help="torch.compile: true, false, or auto = on CUDA, off on CPU")
    compile_scope: Optional[str] = auto("block", "model",
                                        help="block: one graph reused by every block (works with FSDP2/TP/PP); "
                                             "model: the whole forward in one graph (1 GPU or DDP); auto = model "
                                             "where the layout allows, else block")
    compile_mode: str = choice("default", "default", "max-autotune-no-cudagraphs", "max-autotune", "reduce-overhead",
                               help="torch.compile mode (autotuning costs minutes of compile time; reduce-overhead "
                                    "replays CUDA graphs)")
    time_limit_s: float = doc(0.0, "stop cleanly after this many seconds wherever the schedule is, with a "
                                   "checkpoint to resume from (a job's wall-clock limit); 0 = no limit")
    time_budget_s: float = doc(0.0, "train for this long: the schedule's progress is the larger of step / "
                                    "max_steps and elapsed / this, so its decay ends, and the run with it, at "
                                    "this many seconds on a machine too slow for max_steps (the rates then "
                                    "depend on the clock, and a resume is not bit-exact); 0 = the schedule "
                                    "counts steps only")
    on_nan: str = choice("skip", "skip", "stop", "off",
                         help="a NaN/Inf loss or gradient: skip the step, stop, or off (no check: no host sync per step)")
    max_nan_skips: int = doc(10, "on_nan=skip: stop after this many skipped steps")
    on_save_error: str = choice("stop", "stop", "continue", help="a checkpoint cannot be written: stop or go on")
    watchdog_s: float = doc(1800.0, "a rank with no progress this long dumps its stack and exits (0 = off)")
    seq_warmup_steps: int = doc(0, "sequence-length warm-up: for this many first steps each block of "
                                   "model.block_size tokens is cut into shorter rows (same tokens, same order, "
                                   "shorter attention context), doubling from train.seq_warmup_start in equal "
                                   "stages; 0 = off (distlm/train/seq_schedule.py)")
    seq_warmup_start: int = doc(128, "sequence-length warm-up: the first stage's row length, a power of two "
                                     "below model.block_size")
    fp8: str = choice("off", "off", "tensorwise", "rowwise",
                      help="the blocks' linear layers multiply in float8 (e4m3 forward, e5m2 gradients, dynamic "
                           "scales: one per tensor, or one per row and column); head, embeddings and norms stay "
                           "as they are, parameters and checkpoints too. CUDA capability 8.9+ (distlm/model/float8.py)")
    memory_check: bool = doc(True, "refuse to start, before the run folder is made or anything allocated, when "
                                   "the planner's memory estimate of this run is more than the device has free "
                                   "(host RAM on CPU, the GPU's free memory on CUDA); false = start anyway, for "
                                   "when you know the estimate is wrong for your machine")


@dataclass(frozen=True)
class AdamWConfig:
    lr: float = doc(6e-4, "AdamW's peak learning rate (optim.name=adamw: every parameter; muon: the embeddings, "
                          "head, norms and biases)")
    beta1: float = doc(0.9, "AdamW: the first moment's decay")
    beta2: float = doc(0.95, "AdamW: the second moment's decay")
    eps: float = doc(1e-8, "AdamW: added to the second moment's root")
    weight_decay: float = doc(0.1, "AdamW: decoupled weight decay on the matrices that are not embeddings")


@dataclass(frozen=True)
class MuonConfig:
    lr: float = doc(0.02, "Muon's peak learning rate, for the blocks' weight matrices")
    momentum: float = doc(0.95, "Muon: Nesterov momentum coefficient")
    ns_steps: int = doc(5, "Muon: Newton-Schulz iterations (in optim.muon.ns_dtype)")
    ns_dtype: str = choice("auto", "auto", "bf16", "fp32",
                           help="Muon: the dtype of the Newton-Schulz matmuls; auto = bf16 on CUDA, on a CPU "
                                "whichever a timed matmul finds faster (fp32 where bf16 has no fast path, "
                                "e.g. AVX2-only CPUs), the same on every rank")
    weight_decay: float = doc(0.0, "Muon: decoupled weight decay on the matrices it updates")
    embed_lr: float = doc(0.0, "Muon's AdamW part: the peak rate of the embedding tables (token and value "
                               "embeddings), in a group of their own; 0 = optim.adamw.lr, as the rest of that "
                               "part. Needs an untied head")


@dataclass(frozen=True)
class LionConfig:
    lr: float = doc(1e-4, "Lion's peak learning rate (the paper's advice: 3-10x below AdamW's)")
    beta1: float = doc(0.9, "Lion: the update is sign(beta1 m + (1 - beta1) g)")
    beta2: float = doc(0.99, "Lion: the momentum m <- beta2 m + (1 - beta2) g")
    weight_decay: float = doc(1.0, "Lion: decoupled weight decay on the matrices that are not embeddings "
                                   "(3-10x above AdamW's, so that lr x decay stays about the same)")


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer (distlm/optim/): ``name`` picks one from the registry; each optimizer's settings
    are its own part, ``optim.NAME.*``, and only the chosen one's are read. Muon is a combined
    optimizer: its matrices take ``optim.muon.*``, the rest of the model (embeddings, head, norms,
    biases) AdamW with ``optim.adamw.*``, the same settings AdamW alone takes, and
    ``optim.muon.embed_lr`` gives the embedding tables of that AdamW part their own rate. The
    learning-rate schedule (train.warmup_steps, decay, min_lr_ratio) is the run's and scales every
    peak alike."""
    name: str = choice("adamw", "adamw", "muon", "lion",
                       help="adamw: AdamW for every parameter; muon: Muon (orthogonalised momentum) for the "
                            "blocks' weight matrices, AdamW for embeddings, head, norms and biases "
                            "(distlm/optim/muon.py); lion: the sign of an interpolated momentum for every "
                            "parameter, one state tensor each (distlm/optim/lion.py)")
    adamw: AdamWConfig = field(default_factory=AdamWConfig, metadata={"help": "AdamW: optim.adamw.*"})
    muon: MuonConfig = field(default_factory=MuonConfig, metadata={"help": "Muon: optim.muon.*"})
    lion: LionConfig = field(default_factory=LionConfig, metadata={"help": "Lion: optim.lion.*"})


# The degrees come first, one per registered axis (distlm/layout/: parallel.<name>, its help
# line the axis's); then the options of the runtimes.
@with_degrees(lambda axis: doc(1, axis.help), frozen=True)
class ParallelConfig:
    reshard_after_forward: bool = doc(True, "FSDP2: True = ZeRO-3, False = ZeRO-2")
    mixed_precision: bool = doc(True, "FSDP2: bf16 params, fp32 gradient reduce (CUDA only; see grad_reduce_dtype)")
    cpu_offload: bool = False
    ddp_bucket_mb: int = 25
    grad_reduce_dtype: str = choice("fp32", "fp32", "bf16",
                                    help="DDP and FSDP2: the dtype gradients are averaged in across ranks; bf16 "
                                         "halves the bytes (DDP's bf16 compression hook, FSDP2's reduce dtype) "
                                         "and rounds each rank's gradient to 8 bits of mantissa first")
    activation_checkpoint: str = choice("none", "none", "full", "selective")
    timeout_s: int = doc(120, "process-group timeout, so a hang fails instead of waiting 30 min")
    sequence_parallel: bool = doc(True, "TP: norms and dropout on a slice of the sequence (less memory, same math)")
    loss_parallel: bool = doc(True, "TP: cross-entropy on vocabulary shards; the full logits never exist")
    pp_schedule: str = choice("1f1b", "naive", "gpipe", "1f1b", "interleaved-1f1b", "zero-bubble",
                              help="naive = one microbatch, no overlap (the baseline the others beat)")
    pp_microbatches: int = doc(0, "PP: microbatches per step; 0 = local batch / train.micro_batch_size")
    pp_virtual_stages: int = doc(2, "PP: stages per rank for interleaved-1f1b and zero-bubble")
    pp_layers: Optional[str] = doc(None, "PP: blocks per stage, e.g. '4,4,3,1'; default: balanced by FLOPs")
    engine: str = choice("torch", "torch", "horovod", help="data parallelism through torch.distributed or Horovod")
    fp16_compression: bool = doc(False, "Horovod: send gradients as fp16")


@dataclass(frozen=True)
class LogConfig:
    root: str = doc("runs", "run directories live under this folder")
    name: Optional[str] = doc(None, "run name, one folder name under log.root; default: a timestamp")
    every: Optional[int] = auto(help="steps between console/CSV/TensorBoard rows (besides the first step's, the "
                                     "last's and each evaluation's); auto = 10, or on a short run max(1, "
                                     "train.max_steps // 20), so it still gets about 20 points; a number is kept")
    tensorboard: bool = True
    wandb: bool = doc(False, "log to Weights & Biases when it is installed")
    wandb_project: str = "distlm"
    progress: bool = doc(True, "show a progress bar")
    samples: int = doc(3, "language model: text samples from log.sample_prompt at each evaluation and at the "
                          "end (console, TensorBoard text, RUN/samples.txt); sample i uses seed i; 0 = none")
    sample_prompt: str = doc("It was a dark and stormy night", "the prompt log.samples continue")


@dataclass(frozen=True)
class InitConfig:
    from_hf: Optional[str] = doc(None, "start from a local Hugging Face GPT-2 or Llama folder (no hub access)")


@dataclass(frozen=True)
class TaskConfig:
    """What is trained on the trunk. ``lm`` is next-token prediction; ``classify`` puts a
    pooling step and a linear head on the same blocks (distlm/tasks/classify/)."""
    name: str = choice("lm", "lm", "classify", help="lm | classify (task=classify on the command line)")
    attention: str = choice("bidirectional", "bidirectional", "causal", help="classify: the trunk's attention")
    pooling: str = choice("mean", "mean", "first", "last", help="classify: how token states become one vector")
    init_from: Optional[str] = doc(None, "classify: start the trunk from this distlm LM run or checkpoint")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    log: LogConfig = field(default_factory=LogConfig)
    init: InitConfig = field(default_factory=InitConfig)
    task: TaskConfig = field(default_factory=TaskConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)}


def updated(cfg: Config, **sections: dict) -> Config:
    """A new Config with some fields changed, e.g. ``updated(cfg, model={"vocab_size": 50257})``.
    The tree is frozen: this is how resolution fills what only the data or a checkpoint knows."""
    for section, values in sections.items():
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **values)})
    return cfg


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def _suggest(name: str, options) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def all_keys() -> list[str]:
    """Every dotted key of the tree, the fields of nested sections included, in the tree's order."""
    out: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for name, (typ, _) in _field_types(cls).items():
            if dataclasses.is_dataclass(typ):
                walk(typ, f"{prefix}{name}.")
            else:
                out.append(f"{prefix}{name}")

    for section, cls in SECTIONS.items():
        walk(cls, f"{section}.")
    return out


def _suggest_key(key: str) -> str:
    """The did-you-mean of an unknown dotted key: a field of the same name elsewhere in the tree
    (train.lr -> optim.adamw.lr: the first in the tree's order), else the nearest spelling among
    the keys of its section (optim.muon_lr -> optim.muon.lr). Shown as the field's name when it
    sits beside the unknown key, else as the whole key."""
    keys = all_keys()
    parent, _, leaf = key.rpartition(".")
    section = key.split(".", 1)[0]
    close = [k for k in keys if k.rpartition(".")[2] == leaf][:1]
    if not close:
        inside = {k[len(section) + 1:]: k for k in keys if k.startswith(section + ".")}
        close = [inside[k] for k in difflib.get_close_matches(key[len(section) + 1:], list(inside), n=1)]
    if not close:
        return ""
    shown = close[0].rpartition(".")[2] if close[0].rpartition(".")[0] == parent else close[0]
    return f" (did you mean '{shown}'?)"


def _preset_path(name: str) -> Path:
    p = Path(name)
    if p.suffix in (".yaml", ".yml"):
        if not p.exists():  # a folder, FIFO or device is named for what it is when read
            raise ConfigError(f"config file not found: {p}")
        return p
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown preset '{name}'{_suggest(name, list_presets())}; presets: {', '.join(list_presets())}")
    return path


def _read_yaml(path: Path) -> dict:
    data = read_yaml_file(path) or {}  # bounded before it is parsed: distlm/bounded_yaml.py
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f) for f in dataclasses.fields(cls)}


# The longest string any field takes (a path, a prompt, a name); data.mix lists folders.
# With these, a run's config.yaml and its checkpoint marker stay far below every limit
# distlm reads them back with.
STRING_LIMIT = 4096
_STRING_LIMITS = {"data.mix": 1 << 16}


def _shown(value: Any) -> str:
    """A value as an error message shows it: at most 60 characters of its repr (a huge
    integer or string is described, not printed)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 1 << 64:
        return f"an integer of {len(str(abs(value))) if value.bit_length() < 40_000 else 'over 12,000'} digits"
    if isinstance(value, str) and len(value) > 60:
        if value.strip().lstrip("+-").isdigit():
            return f"an integer of {len(value.strip().lstrip('+-')):,} digits"
        return f"{value[:40]!r}... ({len(value):,} characters)"
    text = repr(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text):,} characters)"


def _coerce(key: str, value: Any, typ: Any, f: dataclasses.Field) -> Any:
    if isinstance(value, (dict, list, tuple, set)):
        raise ConfigError(f"{key}: expected a single value, got a {'mapping' if isinstance(value, dict) else 'list'}")
    if isinstance(value, str) and len(value) > STRING_LIMIT and len(value) > _STRING_LIMITS.get(key, 0):
        raise ConfigError(f"{key}: {len(value):,} characters, over the {max(STRING_LIMIT, _STRING_LIMITS.get(key, 0)):,} "
                          f"a config string may hold")
    or_auto = " or auto" if f.metadata.get("auto") else ""
    if or_auto and isinstance(value, str) and value.strip().lower() == AUTO:
        return None
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none", "~")):
            return None
        typ = args[0]
    if typ is bool:
        if isinstance(value, bool):
            out = value
        elif isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            out = True
        elif isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            out = False
        else:
            raise ConfigError(f"{key}: expected true/false{or_auto}, got {_shown(value)}")
    elif typ is int:
        try:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            big = isinstance(value, str) and len(value.strip().lstrip("+-").lstrip("0")) > 19
            out = None if big else int(float(value)) if isinstance(value, str) and "e" in value.lower() else int(value)
            if big or not _INT64[0] <= out <= _INT64[1]:  # more digits than 64 bits hold: not converted at all
                shown = value if isinstance(value, str) and len(value) <= 60 else _shown(value)
                raise ConfigError(f"{key}={shown} is out of range: integers must fit in 64 bits")
        except ConfigError:
            raise
        except OverflowError:  # int(float("1e400")): an infinity has no integer
            raise ConfigError(f"{key}: {_shown(value)} is out of range for an integer") from None
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected an integer{or_auto}, got {_shown(value)}") from None
    elif typ is float:
        try:
            out = float(value)
        except (TypeError, ValueError, OverflowError):  # float(10**400): too large a float
            raise ConfigError(f"{key}: expected a number, got {_shown(value)}") from None
    else:
        if not isinstance(value, (str, int, float)):  # bool too: YAML reads off as false
            raise ConfigError(f"{key}: expected a string, got {_shown(value)}")
        if isinstance(value, int) and abs(value) >= 1 << 64:
            raise ConfigError(f"{key}: expected a string, got {_shown(value)}")
        out = str(value)
    choices = f.metadata.get("choices")
    if choices and out not in choices:
        shown = (*choices, AUTO) if or_auto else choices
        raise ConfigError(f"{key}: {_shown(out)} is not one of {', '.join(shown)}{_suggest(str(out)[:100], shown)}")
    return out


class _Values:
    """Field values gathered, checked and typed one by one, before the frozen tree is built."""

    def __init__(self, base: Optional[Config] = None):
        base = base or Config()
        self.values = {section: dataclasses.asdict(getattr(base, section)) for section in SECTIONS}

    def set(self, section: str, key: str, value: Any) -> None:
        if section not in SECTIONS:
            raise ConfigError(f"unknown config section '{section}'{_suggest(section, SECTIONS)}")
        fields = _field_types(SECTIONS[section])
        head, _, rest = key.partition(".")
        if head in fields and dataclasses.is_dataclass(fields[head][0]):
            self._set_nested(section, head, fields[head][0], rest, value)
            return
        if key not in fields:
            raise ConfigError(f"unknown config key '{section}.{key}'{_suggest_key(f'{section}.{key}')}")
        typ, f = fields[key]
        self.values[section][key] = _coerce(f"{section}.{key}", value, typ, f)

    def _set_nested(self, section: str, name: str, cls: type, key: str, value: Any) -> None:
        """A field of a nested section (model.moe.experts), or the whole nested mapping."""
        where = f"{section}.{name}"
        if not key:
            if not isinstance(value, dict):
                raise ConfigError(f"{where} must be a mapping of its fields, got {str(value)[:80]!r}")
            for k, v in value.items():
                self._set_nested(section, name, cls, str(k), v)
            return
        fields = _field_types(cls)
        if key not in fields:
            raise ConfigError(f"unknown config key '{where}.{key}'{_suggest_key(f'{where}.{key}')}")
        typ, f = fields[key]
        self.values[section][name][key] = _coerce(f"{where}.{key}", value, typ, f)

    def merge(self, data: dict, origin: str) -> None:
        for section, values in data.items():
            if section not in SECTIONS:
                raise ConfigError(f"{origin}: unknown config section '{section}'{_suggest(section, SECTIONS)}")
            if section == "model" and isinstance(values, str):
                self.merge({"model": _read_yaml(_preset_path(values)).get("model", {})}, values)
                continue
            if not isinstance(values, dict):
                raise ConfigError(f"{origin}: section '{section}' must be a mapping, got {_shown(values)}")
            for key, value in values.items():
                self.set(section, key, value)

    def build(self) -> Config:
        return Config(**{section: SECTIONS[section](**_nested(SECTIONS[section], v))
                         for section, v in self.values.items()})


def _nested(cls: type, values: dict) -> dict:
    """A section's values with each nested section's mapping built into its dataclass."""
    types_ = _field_types(cls)
    return {k: (types_[k][0](**v) if dataclasses.is_dataclass(types_[k][0]) and isinstance(v, dict) else v)
            for k, v in values.items()}


# A preset's top-level ``data_parallel`` mapping: the values it gives a run of one data-parallel
# degree, e.g. speedrun-124m's {4: {train: {global_batch_size: 64, max_steps: 300, ...}}}. A row
# replaces the file's own values when the run's degree is the one it names, whole: a command
# line that gives any of its keys leaves the row out (a row is one recipe, the batch and the
# step counts that keep its tokens; half of one would be neither). A saved config is resolved
# and has no table.
DATA_PARALLEL = "data_parallel"


def _data_parallel_table(table: Any, origin: str) -> dict[int, dict]:
    if table is None:
        return {}
    if not isinstance(table, dict):
        raise ConfigError(f"{origin}: {DATA_PARALLEL} must map a data-parallel degree to sections, got "
                          f"{_shown(table)}")
    out = {}
    for degree, sections in table.items():
        if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
            raise ConfigError(f"{origin}: {DATA_PARALLEL}: {_shown(degree)} is not a data-parallel degree "
                              f"(a positive integer)")
        if not isinstance(sections, dict) or not all(isinstance(v, dict) for v in sections.values()):
            raise ConfigError(f"{origin}: {DATA_PARALLEL}.{degree} must map sections to their fields")
        try:  # every key and value checked now, whatever degree this run has
            _Values().merge(sections, f"{origin}: {DATA_PARALLEL}.{degree}")
        except ConfigError as e:
            raise ConfigError(str(e) if str(e).startswith(origin) else f"{origin}: {DATA_PARALLEL}.{degree}: {e}") \
                from None
        out[degree] = {f"{section}.{key}": value for section, fields in sections.items()
                       for key, value in fields.items()}
    return out


def load_config(config: str | None = None, overrides: list[str] = (), notes: Optional[list] = None) -> Config:
    """Build the config: defaults <- FILE or preset (with its data_parallel row for this run's
    data-parallel degree) <- dotted overrides, then validate. ``notes``: a list that gets a line
    saying what a data_parallel row changed, or why it was left out."""
    values = _Values()
    table: dict[int, dict] = {}
    if config:
        path = _preset_path(config)
        data = dict(_read_yaml(path))
        table = _data_parallel_table(data.pop(DATA_PARALLEL, None), str(path))
        values.merge(data, str(path))
    given: set[str] = set()
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like key=value (e.g. train.max_steps=100)")
        key, value = item.split("=", 1)
        if key == "model":  # model=PRESET swaps in a preset's architecture
            values.merge({"model": value}, item)
            continue
        if key == "task":  # task=classify: shorthand for task.name=classify
            values.set("task", "name", value)
            given.add("task.name")
            continue
        if "." not in key:
            raise ConfigError(f"override '{item}': key must be section.field{_suggest(key, SECTIONS)}")
        section, name = key.split(".", 1)
        # The raw string: the field's type converts it (YAML would read "off" as False).
        values.set(section, name, value)
        given.add(key)
    degree = Layout.of(types.SimpleNamespace(**values.values["parallel"])).dp_size
    row = table.get(degree, {})
    if row:
        said = ", ".join(f"{k}={_shown(v)}" for k, v in row.items())
        mine = [k for k in row if k in given]
        if mine:  # the row is one recipe: a command line that changes part of it writes its own
            note = f"its {DATA_PARALLEL} row ({said}) left out: {', '.join(mine)} given on the command line"
        else:
            note = f"{said} (its {DATA_PARALLEL} table)"
            for key, value in row.items():
                section, name = key.split(".", 1)
                values.set(section, name, value)
        if notes is not None:
            notes.append(f"{Path(config).stem} on {degree} data-parallel ranks: {note}")
    cfg = values.build()
    validate(cfg)
    return cfg


def config_from_dict(data: dict, origin: str = "saved config") -> Config:
    """Rebuild a Config saved with a run or checkpoint, checked as a command line's is: a
    checkpoint's marker can be edited, and its config decides what gets allocated. Only the
    paths it names (train.resume, task.init_from) are not checked, since they were the
    training machine's. ``origin`` (the file) starts every error message."""
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: the config is not a mapping")
    for section, values in data.items():
        if not isinstance(values, dict):  # a saved section is never a preset's name, nor a file to read
            raise ConfigError(f"{origin}: config section {section!r} must be a mapping, got {str(values)[:80]!r}")
    try:
        values = _Values()
        values.merge(data, origin)
        cfg = values.build()
        validate_settings(cfg)
    except ConfigError as e:
        message = str(e)
        raise ConfigError(message if message.startswith(origin) else f"{origin}: {message}") from None
    return cfg


def validate(cfg: Config) -> None:
    """Everything a run's config must satisfy, the paths it names included."""
    validate_settings(cfg)
    _validate_paths(cfg)


def _validate_paths(cfg: Config) -> None:
    t = cfg.train
    if t.resume not in ("never", "auto") and not Path(t.resume).exists():
        raise ConfigError(f"train.resume: no such checkpoint: {t.resume}")
    if cfg.task.name == "classify" and cfg.task.init_from is not None and not Path(cfg.task.init_from).exists():
        raise ConfigError(f"task.init_from: no such run or checkpoint: {cfg.task.init_from}")


def validate_settings(cfg: Config) -> None:
    """The values themselves and how they fit together, whatever machine reads them."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    positive = {"model.n_layer": m.n_layer, "model.n_head": m.n_head, "model.d_model": m.d_model,
                "model.d_ff": m.d_ff, "model.block_size": m.block_size, "train.max_steps": t.max_steps,
                "train.global_batch_size": t.global_batch_size, "train.micro_batch_size": t.micro_batch_size,
                **{f"parallel.{a.name}": getattr(p, a.name) for a in AXES}, "log.every": cfg.log.every}
    for key, v in positive.items():
        if v is not None and v <= 0:  # None: auto, chosen positive at start-up
            raise ConfigError(f"{key} must be positive, got {v}")
    _validate_numbers(cfg)  # before anything below computes with a value
    o = cfg.optim
    if o.name == "muon" and o.muon.embed_lr and m.tie_embeddings:
        raise ConfigError(f"optim.muon.embed_lr={o.muon.embed_lr} needs model.tie_embeddings=false: a tied table "
                          f"is also the head, which trains at optim.adamw.lr")
    if m.d_model % m.n_head:
        raise ConfigError(f"model.d_model={m.d_model} is not divisible by model.n_head={m.n_head}")
    if m.position == "rope" and m.head_dim % 2:
        raise ConfigError(f"model.position=rope needs an even head dim, got {m.head_dim}")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout must be in [0, 1), got {m.dropout}")
    if m.vocab_size is not None and m.vocab_size <= 0:
        raise ConfigError(f"model.vocab_size must be positive, got {m.vocab_size}")
    # What each parallel axis refuses, and the batch over the data ranks: distlm/layout/.
    check_layout(cfg)
    _validate_run_name(cfg.log.name)
    if cfg.data.mix and (cfg.data.dir or cfg.data.source == "synthetic"):
        raise ConfigError("data.mix trains on its own folders: leave data.dir unset and data.source=tokens")
    _validate_seq_warmup(cfg)
    _validate_task(cfg)
    _validate_fp8(cfg)
    _validate_moe(cfg)


def _validate_moe(cfg: Config) -> None:
    m, e = cfg.model, cfg.model.moe
    for key, v, lo in (("experts", e.experts, 0), ("top_k", e.top_k, 1), ("d_ff", e.d_ff, 0), ("shared", e.shared, 0),
                       ("every", e.every, 1), ("first_dense", e.first_dense, 0), ("bias_rate", e.bias_rate, 0),
                       ("aux_loss", e.aux_loss, 0), ("route_scale", e.route_scale, 0)):
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"model.moe.{key} must be a finite number, got {v}")
        if v < lo or (key == "route_scale" and v == 0):
            raise ConfigError(f"model.moe.{key} must be {'>' if key == 'route_scale' else '>='} {lo}, got {v}")
    if e.experts > 1 << 16 or e.d_ff > 1 << 18 or e.shared > 1 << 10:
        raise ConfigError(f"model.moe: experts={e.experts}, d_ff={e.d_ff}, shared={e.shared} is above what distlm "
                          f"accepts (65,536 experts, width 262,144, 1,024 shared)")
    if not e.enabled:
        return
    if e.top_k > e.experts:
        raise ConfigError(f"model.moe.top_k={e.top_k} is above model.moe.experts={e.experts}")
    if e.first_dense >= m.n_layer:
        raise ConfigError(f"model.moe.first_dense={e.first_dense} leaves no MoE block in model.n_layer={m.n_layer}")
    p = cfg.parallel
    # Which axes split an MoE model is theirs to say (Axis.model_kinds, distlm/layout/).
    if p.engine != "torch":
        raise ConfigError(f"model.moe.experts={e.experts} needs parallel.engine=torch: the routing biases are "
                          f"updated from the load summed over the ranks through torch.distributed")
    if cfg.train.fp8 != "off":
        raise ConfigError(f"model.moe.experts={e.experts} does not support train.fp8={cfg.train.fp8}: the float8 "
                          f"layers replace nn.Linear, and the experts are 3-D parameters")


def _validate_run_name(name: Optional[str]) -> None:
    """log.name is the run's folder under log.root, never a path out of it (../x, /abs, a/b)."""
    if name is None:
        return
    if not name.strip() or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ConfigError(f"log.name={name!r}: a run name is one folder name under log.root (no '/', '.' or "
                          f"'..'); to keep runs elsewhere, set log.root=DIR")


def _at_least(lo):
    return (lambda v: v >= lo), f">= {lo}"


def _above(lo):
    return (lambda v: v > lo), f"> {lo}"


def _in_unit(closed_top: bool):
    return (lambda v: 0 <= v <= 1 if closed_top else 0 <= v < 1), "in [0, 1]" if closed_top else "in [0, 1)"


# The numbers a typo can make absurd, with what they must be. A NaN passes no comparison
# and is reported by the finiteness check, which runs first over every float field.
_RANGES = {
    "train.min_lr_ratio": _in_unit(True), "train.grad_clip": _at_least(0), "train.warmup_steps": _at_least(0),
    "train.keep_last": _at_least(0), "train.eval_every": _at_least(0), "train.eval_batches": _at_least(0),
    "train.checkpoint_every": _at_least(0), "train.time_limit_s": _at_least(0), "train.time_budget_s": _at_least(0),
    "train.max_nan_skips": _at_least(0), "train.watchdog_s": _at_least(0), "train.wsd_decay_fraction": _in_unit(True),
    "train.seq_warmup_steps": _at_least(0),
    "model.norm_eps": _above(0), "model.rope_theta": _above(0), "model.init_std": _above(0),
    "model.loss_chunk": _at_least(0), "model.vocab_pad_multiple": _at_least(1), "parallel.timeout_s": _at_least(1),
    "log.samples": _at_least(0), "model.logit_softcap": _at_least(0),
    "model.attn_window": _at_least(0), "model.value_embeds": _at_least(0),
    "optim.adamw.lr": _above(0), "optim.adamw.beta1": _in_unit(False), "optim.adamw.beta2": _in_unit(False),
    "optim.adamw.eps": _above(0), "optim.adamw.weight_decay": _at_least(0),
    "optim.muon.lr": _above(0), "optim.muon.momentum": _in_unit(False), "optim.muon.ns_steps": _at_least(1),
    "optim.muon.weight_decay": _at_least(0), "optim.muon.embed_lr": _at_least(0),
    "optim.lion.lr": _above(0), "optim.lion.beta1": _in_unit(True), "optim.lion.beta2": _in_unit(False),
    "optim.lion.weight_decay": _at_least(0),
}


# Upper bounds far past any model trained today (the widest published have d_model 18,432,
# the deepest dense ones about 1,000 blocks, contexts of a million tokens): a value above
# one is a typo or a hostile file, and refusing it here, with its name, beats an estimate
# of petabytes or a constructor that runs for hours building blocks on the meta device.
# train.memory_check=false does not lift them; what fits under them is for the memory
# check (distlm/planner.py) to judge against the machine.
_UPPER = {
    "model.n_layer": 1 << 12, "model.d_model": 1 << 16, "model.d_ff": 1 << 18, "model.n_head": 1 << 16,
    "model.block_size": 1 << 24, "model.vocab_size": 1 << 24, "model.vocab_pad_multiple": 1 << 16,
    "model.value_embeds": 1 << 12, "model.attn_window": 1 << 24, "model.loss_chunk": 1 << 30,
    "train.global_batch_size": 1 << 24, "train.micro_batch_size": 1 << 24, "train.seq_warmup_start": 1 << 24,
    "optim.muon.ns_steps": 1 << 10, "parallel.pp_microbatches": 1 << 20, "parallel.pp_virtual_stages": 1 << 10,
    "parallel.ddp_bucket_mb": 1 << 20, "log.samples": 1 << 10, "model.norm_eps": 1.0,
}
# Every other integer must fit the int64 that torch and numpy hold it in (a seed, a step count).
_INT64 = (-(1 << 63), (1 << 63) - 1)


def _leaves(obj, prefix: str):
    """(dotted key, value) of every field of a section, nested sections' fields included."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            yield from _leaves(v, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", v


def _value(cfg: Config, key: str):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _validate_numbers(cfg: Config) -> None:
    for section in SECTIONS:
        for key, v in _leaves(getattr(cfg, section), f"{section}."):
            if key.startswith("model.moe."):
                continue  # checked with their names by _validate_moe
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"{key} must be a finite number, got {v}")
            if isinstance(v, int) and not isinstance(v, bool) and not _INT64[0] <= v <= _INT64[1]:
                raise ConfigError(f"{key}={_shown(v)} is out of range: integers must fit in 64 bits")
    for key, most in _UPPER.items():
        v = _value(cfg, key)
        if v is not None and v > most:
            raise ConfigError(f"{key}={v} is above {most:,}, the most distlm accepts for it")
    for key, (ok, what) in _RANGES.items():
        v = _value(cfg, key)
        if v is not None and not ok(v):  # None: auto, chosen in range at start-up
            raise ConfigError(f"{key} must be {what}, got {v}")


# torch._dynamo.config.recompile_limit's default: the graphs one compiled function keeps
# (one per input shape and mode); past it dynamo runs new shapes eagerly, and the
# warm-up's last shape, model.block_size, is the one every later step uses.
DYNAMO_RECOMPILE_LIMIT = 8


def seq_warmup_lengths(t: "TrainConfig", block_size: int) -> list[int]:
    """The warm-up's row lengths, one per stage (empty when it is off); model.block_size follows."""
    if not t.seq_warmup_steps:
        return []
    out, n = [], t.seq_warmup_start
    while n < block_size:
        out.append(n)
        n *= 2
    return out


def _validate_seq_warmup(cfg: Config) -> None:
    m, t = cfg.model, cfg.train
    if not t.seq_warmup_steps:
        return
    s, T = t.seq_warmup_start, m.block_size
    if s < 1 or s & (s - 1):
        raise ConfigError(f"train.seq_warmup_start must be a power of two, got {s}")
    if s >= T:
        raise ConfigError(f"train.seq_warmup_start={s} must be below model.block_size={T}: the warm-up's rows "
                          f"grow from it up to the block size")
    if T % s or (T // s) & (T // s - 1):
        raise ConfigError(f"train.seq_warmup_start={s} must divide model.block_size={T} by a power of two: the "
                          f"warm-up's rows double from it up to the block size")
    if cfg.task.name != "lm":
        raise ConfigError(f"train.seq_warmup_steps={t.seq_warmup_steps} is for language models; "
                          f"task.name={cfg.task.name} trains on whole examples")
    # Each row length is a graph of every compiled function, and the evaluation (full
    # blocks, no grad) one more. Compiled per block, blocks with and without a value
    # embedding are two graphs per shape (an upper bound here; an auto compile or scope
    # counts as one that may compile per block). U-net skips are added outside the blocks.
    variants = 1
    if t.compile is not False and t.compile_scope != "model":
        variants = 2 if 0 < 2 * m.value_embeds < m.n_layer else 1
    lengths = seq_warmup_lengths(t, T)
    graphs = (len(lengths) + 2) * variants
    if graphs > DYNAMO_RECOMPILE_LIMIT:
        most = DYNAMO_RECOMPILE_LIMIT // variants - 2
        raise ConfigError(f"train.seq_warmup_start={s} gives {len(lengths)} warm-up row lengths ({s} to {T // 2}): "
                          f"{graphs} graphs per compiled function with the full blocks' and the evaluation's, over "
                          f"torch.compile's recompile limit of {DYNAMO_RECOMPILE_LIMIT}, past which the steps after "
                          f"the warm-up would run uncompiled; use train.seq_warmup_start={T >> most} or more"
                          if most > 0 else
                          f"train.seq_warmup_steps={t.seq_warmup_steps}: compiled per block with "
                          f"{variants} kinds of block inputs (value embeddings, U-net skips), the warm-up's shapes "
                          f"would pass torch.compile's recompile limit of {DYNAMO_RECOMPILE_LIMIT}; use "
                          f"train.compile_scope=model or train.seq_warmup_steps=0")


def _validate_fp8(cfg: Config) -> None:
    m, t = cfg.model, cfg.train
    if t.fp8 == "off":
        return
    # Under tensor parallelism the refusal is the tensor axis's (distlm/layout/tensor.py).
    # torch._scaled_mm: the contraction dim and the weight's two dims must be multiples of 16.
    for key, v in (("model.d_model", m.d_model), ("model.d_ff", m.d_ff)):
        if v % 16:
            raise ConfigError(f"train.fp8={t.fp8} needs {key} to be a multiple of 16 (float8 matmuls work on "
                              f"16-wide tiles), got {v}")


def _validate_task(cfg: Config) -> None:
    task = cfg.task
    if task.name != "classify":
        return
    # Its DDP/FSDP2 path is the one tested (TP and PP refuse it: distlm/layout/).
    if cfg.parallel.engine != "torch":
        raise ConfigError(f"task.name=classify runs on parallel.engine=torch, not {cfg.parallel.engine}")
    # The classifier runs the trunk's blocks itself, without the token-id-driven extras.
    extras = token_id_extras(cfg.model)
    if extras:
        raise ConfigError(f"task.name=classify does not support {', '.join(extras)}: the classifier's trunk runs "
                          f"plain blocks")


def to_yaml(cfg: Config) -> str:
    data = cfg.to_dict()
    for section, cls in SECTIONS.items():  # an unresolved auto reads as the user wrote it
        for f in dataclasses.fields(cls):
            if f.metadata.get("auto") and data[section][f.name] is None:
                data[section][f.name] = AUTO
    return yaml.safe_dump(data, sort_keys=False)
