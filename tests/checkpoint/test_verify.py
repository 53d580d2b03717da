"""Nothing is lost: per-file checksums, non-finite weights never
saved as complete, pruning that keeps a good checkpoint, resume=auto falling back past a
damaged newest one, damaged markers, and failed saves (a real small filesystem where one
can be mounted, and DCP's own exception types injected)."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import traceback
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from distlm.checkpoint import store as ckpt
from distlm.checkpoint.errors import CheckpointError, CheckpointSaveError, CorruptCheckpoint, NonFiniteCheckpoint
from helpers.checkpoints import fresh_model, marker_meta, save, tiny_model

INLINE_CONTAINER = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"


def flip_byte(path: Path, at: int = 100) -> None:
    b = bytearray(path.read_bytes())
    b[at] ^= 0x01
    path.write_bytes(b)


def one_line(e: BaseException) -> str:
    msg = str(e)
    assert "\n" not in msg and "Traceback" not in msg, msg
    return msg


@pytest.fixture
def run(tmp_path) -> Path:
    """A run folder with checkpoints at steps 2, 4 and 6."""
    model, opt = tiny_model()
    for step in (2, 4, 6):
        save(tmp_path / "run" / "checkpoints", step, model, opt)
    return tmp_path / "run"


def ck(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:07d}"


# ---- checksums ---------------------------------------------------------------------------
def test_marker_lists_every_file_with_its_sha256(run):
    folder = ck(run, 2)
    files = json.loads((folder / ckpt.MARKER).read_text())["files"]
    on_disk = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                     if p.is_file() and p.name != ckpt.MARKER)
    assert sorted(files) == on_disk and {".metadata", "__0_0.distcp", "rng/rank_00000.pt"} <= set(files)
    for rel, entry in files.items():
        data = (folder / rel).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_sha256sum_checks_a_checkpoint_by_hand(run):
    folder = ck(run, 2)
    files = json.loads((folder / ckpt.MARKER).read_text())["files"]
    lines = "".join(f"{e['sha256']}  {rel}\n" for rel, e in files.items())
    p = subprocess.run(["sha256sum", "--check", "--quiet", "-"], input=lines, cwd=folder, text=True,
                       capture_output=True)
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.parametrize("damage", ["flip-distcp", "flip-metadata", "flip-rng", "truncate", "delete", "extra-file"])
def test_damaged_file_is_refused_naming_it(run, damage):
    folder = ck(run, 6)
    target = {"flip-metadata": ".metadata", "flip-rng": "rng/rank_00000.pt"}.get(damage, "__0_0.distcp")
    if damage.startswith("flip"):
        flip_byte(folder / target)
    elif damage == "truncate":
        with open(folder / target, "r+b") as f:
            f.truncate(1000)
    elif damage == "delete":
        (folder / target).unlink()
    else:
        target = "__1_0.distcp"
        shutil.copy(folder / "__0_0.distcp", folder / target)
    model, opt = fresh_model()
    with pytest.raises(CorruptCheckpoint) as e:
        ckpt.load_checkpoint(folder, model, opt)
    assert str(folder) in one_line(e.value) and target in str(e.value)
    with pytest.raises(CorruptCheckpoint):
        ckpt.load_checkpoint(folder, model)  # the eval / generate / export path
    with pytest.raises(CorruptCheckpoint):
        ckpt.verify_checkpoint(folder)


def test_checksum_mismatch_is_found_by_a_fresh_process_too(run):
    """This process hashed the files at save (and skips re-hashing unchanged files); a new
    process has no such memory and must find the change on its own."""
    folder = ck(run, 6)
    data = bytearray((folder / "__0_0.distcp").read_bytes())
    data[5000] ^= 0x10
    st = os.stat(folder / "__0_0.distcp")
    (folder / "__0_0.distcp").write_bytes(data)
    os.utime(folder / "__0_0.distcp", ns=(st.st_atime_ns, st.st_mtime_ns))  # even with the mtime put back
    with pytest.raises(CorruptCheckpoint, match="__0_0.distcp does not match its sha256 checksum"):
        ckpt.verify_checkpoint(folder)


def test_a_memo_spares_hashing_an_unchanged_checkpoint_twice(tmp_path, monkeypatch):
    """The Trainer's VerifiedFiles: files hashed at save are not read again to load, prune or
    resume them while they are unchanged; a changed file is hashed (and caught) again; and
    without a memo every verification hashes (one-off loads, other processes)."""
    import distlm.checkpoint.verify as verify
    hashed = []
    real = verify._file_digest
    monkeypatch.setattr(verify, "_file_digest", lambda path: hashed.append(Path(path).name) or real(path))
    memo = ckpt.VerifiedFiles()
    model, opt = tiny_model()
    folder = ckpt.save_checkpoint(tmp_path / "checkpoints", 2, model, opt, marker_meta(2), memo=memo)
    ckpt.update_meta(folder, memo=memo, val_loss=1.0)
    assert ckpt.load_checkpoint(folder, *fresh_model(), memo=memo)["step"] == 2
    ckpt.prune_checkpoints(tmp_path / "checkpoints", 1, memo=memo)
    assert hashed == []
    ckpt.verify_checkpoint(folder)
    assert "__0_0.distcp" in hashed
    hashed.clear()
    flip_byte(folder / "__0_0.distcp", 5000)
    with pytest.raises(CorruptCheckpoint, match="__0_0.distcp does not match"):
        ckpt.load_checkpoint(folder, *fresh_model(), memo=memo)
    assert "__0_0.distcp" in hashed


def test_checkpoint_without_checksums_loads_with_one_note(run, capsys):
    folder = ck(run, 4)
    meta = json.loads((folder / ckpt.MARKER).read_text())
    del meta["files"]
    (folder / ckpt.MARKER).write_text(ckpt.marker_text(meta))
    capsys.readouterr()
    memo = ckpt.VerifiedFiles()  # one note per checkpoint for whoever holds the memo (a run)
    for _ in range(2):
        assert ckpt.load_checkpoint(folder, *fresh_model(), memo=memo)["step"] == 4
    err = capsys.readouterr().err
    assert err.count("has no checksums") == 1 and str(folder) in err


def test_update_meta_keeps_the_checksums_valid(run):
    folder = ck(run, 6)
    ckpt.update_meta(folder, val_loss=1.5)
    ckpt.verify_checkpoint(folder)
    assert ckpt.read_meta(folder)["val_loss"] == 1.5
    with pytest.raises(ValueError):
        ckpt.update_meta(folder, files={})


# ---- markers -------------------------------------------------------------------------------
@pytest.mark.parametrize("edit,resume_only", [
    (lambda m: m.pop("trainer"), True),
    (lambda m: m["trainer"].pop("step"), True),
    (lambda m: m.pop("step"), False),
    (lambda m: m.pop("config"), False),
    (lambda m: m.update(step="10"), False),
    (lambda m: m["files"].update({"../../etc/passwd": {"bytes": 1, "sha256": "0" * 64}}), False),
    (lambda m: m["files"].update({".metadata": {"bytes": "x"}}), False),
], ids=["no-trainer", "no-trainer-step", "no-step", "no-config", "step-str", "files-escape", "files-entry"])
def test_marker_missing_keys_is_a_one_line_error(run, edit, resume_only):
    folder = ck(run, 6)
    meta = json.loads((folder / ckpt.MARKER).read_text())
    edit(meta)
    (folder / ckpt.MARKER).write_text(ckpt.marker_text(meta))
    model, opt = fresh_model()
    with pytest.raises(CorruptCheckpoint) as e:
        ckpt.load_checkpoint(folder, model, opt)  # a resume: KeyError on meta["trainer"] before
    assert str(folder / ckpt.MARKER) in one_line(e.value)
    if resume_only:
        assert ckpt.read_meta(folder)["step"] == 6  # eval needs no trainer state
    else:
        with pytest.raises(CorruptCheckpoint):
            ckpt.read_meta(folder)


def test_unreadable_marker_is_a_one_line_error(run):
    folder = ck(run, 6)
    (folder / ckpt.MARKER).write_text('{"step": 6, "conf')
    with pytest.raises(CorruptCheckpoint) as e:
        ckpt.read_meta(folder)
    assert "not a complete distlm checkpoint" in one_line(e.value)


# ---- resume=auto ---------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["checksum", "marker-json", "marker-keys", "metadata-garbage-legacy"])
def test_resume_auto_falls_back_past_a_damaged_newest(run, damage):
    newest = ck(run, 6)
    if damage == "checksum":
        flip_byte(newest / "__0_0.distcp", 2000)
    elif damage == "marker-json":
        (newest / ckpt.MARKER).write_text("{")
    elif damage == "marker-keys":
        meta = json.loads((newest / ckpt.MARKER).read_text())
        del meta["trainer"]
        (newest / ckpt.MARKER).write_text(ckpt.marker_text(meta))
    else:  # a checkpoint from before checksums whose .metadata is garbage
        meta = json.loads((newest / ckpt.MARKER).read_text())
        del meta["files"]
        (newest / ckpt.MARKER).write_text(ckpt.marker_text(meta))
        (newest / ".metadata").write_bytes(b"\x80\x04garbage")
    said = []
    assert ckpt.resume_target("auto", run, say=said.append) == ck(run, 4)
    assert any(s.startswith(f"resume: skipping corrupt checkpoint {newest}: ") for s in said), said
    assert f"resume=auto: falling back to {ck(run, 4)}, the newest checkpoint that verifies" in said
    folder, meta = ckpt.resume_and_load("auto", run, *fresh_model(), say=said.append)
    assert folder == ck(run, 4) and meta["step"] == 4


def test_resume_auto_falls_back_past_non_finite_weights(run, monkeypatch):
    """A checkpoint with NaN weights can only come from before this check (or by hand):
    it verifies (its checksums are right) but fails to load, and resume takes the one before."""
    model, opt = tiny_model()
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    monkeypatch.setattr(ckpt, "params_finite", lambda m: True)  # stands for the old save
    save(run / "checkpoints", 8, model, opt)
    monkeypatch.undo()
    said = []
    folder, meta = ckpt.resume_and_load("auto", run, *fresh_model(), say=said.append)
    assert folder == ck(run, 6) and meta["step"] == 6
    assert any("step_0000008" in s and "NaN or Inf" in s for s in said), said
    with pytest.raises(CorruptCheckpoint, match="NaN or Inf"):
        ckpt.load_checkpoint(ck(run, 8), fresh_model()[0])  # eval refuses it too


def test_resume_auto_with_every_checkpoint_damaged_stops(run):
    for step in (2, 4, 6):
        flip_byte(ck(run, step) / "__0_0.distcp")
    said = []
    with pytest.raises(CorruptCheckpoint, match="none of the 3 checkpoints") as e:
        ckpt.resume_target("auto", run, say=said.append)
    one_line(e.value)
    assert len([s for s in said if "skipping corrupt" in s]) == 3


def test_resume_auto_with_no_checkpoint_starts_fresh(tmp_path):
    said = []
    assert ckpt.resume_target("auto", tmp_path / "new", say=said.append) is None
    assert ckpt.resume_and_load("auto", tmp_path / "new", *fresh_model(), say=said.append) == (None, None)


def test_a_different_architecture_is_not_skipped_as_corrupt(run):
    """Only damaged checkpoints are skipped: a shape mismatch is the caller's error."""
    from distlm.config import load_config
    from distlm.model.gpt import GPT
    from helpers.checkpoints import TINY
    model = GPT(load_config(None, TINY + ["model.d_model=64", "model.d_ff=128"]).model)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(CheckpointError, match="has shape") as e:
        ckpt.resume_and_load("auto", run, model, opt, say=lambda s: None)
    assert not isinstance(e.value, CorruptCheckpoint)


# ---- non-finite weights --------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_params_finite(bad):
    model, _ = tiny_model(steps=0)
    assert ckpt.params_finite(model)
    with torch.no_grad():
        list(model.parameters())[-1].view(-1)[-1] = bad
    assert not ckpt.params_finite(model)


@pytest.mark.parametrize("async_save", [False, True])
def test_non_finite_weights_are_never_saved(run, async_save):
    model, opt = tiny_model()
    with torch.no_grad():
        next(model.parameters())[3, 3] = float("nan")
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    with pytest.raises(NonFiniteCheckpoint) as e:
        ckpt.save_checkpoint(run / "checkpoints", 8, model, opt, marker_meta(8), async_save=async_save)
    assert isinstance(e.value, CheckpointSaveError) and isinstance(e.value, OSError)
    assert "NaN or Inf" in one_line(e.value) and "NaN or Inf" in e.value.strerror
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before  # nothing written, not even tmp
    ckpt.verify_checkpoint(ck(run, 6))


def test_params_finite_with_a_process_group_and_dtensor_shards(tmp_path):
    """One-rank gloo group, FSDP2: the parameters are DTensors, the check all-reduces, and
    save/load take their collective paths."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model, opt = tiny_model(steps=0)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        assert ckpt.params_finite(model)
        saved = ckpt.save_checkpoint(tmp_path / "checkpoints", 2, model, opt, marker_meta(2))
        assert ckpt.load_checkpoint(saved, model, opt)["step"] == 2
        with torch.no_grad():
            next(model.parameters()).to_local()[0, 0] = float("inf")
        assert not ckpt.params_finite(model)
        with pytest.raises(NonFiniteCheckpoint):
            ckpt.save_checkpoint(tmp_path / "checkpoints", 4, model, opt, marker_meta(4))
    finally:
        dist.destroy_process_group()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_0000002"]


# ---- pruning -------------------------------------------------------------------------------
def test_prune_keeps_the_newest_good_checkpoint_past_a_corrupt_newest(run):
    flip_byte(ck(run, 6) / "__0_0.distcp")
    removed = ckpt.prune_checkpoints(run / "checkpoints", keep_last=1, keep_also=[])
    assert removed == [ck(run, 2)]
    assert [p.name for p in ckpt.list_checkpoints(run / "checkpoints")[0]] == ["step_0000004", "step_0000006"]
    ckpt.load_checkpoint(ck(run, 4), *fresh_model())


def test_prune_deletes_nothing_when_no_checkpoint_verifies(run):
    for step in (2, 4, 6):
        flip_byte(ck(run, step) / "__0_0.distcp")
    assert ckpt.prune_checkpoints(run / "checkpoints", keep_last=1) == []
    assert len(ckpt.list_checkpoints(run / "checkpoints")[0]) == 3


def test_prune_still_prunes(run):
    assert ckpt.prune_checkpoints(run / "checkpoints", keep_last=1, keep_also=[ck(run, 2)]) == [ck(run, 4)]


# ---- failed saves --------------------------------------------------------------------------
def checkpoint_exception(inner: BaseException) -> CheckpointException:
    return CheckpointException("write", {0: (inner, traceback.StackSummary())})


@pytest.mark.parametrize("raised,cause", [
    (checkpoint_exception(RuntimeError(INLINE_CONTAINER)), "disk full"),
    (checkpoint_exception(OSError(errno.ENOSPC, "No space left on device")), "No space left on device"),
    (RuntimeError(INLINE_CONTAINER), "disk full"),
    (OSError(errno.EACCES, "Permission denied"), "Permission denied"),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), "Disk quota exceeded"),
    (checkpoint_exception(ValueError("something else\nwith a second line")), "ValueError: with a second line"),
], ids=["dcp-inline-container", "dcp-enospc", "inline-container", "eacces", "edquot", "other"])
def test_failed_save_is_one_error_class_with_a_readable_cause(run, monkeypatch, raised, cause):
    def failing(*a, **k):
        raise raised
    monkeypatch.setattr(ckpt.dcp, "save", failing)
    model, opt = tiny_model()
    with pytest.raises(CheckpointSaveError) as e:
        ckpt.save_checkpoint(run / "checkpoints", 8, model, opt, marker_meta(8))
    assert e.value.cause.startswith(cause) and cause in one_line(e.value)
    assert str(ck(run, 8)) in str(e.value)
    assert not list((run / "checkpoints").glob(".tmp-step_0000008*")) and not ck(run, 8).exists()
    ckpt.verify_checkpoint(ck(run, 6))  # the previous checkpoint is untouched


def test_failed_async_save_is_a_save_error_at_finish(run, monkeypatch):
    def failing_async(*a, **k):
        f = Future()
        f.set_exception(checkpoint_exception(RuntimeError(INLINE_CONTAINER)))
        return f
    monkeypatch.setattr(ckpt.dcp, "async_save", failing_async)
    model, opt = tiny_model()
    pending = ckpt.save_checkpoint(run / "checkpoints", 8, model, opt, marker_meta(8), async_save=True)
    with pytest.raises(CheckpointSaveError, match="disk full"):
        pending.finish()
    assert not list((run / "checkpoints").glob(".tmp-step_0000008*")) and not ck(run, 8).exists()


def test_failure_writing_the_marker_is_a_save_error(run, monkeypatch):
    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(ckpt, "atomic_write_text", full)
    model, opt = tiny_model()
    with pytest.raises(CheckpointSaveError, match="No space left on device"):
        ckpt.save_checkpoint(run / "checkpoints", 8, model, opt, marker_meta(8))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_0000002", "step_0000004", "step_0000006"]


def test_keyboard_interrupt_during_save_propagates(run, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(ckpt.dcp, "save", interrupted)
    model, opt = tiny_model()
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(run / "checkpoints", 8, model, opt, marker_meta(8))
    assert not list((run / "checkpoints").glob(".tmp-step_0000008*"))


@pytest.fixture
def small_fs(tmp_path):
    """A real tmpfs of a given size (root only), unmounted afterwards."""
    mounted = []

    def mount(size: str) -> Path:
        d = tmp_path / f"fs{len(mounted)}"
        d.mkdir()
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], capture_output=True,
                           text=True)
        if p.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({(p.stderr or p.stdout).strip() or p.returncode}); "
                        f"the injected-exception tests cover the same path")
        mounted.append(d)
        return d
    yield mount
    for d in mounted:
        subprocess.run(["umount", str(d)], capture_output=True)


def test_full_disk_on_the_first_save(small_fs):
    """A checkpoint of the tiny model is ~300 kB: on a 128 kB tmpfs the very first save fails."""
    root = small_fs("128k") / "checkpoints"
    model, opt = tiny_model()
    with pytest.raises(CheckpointSaveError) as e:
        ckpt.save_checkpoint(root, 2, model, opt, marker_meta(2))
    assert e.value.cause.startswith(("disk full", "No space left on device")), e.value.cause
    one_line(e.value)
    assert list(root.iterdir()) == []  # no partial folder left behind


def test_full_disk_keeps_the_previous_checkpoint(small_fs):
    root = small_fs("512k") / "checkpoints"
    model, opt = tiny_model()
    first = ckpt.save_checkpoint(root, 2, model, opt, marker_meta(2))
    with pytest.raises(CheckpointSaveError) as e:
        ckpt.save_checkpoint(root, 4, model, opt, marker_meta(4))
    assert e.value.cause.startswith(("disk full", "No space left on device")), e.value.cause
    assert list(root.iterdir()) == [first]
    ckpt.verify_checkpoint(first)
    assert ckpt.load_checkpoint(first, *fresh_model())["step"] == 2
    with pytest.raises(CheckpointSaveError):  # async: the error comes at finish()
        ckpt.save_checkpoint(root, 4, model, opt, marker_meta(4), async_save=True).finish()
    assert list(root.iterdir()) == [first]


# ---- the Trainer's train.on_save_error, with DCP's own failures ---------------------------
def test_trainer_on_a_full_tmpfs_follows_on_save_error(small_fs, capsys):
    """The issue's case: a filesystem too small for even the first checkpoint. DCP fails with
    its wrapped inline_container error; `continue` trains to the end and says why each save
    failed, then stops (exit 3) when the final save fails again; `stop` stops with one line
    naming the cause."""
    from distlm.train.trainer import TrainingStopped
    from fault_harness import make_trainer
    root = small_fs("128k")
    t = make_trainer(root, "cont", "train.max_steps=4", "train.checkpoint_every=2", "train.on_save_error=continue")
    with pytest.raises(TrainingStopped) as e:  # the final save fails twice: the run must not end as if done
        t.train()
    assert t.step == 4 and "no step can be resumed" in one_line(e.value)
    out = capsys.readouterr().out
    assert "warning: cannot write checkpoint step_0000002" in out and "training goes on" in out
    assert "disk full" in out or "No space left on device" in out
    assert ckpt.list_checkpoints(root / "cont" / "checkpoints") == ([], [])  # no partial folder
    t = make_trainer(root, "stop", "train.max_steps=4", "train.checkpoint_every=2", "train.on_save_error=stop")
    with pytest.raises(TrainingStopped) as e:
        t.train()
    msg = one_line(e.value)
    assert "cannot write checkpoint step_0000002" in msg and "no earlier checkpoint" in msg
    assert "disk full" in msg or "No space left on device" in msg


def test_trainer_stops_on_an_injected_dcp_failure_keeping_the_previous_checkpoint(tmp_path, monkeypatch):
    from distlm.train.trainer import TrainingStopped
    from fault_harness import make_trainer
    real, calls = ckpt.dcp.save, []

    def save(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise checkpoint_exception(RuntimeError(INLINE_CONTAINER))
        return real(*a, **k)
    monkeypatch.setattr(ckpt.dcp, "save", save)
    t = make_trainer(tmp_path, "inj", "train.max_steps=6", "train.checkpoint_every=2", "train.on_save_error=stop")
    with pytest.raises(TrainingStopped) as e:
        t.train()
    prev = tmp_path / "inj" / "checkpoints" / "step_0000002"
    msg = one_line(e.value)
    assert "cannot write checkpoint step_0000004" in msg and "disk full" in msg and f"{prev} is intact" in msg
    assert ckpt.list_checkpoints(tmp_path / "inj" / "checkpoints") == ([prev], [])
    ckpt.verify_checkpoint(prev)


# ---- several writer threads a rank --------------------------------------------------------
def test_a_checkpoint_is_written_in_several_files_that_load_back(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt, "write_threads", lambda environ=None: 3)
    model, opt = tiny_model()
    folder = save(tmp_path, 1, model, opt)
    assert sorted(p.name for p in folder.glob("*.distcp")) == ["__0_0.distcp", "__0_1.distcp", "__0_2.distcp"]
    other, other_opt = fresh_model()
    ckpt.load_checkpoint(folder, other, other_opt)
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(p, q), name


def test_a_writer_thread_that_fails_fails_the_save_and_leaves_nothing(tmp_path, monkeypatch):
    """DCP does not hear of a failure in a writer thread other than its first: the save would
    "succeed" with that thread's tensors missing. The save checks what DCP wrote against what
    it planned, and a failed save waits for the writers before its folder is removed."""
    import threading
    from torch.distributed.checkpoint import filesystem
    monkeypatch.setattr(ckpt, "write_threads", lambda environ=None: 3)
    real = filesystem._write_item

    def write_item(*a, **k):
        if threading.current_thread() is not threading.main_thread():
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **k)
    good = save(tmp_path, 1)
    monkeypatch.setattr(filesystem, "_write_item", write_item)
    with pytest.raises(CheckpointSaveError, match="not written.*a writer thread failed"):
        save(tmp_path, 2)
    assert ckpt.list_checkpoints(tmp_path) == ([good], [])  # the earlier one intact, no partial folder


def test_a_link_at_a_temporary_folders_name_is_never_written_through(tmp_path):
    """The folder a checkpoint is written into is made new under a random name: a link left
    at the old, predictable name (or any name of that step) is unlinked, not followed."""
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    for name in (".tmp-step_0000001", ".tmp-step_0000001-x"):
        (root / name).symlink_to(outside, target_is_directory=True)
    folder = save(root, 1)
    assert list(outside.iterdir()) == [] and ckpt.list_checkpoints(root) == ([folder], [])
    assert not list(root.glob(".tmp-step_*"))
