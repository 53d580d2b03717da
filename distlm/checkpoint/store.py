"""Checkpoints as distributed state dicts (torch.distributed.checkpoint).

Layout of one checkpoint, ``RUN/checkpoints/step_0000100/``:
  .metadata, __*_*.distcp   DCP: model + optimizer, keyed by fully-qualified names,
                            so any layout (1 process, DDP, FSDP2, TP) can load it
  rng/rank_00000.pt         each rank's RNG state (dropout)
  config.json               the run config, as in the marker: covered by the checksums, so an
                            edit of the marker's config is refused (verify.read_meta)
  distlm.json               written last: step, tokens, loader state, config, val loss,
                            and "files": {relpath: {"bytes": n, "sha256": hex}} of every file above

It is written to ``.tmp-step_*`` and renamed into place only when complete, so a
``step_*`` folder without ``distlm.json`` never exists unless something outside
distlm tore it; such folders are reported and skipped.

What a loaded checkpoint is guaranteed to be:
- nothing in it runs: metadata and pickled entries go through safe_dcp's allow-listed
  unpicklers, and any refusal is a one-line CheckpointError;
- its files are the bytes that were saved (sha256 per file, checked on every load; a
  checkpoint written before checksums existed loads unverified, with a note);
- its weights are finite: save refuses NaN/Inf parameters, and load checks again.
"""
from __future__ import annotations

import errno as errno_codes
import io
import json
import os
import shutil
import stat
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict, StateDictOptions

from distlm.checkpoint.errors import (CheckpointError, CheckpointSaveError, CorruptCheckpoint,  # noqa: F401 (re-exported)
                                      NonFiniteCheckpoint)
from distlm.checkpoint.files import CONFIG, MARKER, _fsync_dir, _hash_files, _listed_files, _own_files, open_regular
from distlm.checkpoint.group import _agree, _any_rank, _distributed, _flag_device, _rank, _world
from distlm.checkpoint.staging import HostStaging
from distlm.checkpoint.safe_dcp import (ENTRY_LIMIT, load_weights_only, one_line, read_dcp_metadata, safe_load,
                                       underlying_errors)
from distlm.checkpoint.verify import (VerifiedFiles, marker_text, pruned_meanwhile, read_meta,  # noqa: F401
                                     verify_checkpoint, verify_files)
from distlm.host import local_ranks, usable_cores
from distlm.io import _umask, atomic_write_text, write_new
from distlm.local_shard import local_shard

# DCP warns on every single-process save/load; one process is a supported layout here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


# ---- non-finite weights --------------------------------------------------------------------
def _locally_finite(tensors) -> bool:
    """These tensors (this rank's shards of DTensors) are all finite. Checked in slices, so a
    large shard needs no boolean mask of its own size, with one device sync in all."""
    flags = []
    for p in tensors:
        if not isinstance(p, torch.Tensor):
            continue
        t = local_shard(p).detach()
        if t.is_meta or t.numel() == 0 or not (t.is_floating_point() or t.is_complex()):
            continue
        flags.extend(torch.isfinite(chunk).all() for chunk in t.reshape(-1).split(1 << 24))
    return bool(torch.stack([f.cpu() for f in flags]).all()) if flags else True


def params_finite(model) -> bool:
    """True when every parameter of the model, on every rank, is finite. Collective over the
    default group when one is up (every rank must call it); DTensor (FSDP2/TP) parameters are
    checked shard by shard, each rank its own."""
    return not _any_rank([not _locally_finite(model.parameters())])[0]


# ---- saving ------------------------------------------------------------------------------
def _save_cause(e: BaseException) -> tuple[str, Optional[int]]:
    """(short reason, errno) of a failed save, dug out of DCP's per-rank failures and the
    exception chain: "No space left on device", "Permission denied", "disk full", ..."""
    inner = underlying_errors(e)
    for x in inner:
        seen = set()
        while x is not None and id(x) not in seen:
            seen.add(id(x))
            if isinstance(x, CheckpointSaveError):
                return x.cause, x.errno
            if isinstance(x, OSError) and x.errno:
                return os.strerror(x.errno), x.errno
            if "unexpected pos" in str(x) or "inline_container" in str(x):
                # torch's zip writer got fewer bytes written than it asked for: the disk
                # (or the quota) is full; the OSError itself is lost inside the C++ writer.
                return "disk full (a short write in torch's file writer)", errno_codes.ENOSPC
            x = x.__cause__ or x.__context__
    first = inner[0]
    lines = [ln for ln in str(first).strip().splitlines() if ln.strip()]
    return f"{first.__class__.__name__}: {one_line(lines[-1] if lines else '')}", None


def _as_save_error(e: BaseException, final: Path) -> CheckpointSaveError:
    if isinstance(e, CheckpointSaveError):
        return e
    cause, code = _save_cause(e)
    return CheckpointSaveError(f"cannot write checkpoint {final}: {cause}", cause, code)


def save_checkpoint(ckpt_root: Path, step: int, model, optimizer, meta: dict, async_save: bool = False,
                    memo: Optional[VerifiedFiles] = None, background_group: Optional[dist.ProcessGroup] = None,
                    lap: Optional[Callable[[str], None]] = None, staging: Optional[HostStaging] = None):
    """Collective: every rank calls it. Returns the final folder, or (async_save) a
    PendingSave whose ``finish()`` must be called (also collectively) before the
    checkpoint counts: until then it is a ``.tmp-step_*`` folder that resume skips.
    ``memo`` remembers the files as verified (their checksums were just computed).
    ``background_group``: the group an async save's collectives run on (group.background_save_group;
    required when several processes save in the background). ``lap(name)`` is called at the end
    of each phase of a save made here (the state gathered, the files written, their checksums,
    the marker and the rename), for a caller that times them. ``staging``: the HostStaging a
    synchronous save copies the state into before writing it (its copy counts as the write).

    Any failure is a CheckpointSaveError (NonFiniteCheckpoint for NaN/Inf weights, found
    before anything is written), raised on every rank, with the temp folder removed and
    every earlier checkpoint untouched. KeyboardInterrupt and SystemExit pass through."""
    if async_save and background_group is None and _distributed():
        raise ValueError("save_checkpoint: a background save of several processes needs a background_group")
    ckpt_root = Path(ckpt_root)
    final = ckpt_root / f"step_{step:07d}"
    if not params_finite(model):
        raise NonFiniteCheckpoint(f"cannot write checkpoint {final}: the model parameters hold NaN or Inf",
                                  "the model parameters hold NaN or Inf")
    tmp = None
    try:
        error, name = None, None
        if _rank() == 0:
            try:
                ckpt_root.mkdir(parents=True, exist_ok=True)
                _remove_stale_temps(ckpt_root, step)
                tmp = _new_temp_folder(ckpt_root, step)
                name = tmp.name
                if "config" in meta:
                    write_new(tmp / CONFIG, json.dumps(meta["config"], indent=1).encode())
            except OSError as e:
                error = e
        _agree(error, f"cannot write checkpoint {final}")
        tmp = ckpt_root / _shared_name(name)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        # A rank that cannot write its RNG file still joins DCP's save (a collective), and the
        # failure is agreed on in _finalize: no rank is left waiting.
        rng_error = None
        try:
            (tmp / "rng").mkdir(exist_ok=True)
            if not stat.S_ISDIR(os.lstat(tmp / "rng").st_mode):  # mkdir's exist_ok follows a link
                raise CheckpointSaveError(f"{tmp / 'rng'}: is not a folder of this save (a link?)", "not a folder")
            rng = {"cpu": torch.get_rng_state()}
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                rng["cuda"] = torch.cuda.get_rng_state()
            buf = io.BytesIO()
            torch.save(rng, buf)
            write_new(tmp / "rng" / f"rank_{_rank():05d}.pt", buf.getvalue())
        except Exception as e:
            rng_error = e
        if async_save:
            # async_save copies the state to host memory before returning; the files are
            # written by a background thread while training goes on.
            future = dcp.async_save({"model": model_sd, "optim": optim_sd}, storage_writer=_writer(tmp),
                                    process_group=background_group)
            return PendingSave(future, ckpt_root, tmp, final, {**meta, "step": step}, rng_error, memo)
        lap = lap or (lambda name: None)
        lap("checkpoint state")
        state = {"model": model_sd, "optim": optim_sd}
        state = staging.stage(state) if staging is not None else state
        _check_written(dcp.save(state, storage_writer=_writer(tmp)), final)
        del state
        lap("checkpoint write")
        _finalize(ckpt_root, tmp, final, {**meta, "step": step}, rng_error, memo, lap)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        if tmp is not None:
            discard(tmp)
        raise _as_save_error(e, final) from e
    except BaseException:
        if tmp is not None:
            discard(tmp)
        raise
    return final


# The temporary folder a checkpoint is written into: TEMP_PREFIX + the step + "-" + a random part.
TEMP_PREFIX = ".tmp-step_"


def _new_temp_folder(ckpt_root: Path, step: int) -> Path:
    """A new folder under a name nobody can predict (tempfile.mkdtemp: created, never
    adopted), so a process that can write in the run folder cannot place a link where the
    checkpoint's files will go. Its mode is a plain mkdir's, not mkdtemp's 0700."""
    tmp = Path(tempfile.mkdtemp(dir=ckpt_root, prefix=f"{TEMP_PREFIX}{step:07d}-"))
    os.chmod(tmp, 0o777 & ~_umask())
    return tmp


def _remove_stale_temps(ckpt_root: Path, step: int) -> None:
    """The temporary folders an earlier save of this step left (a process killed mid-save):
    removed, links only unlinked (never followed)."""
    for old in ckpt_root.glob(f"{TEMP_PREFIX}{step:07d}*"):
        if old.is_symlink() or not old.is_dir():
            old.unlink(missing_ok=True)
        else:
            shutil.rmtree(old, ignore_errors=True)


def _shared_name(name: Optional[str]) -> str:
    """Rank 0's temporary folder's name, on every rank (collective when a group is up)."""
    if not _distributed():
        return name
    box = [name]
    dist.broadcast_object_list(box, src=0, device=_flag_device())
    return box[0]


def write_threads(environ=os.environ) -> int:
    """Files (and threads) per rank for a checkpoint's tensors. DCP writes one file per rank on
    one thread by default, and each file is then hashed on one thread: with several, the
    writes, their fsyncs and the checksums run side by side (hashlib and file I/O release the
    GIL). A share of the host's cores for each of its ranks, at most 8."""
    return max(1, min(8, usable_cores() // local_ranks(environ)))


def _writer(tmp: Path) -> dcp.FileSystemWriter:
    return dcp.FileSystemWriter(str(tmp), thread_count=write_threads())


# DCP's writer threads beyond its first: Python names a thread "Thread-N (TARGET)" after its target.
_WRITER_THREAD = "(_write_files_from_queue)"


def _check_written(metadata, final: Path) -> None:
    """Every item DCP planned to write has a place in a file. With several writer threads, DCP
    collects what each wrote but does not hear of one that failed (its exception ends the
    thread): its items would be missing from a checkpoint that saved "successfully"."""
    storage = getattr(metadata, "storage_data", None)
    if storage is None:
        return  # a torch that returns no metadata: nothing to compare
    missing = [fqn for fqn, item in metadata.state_dict_metadata.items()
               if not _stored(fqn, item, storage)]
    if missing:
        raise CheckpointSaveError(f"cannot write checkpoint {final}: {len(missing)} entries were not written "
                                  f"(first: {missing[0]}); a writer thread failed",
                                  "a writer thread failed")


def _stored(fqn: str, item, storage) -> bool:
    from torch.distributed.checkpoint.metadata import MetadataIndex
    chunks = getattr(item, "chunks", None)
    if chunks is None:  # bytes: one entry under the name
        return any(key.fqn == fqn for key in storage)
    return all(MetadataIndex(fqn, chunk.offsets) in storage for chunk in chunks)


def _join_writers() -> None:
    """Wait for DCP's writer threads still running: when one thread fails, DCP raises without
    joining the others, and they would go on writing into a folder being removed."""
    for t in threading.enumerate():
        if t is not threading.current_thread() and t.name.endswith(_WRITER_THREAD):
            t.join()


def discard(tmp: Path) -> None:
    """Remove a save that failed half-way (a full disk keeps no partial files)."""
    _join_writers()
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)


def _remove_checkpoint(p: Path) -> None:
    (p / MARKER).unlink(missing_ok=True)  # first: a half-deleted folder must not pass for complete
    shutil.rmtree(p, ignore_errors=True)


def _finalize(ckpt_root: Path, tmp: Path, final: Path, meta: dict, carried: Optional[BaseException] = None,
              memo: Optional[VerifiedFiles] = None, lap: Callable[[str], None] = lambda name: None) -> None:
    """Collective. Each rank hashes the files it wrote; rank 0 gathers the checksums, hashes
    what no rank claimed, writes the marker and renames the folder into place."""
    rank, error = _rank(), carried
    mine: dict = {}
    if error is None:
        try:
            mine = _hash_files(tmp, _own_files(tmp, rank))
        except Exception as e:
            error = e
    report = (mine, None if error is None else (*_save_cause(error), rank))
    if _distributed():  # doubles as the barrier: every rank's files are on disk before the marker says so
        reports = [None] * _world()
        dist.all_gather_object(reports, report)
    else:
        reports = [report]
    lap("checkpoint checksums")
    failed = [r[1] for r in reports if r[1] is not None]
    if failed:
        cause, code, where = failed[0]
        raise CheckpointSaveError(f"cannot write checkpoint {final}: {cause}"
                                  + (f" (on rank {where})" if _world() > 1 else ""), cause, code)
    error = None
    if rank == 0:
        try:
            files = {k: v for r in reports for k, v in r[0].items()}
            files.update(_hash_files(tmp, [r for r in _listed_files(tmp) if r not in files]))
            _publish(ckpt_root, tmp, final, {**meta, "complete": True, "files": files}, memo)
        except Exception as e:
            error = e
    _agree(error, f"cannot write checkpoint {final}")
    lap("checkpoint marker")


def _publish(ckpt_root: Path, tmp: Path, final: Path, meta: dict, memo: Optional[VerifiedFiles]) -> None:
    """Rank 0: the marker into the temp folder, then the folder into place."""
    if (final / MARKER).is_file():
        try:
            old = read_meta(final)
            verify_files(final, old, collective=False, memo=memo)
        except CheckpointError:
            old = None  # that folder is damaged: the fresh save replaces it below
        if old is not None:
            # This step is already saved whole, and a step's state is the same whoever saves
            # it: keep that folder (no window without it) and refresh only its metadata,
            # with the checksums of the files that stay.
            kept = {k: v for k, v in meta.items() if k != "files"}
            if "files" in old:
                kept["files"] = old["files"]
            if CONFIG in old.get("files", {}):
                kept["config"] = old["config"]  # the config its kept config.json holds
            atomic_write_text(final / MARKER, marker_text(kept))
            shutil.rmtree(tmp, ignore_errors=True)
            _fsync_dir(ckpt_root)
            _remember(memo, final, kept)
            return
    atomic_write_text(tmp / MARKER, marker_text(meta))
    if final.exists():  # a torn or damaged folder of this step: replace it
        _remove_checkpoint(final)
    os.replace(tmp, final)
    _fsync_dir(ckpt_root)
    _remember(memo, final, meta)


def _remember(memo: Optional[VerifiedFiles], ckpt: Path, meta: dict) -> None:
    if memo is not None and "files" in meta:
        memo.remember(ckpt, meta["files"])


class PendingSave:
    def __init__(self, future, ckpt_root: Path, tmp: Path, final: Path, meta: dict,
                 rng_error: Optional[BaseException] = None, memo: Optional[VerifiedFiles] = None):
        self.future, self.ckpt_root, self.tmp, self.final, self.meta = future, ckpt_root, tmp, final, meta
        self.rng_error, self.memo = rng_error, memo

    def finish(self) -> Path:
        """Collective. Raises CheckpointSaveError (every rank) when the background write or
        the finalisation failed; the temp folder is gone then."""
        try:
            _check_written(self.future.result(), self.final)
            _finalize(self.ckpt_root, self.tmp, self.final, self.meta, self.rng_error, self.memo)
        except (Exception, CheckpointException) as e:
            discard(self.tmp)
            raise _as_save_error(e, self.final) from e
        except BaseException:
            discard(self.tmp)
            raise
        return self.final


def update_meta(ckpt: Path, memo: Optional[VerifiedFiles] = None, **fields) -> dict:
    """Rank 0: add or replace top-level entries of a complete checkpoint's marker (the final
    validation loss, written after the save), atomically. The checksums and the step stay
    as saved: the marker is not among the files it lists, so they remain valid (and a
    ``memo`` that held the checkpoint as verified still does)."""
    ckpt = Path(ckpt)
    fixed = {"files", "step", "complete", "config"} & set(fields)
    if fixed:
        raise ValueError(f"update_meta cannot change {sorted(fixed)}: they describe what was saved")
    meta = read_meta(ckpt)
    was_verified = memo is not None and "files" in meta and memo.holds(ckpt, meta["files"])
    meta.update(fields)
    atomic_write_text(ckpt / MARKER, marker_text(meta))
    if was_verified:
        memo.remember(ckpt, meta["files"])
    return meta


# ---- finding checkpoints -----------------------------------------------------------------
def list_checkpoints(ckpt_root: Path) -> tuple[list[Path], list[Path]]:
    """(complete checkpoints oldest first, torn folders: no marker, or a link)."""
    complete, torn = [], []
    if not Path(ckpt_root).is_dir():
        return complete, torn
    for p in sorted(Path(ckpt_root).iterdir()):
        # a link is never followed out of the run folder: it counts as torn, left alone
        if p.name.startswith("step_") and not p.is_symlink() and (p / MARKER).is_file():
            complete.append(p)
        elif p.name.startswith(("step_", TEMP_PREFIX)):
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
        from distlm.folders import checkpoints_near, describe
        raise CheckpointError(f"no complete checkpoint under {p}: {describe(p)}; {checkpoints_near(p)}")
    return complete[-1]


def _reason(e: CheckpointError, ckpt: Path) -> str:
    msg = str(e)
    for prefix in (f"{ckpt}: ", f"{ckpt}/"):
        if msg.startswith(prefix):
            return msg[len(prefix):]
    return msg


def _auto_candidates(run_dir: Path, say, memo: Optional[VerifiedFiles]) -> Iterator[Path]:
    """resume=auto: the run's complete checkpoints that verify, newest first (collective).
    Torn and corrupt ones are named and skipped; raises when there are checkpoints but
    none can be used (starting again from step 0 over them is a person's decision)."""
    root = Path(run_dir) / "checkpoints"
    complete, torn = list_checkpoints(root)
    for p in torn:
        say(f"resume: skipping incomplete checkpoint {p} ({'a link' if p.is_symlink() else 'no ' + MARKER})")
    if not complete:
        say(f"resume=auto: no checkpoint in {run_dir}, starting from step 0")
        return
    skipped = 0
    for p in reversed(complete):
        try:
            verify_checkpoint(p, memo=memo)
        except CorruptCheckpoint as e:
            say(f"resume: skipping corrupt checkpoint {p}: {_reason(e, p)}")
            skipped += 1
            continue
        if skipped:
            say(f"resume=auto: falling back to {p}, the newest checkpoint that verifies")
        yield p
    raise CorruptCheckpoint(f"resume=auto: none of the {len(complete)} checkpoints in {root} can be used (each is "
                            f"named above); move them aside, or set train.resume=never to start again")


def resume_target(resume: str, run_dir: Path, say=print, memo: Optional[VerifiedFiles] = None) -> Optional[Path]:
    """train.resume -> the checkpoint to load: ``never`` -> None; ``auto`` -> the run's newest
    complete checkpoint that verifies (torn and corrupt ones are named and skipped; None when
    there is none); else PATH. Collective for ``auto`` (verification is split among ranks)."""
    if resume == "never":
        return None
    if resume != "auto":
        return resolve_checkpoint(resume)
    return next(_auto_candidates(run_dir, say, memo), None)


def resume_and_load(resume: str, run_dir: Path, model, optimizer, say=print,
                    memo: Optional[VerifiedFiles] = None) -> tuple[Optional[Path], Optional[dict]]:
    """resume_target, then load_checkpoint, in one: with ``auto``, a checkpoint that verifies
    but fails to load as corrupt (non-finite weights, an unreadable entry) is skipped too,
    for the one before it. Returns (folder, marker) or (None, None). Collective."""
    if resume == "never":
        return None, None
    if resume != "auto":
        folder = resolve_checkpoint(resume)
        return folder, load_checkpoint(folder, model, optimizer, memo=memo)
    for folder in _auto_candidates(run_dir, say, memo):
        try:
            return folder, load_checkpoint(folder, model, optimizer, memo=memo)
        except CorruptCheckpoint as e:
            say(f"resume: skipping corrupt checkpoint {folder}: {_reason(e, folder)}")
    return None, None


# ---- loading -----------------------------------------------------------------------------
def _check_shapes(ckpt: Path, prefix: str, state: dict) -> None:
    md = read_dcp_metadata(Path(ckpt) / ".metadata").state_dict_metadata
    for key, value in state.items():
        full = f"{prefix}.{key}"
        if full not in md:
            raise CheckpointError(f"{ckpt}: has no '{key}' that this model needs (a different architecture?)")
        saved = tuple(getattr(md[full], "size", ()))
        want = tuple(value.shape) if hasattr(value, "shape") else ()
        if saved != want:
            raise CheckpointError(f"{ckpt}: '{key}' has shape {list(saved)} but the model expects {list(want)}")


def load_model_state(ckpt: Path, model_sd: dict, verify: bool = True, memo: Optional[VerifiedFiles] = None) -> dict:
    """Collective. Fill ``model_sd`` (a model state dict from get_state_dict, or a part of
    one) in place with the checkpoint's model weights, checked like load_checkpoint's:
    checksums, names and shapes, safe unpickling, finite values. Returns the marker."""
    ckpt = Path(ckpt)
    meta = read_meta(ckpt)
    if verify:
        verify_files(ckpt, meta, collective=True, memo=memo)
    _check_shapes(ckpt, "model", model_sd)
    safe_load({"model": model_sd}, ckpt)
    if _any_rank([not _locally_finite(model_sd.values())])[0]:
        raise CorruptCheckpoint(f"{ckpt}: the model weights hold NaN or Inf (saved after training diverged)")
    return meta


def _read_rng(rng_file: Path) -> dict:
    with open_regular(rng_file) as fh:
        rng = load_weights_only(io.BytesIO(fh.read(ENTRY_LIMIT + 1)), str(rng_file))
    if not (isinstance(rng, dict) and isinstance(rng.get("cpu"), torch.Tensor) and rng["cpu"].dtype == torch.uint8
            and isinstance(rng.get("cuda", rng["cpu"]), torch.Tensor)):
        raise CorruptCheckpoint(f"{rng_file}: not an RNG state")
    try:  # a wrong size or an invalid state, tried on a scratch generator, not the process's own
        torch.Generator().set_state(rng["cpu"])
    except RuntimeError as e:
        raise CorruptCheckpoint(f"{rng_file}: not a CPU RNG state ({one_line(str(e).splitlines()[0], 120)})") from None
    if "cuda" in rng and (rng["cuda"].dtype != torch.uint8 or rng["cuda"].dim() != 1
                          or (torch.cuda.is_available() and rng["cuda"].numel() != torch.cuda.get_rng_state().numel())):
        raise CorruptCheckpoint(f"{rng_file}: 'cuda' is not a CUDA RNG state of this torch")
    return rng


def load_checkpoint(ckpt: Path, model, optimizer=None, verify: bool = True,
                    memo: Optional[VerifiedFiles] = None) -> dict:
    """Collective. Loads in place into whatever layout the model/optimizer now have.
    ``verify``: check the files' checksums first (cheap when ``memo`` holds the checkpoint
    as verified and unchanged). The loaded weights must be finite. Any problem is a one-line
    CheckpointError (CorruptCheckpoint for damaged content); a checkpoint pruned while it was
    read (`distlm eval` beside a training run) says so."""
    ckpt = Path(ckpt)
    try:
        return _load_checkpoint(ckpt, model, optimizer, verify, memo)
    except CheckpointError as e:
        raise pruned_meanwhile(ckpt) or e from None


def _load_checkpoint(ckpt: Path, model, optimizer, verify: bool, memo: Optional[VerifiedFiles]) -> dict:
    meta = read_meta(ckpt, resume=optimizer is not None)
    if verify:
        verify_files(ckpt, meta, collective=True, memo=memo)
    if optimizer is None:
        model_sd = get_state_dict(model, [], options=StateDictOptions())[0]
        load_model_state(ckpt, model_sd, verify=False)
        set_state_dict(model, [], model_state_dict=model_sd, optim_state_dict={})
        return meta
    model_sd, optim_sd = get_state_dict(model, optimizer)
    _check_shapes(ckpt, "model", model_sd)
    state = {"model": model_sd, "optim": optim_sd}
    safe_load(state, ckpt)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng_file = ckpt / "rng" / f"rank_{_rank():05d}.pt"
    rng, rng_error = None, None
    if os.path.lexists(rng_file):  # a new rank (resumed on more ranks) keeps its seeded RNG
        try:
            rng = _read_rng(rng_file)
        except CheckpointError as e:
            rng_error = e
    _require_finite(ckpt, model, rng_error)
    if rng is not None:
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return meta


def _require_finite(ckpt: Path, model, rng_error: Optional[CheckpointError] = None) -> None:
    """Collective: the loaded weights are finite on every rank, and every rank read its RNG
    file; otherwise every rank raises (one rank raising alone would hang the others)."""
    nonfinite, rng_bad = _any_rank([not _locally_finite(model.parameters()), rng_error is not None])
    if rng_error is not None:
        raise rng_error
    if rng_bad:
        raise CorruptCheckpoint(f"{ckpt}: another rank's RNG file could not be loaded (its output names it)")
    if nonfinite:
        raise CorruptCheckpoint(f"{ckpt}: the model parameters hold NaN or Inf (saved after training diverged)")


# ---- pruning -----------------------------------------------------------------------------
def newest_good_checkpoint(ckpt_root: Path, memo: Optional[VerifiedFiles] = None) -> Optional[Path]:
    """The newest complete checkpoint that verifies (rank 0 alone: not collective)."""
    complete, _ = list_checkpoints(ckpt_root)
    for p in reversed(complete):
        try:
            verify_checkpoint(p, collective=False, memo=memo)
            return p
        except CorruptCheckpoint as e:
            if memo is None or memo.first_note(f"prune:{p.resolve()}"):
                print(f"warning: checkpoint {p} fails verification ({_reason(e, p)}); pruning keeps the newest "
                      f"one that verifies", file=sys.stderr)
    return None


def prune_checkpoints(ckpt_root: Path, keep_last: int, keep_also: list[Path] = (),
                      memo: Optional[VerifiedFiles] = None, protect: Optional[Path] = None) -> list[Path]:
    """Delete old complete checkpoints beyond the newest keep_last and those in keep_also
    (the best). ``protect`` (the last one before a fault) counts among the keep_last: with
    keep_last=2 the newest and it are kept. Never deleted: the newest complete one, and the
    newest one that verifies; when none verifies, nothing is deleted. Torn folders are left
    for a person to look at. Rank 0 only."""
    complete, _ = list_checkpoints(ckpt_root)
    good = newest_good_checkpoint(ckpt_root, memo) if complete else None
    if good is None:
        return []
    newest = complete[-max(1, keep_last):]
    if protect is not None and Path(protect) in complete and Path(protect) not in newest:
        newest = complete[-max(1, keep_last - 1):]
    keep = set(newest) | {Path(p) for p in keep_also} | {good} | ({Path(protect)} if protect else set())
    removed = []
    for p in complete:
        if p not in keep:
            _remove_checkpoint(p)
            removed.append(p)
    return removed
