"""The files of a checkpoint folder: which are payload, listing them, and their checksums."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Iterator

from distlm.checkpoint.errors import CorruptCheckpoint

MARKER = "distlm.json"
# The run config the checkpoint was saved with, a file of its own so that the checksums in
# the marker cover it: the marker's own "config" must equal it (verify.read_meta), so an
# edit of n_head or norm_eps in distlm.json is refused instead of building another model.
# Not "config.json": a checkpoint folder must never pass for a Hugging Face model folder.
CONFIG = "run-config.json"
# One core, a 500 MB file in the page cache, this project's 2-core CPU box (with SHA-NI):
# sha256 1218 MB/s, blake2b 714 MB/s, zlib.crc32 2884 MB/s, plain read 7882 MB/s.
# sha256: a cryptographic hash at 40% of crc32's speed, and `sha256sum` checks a checkpoint
# by hand. Files hash in parallel threads (hashlib releases the GIL), and at save each rank
# hashes the files it wrote itself. End to end on that box, a 371 MB checkpoint (29M params
# + AdamW, page cache): save 0.52 s -> 0.96 s, load 0.44 s -> 0.83 s with verification,
# 0.37 s when this process saved or verified it already (verify.py: VerifiedFiles).
HASH = "sha256"
_CHUNK = 4 << 20


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def file_kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _not_regular(path, mode: int) -> CorruptCheckpoint:
    # A link may point anywhere outside the folder; a FIFO or a device would hang a read or never end.
    return CorruptCheckpoint(f"{path}: is {file_kind(mode)}, not a regular file; a checkpoint holds only "
                             f"regular files (refused)")


def regular_file(path: Path) -> os.stat_result:
    """The stat of ``path`` itself (links not followed); CorruptCheckpoint unless it is a
    regular file. FileNotFoundError passes through."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(path, st.st_mode)
    return st


@contextlib.contextmanager
def open_regular(path: Path, source: object = None) -> Iterator[IO[bytes]]:
    """``path`` opened for reading without following a link and without blocking on a FIFO
    (O_NOFOLLOW | O_NONBLOCK), then checked on the open descriptor to be a regular file, so
    nothing can swap it in between. CorruptCheckpoint names ``source`` (default: the path)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _not_regular(source or path, stat.S_IFLNK) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(source or path, mode)
        os.set_blocking(fd, True)
        fh = os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise
    with fh:
        yield fh


def _is_marker_file(rel: str) -> bool:
    return rel == MARKER or rel.startswith(f".{MARKER}.tmp-")


def _is_payload(rel: str) -> bool:
    """A file some load reads: it must be listed, with its checksum, in the marker."""
    return (rel.endswith((".metadata", ".distcp")) or (rel.startswith("rng/") and rel.endswith(".pt"))
            or rel == CONFIG)


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
    with open_regular(path) as f:
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
