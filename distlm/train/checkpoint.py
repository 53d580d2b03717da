"""Checkpoints as distributed state dicts (torch.distributed.checkpoint).

Layout of one checkpoint, ``RUN/checkpoints/step_0000100/``:
  .metadata, __*_*.distcp   DCP: model + optimizer, keyed by fully-qualified names,
                            so any layout (1 process, DDP, FSDP2, TP) can load it
  rng/rank_00000.pt         each rank's RNG state (dropout)
  distlm.json               written last: step, tokens, loader state, config, val loss

It is written to ``.tmp-step_*`` and renamed into place only when complete, so a
``step_*`` folder without ``distlm.json`` never exists unless something outside
distlm tore it; such folders are reported and skipped.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict, StateDictOptions

from distlm.train.safe_dcp import SafeReader, safe_load  # noqa: E402

MARKER = "distlm.json"
# DCP warns on every single-process save/load; one process is a supported layout here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class CheckpointError(ValueError):
    pass


def _barrier():
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(ckpt_root: Path, step: int, model, optimizer, meta: dict, async_save: bool = False):
    """Collective: every rank calls it. Returns the final folder, or (async_save) a
    PendingSave whose ``finish()`` must be called (also collectively) before the
    checkpoint counts: until then it is a ``.tmp-step_*`` folder that resume skips."""
    ckpt_root = Path(ckpt_root)
    final = ckpt_root / f"step_{step:07d}"
    tmp = ckpt_root / f".tmp-step_{step:07d}"
    if _rank() == 0:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    (tmp / "rng").mkdir(exist_ok=True)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, tmp / "rng" / f"rank_{_rank():05d}.pt")
    if async_save:
        # async_save copies the state to host memory before returning; the files are
        # written by a background thread while training goes on.
        future = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        return PendingSave(future, ckpt_root, tmp, final, {**meta, "step": step})
    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        _finalize(ckpt_root, tmp, final, {**meta, "step": step})
    except BaseException:
        discard(tmp)
        raise
    return final


def discard(tmp: Path) -> None:
    """Remove a save that failed half-way (a full disk keeps no partial files)."""
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)


def _finalize(ckpt_root: Path, tmp: Path, final: Path, meta: dict) -> None:
    _barrier()  # every rank's files are on disk before the marker says so
    if _rank() == 0:
        if (final / MARKER).is_file():
            # This step is already saved whole, and a step's state is the same whoever saves
            # it: keep that folder (no window without it) and refresh only its metadata.
            atomic_write_text(final / MARKER, json.dumps({**meta, "complete": True}, indent=1))
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            atomic_write_text(tmp / MARKER, json.dumps({**meta, "complete": True}, indent=1))
            if final.exists():  # a torn folder of this step (no marker): replace it
                shutil.rmtree(final)
            os.replace(tmp, final)
        _fsync_dir(ckpt_root)
    _barrier()


class PendingSave:
    def __init__(self, future, ckpt_root: Path, tmp: Path, final: Path, meta: dict):
        self.future, self.ckpt_root, self.tmp, self.final, self.meta = future, ckpt_root, tmp, final, meta

    def finish(self) -> Path:
        try:
            self.future.result()
            _finalize(self.ckpt_root, self.tmp, self.final, self.meta)
        except BaseException:
            discard(self.tmp)
            raise
        return self.final


def read_meta(ckpt: Path) -> dict:
    try:
        return json.loads((Path(ckpt) / MARKER).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{ckpt}: not a complete distlm checkpoint ({e.__class__.__name__})") from None


def list_checkpoints(ckpt_root: Path) -> tuple[list[Path], list[Path]]:
    """(complete checkpoints oldest first, torn folders)."""
    complete, torn = [], []
    if not Path(ckpt_root).is_dir():
        return complete, torn
    for p in sorted(Path(ckpt_root).iterdir()):
        if p.name.startswith("step_") and (p / MARKER).is_file():
            complete.append(p)
        elif p.name.startswith(("step_", ".tmp-step_")):
            torn.append(p)
    return complete, torn


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or a run folder (its newest complete checkpoint)."""
    p = Path(path)
    if (p / MARKER).is_file():
        return p
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    complete, _ = list_checkpoints(root)
    if not complete:
        raise CheckpointError(f"no complete checkpoint under {p}")
    return complete[-1]


def resume_target(resume: str, run_dir: Path, say=print) -> Optional[Path]:
    """train.resume -> the checkpoint to load: ``never`` -> None; ``auto`` -> the run's newest
    complete checkpoint (torn ones are named and skipped; None when there is none); else PATH."""
    if resume == "never":
        return None
    if resume != "auto":
        return resolve_checkpoint(resume)
    complete, torn = list_checkpoints(run_dir / "checkpoints")
    for p in torn:
        say(f"resume: skipping incomplete checkpoint {p} (no {MARKER})")
    if not complete:
        say(f"resume=auto: no checkpoint in {run_dir}, starting from step 0")
        return None
    return complete[-1]


def _check_shapes(ckpt: Path, prefix: str, state: dict) -> None:
    try:
        md = SafeReader(str(ckpt)).read_metadata().state_dict_metadata
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError) as e:
        raise CheckpointError(f"{ckpt}: unreadable checkpoint metadata ({str(e).splitlines()[0][:200]})") from None
    for key, value in state.items():
        full = f"{prefix}.{key}"
        if full not in md:
            raise CheckpointError(f"{ckpt}: has no '{key}' that this model needs (a different architecture?)")
        saved = tuple(getattr(md[full], "size", ()))
        want = tuple(value.shape) if hasattr(value, "shape") else ()
        if saved != want:
            raise CheckpointError(f"{ckpt}: '{key}' has shape {list(saved)} but the model expects {list(want)}")


def load_checkpoint(ckpt: Path, model, optimizer=None) -> dict:
    """Collective. Loads in place into whatever layout the model/optimizer now have."""
    meta = read_meta(ckpt)
    if optimizer is None:
        opts = StateDictOptions()
        model_sd = get_state_dict(model, [], options=opts)[0]
        _check_shapes(ckpt, "model", model_sd)
        safe_load({"model": model_sd}, ckpt)
        set_state_dict(model, [], model_state_dict=model_sd, optim_state_dict={})
        return meta
    model_sd, optim_sd = get_state_dict(model, optimizer)
    _check_shapes(ckpt, "model", model_sd)
    state = {"model": model_sd, "optim": optim_sd}
    safe_load(state, ckpt)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng_file = Path(ckpt) / "rng" / f"rank_{_rank():05d}.pt"
    if rng_file.is_file():  # a new rank (resumed on more ranks) keeps its seeded RNG
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return meta


def prune_checkpoints(ckpt_root: Path, keep_last: int, keep_also: list[Path] = ()) -> list[Path]:
    """Delete old complete checkpoints beyond the newest keep_last and those in keep_also
    (the best, the last before a fault). The newest complete one is never deleted, and
    torn folders are left for a person to look at. Rank 0 only."""
    complete, _ = list_checkpoints(ckpt_root)
    keep = set(complete[-max(1, keep_last):]) | {Path(p) for p in keep_also}
    removed = []
    for p in complete:
        if p not in keep:
            (p / MARKER).unlink(missing_ok=True)  # first: a half-deleted folder must not pass for complete
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed
