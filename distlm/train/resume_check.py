"""Resume only what this run would have trained: the checkpoint's config against the new one.

A checkpoint's marker keeps the resolved config it was trained with. A resume restores the
weights, the optimizer state and the loader's step; it is the same run only when the model
and the order of its batches are the same. Every config field is classified below, once:

MUST_MATCH    the model's shape or function, the data and the order of its batches, the
              optimizer whose state is restored. A difference is refused, before any weight
              is loaded, naming each field with both values.
MAY_CHANGE    how the same run is carried on: its length and schedule, evaluation, logging,
              checkpointing, the parallel layout (checkpoints reshard across layouts), the
              device, dtype and compilation, the micro-batch (the global batch, and so the
              data order and the update, stay the same; only the accumulation changes).

tests/train/test_logger.py checks that every field of the config is in exactly one of the two,
so a new field cannot slip through unclassified.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Optional

from distlm.checkpoint import store as ckpt
from distlm.checkpoint.errors import CheckpointError
from distlm.config import SECTIONS, Config, ConfigError, OptimConfig

MUST_MATCH: dict[str, tuple[str, ...] | str] = {
    # Every architecture field but loss_chunk: they decide the parameters' shapes, or what the
    # same parameters compute (dropout, norms, masks, RoPE base, soft-capping, init std).
    "model": "*",
    # The training tokens: which folder (or mixture), real or synthetic.
    "data": ("dir", "source", "mix"),
    # The data order is a function of (seed, step, global batch); the restored optimizer
    # state belongs to one optimizer. The sequence warm-up cuts those batches into rows by
    # step: another one changes what the run's early steps trained on (their examples and
    # contexts), and one changed mid-run would send a model already on full blocks back to
    # short rows, unlike extending a learning-rate schedule.
    "train": ("seed", "global_batch_size", "seq_warmup_steps", "seq_warmup_start"),
    # optim.muon.embed_lr on or off decides whether the embedding tables have their own optimizer
    # group; its value, like any rate, may change (see _same). A nested field named here is kept
    # although its section is listed under MAY_CHANGE.
    "optim": ("name", "muon.embed_lr"),
    # A language model and a classifier, or two poolings, are different models.
    "task": ("name", "attention", "pooling"),
}

MAY_CHANGE: dict[str, tuple[str, ...] | str] = {
    # The head and cross-entropy computed this many tokens at a time: memory, not math.
    "model": ("loss_chunk",),
    "data": ("verify_checksums",),
    "train": (
        # Length and learning-rate schedule: extending a run (more max_steps, a longer decay)
        # is what resume is for.
        "max_steps", "warmup_steps", "decay", "wsd_decay_fraction", "min_lr_ratio", "grad_clip", "time_budget_s",
        # Accumulation only: the same global batch in more or fewer forwards.
        "micro_batch_size",
        # Evaluation, checkpoints, resume itself.
        "eval_every", "eval_batches", "checkpoint_every", "keep_last", "async_checkpoint", "resume",
        # Where and how fast it runs: a GPU run continues on a CPU and back (fp32 or bf16).
        "device", "dtype", "compile", "compile_scope", "compile_mode", "memory_check",
        # Float8 matmuls on the same parameters, kept in their dtype: a float8 run goes on in bf16 and back.
        "fp8",
        # Fault handling.
        "time_limit_s", "on_nan", "max_nan_skips", "on_save_error", "watchdog_s"),
    # Every optimizer's own settings (rates, momenta, decay, Muon's Newton-Schulz steps and the
    # precision of its matmuls, which gives the same update to bf16's rounding), like the
    # schedule's: all but which optimizer it is and which groups it has (MUST_MATCH).
    "optim": tuple(f.name for f in dataclasses.fields(OptimConfig) if f.name not in MUST_MATCH["optim"]),
    # Checkpoints are keyed by parameter names, whatever the layout (tested across layouts).
    "parallel": "*",
    "log": "*",
    # Only a fresh start reads these: a resume brings its own weights (the architecture they
    # implied is compared under model.*).
    "init": "*",
    "task": ("init_from",),
}


def _fields(section: str, spec) -> set[str]:
    names = {f.name for f in dataclasses.fields(SECTIONS[section])}
    return names if spec == "*" else set(spec)


def must_match_fields() -> list[str]:
    """Dotted names of every field a resume must keep."""
    may = {f"{s}.{n}" for s, spec in MAY_CHANGE.items() for n in _fields(s, spec)}
    return sorted(f"{s}.{n}" for s, spec in MUST_MATCH.items() for n in _fields(s, spec) if f"{s}.{n}" not in may)


def _same(key: str, saved: Any, now: Any) -> bool:
    if saved == now:
        return True
    if key == "optim.muon.embed_lr":
        return bool(saved) == bool(now)  # another rate is fine; on <-> off changes the optimizer's groups
    if key == "data.dir" and saved and now:
        # The same folder spelled two ways (relative and absolute): still the same data.
        try:
            return os.path.samefile(saved, now)
        except OSError:
            return False
    return False


def _show(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if v == "":
        return '""'
    return str(v)


def differences(saved: dict, cfg: Config) -> list[tuple[str, Any, Any]]:
    """(field, checkpoint's value, this run's value) of every MUST_MATCH field that differs.
    A field missing from an older checkpoint's config counts as its default (new fields
    default to what distlm did before they existed)."""
    out = []
    for key in must_match_fields():
        section, name, *inner = key.split(".")
        f = next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == name)
        if inner:  # one field of a nested section (optim.muon.embed_lr)
            g = next(g for g in dataclasses.fields(f.default_factory) if g.name == inner[0])
            was_section = (saved.get(section) or {}).get(name)
            was = (was_section if isinstance(was_section, dict) else {}).get(inner[0], g.default)
            now = getattr(getattr(getattr(cfg, section), name), inner[0])
            if not _same(key, was, now):
                out.append((key, was, now))
            continue
        default = f.default
        was = (saved.get(section) or {}).get(name, default)
        now = getattr(getattr(cfg, section), name)
        if dataclasses.is_dataclass(now):  # a nested section (model.moe): compared field by field
            base = dataclasses.asdict(f.default_factory())
            was = {**base, **(was if isinstance(was, dict) else {})}
            now = dataclasses.asdict(now)
            # the kernel computes the same numbers, as train.compile does
            out += [(f"{key}.{k}", was[k], now[k]) for k in now if was[k] != now[k] and k != "kernel"]
            continue
        if not _same(key, was, now):
            out.append((key, was, now))
    return out


def check_resume_config(saved: dict, cfg: Config, folder: Path) -> None:
    """A one-line ConfigError naming every field that differs between the checkpoint's config
    and this run's, with both values; nothing when the run may be resumed from it."""
    diff = differences(saved, cfg)
    if not diff:
        return
    was = ", ".join(f"{k}={_show(a)}" for k, a, _ in diff)
    now = ", ".join(f"{k}={_show(b)}" for k, _, b in diff)
    raise ConfigError(
        f"train.resume={cfg.train.resume}: the checkpoint was trained with {was}, this run has {now}; a resume "
        f"keeps the model's shape and function, the data, its order and the optimizer, so {folder} cannot "
        f"continue this run: pass the checkpoint's values, or start a new run (another log.name, or "
        f"train.resume=never)")


def newest_marker(resume: str, run_dir: Path) -> tuple[Optional[Path], Optional[dict]]:
    """The checkpoint train.resume would load, read before any weight is (marker only, no
    checksums, not collective): auto -> the run's newest complete checkpoint with a readable
    marker; PATH -> that checkpoint. (None, None) when there is none to check: resuming then
    says why (nothing to resume, or a damaged checkpoint, skipped or refused)."""
    if resume == "never":
        return None, None
    try:
        folders = [ckpt.resolve_checkpoint(resume)] if resume != "auto" else \
            list(reversed(ckpt.list_checkpoints(Path(run_dir) / "checkpoints")[0]))
    except CheckpointError:
        return None, None
    for folder in folders:
        try:
            return folder, ckpt.read_meta(folder)
        except CheckpointError:
            continue
    return None, None


def check_before_resume(cfg: Config, run_dir: Path) -> None:
    """Refuse, before the model is built or loaded, a checkpoint of another architecture or
    data: a shape error, or worse a silent resume, would come first otherwise."""
    folder, meta = newest_marker(cfg.train.resume, run_dir)
    if meta is not None:
        check_resume_config(meta["config"], cfg, folder)
