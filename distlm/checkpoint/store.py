"""Checkpoints as distributed state dicts (torch.distributed.checkpoint).

Layout of one checkpoint, ``RUN/checkpoints/step_0000100/``:
  .metadata, __*_*.distcp   DCP: model + optimizer, keyed by fully-qualified names,
                            so any layout (1 process, DDP, FSDP2, TP) can load it
  rng/rank_00000.pt         each rank's RNG state (dropout)
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
import hashlib
import json
import os
import shutil
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict, StateDictOptions

from distlm.checkpoint.errors import (CheckpointError, CheckpointSaveError, CorruptCheckpoint,  # noqa: F401 (re-exported)
                                      NonFiniteCheckpoint)
from distlm.checkpoint.safe_dcp import load_weights_only, one_line, read_dcp_metadata, safe_load, underlying_errors
from distlm.io import atomic_write_text

MARKER = "distlm.json"
# One core, a 500 MB file in the page cache, this project's 2-core CPU box (with SHA-NI):
# sha256 1218 MB/s, blake2b 714 MB/s, zlib.crc32 2884 MB/s, plain read 7882 MB/s.
# sha256: a cryptographic hash at 40% of crc32's speed, and `sha256sum` checks a checkpoint
# by hand. Files hash in parallel threads (hashlib releases the GIL), and at save each rank
# hashes the files it wrote itself. End to end on that box, a 371 MB checkpoint (29M params
# + AdamW, page cache): save 0.52 s -> 0.96 s, load 0.44 s -> 0.83 s with verification,
# 0.37 s when this process saved or verified it already (see _VERIFIED).
HASH = "sha256"
_CHUNK = 4 << 20
# DCP warns on every single-process save/load; one process is a supported layout here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


# ---- process group helpers -------------------------------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier():
    if _distributed():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world() -> int:
    return dist.get_world_size() if _distributed() else 1


def _flag_device() -> torch.device:
    # NCCL reduces CUDA tensors only; gloo (and "cpu:gloo,cuda:nccl") reduce CPU ones.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _any_rank(flags: list[bool]) -> list[bool]:
    """Element-wise OR of boolean flags over all ranks (collective when a group is up)."""
    if not _distributed():
        return list(flags)
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=_flag_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def _agree(error: Optional[BaseException], what: str) -> None:
    """Collective, in place of a barrier: if any rank failed, every rank raises. A rank
    that raised alone would leave the others waiting in the next collective until the timeout."""
    if _any_rank([error is not None])[0]:
        if error is not None:
            raise error
        raise CheckpointSaveError(f"{what}: failed on another rank (its output names the cause)",
                                  "failed on another rank")


# ---- files -------------------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_marker_file(rel: str) -> bool:
    return rel == MARKER or rel.startswith(f".{MARKER}.tmp-")


def _is_payload(rel: str) -> bool:
    """A file some load reads: it must be listed, with its checksum, in the marker."""
    return rel.endswith((".metadata", ".distcp")) or (rel.startswith("rng/") and rel.endswith(".pt"))


def _listed_files(folder: Path) -> list[str]:
    """Every file of a checkpoint folder but its marker, as sorted posix relative paths."""
    out = []
    for dirpath, _, names in os.walk(folder):
        for n in names:
            rel = (Path(dirpath) / n).relative_to(folder).as_posix()
            if not _is_marker_file(rel):
                out.append(rel)
    return sorted(out)


def _file_digest(path: Path) -> tuple[int, str]:
    h, n = hashlib.new(HASH), 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while k := f.readinto(buf):
            h.update(view[:k])
            n += k
    return n, h.hexdigest()


def _hash_files(folder: Path, rels: list[str]) -> dict[str, dict]:
    """{rel: {"bytes": n, HASH: hex}}, the files hashed in parallel threads."""
    if not rels:
        return {}
    workers = max(1, min(len(rels), os.cpu_count() or 1, 8))
    with ThreadPoolExecutor(workers) as pool:
        done = list(pool.map(lambda r: _file_digest(folder / r), rels))
    return {r: {"bytes": n, HASH: hx} for r, (n, hx) in zip(rels, done)}


def _own_files(folder: Path, rank: int) -> list[str]:
    """The files this rank wrote (DCP names a rank's data files __RANK_*.distcp): hashing
    them on the rank that wrote them reads its own page cache, in parallel with the others.
    Anything nobody claims (the .metadata, a naming scheme of a later torch) rank 0 hashes."""
    own = [p.relative_to(folder).as_posix() for p in folder.glob(f"__{rank}_*.distcp")]
    rng = f"rng/rank_{rank:05d}.pt"
    return sorted(own + ([rng] if (folder / rng).is_file() else []))


# ---- non-finite weights --------------------------------------------------------------------
def _locally_finite(tensors) -> bool:
    """These tensors (this rank's shards of DTensors) are all finite. Checked in slices, so a
    large shard needs no boolean mask of its own size, with one device sync in all."""
    flags = []
    for p in tensors:
        if not isinstance(p, torch.Tensor):
            continue
        t = (p.to_local() if hasattr(p, "to_local") else p).detach()
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


def save_checkpoint(ckpt_root: Path, step: int, model, optimizer, meta: dict, async_save: bool = False):
    """Collective: every rank calls it. Returns the final folder, or (async_save) a
    PendingSave whose ``finish()`` must be called (also collectively) before the
    checkpoint counts: until then it is a ``.tmp-step_*`` folder that resume skips.

    Any failure is a CheckpointSaveError (NonFiniteCheckpoint for NaN/Inf weights, found
    before anything is written), raised on every rank, with the temp folder removed and
    every earlier checkpoint untouched. KeyboardInterrupt and SystemExit pass through."""
    ckpt_root = Path(ckpt_root)
    final = ckpt_root / f"step_{step:07d}"
    tmp = ckpt_root / f".tmp-step_{step:07d}"
    if not params_finite(model):
        raise NonFiniteCheckpoint(f"cannot write checkpoint {final}: the model parameters hold NaN or Inf",
                                  "the model parameters hold NaN or Inf")
    try:
        error = None
        if _rank() == 0:
            try:
                ckpt_root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
            except OSError as e:
                error = e
        _agree(error, f"cannot write checkpoint {final}")
        model_sd, optim_sd = get_state_dict(model, optimizer)
        # A rank that cannot write its RNG file still joins DCP's save (a collective), and the
        # failure is agreed on in _finalize: no rank is left waiting.
        rng_error = None
        try:
            (tmp / "rng").mkdir(exist_ok=True)
            rng = {"cpu": torch.get_rng_state()}
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                rng["cuda"] = torch.cuda.get_rng_state()
            torch.save(rng, tmp / "rng" / f"rank_{_rank():05d}.pt")
        except Exception as e:
            rng_error = e
        if async_save:
            # async_save copies the state to host memory before returning; the files are
            # written by a background thread while training goes on.
            future = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
            return PendingSave(future, ckpt_root, tmp, final, {**meta, "step": step}, rng_error)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        _finalize(ckpt_root, tmp, final, {**meta, "step": step}, rng_error)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        discard(tmp)
        raise _as_save_error(e, final) from e
    except BaseException:
        discard(tmp)
        raise
    return final


def discard(tmp: Path) -> None:
    """Remove a save that failed half-way (a full disk keeps no partial files)."""
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)


def _remove_checkpoint(p: Path) -> None:
    (p / MARKER).unlink(missing_ok=True)  # first: a half-deleted folder must not pass for complete
    shutil.rmtree(p, ignore_errors=True)


def _finalize(ckpt_root: Path, tmp: Path, final: Path, meta: dict, carried: Optional[BaseException] = None) -> None:
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
            _publish(ckpt_root, tmp, final, {**meta, "complete": True, "files": files})
        except Exception as e:
            error = e
    _agree(error, f"cannot write checkpoint {final}")


def _publish(ckpt_root: Path, tmp: Path, final: Path, meta: dict) -> None:
    """Rank 0: the marker into the temp folder, then the folder into place."""
    if (final / MARKER).is_file():
        try:
            old = read_meta(final)
            _verify_files(final, old, collective=False)
        except CheckpointError:
            old = None  # that folder is damaged: the fresh save replaces it below
        if old is not None:
            # This step is already saved whole, and a step's state is the same whoever saves
            # it: keep that folder (no window without it) and refresh only its metadata,
            # with the checksums of the files that stay.
            kept = {k: v for k, v in meta.items() if k != "files"}
            if "files" in old:
                kept["files"] = old["files"]
            atomic_write_text(final / MARKER, json.dumps(kept, indent=1))
            shutil.rmtree(tmp, ignore_errors=True)
            _fsync_dir(ckpt_root)
            _remember_verified(final, kept)
            return
    atomic_write_text(tmp / MARKER, json.dumps(meta, indent=1))
    if final.exists():  # a torn or damaged folder of this step: replace it
        _remove_checkpoint(final)
    os.replace(tmp, final)
    _fsync_dir(ckpt_root)
    _remember_verified(final, meta)


class PendingSave:
    def __init__(self, future, ckpt_root: Path, tmp: Path, final: Path, meta: dict,
                 rng_error: Optional[BaseException] = None):
        self.future, self.ckpt_root, self.tmp, self.final, self.meta = future, ckpt_root, tmp, final, meta
        self.rng_error = rng_error

    def finish(self) -> Path:
        """Collective. Raises CheckpointSaveError (every rank) when the background write or
        the finalisation failed; the temp folder is gone then."""
        try:
            self.future.result()
            _finalize(self.ckpt_root, self.tmp, self.final, self.meta, self.rng_error)
        except (Exception, CheckpointException) as e:
            discard(self.tmp)
            raise _as_save_error(e, self.final) from e
        except BaseException:
            discard(self.tmp)
            raise
        return self.final


# ---- the marker --------------------------------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _marker_problem(meta, resume: bool) -> Optional[str]:
    """What is wrong with a parsed marker, or None. ``resume``: it must also hold the
    trainer state a resume restores."""
    if not isinstance(meta, dict):
        return f"holds a JSON {type(meta).__name__}, not an object"
    if "step" not in meta:
        return "has no 'step'"
    if not _is_int(meta["step"]) or meta["step"] < 0:
        return f"'step' is {one_line(repr(meta['step']), 40)}, not a step number"
    if not isinstance(meta.get("config"), dict):
        return "has no 'config' section" if "config" not in meta else "'config' is not an object"
    if resume:
        trainer = meta.get("trainer")
        if not isinstance(trainer, dict):
            return "has no 'trainer' state" if "trainer" not in meta else "'trainer' is not an object"
        if not _is_int(trainer.get("step")):
            return "has no 'trainer.step'"
    files = meta.get("files")
    if files is not None:
        if not isinstance(files, dict):
            return "'files' is not an object"
        for rel, entry in files.items():
            parts = Path(rel).parts
            if not rel or Path(rel).is_absolute() or ".." in parts or _is_marker_file(rel):
                return f"'files' lists {one_line(rel, 80)}, not a file inside the checkpoint"
            if (not isinstance(entry, dict) or not _is_int(entry.get("bytes"))
                    or not isinstance(entry.get(HASH), str) or len(entry[HASH]) != hashlib.new(HASH).digest_size * 2):
                return f"'files' entry of {one_line(rel, 80)} is not {{\"bytes\": n, \"{HASH}\": hex}}"
    return None


def read_meta(ckpt: Path, resume: bool = False) -> dict:
    """A checkpoint's marker, checked for the keys every reader needs (``step``, ``config``;
    with ``resume``, the trainer state too): a damaged one is a one-line CheckpointError."""
    try:
        meta = json.loads((Path(ckpt) / MARKER).read_text())
    except (OSError, ValueError) as e:
        raise CorruptCheckpoint(f"{ckpt}: not a complete distlm checkpoint ({e.__class__.__name__})") from None
    problem = _marker_problem(meta, resume)
    if problem:
        raise CorruptCheckpoint(f"{Path(ckpt) / MARKER}: {problem} (not written by distlm, or edited)")
    return meta


def update_meta(ckpt: Path, **fields) -> dict:
    """Rank 0: add or replace top-level entries of a complete checkpoint's marker (the final
    validation loss, written after the save), atomically. The checksums and the step stay
    as saved: the marker is not among the files it lists, so they remain valid."""
    ckpt = Path(ckpt)
    fixed = {"files", "step", "complete"} & set(fields)
    if fixed:
        raise ValueError(f"update_meta cannot change {sorted(fixed)}: they describe what was saved")
    meta = read_meta(ckpt)
    key = str(ckpt.resolve())
    was_verified = "files" in meta and _VERIFIED.get(key) == _fingerprint(ckpt, meta["files"])
    meta.update(fields)
    atomic_write_text(ckpt / MARKER, json.dumps(meta, indent=1))
    if was_verified:
        _remember_verified(ckpt, meta)
    return meta


# ---- verification ------------------------------------------------------------------------
# Checkpoints this process has hashed (at save or load), with the stat of every file then:
# a checkpoint read again unchanged (resume_target then load_checkpoint, prune after a
# save) is not hashed twice. Any write to a file changes its mtime/ctime and voids it.
_VERIFIED: dict[str, tuple] = {}
_NOTED: set[str] = set()


def _fingerprint(ckpt: Path, rels) -> Optional[tuple]:
    out = []
    for rel in (MARKER, *sorted(rels)):
        try:
            st = os.stat(Path(ckpt) / rel)
        except OSError:
            return None
        out.append((rel, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
    return tuple(out)


def _remember_verified(ckpt: Path, meta: dict) -> None:
    if "files" in meta:
        fp = _fingerprint(ckpt, meta["files"])
        if fp is not None:
            _VERIFIED[str(Path(ckpt).resolve())] = fp


def _note_unverified(ckpt: Path) -> None:
    key = str(Path(ckpt).resolve())
    if key not in _NOTED and _rank() == 0:
        _NOTED.add(key)
        print(f"note: {ckpt} has no checksums (saved before distlm recorded them); its files are not verified",
              file=sys.stderr)


def _shares(sizes: list[int], world: int) -> list[int]:
    """Rank of each file: largest first onto the least-loaded rank (the same on every rank)."""
    load, owner = [0] * world, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


_CODES = {1: "is missing", 2: "could not be read", 3: f"does not match its {HASH} checksum"}


def _verify_files(ckpt: Path, meta: dict, collective: bool) -> None:
    """Every file the marker lists has its size and checksum; no loadable file is unlisted.
    ``collective`` (with a process group up, every rank calling): the files are split by size
    among the ranks and each is read once in all, and every rank reaches the same verdict."""
    ckpt = Path(ckpt)
    files = meta.get("files")
    if files is None:
        _note_unverified(ckpt)
        return
    rels = sorted(files)
    unlisted = [r for r in _listed_files(ckpt) if _is_payload(r) and r not in files]
    if unlisted:
        raise CorruptCheckpoint(f"{ckpt}: {one_line(unlisted[0], 100)} is not among the files its {MARKER} lists "
                                f"(added after the save)")
    for rel in rels:  # sizes first: cheap, and the same answer on every rank
        p = ckpt / rel
        if not p.is_file():
            raise CorruptCheckpoint(f"{ckpt}: {one_line(rel, 100)} is missing")
        size = p.stat().st_size
        if size != files[rel]["bytes"]:
            raise CorruptCheckpoint(f"{ckpt}: {one_line(rel, 100)} is {size} bytes, but {files[rel]['bytes']} "
                                    f"were saved (truncated or changed)")
    key, fp = str(ckpt.resolve()), _fingerprint(ckpt, rels)
    cached = fp is not None and _VERIFIED.get(key) == fp
    spread = collective and _distributed()
    owner = _shares([files[r]["bytes"] for r in rels], _world()) if spread else [0] * len(rels)
    mine = [] if cached else [r for r, o in zip(rels, owner) if o == _rank()]

    def check(rel: str) -> int:
        try:
            _, hx = _file_digest(ckpt / rel)
        except FileNotFoundError:
            return 1
        except OSError:
            return 2
        return 0 if hx == files[rel][HASH] else 3
    codes = dict.fromkeys(rels, 0)
    if mine:
        with ThreadPoolExecutor(max(1, min(len(mine), os.cpu_count() or 1, 8))) as pool:
            codes.update(zip(mine, pool.map(check, mine)))
    if spread:  # one collective, always: a rank with a cached verdict contributes zeros
        t = torch.tensor([codes[r] for r in rels], dtype=torch.int32, device=_flag_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        codes = dict(zip(rels, t.tolist()))
    bad = [(r, c) for r, c in codes.items() if c]
    if bad:
        _VERIFIED.pop(key, None)
        rel, code = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise CorruptCheckpoint(f"{ckpt}: {one_line(rel, 100)} {_CODES[code]}{more}: the files changed after the "
                                f"save (bad disk or copy, or an edit)")
    if fp is not None:
        _VERIFIED[key] = fp


def verify_checkpoint(ckpt: Path, collective: bool = True) -> None:
    """Raises CorruptCheckpoint unless the checkpoint is usable for a resume: its marker has
    the keys a resume needs, every file matches its saved checksum, and its DCP metadata
    reads (safely). ``collective``: with a process group up every rank must call it (the
    hashing is split among them); pass False from a single rank."""
    ckpt = Path(ckpt)
    meta = read_meta(ckpt, resume=True)
    _verify_files(ckpt, meta, collective)
    read_dcp_metadata(ckpt / ".metadata")


# ---- finding checkpoints -----------------------------------------------------------------
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


def _reason(e: CheckpointError, ckpt: Path) -> str:
    msg = str(e)
    for prefix in (f"{ckpt}: ", f"{ckpt}/"):
        if msg.startswith(prefix):
            return msg[len(prefix):]
    return msg


def _auto_candidates(run_dir: Path, say) -> Iterator[Path]:
    """resume=auto: the run's complete checkpoints that verify, newest first (collective).
    Torn and corrupt ones are named and skipped; raises when there are checkpoints but
    none can be used (starting again from step 0 over them is a person's decision)."""
    root = Path(run_dir) / "checkpoints"
    complete, torn = list_checkpoints(root)
    for p in torn:
        say(f"resume: skipping incomplete checkpoint {p} (no {MARKER})")
    if not complete:
        say(f"resume=auto: no checkpoint in {run_dir}, starting from step 0")
        return
    skipped = 0
    for p in reversed(complete):
        try:
            verify_checkpoint(p)
        except CorruptCheckpoint as e:
            say(f"resume: skipping corrupt checkpoint {p}: {_reason(e, p)}")
            skipped += 1
            continue
        if skipped:
            say(f"resume=auto: falling back to {p}, the newest checkpoint that verifies")
        yield p
    raise CorruptCheckpoint(f"resume=auto: none of the {len(complete)} checkpoints in {root} can be used (each is "
                            f"named above); move them aside, or set train.resume=never to start again")


def resume_target(resume: str, run_dir: Path, say=print) -> Optional[Path]:
    """train.resume -> the checkpoint to load: ``never`` -> None; ``auto`` -> the run's newest
    complete checkpoint that verifies (torn and corrupt ones are named and skipped; None when
    there is none); else PATH. Collective for ``auto`` (verification is split among ranks)."""
    if resume == "never":
        return None
    if resume != "auto":
        return resolve_checkpoint(resume)
    return next(_auto_candidates(run_dir, say), None)


def resume_and_load(resume: str, run_dir: Path, model, optimizer, say=print) -> tuple[Optional[Path], Optional[dict]]:
    """resume_target, then load_checkpoint, in one: with ``auto``, a checkpoint that verifies
    but fails to load as corrupt (non-finite weights, an unreadable entry) is skipped too,
    for the one before it. Returns (folder, marker) or (None, None). Collective."""
    if resume == "never":
        return None, None
    if resume != "auto":
        folder = resolve_checkpoint(resume)
        return folder, load_checkpoint(folder, model, optimizer)
    for folder in _auto_candidates(run_dir, say):
        try:
            return folder, load_checkpoint(folder, model, optimizer)
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


def load_model_state(ckpt: Path, model_sd: dict, verify: bool = True) -> dict:
    """Collective. Fill ``model_sd`` (a model state dict from get_state_dict, or a part of
    one) in place with the checkpoint's model weights, checked like load_checkpoint's:
    checksums, names and shapes, safe unpickling, finite values. Returns the marker."""
    ckpt = Path(ckpt)
    meta = read_meta(ckpt)
    if verify:
        _verify_files(ckpt, meta, collective=True)
    _check_shapes(ckpt, "model", model_sd)
    safe_load({"model": model_sd}, ckpt)
    if _any_rank([not _locally_finite(model_sd.values())])[0]:
        raise CorruptCheckpoint(f"{ckpt}: the model weights hold NaN or Inf (saved after training diverged)")
    return meta


def _read_rng(rng_file: Path) -> dict:
    rng = load_weights_only(rng_file, str(rng_file))
    if not (isinstance(rng, dict) and isinstance(rng.get("cpu"), torch.Tensor) and rng["cpu"].dtype == torch.uint8
            and isinstance(rng.get("cuda", rng["cpu"]), torch.Tensor)):
        raise CorruptCheckpoint(f"{rng_file}: not an RNG state")
    return rng


def load_checkpoint(ckpt: Path, model, optimizer=None, verify: bool = True) -> dict:
    """Collective. Loads in place into whatever layout the model/optimizer now have.
    ``verify``: check the files' checksums first (cheap when this process saved or verified
    the checkpoint already). The loaded weights must be finite. Any problem is a one-line
    CheckpointError (CorruptCheckpoint for damaged content)."""
    ckpt = Path(ckpt)
    meta = read_meta(ckpt, resume=optimizer is not None)
    if verify:
        _verify_files(ckpt, meta, collective=True)
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
    if rng_file.is_file():  # a new rank (resumed on more ranks) keeps its seeded RNG
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
def newest_good_checkpoint(ckpt_root: Path) -> Optional[Path]:
    """The newest complete checkpoint that verifies (rank 0 alone: not collective)."""
    complete, _ = list_checkpoints(ckpt_root)
    for p in reversed(complete):
        try:
            verify_checkpoint(p, collective=False)
            return p
        except CorruptCheckpoint as e:
            key = f"prune:{p.resolve()}"
            if key not in _NOTED:
                _NOTED.add(key)
                print(f"warning: checkpoint {p} fails verification ({_reason(e, p)}); pruning keeps the newest "
                      f"one that verifies", file=sys.stderr)
    return None


def prune_checkpoints(ckpt_root: Path, keep_last: int, keep_also: list[Path] = ()) -> list[Path]:
    """Delete old complete checkpoints beyond the newest keep_last and those in keep_also
    (the best, the last before a fault). Never deleted: the newest complete one, and the
    newest one that verifies; when none verifies, nothing is deleted. Torn folders are left
    for a person to look at. Rank 0 only."""
    complete, _ = list_checkpoints(ckpt_root)
    good = newest_good_checkpoint(ckpt_root) if complete else None
    if good is None:
        return []
    keep = set(complete[-max(1, keep_last):]) | {Path(p) for p in keep_also} | {good}
    removed = []
    for p in complete:
        if p not in keep:
            _remove_checkpoint(p)
            removed.append(p)
    return removed
