"""Is a checkpoint what was saved? Its marker (distlm.json) is checked for the keys every
reader needs, and every file it lists for its size and sha256 checksum.

Hashing a large checkpoint takes seconds, and one process often reads the same checkpoint
more than once (the Trainer saves it, then prunes, which verifies the newest; a resume
finds a checkpoint, then loads it). A ``VerifiedFiles`` memo, owned by whoever does all
that (the Trainer), remembers what it hashed with the stat of every file then, so an
unchanged checkpoint is not hashed twice; any write to a file changes its mtime/ctime and
voids the entry. Without a memo every call hashes: a one-off load in a fresh process."""
from __future__ import annotations

import hashlib
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from distlm.checkpoint.errors import CheckpointError, CorruptCheckpoint
from distlm.checkpoint.files import (CONFIG, HASH, MARKER, _file_digest, _is_marker_file, _is_payload, _listed_files,
                                    open_regular, regular_file)
from distlm.checkpoint.group import _distributed, _flag_device, _rank, _world
from distlm.checkpoint.safe_dcp import one_line, read_dcp_metadata


class VerifiedFiles:
    """Checkpoints this object's owner hashed (at save or load), each with the stat of its
    marker and files then."""

    def __init__(self):
        self._seen: dict[str, tuple] = {}
        self._noted: set[str] = set()  # checkpoints without checksums, already reported

    @staticmethod
    def _fingerprint(ckpt: Path, rels) -> Optional[tuple]:
        out = []
        for rel in (MARKER, *sorted(rels)):
            try:
                st = os.stat(Path(ckpt) / rel)
            except OSError:
                return None
            out.append((rel, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
        return tuple(out)

    def holds(self, ckpt: Path, rels) -> bool:
        fp = self._fingerprint(ckpt, rels)
        return fp is not None and self._seen.get(str(Path(ckpt).resolve())) == fp

    def remember(self, ckpt: Path, rels) -> None:
        fp = self._fingerprint(ckpt, rels)
        if fp is not None:
            self._seen[str(Path(ckpt).resolve())] = fp

    def forget(self, ckpt: Path) -> None:
        self._seen.pop(str(Path(ckpt).resolve()), None)

    def first_note(self, key: str) -> bool:
        """True the first time ``key`` (a note about a checkpoint) is asked about."""
        new = key not in self._noted
        self._noted.add(key)
        return new


def note_unverified(ckpt: Path, memo: Optional[VerifiedFiles]) -> None:
    """A checkpoint saved before distlm recorded checksums loads unverified, with a note
    (once per checkpoint per memo)."""
    if _rank() == 0 and (memo is None or memo.first_note(f"unverified:{Path(ckpt).resolve()}")):
        print(f"note: {ckpt} has no checksums (saved before distlm recorded them); its files are not verified",
              file=sys.stderr)


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


_MARKER_LIMIT = 64 << 20  # a marker lists a few files per rank: kilobytes
# The marker's own checksum: sha256 of every other field (the step, the trainer state a
# resume restores: its step, the loader's step and order, tokens seen, ...; the config,
# the files' checksums), so an edit of one character of any of them is refused. It guards
# against a damaged or hand-edited marker, as the file checksums do, not against someone
# who rewrites the checkpoint on purpose (nothing without a key could).
SEAL = "marker_sha256"


def _canonical(meta: dict) -> bytes:
    return json.dumps({k: v for k, v in meta.items() if k != SEAL}, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True).encode()


def marker_text(meta: dict) -> str:
    """The marker file's text: ``meta`` with its seal. Sealed as it will be read back (through
    JSON: tuples become lists, keys strings)."""
    plain = json.loads(json.dumps({k: v for k, v in meta.items() if k != SEAL}))
    plain[SEAL] = hashlib.new(HASH, _canonical(plain)).hexdigest()
    return json.dumps(plain, indent=1)


def _seal_problem(meta: dict) -> Optional[str]:
    """Why the marker's fields do not match its seal, or None (also for a marker saved before
    markers were sealed: it has none)."""
    if SEAL not in meta:
        return None
    if meta[SEAL] != hashlib.new(HASH, _canonical(meta)).hexdigest():
        return (f"its fields do not match its {SEAL} (the step, trainer state, config or file checksums were "
                f"changed after the save)")
    return None


def read_meta(ckpt: Path, resume: bool = False) -> dict:
    """A checkpoint's marker, checked for the keys every reader needs (``step``, ``config``;
    with ``resume``, the trainer state too): a damaged one is a one-line CheckpointError."""
    marker = Path(ckpt) / MARKER
    try:
        with open_regular(marker) as fh:
            raw = fh.read(_MARKER_LIMIT + 1)
        if len(raw) > _MARKER_LIMIT:
            raise CorruptCheckpoint(f"{marker}: over {_MARKER_LIMIT >> 20} MB, not a marker distlm wrote")
        meta = json.loads(raw)
    except CorruptCheckpoint:
        raise
    except FileNotFoundError:
        raise pruned_meanwhile(Path(ckpt)) or CorruptCheckpoint(
            f"{ckpt}: not a complete distlm checkpoint (FileNotFoundError)") from None
    except (OSError, ValueError) as e:
        raise CorruptCheckpoint(f"{ckpt}: not a complete distlm checkpoint ({e.__class__.__name__})") from None
    problem = _marker_problem(meta, resume)
    if problem:
        raise CorruptCheckpoint(f"{Path(ckpt) / MARKER}: {problem} (not written by distlm, or edited)")
    if CONFIG in (meta.get("files") or {}):
        _check_config(Path(ckpt), meta["config"], meta["files"][CONFIG][HASH])
    problem = _seal_problem(meta)
    if problem:
        raise CorruptCheckpoint(f"{Path(ckpt) / MARKER}: {problem}; refused")
    return meta


def pruned_meanwhile(ckpt: Path) -> Optional[CheckpointError]:
    """The error to give when a checkpoint's files vanish while it is read: a training run
    writing the same folder pruned it (it keeps train.keep_last), and a newer one is there.
    None when it does not look like that race."""
    ckpt = Path(ckpt)
    if os.path.lexists(ckpt / MARKER) or not ckpt.name.startswith("step_"):
        return None
    try:
        newer = sorted(p for p in ckpt.parent.iterdir() if p.name.startswith("step_") and p.name > ckpt.name
                       and (p / MARKER).is_file())
    except OSError:
        newer = []
    if not newer:
        return None
    return CheckpointError(f"{ckpt}: was pruned while being read (a training run is saving newer checkpoints in "
                           f"{ckpt.parent} and keeps only train.keep_last); run again to read the newest, {newer[-1]}")


def _leaves(tree, prefix: str = "") -> dict[str, str]:
    """Dotted field -> its JSON text (so NaN equals NaN, and 1 differs from 1.0)."""
    if isinstance(tree, dict) and tree:
        return {k: v for key, sub in tree.items() for k, v in _leaves(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: json.dumps(tree, sort_keys=True)}


def _check_config(ckpt: Path, config: dict, checksum: str) -> None:
    """The marker's config equals the checkpoint's config.json, whose checksum the marker
    lists (a small file: checked here, on every read of the marker). Markers saved before
    distlm wrote config.json have none: their config is taken as it is."""
    saved_file = ckpt / CONFIG
    try:
        with open_regular(saved_file) as fh:
            raw = fh.read(_MARKER_LIMIT + 1)
        if hashlib.new(HASH, raw).hexdigest() != checksum:
            raise CorruptCheckpoint(f"{ckpt}: {CONFIG} does not match its {HASH} checksum: the files changed after "
                                    f"the save (bad disk or copy, or an edit)")
        saved = json.loads(raw)
    except CorruptCheckpoint:
        raise
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{saved_file}: missing, but its {MARKER} lists it") from None
    except (OSError, ValueError) as e:
        raise CorruptCheckpoint(f"{saved_file}: unreadable ({e.__class__.__name__})") from None
    if saved == config:
        return
    mine, theirs = _leaves(config), _leaves(saved)
    for field in sorted(set(mine) | set(theirs)):
        if mine.get(field) != theirs.get(field):
            have, want = (one_line(theirs_or_mine.get(field, "(absent)"), 60) for theirs_or_mine in (mine, theirs))
            raise CorruptCheckpoint(f"{ckpt / MARKER}: config field {one_line(field, 80)} is {have}, but the "
                                    f"checkpoint was saved with {want} ({CONFIG}, covered by its checksums): the "
                                    f"marker was edited; refused")


# ---- the files ---------------------------------------------------------------------------
def _shares(sizes: list[int], world: int) -> list[int]:
    """Rank of each file: largest first onto the least-loaded rank (the same on every rank)."""
    load, owner = [0] * world, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


_CODES = {1: "is missing", 2: "could not be read", 3: f"does not match its {HASH} checksum"}


def verify_files(ckpt: Path, meta: dict, collective: bool, memo: Optional[VerifiedFiles] = None) -> None:
    """Every file the marker lists has its size and checksum; no loadable file is unlisted.
    ``collective`` (with a process group up, every rank calling): the files are split by size
    among the ranks and each is read once in all, and every rank reaches the same verdict.
    ``memo``: files it holds as verified, unchanged since, are not read again."""
    ckpt = Path(ckpt)
    files = meta.get("files")
    if files is None:
        note_unverified(ckpt, memo)
        return
    if CONFIG not in files and _rank() == 0 and (memo is None or memo.first_note(f"config:{ckpt.resolve()}")):
        print(f"note: {ckpt}'s config is not covered by its checksums (saved before distlm recorded one); an edit of it "
              f"would go unnoticed", file=sys.stderr)
    rels = sorted(files)
    unlisted = [r for r in _listed_files(ckpt) if _is_payload(r) and r not in files]
    if unlisted:
        raise CorruptCheckpoint(f"{ckpt}: {one_line(unlisted[0], 100)} is not among the files its {MARKER} lists "
                                f"(added after the save)")
    for rel in rels:  # sizes first: cheap, and the same answer on every rank
        p = ckpt / rel
        try:
            size = regular_file(p).st_size  # a link or a FIFO is refused, never followed or read
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{ckpt}: {one_line(rel, 100)} is missing") from None
        if size != files[rel]["bytes"]:
            raise CorruptCheckpoint(f"{ckpt}: {one_line(rel, 100)} is {size} bytes, but {files[rel]['bytes']} "
                                    f"were saved (truncated or changed)")
    cached = memo is not None and memo.holds(ckpt, rels)
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
        if memo is not None:
            memo.forget(ckpt)
        rel, code = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise CorruptCheckpoint(f"{ckpt}: {one_line(rel, 100)} {_CODES[code]}{more}: the files changed after the "
                                f"save (bad disk or copy, or an edit)")
    if memo is not None:
        memo.remember(ckpt, rels)


def verify_checkpoint(ckpt: Path, collective: bool = True, memo: Optional[VerifiedFiles] = None) -> None:
    """Raises CorruptCheckpoint unless the checkpoint is usable for a resume: its marker has
    the keys a resume needs, every file matches its saved checksum, and its DCP metadata
    reads (safely). ``collective``: with a process group up every rank must call it (the
    hashing is split among them); pass False from a single rank. ``memo``: see verify_files."""
    ckpt = Path(ckpt)
    meta = read_meta(ckpt, resume=True)
    verify_files(ckpt, meta, collective, memo)
    read_dcp_metadata(ckpt / ".metadata")
