"""A run folder from someone else (a tarball) is never followed out of (2026-11-27): its
``.lock`` and the files distlm appends to or reads are links, FIFOs, folders or sockets
only to be refused in one line, and whatever a link points at is left as it was."""
from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fault_harness import CLI_TINY  # noqa: E402

from distlm.config import ConfigError  # noqa: E402
from distlm.train.runlock import RunLock  # noqa: E402

SECRET = "do not truncate me\n"


def outside_file(tmp_path: Path) -> Path:
    target = tmp_path / "outside" / "precious.txt"
    target.parent.mkdir()
    target.write_text(SECRET)
    return target


def one_line_refusal(e: BaseException, path: Path, kind: str) -> None:
    msg = str(e)
    assert "\n" not in msg and str(path) in msg and kind in msg, msg


def make_special(path: Path, kind: str, tmp_path: Path) -> str:
    """Put a ``kind`` at ``path``; returns the words the refusal must use."""
    if kind == "symlink":
        os.symlink(outside_file(tmp_path), path)
        return "a symbolic link"
    if kind == "dangling-symlink":
        os.symlink(tmp_path / "nowhere" / "x", path)
        return "a symbolic link"
    if kind == "folder":
        path.mkdir()
        return "a folder"
    if kind == "fifo":
        os.mkfifo(path)
        return "a FIFO"
    if kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()
        return "a socket"
    if kind == "hardlink":
        os.link(outside_file(tmp_path), path)
        return "hard link"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["symlink", "dangling-symlink", "folder", "fifo", "socket", "hardlink"])
def test_a_lock_that_is_not_a_plain_file_is_refused_and_nothing_outside_changes(kind, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    words = make_special(run / ".lock", kind, tmp_path)
    with pytest.raises(ConfigError) as e:
        RunLock(run).acquire()
    one_line_refusal(e.value, run / ".lock", words)
    if kind in ("symlink", "hardlink"):
        assert (tmp_path / "outside" / "precious.txt").read_text() == SECRET
    if kind == "dangling-symlink":
        assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("name", ["metrics.csv", "samples.txt", "config.yaml", "checkpoints/step_0000002",
                                  "checkpoints/step_0000002/distlm.json", "tokenizer/tokenizer.json"])
@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_run_file_that_is_a_link_or_fifo_is_refused_before_anything_is_written(name, kind, tmp_path):
    run = tmp_path / "run"
    (run / name).parent.mkdir(parents=True)
    words = make_special(run / name, kind, tmp_path)
    with pytest.raises(ConfigError) as e:
        RunLock(run).acquire()
    one_line_refusal(e.value, run / name, words)
    if kind == "symlink":
        assert (tmp_path / "outside" / "precious.txt").read_text() == SECRET


def test_a_plain_run_folder_still_locks(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_0000002" / "rng").mkdir(parents=True)
    (run / "metrics.csv").write_text("step\n")
    lock = RunLock(run).acquire()
    assert (run / ".lock").read_text().strip() == str(os.getpid())
    lock.release()


@pytest.mark.parametrize("kind", ["symlink", "folder"])
def test_resuming_a_run_with_a_hostile_lock_exits_2_in_one_line(kind, tmp_path, capsys):
    """The case of 2026-11-27 through the CLI: the link's target kept, no traceback."""
    from distlm.cli import main
    root = tmp_path / "runs"
    (root / "r").mkdir(parents=True)
    words = make_special(root / "r" / ".lock", kind, tmp_path)
    code = main(["train", *CLI_TINY, "train.max_steps=2", f"log.root={root}", "log.name=r", "train.resume=auto"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and words in err[0], err
    if kind == "symlink":
        assert (tmp_path / "outside" / "precious.txt").read_text() == SECRET
