"""The first hour on a CPU (2026-11-27): speed that fits the CPU, a schedule that ends on time,
progress a user can follow, and a record of every run, however short.

    speed     Muon's Newton-Schulz dtype is measured per device (optim.muon.ns_dtype=auto):
              fp32 where bf16 is measured slower, bf16 on CUDA; fp32 agrees with bf16 to
              bf16's rounding
    schedule  the CPU demo config's learning-rate schedule ends, with its final evaluation,
              at the time limit on a machine too slow for its max_steps (a slowed step)
    progress  each row says step N/M, elapsed and ETA; the first row is the first step's,
              whatever log.every is; the progress bar shows what the row shows
    record    a run stopped early writes its last step's row; one point is drawn as a
              point and labelled so; `distlm plot` refuses a run with nothing to plot
"""
from __future__ import annotations

import csv
import fcntl
import os
import platform
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from distlm.checkpoint import store as ckpt
from distlm.config import load_config
from distlm.optim.matmul_dtype import MatmulDtypeProbe
from distlm.optim.muon import Muon, newton_schulz
from distlm.optim import REGISTRY
from distlm.train.optim import build_optimizer

ROOT = Path(__file__).resolve().parents[2]
# The demo's model and schedule on random tokens of the demo's vocabulary: no corpus to prepare.
DEMO_SYNTHETIC = ["data.source=synthetic", "model.vocab_size=4096", "train.device=cpu", "log.samples=0"]
# bf16 keeps 8 significant bits: one rounding is at most 2^-8 relative. Five Newton-Schulz
# steps of three matmuls each compound it; 8 roundings' worth is the tolerance.
BF16_TOL = 8 * 2.0 ** -8


@pytest.fixture(scope="module")
def book_data(tmp_path_factory) -> Path:
    """A few books' worth of sentences on a small BPE, enough for the demo's batch and a real
    validation loss (synthetic tokens have no validation split)."""
    from conftest import SAMPLE_TEXT
    from distlm.corpus.prepare import prepare
    text = tmp_path_factory.mktemp("books")
    for i, t in enumerate(SAMPLE_TEXT * 4):
        (text / f"doc{i:02d}.txt").write_text(t)
    out = tmp_path_factory.mktemp("data") / "books"
    prepare([str(text)], out, tokenizer="bpe:512", val_fraction=0.2, seed=0, workers=1, progress=False)
    return out


@pytest.fixture
def one_thread():
    """Two intra-op threads on a box shared with other work: a demo step took 20 s against 1.9 s
    with one (2026-11-27, load average 25 on 2 cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def rows(run: Path) -> list[dict]:
    with open(run / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


class OneComm:
    """A single process's comm: the max over one rank is the value."""

    def max(self, t):
        return t


# ---- speed -----------------------------------------------------------------------------
def test_auto_picks_fp32_where_bf16_is_measured_slower_and_measures_once():
    calls = []

    def slow_bf16(device, dtype):  # the 2-core AVX2-only EPYC's timings
        calls.append(dtype)
        return {torch.bfloat16: 46.4e-3, torch.float32: 1.08e-3}[dtype]

    probe = MatmulDtypeProbe(measure=slow_bf16)
    cfg = load_config("demo", DEMO_SYNTHETIC)
    assert cfg.optim.muon.ns_dtype == "auto"
    resolve_ns_dtype = REGISTRY["muon"].resolve  # Muon's spec resolves its own setting
    resolved, line = resolve_ns_dtype(cfg, torch.device("cpu"), OneComm(), probe)
    assert resolved.optim.muon.ns_dtype == "fp32"
    assert line.startswith("optim.muon.ns_dtype=auto: fp32") and "bf16 46.40 ms, fp32 1.08 ms" in line
    assert probe.choose("cpu").dtype is torch.float32 and len(calls) == 2  # cached: not measured again

    fast_bf16 = MatmulDtypeProbe(measure=lambda d, dtype: {torch.bfloat16: 0.30e-3, torch.float32: 1.26e-3}[dtype])
    assert resolve_ns_dtype(cfg, torch.device("cpu"), OneComm(), fast_bf16)[0].optim.muon.ns_dtype == "bf16"

    def never(device, dtype):
        raise AssertionError("CUDA is not timed: bf16 runs on tensor cores")

    assert MatmulDtypeProbe(measure=never).choose(torch.device("cuda", 0)).dtype is torch.bfloat16
    # An explicit value is kept, and nothing is measured for it.
    explicit = load_config("demo", DEMO_SYNTHETIC + ["optim.muon.ns_dtype=bf16"])
    assert resolve_ns_dtype(explicit, torch.device("cpu"), OneComm(), MatmulDtypeProbe(measure=never))[1] is None


def test_build_optimizer_runs_newton_schulz_in_the_configured_dtype():
    from distlm.model.gpt import GPT
    cfg = load_config("demo", DEMO_SYNTHETIC)
    model = GPT(cfg.model)
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        opt = build_optimizer(model, load_config("demo", DEMO_SYNTHETIC + [f"optim.muon.ns_dtype={name}"]), "cpu")
        assert isinstance(opt, Muon) and opt.ns_dtype is dtype


@pytest.mark.parametrize("shape", [(128, 128), (128, 512), (512, 128), (3, 96, 64)])
def test_fp32_newton_schulz_matches_bf16_within_bf16_rounding(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    exact = newton_schulz(g, dtype=torch.float32)
    rounded = newton_schulz(g, dtype=torch.bfloat16).float()
    assert exact.dtype is torch.float32
    rel = float((exact - rounded).norm() / exact.norm())
    assert rel < BF16_TOL, rel
    # The same singular values, to bf16's rounding (a random square matrix has a few too small
    # for five steps to lift into the band: they must come out equally small in both).
    s_exact, s_rounded = torch.linalg.svdvals(exact), torch.linalg.svdvals(rounded)
    assert float((s_exact - s_rounded).abs().max()) < 2 * BF16_TOL


def test_a_muon_step_in_fp32_matches_bf16_within_bf16_rounding():
    gen = torch.Generator().manual_seed(1)
    w0, grad = torch.randn(96, 64, generator=gen), torch.randn(96, 64, generator=gen)
    moved = {}
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.nn.Parameter(w0.clone())
        w.grad = grad.clone()
        Muon([{"params": [w]}], lr=0.05, ns_dtype=dtype).step()
        moved[dtype] = w.detach() - w0
    rel = float((moved[torch.float32] - moved[torch.bfloat16]).norm() / moved[torch.bfloat16].norm())
    assert 0 < rel < BF16_TOL, rel


# ---- schedule and record ---------------------------------------------------------------
SLOW_STEP_S = 4.0  # seconds a step takes on the machine simulated: 600 steps would need 2,400 s


def test_demo_schedule_ends_at_its_time_limit_on_a_slow_machine(tmp_path, book_data, one_thread):
    """The demo config on a machine where each step takes SLOW_STEP_S: the schedule's clock
    is the injected slow steps' simulated time (no sleep, no wall clock), so 200 s hold 49 of
    its 600 steps (the step projected to end, with one to spare, past 200 s is the last).
    The learning rate must warm up, hold, decay to min_lr by the time limit, and the run must end
    there with a final evaluation, written to metrics.csv, TensorBoard and the plot."""
    from distlm.cli.demo import CPU_OVERRIDES
    from distlm.train.trainer import Trainer
    cfg = load_config("demo", [*CPU_OVERRIDES, f"data.dir={book_data}", "train.device=cpu", "log.samples=0", f"log.root={tmp_path}",
                               "log.name=slow", "log.progress=false", "log.every=1"])
    assert cfg.train.time_budget_s == 200 and cfg.train.time_limit_s == 0 and cfg.train.max_steps == 600
    trainer = Trainer(cfg)
    simulated = [0.0]
    real_step = trainer.train_step

    def slow_step(*args, **kwargs):
        out = real_step(*args, **kwargs)
        simulated[0] += SLOW_STEP_S
        return out

    trainer.train_step = slow_step
    trainer.lr_clock.clock = lambda: simulated[0]
    summary = trainer.train()

    # Step k (from 0) starts at 4k simulated seconds and is projected to end, a step to spare,
    # at 4k + 8: the first with 4k + 8 >= 200 is k = 48, the 49th step.
    assert summary["stopped"] is None and summary["step"] == 49, summary
    table = rows(tmp_path / "slow")
    assert [r["step"] for r in table] == [str(s) for s in range(1, summary["step"] + 1)]
    lrs = [float(r["lr"]) for r in table]
    peak, final = cfg.optim.adamw.lr, cfg.optim.adamw.lr * cfg.train.min_lr_ratio
    assert lrs[-1] == final  # the cooldown ran to its end
    assert max(lrs) == pytest.approx(peak) and lrs.index(max(lrs)) < len(lrs) // 2  # warm-up and hold first
    after_peak = lrs[lrs.index(max(lrs)):]
    assert all(b <= a for a, b in zip(after_peak, after_peak[1:]))  # then down, never back up
    assert table[-1]["val_loss"] and math_isfinite(table[-1]["val_loss"])  # the final evaluation, on the last row
    assert ckpt.read_meta(Path(summary["checkpoint"]))["trainer"]["lr_clock"] == {"progress": 1.0}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "slow" / "tensorboard"))
    acc.Reload()
    assert acc.Scalars("train/loss")[-1].step == summary["step"]
    assert acc.Scalars("train/lr")[-1].value == pytest.approx(final)
    assert [e.step for e in acc.Scalars("val/val_loss")] == [summary["step"]]
    assert drawn_pixels(tmp_path / "slow" / "loss.png") > 0


def test_the_cpu_demo_takes_its_whole_batch_in_one_pass():
    """The demo preset leaves its micro-batch to auto (8 on a CPU process), so that it runs on 2
    or 4 processes; `distlm demo` on a CPU sets the one pass of 16 its figures were measured with."""
    from distlm.cli.demo import CPU_OVERRIDES
    assert load_config("demo").train.micro_batch_size is None
    t = load_config("demo", CPU_OVERRIDES).train
    assert t.micro_batch_size == t.global_batch_size == 16


def math_isfinite(text: str) -> bool:
    return np.isfinite(float(text))


def drawn_pixels(png: Path, color=(0x1F, 0x77, 0xB4)) -> int:
    """Pixels of matplotlib's first line colour (C0, the first run's train curve) in the PNG."""
    import matplotlib.image as mpimg
    img = mpimg.imread(str(png))[..., :3]
    if img.dtype != np.uint8:
        img = (img * 255).round()
    return int((np.abs(img.astype(int) - np.array(color)).sum(axis=-1) < 30).sum())


def test_a_stopped_run_writes_its_last_steps_row(tmp_path, monkeypatch, one_thread):
    """A run stopped at step 3 with log.every=50 (steps 1 and 3 logged, nothing between): the
    first step's row comes at once, the stopping step's row is written, TensorBoard has both
    and the plot draws them."""
    import distlm.train.trainer as trainer_module
    from distlm.train.trainer import Trainer
    cfg = load_config("demo", DEMO_SYNTHETIC + [f"log.root={tmp_path}", "log.name=short", "log.progress=false",
                                                "train.max_steps=2000", "log.every=50", "train.time_budget_s=0"])
    trainer = Trainer(cfg)
    monkeypatch.setattr(trainer_module, "stop_reason",
                        lambda stop, t0, tcfg, step, *a: "a test's stop" if step == 3 else None)
    summary = trainer.train()
    assert summary["stopped"] == "a test's stop" and summary["step"] == 3
    table = rows(tmp_path / "short")
    assert [r["step"] for r in table] == ["1", "3"] and all(r["loss"] for r in table)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "short" / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 3]
    assert drawn_pixels(tmp_path / "short" / "loss.png") > 0


def _write_metrics(run: Path, table: list[dict]) -> None:
    from distlm.train.logger import COLUMNS
    run.mkdir(parents=True)
    with open(run / "metrics.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in table:
            w.writerow(r)


def test_one_point_is_drawn_and_labelled_and_nothing_to_plot_is_refused(tmp_path, monkeypatch):
    from distlm.cli import main
    from distlm.report import plot as plot_module
    one, empty = tmp_path / "one", tmp_path / "empty"
    _write_metrics(one, [{"step": 7, "loss": 5.5, "val_loss": 5.7}])
    _write_metrics(empty, [])

    labels = []
    real_save = plot_module.save_figure

    def keep_labels(fig, out, **kw):
        labels.extend(t.get_text() for ax in fig.axes for t in ax.get_legend().get_texts())
        return real_save(fig, out, **kw)

    monkeypatch.setattr(plot_module, "save_figure", keep_labels)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no library warning reaches the console
        plot_module.plot_runs([one], tmp_path / "one.png")
    assert labels == ["one train (1 point, step 7)", "one val (1 point, step 7)"]
    assert drawn_pixels(tmp_path / "one.png") > 20  # the train point, drawn as a marker

    out = tmp_path / "empty.png"
    err = subprocess.run([sys.executable, "-m", "distlm", "plot", str(empty), "--out", str(out)],
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert err.returncode == 2 and not out.exists(), (err.stdout, err.stderr)
    assert err.stderr.count("\n") == 1 and "nothing to plot" in err.stderr and str(empty) in err.stderr
    assert main(["plot", str(one), "--out", str(tmp_path / "again.png")]) == 0


# ---- progress, through pipes ------------------------------------------------------------
ROW = re.compile(r"^step\s+(\d+)/(\d+) \| (\d+:\d\d elapsed \| eta (?:\d+:\d\d|\?)(?: \(time limit\))?) \| loss ",
                 re.M)


def _drain(fd: int, into: list) -> None:
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the child closed its end
            return
        if not chunk:
            return
        into.append(chunk)


def test_console_rows_and_the_progress_bar_say_where_the_run_stands(tmp_path):
    """`distlm train` as a user runs it: stdout through a pipe, stderr on a terminal (a
    pseudo-terminal, so the progress bar is drawn). With log.every=50 the first row is the first
    step's; it says step 1/2000, elapsed and ETA, and the bar drawn after it says the same.
    Ctrl-C then stops the run: its last step's row is written, and the status is 130, as for
    any process Ctrl-C ended (a script must not take it for a finished run). Where x86 oneDNN can be capped
    at AVX2 (no fast bf16), Newton-Schulz must have been measured and put in fp32."""
    x86 = platform.machine() in ("x86_64", "AMD64")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if x86:  # the 2-core AVX2-only CPU this was first seen on: bf16 matmuls 40x slower than fp32
        env.update(ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2")
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))
    cmd = [sys.executable, "-m", "distlm", "train", "--config", "demo", *DEMO_SYNTHETIC, f"log.root={tmp_path}",
           "log.name=follow", "log.every=50", "train.max_steps=2000", "train.time_budget_s=0"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=slave, text=True)
    os.close(slave)
    terminal: list = []
    reader = threading.Thread(target=_drain, args=(master, terminal), daemon=True)
    reader.start()
    out = []
    try:
        for line in proc.stdout:
            out.append(line)
            if ROW.match(line):
                proc.send_signal(signal.SIGINT)  # the user has seen the run move, and stops it
                break
        out.extend(proc.stdout)
        assert proc.wait(timeout=300) == 130, "".join(out)
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(timeout=10)
        os.close(master)
    stdout, bar = "".join(out), b"".join(terminal).decode(errors="replace")
    found = ROW.findall(stdout)
    assert found and found[0][:2] == ("1", "2000"), stdout
    last = int(found[-1][0])
    assert re.search(rf"SIGINT received at step {last}: saving", stdout), stdout
    assert [r["step"] for r in rows(tmp_path / "follow")] == sorted({"1", str(last)}, key=int)
    for step, total, times in found:  # the bar, redrawn under each row, shows the row's numbers
        assert f"step {step}/{total} | {times}" in bar, (step, times, bar[-2000:])
    assert "Warning" not in bar and "warning" not in stdout.lower(), (bar[-2000:], stdout)
    if x86:
        assert "optim.muon.ns_dtype=auto: fp32 for Newton-Schulz" in stdout, stdout
        assert "ns_dtype: fp32" in (tmp_path / "follow" / "config.yaml").read_text()


# ---- a crash: the tour's step 5 ---------------------------------------------------------
# The tour's command (README step 5) with the tiny preset's own checkpoint schedule, on a
# smaller model and random tokens so that three 300-step runs fit in a test.
CRASH = ["--config", "tiny", "train.max_steps=300", "train.device=cpu", "data.source=synthetic",
         "model.vocab_size=512", "model.n_layer=1", "model.d_model=64", "model.d_ff=128", "log.samples=0",
         "log.progress=false", "log.tensorboard=false", "log.every=10"]


def _train(tmp_path, *args):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return [sys.executable, "-m", "distlm", "train", *CRASH, f"log.root={tmp_path}", *args], env


def test_a_run_killed_with_kill_9_midway_resumes_bit_exactly(tmp_path):
    """kill -9 gives the Trainer no chance to save: what is left is the preset's periodic
    checkpoints, which its log announces. Killed past its first checkpoint and before its end,
    the run resumes from that checkpoint with the tour's command + train.resume=auto and ends
    with the uninterrupted run's losses, bit for bit."""
    cmd, env = _train(tmp_path, "log.name=ref")
    ref = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stderr[-2000:]
    assert "checkpoints: every 100 steps (train.checkpoint_every) and at the end; a crash loses at most 100 steps" \
        in ref.stdout, ref.stdout
    # where it writes, resolved, and the log.every given kept (300 steps would otherwise adapt)
    assert f"paths: run folder {(tmp_path / 'ref').resolve()} (log.root={tmp_path}), data.source=synthetic" \
        in ref.stdout, ref.stdout
    assert "log.every=auto" not in ref.stdout and [r["step"] for r in rows(tmp_path / "ref")][:3] == ["1", "10", "20"]

    cmd, env = _train(tmp_path, "log.name=crash")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    root = tmp_path / "crash" / "checkpoints"
    try:
        while not ckpt.list_checkpoints(root)[0]:
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            threading.Event().wait(0.02)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    kept = ckpt.list_checkpoints(root)[0]
    assert kept and all(p.name != "step_0000300" for p in kept), kept  # killed midway, not after the end

    cmd, env = _train(tmp_path, "log.name=crash", "train.resume=auto")
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    resumed = int(re.search(r"resumed from \S+ \(step (\d+),", again.stdout).group(1))
    assert 100 <= resumed < 300 and "done: step 300" in again.stdout, again.stdout

    def losses(run):
        return {r["step"]: (r["loss"], r["lr"], r["grad_norm"]) for r in rows(tmp_path / run)}

    mine, theirs = losses("crash"), losses("ref")
    after = [s for s in theirs if int(s) > resumed]
    assert after and all(mine[s] == theirs[s] for s in after), [(s, mine.get(s), theirs[s]) for s in after]
