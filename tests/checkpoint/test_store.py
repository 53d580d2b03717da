"""Checkpoint writing under faults: a full disk, failed background saves, torn folders,
kills between the renames of a save or a prune. Split from tests/train/test_faults.py, whose helpers (tests/fault_harness.py)
it uses."""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
import torch

import fault_harness as fh
from helpers.checkpoints import marker_meta
from distlm.checkpoint import staging as staging_mod
from distlm.checkpoint import store as ckpt
from distlm.train.trainer import TrainingStopped
from fault_harness import make_trainer, names


# ---- 4. disk faults ------------------------------------------------------------------
def fail_saves(monkeypatch, fail_on: set[int]) -> list[int]:
    """dcp.save (as distlm.checkpoint calls it) raises ENOSPC on the given calls."""
    real, calls = ckpt.dcp.save, []

    def save(*a, **k):
        calls.append(len(calls) + 1)
        if calls[-1] in fail_on:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **k)
    monkeypatch.setattr(ckpt.dcp, "save", save)
    return calls


def test_enospc_stop_keeps_previous_checkpoint(tmp_path, monkeypatch):
    t = make_trainer(tmp_path, "full", "train.max_steps=10", "train.checkpoint_every=2",
                     "train.on_save_error=stop")
    fail_saves(monkeypatch, {2})
    with pytest.raises(TrainingStopped) as e:
        t.train()
    msg = str(e.value)
    prev = tmp_path / "full" / "checkpoints" / "step_0000002"
    assert "cannot write checkpoint step_0000004" in msg and "No space left on device" in msg
    assert f"the previous checkpoint {prev} is intact" in msg and "train.on_save_error=stop" in msg
    complete, _ = fh.checkpoints(tmp_path / "full")
    assert complete == [prev] and fh.load_into_fresh(prev)["step"] == 2


def test_enospc_continue_goes_on_and_saves_later(tmp_path, monkeypatch, capsys):
    t = make_trainer(tmp_path, "cont", "train.max_steps=10", "train.checkpoint_every=2",
                     "train.on_save_error=continue")
    calls = fail_saves(monkeypatch, {2, 3})
    summary = t.train()
    out = capsys.readouterr().out
    assert "warning: cannot write checkpoint step_0000004" in out and "training goes on" in out
    assert "cannot write checkpoint step_0000006" in out
    # saves at steps 2, 4, 6, 8, 10; the end of train() does not save step 10 a second time
    assert summary["step"] == 10 and len(calls) == 5
    complete, _ = fh.checkpoints(tmp_path / "cont")
    assert [p.name for p in complete] == ["step_0000008", "step_0000010"]
    for p in complete:
        fh.load_into_fresh(p)


def test_failed_save_cleans_its_tmp_folder(tmp_path, monkeypatch):
    t = make_trainer(tmp_path, "tmpleft", "train.max_steps=4", "train.checkpoint_every=2",
                     "train.on_save_error=continue")
    fail_saves(monkeypatch, {1})
    t.train()
    _, torn = fh.checkpoints(tmp_path / "tmpleft")
    assert torn == []


def fail_async_saves(monkeypatch, fail_on: set[int]) -> list[int]:
    """dcp.async_save's background write fails (ENOSPC) on the given calls."""
    from concurrent.futures import Future
    real, calls = ckpt.dcp.async_save, []

    def async_save(*a, **k):
        calls.append(len(calls) + 1)
        if calls[-1] in fail_on:
            failed = Future()
            failed.set_exception(OSError(errno.ENOSPC, "No space left on device"))
            return failed
        return real(*a, **k)
    monkeypatch.setattr(ckpt.dcp, "async_save", async_save)
    return calls


def test_async_save_error_names_its_step_and_the_next_save_happens(tmp_path, monkeypatch, capsys):
    t = make_trainer(tmp_path, "asyncfail", "train.max_steps=8", "train.checkpoint_every=2", "train.keep_last=10",
                     "train.async_checkpoint=true", "train.on_save_error=continue")
    fail_async_saves(monkeypatch, {2})  # step 4's background write
    t.train()
    out = capsys.readouterr().out
    assert "cannot write checkpoint step_0000004" in out, out
    assert [p.name for p in fh.checkpoints(tmp_path / "asyncfail")[0]] == ["step_0000002", "step_0000006",
                                                                            "step_0000008"]


def test_async_final_save_error_follows_on_save_error(tmp_path, monkeypatch):
    t = make_trainer(tmp_path, "asyncend", "train.max_steps=4", "train.checkpoint_every=2",
                     "train.async_checkpoint=true", "train.on_save_error=stop")
    fail_async_saves(monkeypatch, {2})  # step 4's save is the last: train() finishes it at the end
    with pytest.raises(TrainingStopped, match="No space left on device"):
        t.train()


def test_torn_newest_checkpoint_is_skipped_on_resume(tmp_path, capsys):
    t = make_trainer(tmp_path, "torn", "train.max_steps=6", "train.checkpoint_every=2", "train.keep_last=3")
    t.train()
    full = fh.metric_rows(tmp_path / "torn")
    (tmp_path / "torn" / "checkpoints" / "step_0000006" / ckpt.MARKER).unlink()
    capsys.readouterr()
    t2 = make_trainer(tmp_path, "torn", "train.max_steps=6", "train.checkpoint_every=2", "train.keep_last=3",
                      "train.resume=auto")
    out = capsys.readouterr().out
    torn = tmp_path / "torn" / "checkpoints" / "step_0000006"
    assert f"resume: skipping incomplete checkpoint {torn} (no distlm.json)" in out
    assert t2.step == 4 and "step_0000004 (step 4," in out
    t2.train()  # re-saves step 6 over the torn folder
    assert fh.metric_rows(tmp_path / "torn") == full
    assert names(tmp_path / "torn") == ["step_0000002", "step_0000004", "step_0000006"]
    assert fh.load_into_fresh(torn)["step"] == 6


class Killed(BaseException):
    """Stands for SIGKILL at a chosen instruction: nothing after it runs."""


def test_interrupted_prune_leaves_no_checkpoint_that_claims_to_be_whole(tmp_path, monkeypatch):
    """kill -9 inside prune's rmtree: whatever is left must not carry a marker unless it loads."""
    t = make_trainer(tmp_path, "pr", "train.max_steps=6", "train.checkpoint_every=2", "train.keep_last=5")
    t.train()
    root = tmp_path / "pr" / "checkpoints"
    real = shutil.rmtree

    def dies_midway(path, *a, **k):  # deletes one payload file, then the process is gone
        (Path(path) / ".metadata").unlink(missing_ok=True)
        raise Killed
    monkeypatch.setattr(ckpt.shutil, "rmtree", dies_midway)
    with pytest.raises(Killed):
        ckpt.prune_checkpoints(root, keep_last=1)
    monkeypatch.setattr(ckpt.shutil, "rmtree", real)
    complete, torn = ckpt.list_checkpoints(root)
    assert complete[-1].name == "step_0000006"
    for p in complete:
        fh.load_into_fresh(p)


def test_kill_between_the_renames_of_a_resave_keeps_the_step(tmp_path, monkeypatch):
    t = make_trainer(tmp_path, "rs", "train.max_steps=4", "train.checkpoint_every=2", "train.keep_last=5")
    t.train()
    real = os.replace

    def replace(src, dst):
        if Path(src).name.startswith(".tmp-step_") and Path(dst).name.startswith("step_"):
            raise Killed  # .tmp-step_N -> step_N never happens
        return real(src, dst)
    monkeypatch.setattr(ckpt.os, "replace", replace)
    t._last_saved_step = None
    t.save()  # a re-save of a complete step must not need the rename at all
    monkeypatch.setattr(ckpt.os, "replace", real)
    complete, _ = ckpt.list_checkpoints(tmp_path / "rs" / "checkpoints")
    assert complete[-1].name == "step_0000004", f"newest complete is {complete[-1].name}: step 4 was lost"


def test_train_runs_with_python_level_stderr_redirected(tmp_path):
    """The watchdog wants a real file descriptor; sys.stderr may be a StringIO (notebooks,
    redirect_stderr, pytest's capsys). It used to raise io.UnsupportedOperation: fileno."""
    import contextlib
    import io
    t = make_trainer(tmp_path, "se", "train.max_steps=2", "train.watchdog_s=60")
    with contextlib.redirect_stderr(io.StringIO()):
        assert t.train()["step"] == 2




def test_a_cpu_state_has_nothing_to_stage(tmp_path):
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    staging = staging_mod.HostStaging()
    assert staging.prepare(model, opt) is False
    state = {"model": model.state_dict()}
    assert staging.stage(state) is state


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_state_is_staged_in_pinned_memory_before_the_write_and_loads_back_the_same(tmp_path, monkeypatch):
    """Prepared, the write is handed the pinned host copies, reused by the next save; not prepared
    (or too large for the host), the device's own tensors. Either way the checkpoint loads back
    bit for bit."""
    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).cuda()

    model = build()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64, device="cuda")).sum().backward()
    opt.step()
    seen: list[set] = []
    real_save = ckpt.dcp.save

    def spy(state, **kw):
        seen.append({(t.device.type, t.is_pinned()) for _, t in staging_mod._tensor_paths(state) if t.numel() > 1})
        return real_save(state, **kw)

    monkeypatch.setattr(ckpt.dcp, "save", spy)
    staging = staging_mod.HostStaging()
    assert staging.prepare(model, opt)
    first = ckpt.save_checkpoint(tmp_path / "ckpt", 1, model, opt, marker_meta(1), staging=staging)
    buffers = {id(b) for b in staging._buffers.values()}
    ckpt.save_checkpoint(tmp_path / "ckpt", 2, model, opt, marker_meta(2), staging=staging)
    assert {id(b) for b in staging._buffers.values()} == buffers  # the same memory, reused
    ckpt.save_checkpoint(tmp_path / "ckpt", 3, model, opt, marker_meta(3))
    monkeypatch.setattr(staging_mod, "host_available_bytes", lambda: 1024)  # too little to stage it
    assert staging_mod.HostStaging().prepare(model, opt) is False
    assert seen == [{("cpu", True)}, {("cpu", True)}, {("cuda", False)}], seen
    again = build()
    again_opt = torch.optim.AdamW(again.parameters())
    ckpt.load_checkpoint(first, again, again_opt)
    for a, b in zip(model.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)
    assert len(again_opt.state_dict()["state"]) == len(opt.state_dict()["state"]) == 4
    for a, b in zip(opt.state_dict()["state"].values(), again_opt.state_dict()["state"].values()):
        assert all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)
