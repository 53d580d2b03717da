"""Writing files so that a crash, a full disk or a signal leaves the old file or the new
one, never half of either: every writer here fills a temporary file beside the target,
flushes it to disk, then renames it over the target (a rename within one folder is atomic
on POSIX filesystems).
"""
from __future__ import annotations

import contextlib
import csv
import os
import shutil
from pathlib import Path
from typing import Callable, Iterable, Iterator


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path``, on any
    error (or a signal's KeyboardInterrupt) it is removed and ``path`` is untouched."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        if tmp.is_file():
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def atomic_write_dir(path: str | Path, fill: Callable[[Path], None]) -> None:
    """Build a folder with ``fill(tmp_dir)`` and swap it in whole: a reader sees the old
    folder or the complete new one (the old one, if any, is removed after the swap)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        fill(tmp)
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not path.exists():
            os.replace(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)


def write_csv(path: str | Path, fieldnames: list[str], rows: Iterable[dict]) -> None:
    """The whole CSV file, atomically."""
    with atomic_path(path) as tmp:
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fieldnames, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)


def read_csv(path: str | Path) -> list[dict]:
    if not Path(path).exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def trim_csv(path: str | Path, fieldnames: list[str], keep: Callable[[dict], bool]) -> list[dict]:
    """Keep the rows for which ``keep(row)`` holds (a resumed run drops the rows its crashed
    attempt wrote past the checkpoint); returns them. Missing file: nothing to do."""
    if not Path(path).exists():
        return []
    rows = [r for r in read_csv(path) if keep(r)]
    write_csv(path, fieldnames, rows)
    return rows
