"""One trainer per run folder.

Two trainers writing one run corrupt each other: each truncates ``metrics.csv`` by swapping
in a new file while the other keeps writing to the old, deleted one, and their checkpoint
saves collide. The first trainer takes an exclusive POSIX record lock (``lockf``) on
``RUN/.lock``; a trainer in another process is refused with the holder's PID. The kernel
drops the lock when its process dies, however it dies (kill -9 included), so a stale lock
never blocks a resume. A record lock belongs to the process, not to one open file: a
second Trainer in the same process (a resume in a notebook, a test) takes it again.

A run folder may come from someone else (a tarball), so nothing in it is followed out of
it: ``.lock`` is opened with O_NOFOLLOW (else a ``.lock`` linked to any file would have
that file truncated to the trainer's PID), and once the lock is held the folder is
checked to hold only regular files and folders: distlm appends to metrics.csv, rewrites
samples.txt and reads checkpoints there, and a link among them would write or read
elsewhere, a FIFO would hang. Each refusal is one line naming the path.
"""
from __future__ import annotations

import errno
import fcntl
import itertools
import os
import stat
import time
from pathlib import Path

from distlm.bounded_yaml import read_yaml_file
from distlm.config import SECTIONS, ConfigError

LOCK = ".lock"


def claim_run_name(root: Path, prefix: str) -> str:
    """A new run's default name, PREFIX-YYYYmmdd-HHMMSS, claimed by creating its folder:
    two jobs started in the same second from the same folder (two benches side by side on one
    machine) took the same name, and the second was refused as "in use by another trainer".
    The later one now gets -2 (-3, ...). Called by one process; the others are told the name."""
    root = Path(root)
    make_folder(root, "log.root")
    stamp = time.strftime(f"{prefix}-%Y%m%d-%H%M%S")
    for n in itertools.count(1):
        name = stamp if n == 1 else f"{stamp}-{n}"
        try:
            (root / name).mkdir()
            return name
        except FileExistsError:
            continue
        except OSError as e:
            raise ConfigError(f"log.root={root}: cannot create the run folder {root / name}: "
                              f"{e.strerror or e.__class__.__name__}") from None


class RunLock:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        make_folder(self.path.parent, "the run folder")
        fd = self._open()
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
            holder = text if text.isdigit() and text.isascii() else "unknown"  # never echo its bytes raw
            os.close(fd)
            raise ConfigError(f"run directory {self.path.parent} is in use by another trainer (PID {holder}); "
                              f"wait for it to finish or choose another log.name") from None
        try:
            check_run_folder(self.path.parent)
            check_holds_a_run(self.path.parent)
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def _open(self) -> int:
        """The lock file itself: never a link (O_NOFOLLOW), never blocking on a FIFO (O_NONBLOCK),
        and checked on the open descriptor to be a regular file with no other name."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as e:
            kind = _kind_of(self.path)
            why = f"is {kind}" if kind else (e.strerror or e.__class__.__name__)
            if e.errno == errno.ELOOP:
                why = "is a symbolic link"
            raise ConfigError(f"{self.path}: {why}, not the run's lock file; refused (remove it to use this run "
                              f"folder)") from None
        st = os.fstat(fd)
        problem = None if stat.S_ISREG(st.st_mode) else f"is {_kind(st.st_mode)}"
        if problem is None and st.st_nlink > 1:
            problem = f"has {st.st_nlink - 1} other hard link(s): it may be a file outside the run folder"
        if problem:
            os.close(fd)
            raise ConfigError(f"{self.path}: {problem}, not the run's lock file; refused (remove it to use this "
                              f"run folder)")
        return fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the process's record lock
            self._fd = None

    def abandon(self) -> None:
        """Give the folder up after a start that stopped before writing anything to it: the
        lock file and the folder are removed (the lock file while still held, so no other
        trainer holds it then), then the lock is released. A folder with anything else in it
        is only released."""
        folder = self.path.parent
        try:
            if self._fd is not None and holds_no_run(folder):
                self.path.unlink()
                self.release()
                folder.rmdir()
        except OSError:
            pass  # something arrived in the folder meanwhile: it stays, as it is
        finally:
            self.release()


# What distlm itself may have put in a run folder before the run's first file: the lock, and
# a Slurm attempt's record (distlm/launch/slurm.py), written before the trainer starts.
_BEFORE_A_RUN = {LOCK, "slurm"}
# The run's marker: written before its first step, so any run that has trained holds it.
RUN_CONFIG = "config.yaml"


def check_holds_a_run(run_dir: Path) -> None:
    """ConfigError unless ``run_dir`` is new (empty, or only what distlm writes before a run
    starts) or holds a distlm run: a config.yaml that is a distlm config, or a checkpoint. A
    folder of something else (a home folder, a data folder, log.root itself as log.name=.,
    a link's target) is never adopted, whatever train.resume says: a start there would
    overwrite its config.yaml and metrics.csv."""
    run_dir = Path(run_dir)
    with os.scandir(run_dir) as entries:
        names = {entry.name for entry in entries}
    if names <= _BEFORE_A_RUN or _has_checkpoint(run_dir / "checkpoints"):
        return
    why = _not_a_run_config(run_dir / RUN_CONFIG)
    if why:
        theirs = sorted(names - _BEFORE_A_RUN)
        # someone else's names: never a line break or an escape code in the one-line error
        shown = ", ".join("".join(c if c.isprintable() else "?" for c in n[:60]) for n in theirs[:3])
        shown += ", ..." if len(theirs) > 3 else ""
        raise ConfigError(f"{run_dir}: holds files ({shown}) but no distlm run ({why}); refused: a run started "
                          f"there would overwrite them (choose another log.name, or an empty folder)")


def _has_checkpoint(ckpt_root: Path) -> bool:
    from distlm.checkpoint.files import MARKER  # the package imports torch: only when asked
    try:
        with os.scandir(ckpt_root) as entries:
            return any(e.name.startswith("step_") and e.is_dir(follow_symlinks=False)
                       and os.path.isfile(os.path.join(e.path, MARKER)) for e in entries)
    except OSError:
        return False


def _not_a_run_config(path: Path) -> str:
    """Why ``path`` is not the config.yaml of a distlm run ("" when it is one): a regular file
    whose top level is a mapping of config sections."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return f"no {RUN_CONFIG}"
    if not stat.S_ISREG(st.st_mode):
        return f"its {RUN_CONFIG} is {_kind(st.st_mode)}"
    try:
        data = read_yaml_file(path)
    except ConfigError:
        return f"its {RUN_CONFIG} is not a distlm config"
    if not isinstance(data, dict) or not data or not set(data) <= set(SECTIONS):
        return f"its {RUN_CONFIG} is not a distlm config"
    return ""


def make_folder(folder: Path, what: str) -> None:
    """``folder`` and its parents, or a one-line ConfigError: log.root on a file, under /proc,
    read-only or full is a user's choice of place, not a bug."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = "a file is in the way" if isinstance(e, (FileExistsError, NotADirectoryError)) else (
            e.strerror or e.__class__.__name__)
        raise ConfigError(f"{folder}: cannot create {what} there ({why}); choose another log.root or "
                          f"log.name") from None


def holds_no_run(run_dir: Path) -> bool:
    """Whether a run folder holds nothing of a run: nothing at all, or only the lock file of a
    start that stopped before its first file (killed, or a process whose clean-up never ran)."""
    return all(entry.name == LOCK for entry in Path(run_dir).iterdir())


_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _kind_of(path: Path) -> str:
    try:
        return _kind(os.lstat(path).st_mode)
    except OSError:
        return ""


def check_run_folder(run_dir: Path) -> None:
    """ConfigError naming the first entry of the run folder (at any depth) that is neither a
    regular file nor a folder: a link would take a write or a read out of the folder, a FIFO
    or a device would hang it. Links are not followed; only lstat, no file is opened."""
    pending = [Path(run_dir)]
    while pending:
        folder = pending.pop()
        with os.scandir(folder) as entries:
            for entry in entries:
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    pending.append(Path(entry.path))
                elif not stat.S_ISREG(st.st_mode):
                    raise ConfigError(f"{entry.path}: is {_kind(st.st_mode)}; a run folder holds only regular files "
                                      f"and folders, and distlm follows nothing out of it (refused; remove it)")
