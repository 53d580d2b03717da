"""Writing files so that a crash, a full disk or a signal leaves the old file or the new
one, never half of either, and so that nothing is ever written through a link: every
writer here creates a new file beside the target (O_CREAT | O_EXCL | O_NOFOLLOW, under a
name nobody can predict: tempfile.mkstemp), fills it through that descriptor, flushes it
to disk, then renames it over the target (a rename within one folder is atomic on POSIX
filesystems, and replaces a link instead of writing through it). A process that can write
in the folder can therefore neither pre-place a link at the temporary name nor redirect
the write to a file elsewhere; an existing file with other hard links is replaced, never
written into.
"""
from __future__ import annotations

import contextlib
import csv
import io
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import IO, Callable, Iterable, Iterator

from distlm.errors import ConfigError


def _umask() -> int:
    """The process's umask, read without changing it (os.umask can only set it, which a
    thread running meanwhile would see)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def _new_temp(path: Path) -> tuple[int, Path]:
    """A new, empty regular file beside ``path``: (descriptor, name). mkstemp opens it with
    O_CREAT | O_EXCL | O_NOFOLLOW under a random name; the mode is what an ordinary
    ``open(path, "w")`` would give (mkstemp's own 0600 would hide metrics from their group)."""
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
    except OSError:
        pass
    return fd, Path(name)


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "w", encoding: str | None = "utf-8",
                newline: str | None = None) -> Iterator[IO]:
    """A file object on a new temporary file beside ``path`` (``mode`` "w" or "wb"); on
    success it is flushed, fsync'd and renamed over ``path``; on any error (or a signal's
    KeyboardInterrupt) it is removed and ``path`` is untouched."""
    path = Path(path)
    fd, tmp = _new_temp(path)
    try:
        if "b" in mode:
            f = os.fdopen(fd, "wb")
        else:
            f = os.fdopen(fd, "w", encoding=encoding, newline=newline)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    try:
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_file(path) as f:
        f.write(text)


def write_new(path: str | Path, data: bytes) -> None:
    """A file that must not exist yet, in a folder this process just made (a checkpoint's
    temporary folder): created with O_CREAT | O_EXCL | O_NOFOLLOW, so a name placed there
    meanwhile (a link, anything) is refused with FileExistsError instead of written through."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def atomic_append(path: str | Path, text: str, limit: int = 1 << 30) -> None:
    """Append ``text`` to ``path`` without writing into it: its content (read without
    following a link, and only from a regular file) and ``text`` go into a new file that
    replaces it. A link at ``path`` is replaced, not followed; a hard link's other names
    keep their old content. ``limit``: the most bytes of the old file read."""
    path = Path(path)
    old = read_own(path, limit)
    with atomic_file(path, "wb") as f:
        f.write(old)
        f.write(text.encode("utf-8"))


def read_own(path: str | Path, limit: int) -> bytes:
    """The bytes of a file distlm wrote (metrics.csv, samples.txt), b"" when there is none.
    A link is not followed, a FIFO is not waited on, and anything but a regular file, or a
    file over ``limit`` bytes, is a ConfigError naming it (one line)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return b""
    except OSError as e:
        if os.path.islink(path):
            raise ConfigError(f"{path}: is a symbolic link, not a file of the run (refused; remove it)") from None
        raise ConfigError(f"{path}: {e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # before fdopen, which refuses a folder with a bare OSError
        os.close(fd)
        raise ConfigError(f"{path}: is not a regular file (refused; remove it)")
    with os.fdopen(fd, "rb") as f:
        if st.st_size > limit:
            raise ConfigError(f"{path}: {st.st_size} bytes, over the {limit}-byte limit of a file distlm "
                             f"writes (refused)")
        os.set_blocking(fd, True)
        return f.read(limit + 1)[:limit]


def atomic_write_dir(path: str | Path, fill: Callable[[Path], None]) -> None:
    """Build a folder with ``fill(tmp_dir)`` and swap it in whole: a reader sees the old
    folder or the complete new one (the old one, if any, is removed after the swap). The
    temporary folder is made new under a random name (tempfile.mkdtemp)."""
    path = Path(path)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    old = None
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        fill(tmp)
        if path.exists() or path.is_symlink():
            old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.old-"))
            os.replace(path, old / path.name)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not path.exists():
            os.replace(old / path.name, path)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def csv_text(fieldnames: list[str], rows: Iterable[dict]) -> str:
    """A CSV file's text: the header, then ``rows`` (keys outside ``fieldnames`` left out)."""
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=fieldnames, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def write_csv(path: str | Path, fieldnames: list[str], rows: Iterable[dict]) -> None:
    """The whole CSV file, atomically."""
    with atomic_file(path, newline="") as f:
        f.write(csv_text(fieldnames, rows))


def read_csv(path: str | Path, limit: int = 1 << 30) -> list[dict]:
    """The rows of a CSV file distlm wrote ([] when there is none); see read_own."""
    data = read_own(path, limit)
    if not data:
        return []
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); not a file distlm wrote (refused)") from None
    try:
        return list(csv.DictReader(io.StringIO(text, newline="")))
    except csv.Error as e:  # a NUL byte, a field over csv's limit: not a file distlm wrote
        raise ConfigError(f"{path}: not a CSV file distlm wrote ({e}); refused (move it aside)") from None


def replace_and_keep(path: str | Path, text: str, newline: str | None = "") -> IO:
    """A new file holding ``text`` renamed over ``path``, and its file object, left open for
    appending (and reading back: "w+"): a file distlm appends to (metrics.csv) is only ever
    written and read through the descriptor that created it, so whatever is placed at its
    name later (a link to a file elsewhere) is never written through nor read. The caller
    closes it."""
    path = Path(path)
    fd, tmp = _new_temp(path)
    try:
        f = os.fdopen(fd, "w+", encoding="utf-8", newline=newline)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    try:
        f.write(text)
        f.flush()
        os.fsync(fd)
        os.replace(tmp, path)
    except BaseException:
        f.close()
        tmp.unlink(missing_ok=True)
        raise
    return f
