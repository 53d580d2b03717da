"""A run folder from someone else (a tarball) is never followed out of (2026-11-27): its
``.lock`` and the files distlm appends to or reads are links, FIFOs, folders or sockets
only to be refused in one line, and whatever a link points at is left as it was."""
from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
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
    (run / "config.yaml").write_text("model:\n  n_layer: 2\n")
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


# ---- the final save, pruning, and a reader racing a pruner ------------------------------
def failing_saves(monkeypatch, fail):
    """store.save_checkpoint raising a full disk whenever ``fail(step)`` says so."""
    from distlm.checkpoint import store
    from distlm.checkpoint.errors import CheckpointSaveError
    inner, tries = store.save_checkpoint, []

    def save(root, step, *a, **k):
        tries.append(step)
        if fail(step, tries.count(step)):
            raise CheckpointSaveError(f"cannot write checkpoint {root}/step_{step:07d}: No space left on device",
                                      "No space left on device", 28)
        return inner(root, step, *a, **k)
    monkeypatch.setattr(store, "save_checkpoint", save)
    return tries


def tiny_train(root: Path, *extra: str) -> list[str]:
    return ["train", *CLI_TINY, "train.max_steps=5", "train.checkpoint_every=2", f"log.root={root}", "log.name=r",
            "train.on_save_error=continue", *extra]


def test_a_final_save_that_keeps_failing_exits_3_naming_the_last_resumable_step(tmp_path, monkeypatch, capsys):
    from distlm.cli import main
    tries = failing_saves(monkeypatch, lambda step, n: step == 5)
    assert main(tiny_train(tmp_path)) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "final checkpoint step_0000005 could not be written" in err[0], err
    assert "the last step that can be resumed is 4" in err[0] and "No space left on device" in err[0], err
    assert tries.count(5) == 2  # tried again before giving up


def test_a_final_save_that_fails_once_is_retried_and_the_run_ends_well(tmp_path, monkeypatch, capsys):
    from distlm.checkpoint import store
    from distlm.cli import main
    failing_saves(monkeypatch, lambda step, n: step == 5 and n == 1)
    assert main(tiny_train(tmp_path)) == 0
    final = tmp_path / "r" / "checkpoints" / "step_0000005"
    assert store.read_meta(final)["step"] == 5


def test_keep_last_counts_the_checkpoint_kept_from_before_a_fault(tmp_path):
    """Four skipped NaN steps used to protect four checkpoints: keep_last=2 kept 6. Now the
    one before the latest fault is kept, and counts among the two."""
    from fault_harness import make_trainer, nan_at, names
    t = make_trainer(tmp_path, "k", "train.max_steps=12", "train.checkpoint_every=1", "train.keep_last=2",
                     "train.on_nan=skip")
    nan_at(t, 3, 5, 7, 9)
    t.train()
    assert names(tmp_path / "k") == ["step_0000008", "step_0000012"] and t.protected == ["step_0000008"]


def test_a_checkpoint_pruned_while_being_read_names_the_race(tmp_path, monkeypatch, capsys):
    from helpers.checkpoints import fresh_model, save
    from distlm.checkpoint import store
    from distlm.checkpoint.errors import CheckpointError
    from distlm.cli import main
    root = tmp_path / "run" / "checkpoints"
    older, newer = save(root, 2), save(root, 4)
    inner = store.verify_files

    def pruned_during_verification(ckpt, *a, **k):  # the trainer's prune, between two reads
        if Path(ckpt) == older:
            store._remove_checkpoint(older)
        return inner(ckpt, *a, **k)
    monkeypatch.setattr(store, "verify_files", pruned_during_verification)
    with pytest.raises(CheckpointError) as e:
        store.load_checkpoint(older, *fresh_model())
    msg = str(e.value)
    assert "\n" not in msg and "was pruned while being read" in msg and str(newer) in msg, msg
    older = save(root, 2)
    assert main(["eval", "--checkpoint", str(older)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was pruned while being read" in err[0] and "run again" in err[0], err
