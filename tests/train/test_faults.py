"""Reliability: what the Trainer promises when things go wrong, tested by doing them.

- kill -9 anywhere (start-up, mid-step, mid-save, mid-prune), one process and a 2-rank
  torchrun tree: the run resumed again and again is the uninterrupted run, bit for bit;
  every checkpoint with a marker loads; no work is lost beyond the newest checkpoint.
- SIGTERM / SIGINT: the step finishes, a checkpoint is saved, exit 128 + the signal, and resuming
  from it finishes with the reference's losses.
- NaN/Inf: skipped (the parameters and optimizer state untouched) or stop (exit 3,
  the step and the tensors named, the checkpoint before the fault protected).
- A checkpoint that cannot be written (ENOSPC), or one torn by hand afterwards.
- Corrupt, truncated and inconsistent data; a checkpoint file that would run code.
- Async checkpoints: what is saved is the state at the save, and resumes are exact.

The runs are tiny (2 layers, d=32, block 16, synthetic tokens, vocab 256; see
fault_harness.CLI_TINY) so that ~20 real process kills fit in about two minutes on two
cores. Counts go to stdout (pytest -s) and to ``fault_counts.json`` in the tmp folder.
"""
from __future__ import annotations

import csv
import json
import math
import random
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import fault_harness as fh
from fault_harness import make_trainer, names, nan_at, params, record_steps
from distlm.checkpoint import store as ckpt
from distlm.train.trainer import Trainer, TrainingStopped

KILL_SEED = 1234
SUMMARY: dict = {}


@dataclass
class Reference:
    root: Path
    rows: list
    startup_s: float  # launch -> first step printed
    step_s: float  # mean wall time of a step, saves and prunes included
    total_s: float


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Reference:
    """The uninterrupted run every interrupted one must reproduce."""
    root = tmp_path_factory.mktemp("faults")
    log = root / "ref.log"
    t0 = time.monotonic()
    proc = fh.launch(fh.train_cmd(root, "ref"), log)
    assert fh.wait_for(lambda: fh.last_console_step(log) >= 1, proc), log.read_text()
    startup = time.monotonic() - t0
    assert proc.wait(timeout=fh.WAIT_S) == 0, log.read_text()
    total = time.monotonic() - t0
    rows = fh.metric_rows(root / "ref")
    assert [r[0] for r in rows] == [str(s) for s in range(1, fh.STEPS + 1)]
    with open(root / "ref" / "metrics.csv") as f:
        elapsed = [float(r["elapsed_s"]) for r in csv.DictReader(f) if r["loss"]]
    step_s = (elapsed[-1] - elapsed[0]) / (len(elapsed) - 1)
    SUMMARY["reference"] = {"startup_s": round(startup, 2), "step_s": round(step_s, 4), "total_s": round(total, 2)}
    return Reference(root, rows, startup, step_s, total)


@pytest.fixture(scope="module")
def summary_file(reference):
    """Every test adds its counts to SUMMARY; written once the module is done."""
    yield reference.root / "fault_counts.json"
    path = reference.root / "fault_counts.json"
    path.write_text(json.dumps(SUMMARY, indent=1))
    print(f"\nfault counts: {path}")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The in-process runs are tiny: one intra-op thread is faster than two fighting on a shared box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def close(a: str, b: str, tol: float = 1e-5) -> bool:
    return math.isclose(float(a), float(b), rel_tol=tol, abs_tol=tol)


# ---- 1. kill -9 anywhere ---------------------------------------------------------------
@pytest.mark.dist
@pytest.mark.timeout(3600)  # dozens of launches: slow, not stuck, on a loaded box
def test_kill9_anywhere_resumes_bit_exact(reference, summary_file, tmp_path):
    """SIGKILL at moments drawn from random.Random(1234), >= 15 times for one process and
    >= 5 times for a 2-rank torchrun job; each time resume=auto from what is on disk.
    After every kill, every checkpoint with a marker must load and the next attempt must
    start from the newest one; at the end metrics.csv must be the reference's."""
    rng = random.Random(KILL_SEED)
    after = max(0.01, 3 * reference.step_s)  # past a chosen step's row: the step, its save, its prune

    one = fh.Campaign(tmp_path, "victim", rng, after_s=after, min_kills=16, require=("startup", "save")).run()
    for run_dir in one.run_dirs:
        assert fh.metric_rows(run_dir) == reference.rows, f"{run_dir.name} differs from the uninterrupted run"
    c1 = one.counts()

    # Two ranks (DDP over gloo), the whole torchrun tree killed each time. The loader
    # deals the same global batch to 1 or 2 ranks, so it must match the 1-process run.
    two = fh.Campaign(tmp_path, "victim2", rng, after_s=after, min_kills=5, nproc=2, startup_share=0.15,
                      advance=(3, 7)).run()
    c2, exact = two.counts(), True
    for run_dir in two.run_dirs:
        rows2 = fh.metric_rows(run_dir)
        assert [r[0] for r in rows2] == [r[0] for r in reference.rows]
        for got, ref in zip(rows2, reference.rows):
            assert got[3] == ref[3], f"lr at step {got[0]}"
            assert close(got[1], ref[1]) and close(got[2], ref[2]), f"2-rank step {got[0]}: {got} vs {ref}"
        exact = exact and rows2 == reference.rows
    c2["bit_exact_vs_1_process"] = exact

    for run_dir in one.run_dirs + two.run_dirs:  # what is left: complete checkpoints that load, the last one's
        complete, torn = fh.checkpoints(run_dir)
        assert complete and fh.step_of(complete[-1]) == fh.STEPS
        assert not any(p.name.startswith(".tmp-") for p in torn), "the finished run left a .tmp-step_* folder"
        for p in complete:
            fh.load_into_fresh(p)

    kills = c1["kills"] + c2["kills"]
    SUMMARY["kill9"] = {"seed": KILL_SEED, "kills": kills, "single": c1, "ddp2": c2}
    print(f"\nkill -9: {kills} kills ({c1['kills']} x 1 process, {c2['kills']} x 2-rank torchrun), "
          f"{c1['mid_save_kills'] + c2['mid_save_kills']} left a torn .tmp-step_* (mid-save), "
          f"{c1['resumes'] + c2['resumes']} resumes; phases 1-proc {c1['phases']}, 2-rank {c2['phases']}; "
          f"{c1['seconds'] + c2['seconds']:.0f} s")
    assert c1["kills"] >= 15 and c2["kills"] >= 5 and kills >= 20
    assert c1["phases"].get("startup", 0) >= 1 and c1["phases"].get("save", 0) >= 1, c1["phases"]
    assert c1["resumes_from_checkpoint"] >= 10 and c2["resumes_from_checkpoint"] >= 1, (c1, c2)


# ---- 2. SIGTERM / SIGINT -------------------------------------------------------------
@pytest.mark.dist
@pytest.mark.parametrize("sig, after_step", [(signal.SIGTERM, 2), (signal.SIGINT, 1)], ids=["SIGTERM", "SIGINT"])
def test_signal_saves_exits_128_plus_it_and_resumes(reference, summary_file, tmp_path, sig, after_step):
    """SIGTERM after step 2's row (its save is under way); SIGINT after step 1's (mid-step).
    The status is the shell's for a process the signal ended (143, 130): saved, not finished."""
    run_dir, log = tmp_path / "sig", tmp_path / "sig.log"
    proc = fh.launch(fh.train_cmd(tmp_path, "sig"), log)
    assert fh.wait_for(lambda: fh.last_logged_step(run_dir) >= after_step, proc), log.read_text()
    proc.send_signal(sig)
    assert proc.wait(timeout=fh.WAIT_S) == 128 + sig, log.read_text()
    out = log.read_text()
    assert f"stopped: {sig.name} received" in out, out
    step = int(re.search(rf"{sig.name} received at step (\d+): saving a checkpoint", out).group(1))
    assert after_step <= step < fh.STEPS
    saved = Path(re.search(r"stopped: \S+ received; checkpoint (\S+);", out).group(1))
    assert saved.name == f"step_{step:07d}" and saved.parent == run_dir / "checkpoints"
    complete, torn = fh.checkpoints(run_dir)
    assert complete[-1] == saved and not torn
    assert fh.load_into_fresh(saved)["trainer"]["step"] == step
    assert fh.metric_rows(run_dir) == reference.rows[:step]
    assert "continue with: distlm train ... log.name=sig train.resume=auto" in out

    p = fh.run(fh.train_cmd(tmp_path, "sig", "train.resume=auto"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"resumed from {saved} (step {step}," in p.stdout and f"done: step {fh.STEPS}" in p.stdout
    assert fh.metric_rows(run_dir) == reference.rows
    SUMMARY.setdefault("preemptions", []).append({"signal": sig.name, "stopped_at": step})


@pytest.mark.dist
def test_sigterm_to_torchrun_saves_on_both_ranks_and_resumes_on_one(reference, summary_file, tmp_path):
    """SLURM-style preemption of a 2-rank job: torchrun forwards SIGTERM to the ranks, which
    agree on the step (all-reduced stop flag), save one checkpoint together and exit 0.
    (torchrun itself then exits 1 with a SignalException: its behaviour, not distlm's.)
    The checkpoint is resumed by a single process: the layout may change across a resume."""
    run_dir, log = tmp_path / "pre", tmp_path / "pre.log"
    proc = fh.launch(fh.train_cmd(tmp_path, "pre", nproc=2), log)
    assert fh.wait_for(lambda: fh.last_console_step(log) >= 3, proc), log.read_text()
    ranks = fh.descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=fh.WAIT_S)
    out = log.read_text()
    assert rc in (0, 1), out
    assert fh.wait_until(lambda: not [p for p in ranks if fh._alive(p)]), "ranks outlived torchrun"
    # torchrun signals the ranks one after the other: rank 0 either saw the signal itself or
    # learnt of it from the other rank through the all-reduced stop flag; both stop at one step.
    said = re.search(r"(SIGTERM received|another rank asked to stop) at step (\d+): saving a checkpoint", out)
    assert said, out
    why, step = said.group(1), int(said.group(2))
    assert f"stopped: {why}; checkpoint {run_dir / 'checkpoints' / f'step_{step:07d}'};" in out
    complete, torn = fh.checkpoints(run_dir)
    assert fh.step_of(complete[-1]) == step and not torn and step < fh.STEPS
    assert sorted(p.name for p in (complete[-1] / "rng").iterdir()) == ["rank_00000.pt", "rank_00001.pt"]
    p = fh.run(fh.train_cmd(tmp_path, "pre", "train.resume=auto"))
    assert p.returncode == 0 and f"(step {step}," in p.stdout, p.stdout + p.stderr
    rows = fh.metric_rows(run_dir)
    assert [r[0] for r in rows] == [r[0] for r in reference.rows]
    for got, ref in zip(rows, reference.rows):
        assert got[3] == ref[3] and close(got[1], ref[1]) and close(got[2], ref[2]), (got, ref)
    SUMMARY.setdefault("preemptions", []).append({"signal": "SIGTERM to torchrun (2 ranks)", "stopped_at": step,
                                                  "torchrun_rc": rc, "bit_exact": rows == reference.rows})


def test_second_ctrl_c_interrupts_at_once(tmp_path):
    """The first SIGINT asks for a save-and-exit; a second one, while that is under way,
    interrupts at once (KeyboardInterrupt; the CLI exits 130), and the handlers are put back."""
    t = make_trainer(tmp_path, "cc", "train.max_steps=20", "train.checkpoint_every=2")
    inner, seen = t.train_step, []

    def step(*a, **k):
        out = inner(*a, **k)
        if t.step == 3:
            # raise_signal delivers to this thread before it returns, and Python runs the
            # handler at the next bytecode: no wait for a signal in flight (os.kill may hand it
            # to another thread, which a loaded machine can leave unscheduled for a while).
            signal.raise_signal(signal.SIGINT)
            seen.append(t.step)  # the first one only asked for a save-and-exit
            signal.raise_signal(signal.SIGINT)
            seen.append("not interrupted")
        return out
    t.train_step = step
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        t.train()
    assert seen == [3] and t.step == 3 and signal.getsignal(signal.SIGINT) is before
    complete, _ = fh.checkpoints(tmp_path / "cc")
    assert [p.name for p in complete] == ["step_0000002"] and fh.load_into_fresh(complete[0])["step"] == 2


# ---- 3. non-finite values --------------------------------------------------------------
def test_nan_skip_leaves_parameters_and_goes_on(tmp_path, capsys):
    t = make_trainer(tmp_path, "skip", "train.max_steps=10", "train.checkpoint_every=1", "train.keep_last=1",
                     "train.on_nan=skip")
    nan_at(t, 5)
    seen = record_steps(t)
    summary = t.train()
    out = capsys.readouterr().out
    assert "warning: non-finite values at step 5: loss nan" in out and "step skipped (1/10)" in out
    assert "step_0000004 (before the fault) is kept" in out
    before, after, adam_before, adam_after, loss = seen[5]
    assert math.isnan(loss)
    assert before and len(before) == len(after)
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "a skipped step changed the parameters"
    assert adam_before == adam_after, "a skipped step advanced AdamW"
    for s in (4, 6):  # the steps around it did train
        assert not all(torch.equal(a, b) for a, b in zip(seen[s][0], seen[s][1]))
        assert math.isfinite(seen[s][4])
    assert summary["step"] == 10 and t.nan_skips == 1
    rows = fh.metric_rows(tmp_path / "skip")
    assert [r[0] for r in rows] == [str(s) for s in range(1, 11)] and rows[4][1] == "nan"
    # keep_last=1 pruned every other checkpoint, but not the last one before the fault.
    assert names(tmp_path / "skip") == ["step_0000004", "step_0000010"]
    meta = fh.load_into_fresh(tmp_path / "skip" / "checkpoints" / "step_0000010")
    assert meta["trainer"]["protected"] == ["step_0000004"] and meta["trainer"]["nan_skips"] == 1
    fh.load_into_fresh(tmp_path / "skip" / "checkpoints" / "step_0000004")


def test_nan_skip_budget_then_stop(tmp_path, capsys):
    t = make_trainer(tmp_path, "budget", "train.max_steps=10", "train.checkpoint_every=2", "train.on_nan=skip",
                     "train.max_nan_skips=1")
    nan_at(t, 3, 6)
    with pytest.raises(TrainingStopped, match=r"non-finite values at step 6: .*more than train.max_nan_skips=1"):
        t.train()
    assert "non-finite values at step 3" in capsys.readouterr().out


def test_nan_stop_names_step_and_tensors_and_keeps_checkpoint(tmp_path):
    t = make_trainer(tmp_path, "stop", "train.max_steps=10", "train.checkpoint_every=1", "train.keep_last=1",
                     "train.on_nan=stop")
    nan_at(t, 5)
    seen = record_steps(t)
    with pytest.raises(TrainingStopped) as e:
        t.train()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("non-finite values at step 5: loss nan, grad norm nan")
    assert "; gradients of tok_emb.weight, " in msg and "(train.on_nan=stop)" in msg
    before = tmp_path / "stop" / "checkpoints" / "step_0000004"
    assert f"checkpoint {before} (before the fault) is kept" in msg
    # keep_last=1 pruned steps 1-3 as it went; the one before the fault is protected and loads.
    assert t.protected == ["step_0000004"] and names(tmp_path / "stop") == ["step_0000004"]
    assert fh.load_into_fresh(before)["step"] == 4
    assert 5 not in seen  # it never returned from the faulty step
    assert all(torch.equal(a, b) for a, b in zip(seen[4][1], params(t))), "the faulty step changed parameters"


def inf_in(t: Trainer, step: int) -> str:
    """Only one parameter's gradient becomes non-finite at ``step`` (the loss stays finite)."""
    name, p = [(n, p) for n, p in t.module.named_parameters() if n.startswith("blocks.1.") and p.ndim == 2][-1]
    p.register_hook(lambda g: g * float("inf") if t.step + 1 == step else g)
    return name


def test_inf_in_one_gradient_names_that_tensor_without_clipping(tmp_path):
    t = make_trainer(tmp_path, "inf0", "train.max_steps=6", "train.on_nan=stop", "train.grad_clip=0")
    name = inf_in(t, 3)
    with pytest.raises(TrainingStopped) as e:
        t.train()
    assert str(e.value).startswith("non-finite values at step 3: loss ")
    assert f"; gradients of {name} (train.on_nan=stop)" in str(e.value), str(e.value)


def test_inf_in_one_gradient_names_that_tensor_with_clipping(tmp_path):
    t = make_trainer(tmp_path, "inf1", "train.max_steps=6", "train.on_nan=stop", "train.grad_clip=1.0")
    name = inf_in(t, 3)
    with pytest.raises(TrainingStopped) as e:
        t.train()
    assert f"; gradients of {name} (train.on_nan=stop)" in str(e.value), str(e.value)


@pytest.mark.dist
def test_nan_via_cli_exits_3_with_one_line(tmp_path):
    p = fh.run(fh.train_cmd(tmp_path, "div", "optim.adamw.lr=1e30", "train.min_lr_ratio=0", "train.on_nan=stop",
                            "train.checkpoint_every=1"))
    assert p.returncode == 3, p.stdout + p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: non-finite values at step "), p.stderr
    assert "gradients of tok_emb.weight" in err[0] and "(train.on_nan=stop)" in err[0]
    step = int(re.search(r"at step (\d+)", err[0]).group(1))
    assert f"step_{step - 1:07d} (before the fault) is kept" in err[0]


# ---- 7. async checkpoints ------------------------------------------------------------
def test_async_checkpoint_holds_the_state_at_the_save(tmp_path):
    """dcp.async_save writes in the background while training goes on: each checkpoint
    must still hold the parameters of its own step, not a later one's."""
    t = make_trainer(tmp_path, "as", "train.max_steps=8", "train.checkpoint_every=2", "train.keep_last=10",
                     "train.async_checkpoint=true")
    at_save, inner = {}, t.save

    def save(*a, **k):
        at_save[t.step] = params(t)
        return inner(*a, **k)
    t.save = save
    t.train()
    complete, torn = fh.checkpoints(tmp_path / "as")
    assert [fh.step_of(p) for p in complete] == [2, 4, 6, 8] and not torn
    for p in complete:
        model, opt = fh.fresh_model_and_optimizer(fh.CLI_TINY)
        rng = torch.get_rng_state()
        ckpt.load_checkpoint(p, model, opt)
        torch.set_rng_state(rng)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), at_save[fh.step_of(p)])), p.name


def test_background_saves_run_their_collectives_on_a_gloo_group_of_their_own(tmp_path, monkeypatch):
    """Under torch.distributed, dcp.async_save gets a gloo group made for it, not the world
    group: its collectives run from a thread of their own and must not interleave with the
    training's, and on GPUs the world group is NCCL, which async_save refuses. One process
    in a real gloo world checks the plumbing; tests/layout/test_data.py's fsdp2_async job runs
    background saves on 2 ranks against one process."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from distlm.checkpoint.group import background_save_group
    assert background_save_group(60) is None  # one process, no process group: nothing to make
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        used, real = [], dcp.async_save
        monkeypatch.setattr(dcp, "async_save", lambda *a, **k: used.append(k.get("process_group")) or real(*a, **k))
        t = make_trainer(tmp_path, "bg", "train.max_steps=4", "train.checkpoint_every=2", "train.async_checkpoint=true")
        group = t.background_save_group
        assert group is not None and group is not dist.group.WORLD and dist.get_backend(group) == "gloo"
        t.train()
        assert used == [group, group]
        complete, torn = fh.checkpoints(tmp_path / "bg")
        assert [fh.step_of(p) for p in complete] == [2, 4] and not torn
        model, opt = fh.fresh_model_and_optimizer(fh.CLI_TINY)
        with pytest.raises(ValueError, match="needs a background_group"):
            ckpt.save_checkpoint(tmp_path / "x", 1, model, opt, {}, async_save=True)
        assert not (tmp_path / "x").exists()
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.timeout(3600)  # dozens of launches: slow, not stuck, on a loaded box
def test_async_checkpoint_kill9_resumes_bit_exact(reference, summary_file, tmp_path):
    rng = random.Random(KILL_SEED + 1)
    c = fh.Campaign(tmp_path, "async", rng, after_s=max(0.01, 3 * reference.step_s), min_kills=4,
                    extra=("train.async_checkpoint=true",), startup_share=0.0).run()
    for run_dir in c.run_dirs:
        assert fh.metric_rows(run_dir) == reference.rows
    counts = c.counts()
    SUMMARY["async_kill9"] = counts
    print(f"\nasync kill -9: {counts['kills']} kills, {counts['mid_save_kills']} mid-save, "
          f"{counts['resumes']} resumes, phases {counts['phases']}")
    assert counts["kills"] >= 4
