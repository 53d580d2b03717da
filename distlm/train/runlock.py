"""One trainer per run folder.

Two trainers writing one run corrupt each other: each truncates ``metrics.csv`` by swapping
in a new file while the other keeps writing to the old, deleted one, and their checkpoint
saves collide. The first trainer takes an exclusive POSIX record lock (``lockf``) on
``RUN/.lock``; a trainer in another process is refused with the holder's PID. The kernel
drops the lock when its process dies, however it dies (kill -9 included), so a stale lock
never blocks a resume. A record lock belongs to the process, not to one open file: a
second Trainer in the same process (a resume in a notebook, a test) takes it again.
"""
from __future__ import annotations

import fcntl
import itertools
import os
import time
from pathlib import Path

from distlm.config import ConfigError

LOCK = ".lock"


def claim_run_name(root: Path, prefix: str) -> str:
    """A new run's default name, PREFIX-YYYYmmdd-HHMMSS, claimed by creating its folder:
    two jobs started in the same second from the same folder (two benches side by side on one
    machine) took the same name, and the second was refused as "in use by another trainer".
    The later one now gets -2 (-3, ...). Called by one process; the others are told the name."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime(f"{prefix}-%Y%m%d-%H%M%S")
    for n in itertools.count(1):
        name = stamp if n == 1 else f"{stamp}-{n}"
        try:
            (root / name).mkdir()
            return name
        except FileExistsError:
            continue


class RunLock:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(f"run directory {self.path.parent} is in use by another trainer (PID {holder}); "
                              f"wait for it to finish or choose another log.name") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the process's record lock
            self._fd = None
