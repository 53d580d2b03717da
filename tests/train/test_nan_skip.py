"""train.on_nan=skip (the default) decided on the device: a step whose loss or gradient is not
finite is left out by the optimizer itself, from a found_inf flag, and the host never waits for
the verdict; the Trainer reads the verdicts where it reads the loss anyway.

- Each optimizer (AdamW's fused kernel, Lion, Muon with fused AdamW groups) leaves a flagged
  step out bit for bit, and a flag of 0 changes no bit of the step.
- A NaN gradient at step k under the default: parameters and optimizer state after step k are
  the bits they were before it; no host read inside the training step; the warning names step
  k (read through a pipe); train.max_nan_skips still stops (exit 3); a checkpoint is never
  written with a skip that was not read.
- Two processes (DDP, FSDP2) with a NaN at one step equal one process.

A GPU builds fused AdamW; a CPU the per-tensor kernels, which take no flag, so the CPU keeps
the host check (it costs a CPU nothing). The tests build the GPU's optimizers on the CPU
(``cuda_kernels``): torch's fused AdamW kernel runs on both.
"""
from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fault_harness as fh
from distlm.config import load_config
from distlm.checkpoint import store as ckpt
from distlm.optim import REGISTRY
from distlm.optim.base import BuildContext
from distlm.train.faults import TrainingStopped
from distlm.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
# A log row every 2 steps: a fault at an odd step is read one step later.
RUN = [*fh.CLI_TINY, "train.max_steps=40", "train.checkpoint_every=0", "train.warmup_steps=2", "log.every=2"]
OPTIMIZERS = {"adamw": [], "lion": ["optim.name=lion", "optim.lion.lr=1e-4"], "muon": ["optim.name=muon"]}


@pytest.fixture
def cuda_kernels(monkeypatch):
    """The optimizers as a GPU builds them (fused AdamW), on the CPU."""
    import distlm.optim.adamw as adamw
    import distlm.optim.muon as muon
    from distlm.optim.groups import elementwise_kernel
    gpu = lambda groups, device_type: elementwise_kernel(groups, "cuda")  # noqa: E731
    monkeypatch.setattr(adamw, "elementwise_kernel", gpu)
    monkeypatch.setattr(muon, "elementwise_kernel", gpu)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits (so -0.0 and 0.0 differ, and NaNs compare)."""
    t = t.detach()
    return t.clone().view(torch.int32) if t.dtype == torch.float32 else t.clone()


def snapshot(params, optimizer) -> list[torch.Tensor]:
    out = [bits(p) for p in params]
    for p in params:
        out += [bits(v) if torch.is_tensor(v) else torch.tensor(v) for _, v in sorted(optimizer.state[p].items())]
    return out


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def _model_and_cfg(name: str):
    cfg = load_config(None, [*RUN, *OPTIMIZERS[name], "optim.muon.ns_dtype=fp32"])
    from distlm.model.gpt import GPT
    torch.manual_seed(0)
    return GPT(cfg.model), cfg


def _step(opt, found_inf=None):
    if found_inf is not None:
        device = opt.param_groups[0]["params"][0].device
        opt.grad_scale, opt.found_inf = None, torch.tensor(float(found_inf), device=device)
    try:
        opt.step()
    finally:
        if found_inf is not None:
            del opt.grad_scale, opt.found_inf


# ---- the optimizers ----------------------------------------------------------------------
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_each_optimizer_leaves_a_flagged_step_out_bit_for_bit(name, device):
    """On a GPU too (the torch there may not be this one): pytest tests/train/test_nan_skip.py -k bit_for_bit"""
    spec = REGISTRY[name]
    runs = []
    for _ in range(2):  # one optimizer handed found_inf=0 on its good steps, one handed nothing
        model, cfg = _model_and_cfg(name)
        model = model.to(device)
        runs.append((model, spec.build(model, cfg, BuildContext("cuda"))))
    (flagged_model, flagged), (plain_model, plain) = runs
    gen = torch.Generator().manual_seed(1)
    params = list(flagged_model.parameters())
    for step in range(4):
        grads = [torch.randn(p.shape, generator=gen).to(device) for p in params]
        for model in (flagged_model, plain_model):
            for p, g in zip(model.parameters(), grads):
                p.grad = g.clone()
        if step == 2:  # NaN and Inf in the gradients, flagged: nothing may move
            before = snapshot(params, flagged)
            for p in params:
                p.grad.view(-1)[0] = float("nan")
                p.grad.view(-1)[-1] = float("inf")
            _step(flagged, found_inf=1.0)
            assert same(snapshot(params, flagged), before), name
            for p, g in zip(plain_model.parameters(), grads):
                p.grad = None  # the unflagged twin takes no step here
            continue
        _step(flagged, found_inf=0.0)
        _step(plain)
        # A flag of 0 takes the step the unflagged optimizer takes, to the bit.
        assert same(snapshot(params, flagged), snapshot(list(plain_model.parameters()), plain)), (name, step)
    assert not same(snapshot(params, flagged), before)  # the step after the skipped one moved
    assert spec.skips_on_device(flagged)


def test_an_optimizer_without_the_flag_says_so():
    # The CPU build (per-tensor AdamW kernels) takes no found_inf: the Trainer keeps the host check.
    for name in ("adamw", "muon"):
        model, cfg = _model_and_cfg(name)
        assert not REGISTRY[name].skips_on_device(REGISTRY[name].build(model, cfg, BuildContext("cpu")))


# ---- the Trainer, one process ------------------------------------------------------------
def make_trainer(root: Path, name: str, *extra: str) -> Trainer:
    return Trainer(load_config(None, [*RUN, f"log.root={root}", f"log.name={name}", *extra]))


def poison(t: Trainer, *steps: int) -> None:
    """The first parameter's gradient is NaN at the given (1-based) steps; the loss stays finite."""
    p = next(t.module.parameters())
    p.register_hook(lambda g: g * float("nan") if t.step + 1 in steps else g)


class HostReads:
    """Counts reads of a tensor's value on the host (bool, item, float, int, tolist) made inside
    ``Trainer.train_step``: on a GPU each one waits for the device."""
    NAMES = ("__bool__", "item", "__float__", "__int__", "__index__", "tolist")

    def __init__(self, monkeypatch, t: Trainer):
        self.count, self._inside = 0, False
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)

            def counted(tensor, *a, _original=original, **k):
                self.count += self._inside
                return _original(tensor, *a, **k)
            monkeypatch.setattr(torch.Tensor, name, counted)
        inner = t.train_step

        def train_step(*a, **k):
            self._inside = True
            try:
                return inner(*a, **k)
            finally:
                self._inside = False
        t.train_step = train_step


def record(t: Trainer, step: int) -> dict:
    """The parameters and optimizer state before and after ``step`` (1-based)."""
    seen, inner = {}, t.train_step

    def train_step(*a, **k):
        params = list(t.module.parameters())
        if t.step + 1 == step:
            seen["before"] = snapshot(params, t.optimizer)
        out = inner(*a, **k)
        if t.step == step:
            seen["after"] = snapshot(params, t.optimizer)
            seen["skips_counted"] = t.nan_skips
        return out
    t.train_step = train_step
    return seen


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_nan_gradient_is_skipped_on_the_device_with_no_host_read_per_step(name, tmp_path, capsys, monkeypatch,
                                                                             cuda_kernels):
    t = make_trainer(tmp_path, name, *OPTIMIZERS[name])
    poison(t, 5)
    seen = record(t, 5)
    reads = HostReads(monkeypatch, t)
    summary = t.train()
    assert reads.count == 0, f"{reads.count} host reads inside 40 training steps"
    assert same(seen["before"], seen["after"]), "the skipped step changed the parameters or the optimizer state"
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if line.startswith("warning: non-finite")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: non-finite values at step 5: loss ")
    assert ", grad norm nan" in warnings[0] and "step skipped (1/10)" in warnings[0]
    # Not read at the step: with the row of step 6 (a row every 2 steps), before it.
    assert seen["skips_counted"] == 0 and out.index("step      4/40") < out.index(warnings[0]) < out.index(
        "step      6/40")
    assert summary["step"] == 40 and t.nan_skips == 1 and math.isfinite(summary["train_loss"])
    rows = fh.metric_rows(tmp_path / name)
    assert [r[2] for r in rows if r[0] == "6"] != ["nan"]  # the run went on


def test_the_host_check_remains_for_stop_and_for_an_optimizer_without_the_flag(tmp_path, monkeypatch):
    from distlm.train.faults import DeviceSkip, HostCheck
    assert isinstance(make_trainer(tmp_path, "default").nan_guard, HostCheck)  # per-tensor AdamW on the CPU
    import distlm.optim.adamw as adamw
    from distlm.optim.groups import elementwise_kernel
    monkeypatch.setattr(adamw, "elementwise_kernel", lambda groups, device_type: elementwise_kernel(groups, "cuda"))
    assert isinstance(make_trainer(tmp_path, "gpu-build").nan_guard, DeviceSkip)
    assert isinstance(make_trainer(tmp_path, "stop", "train.on_nan=stop").nan_guard, HostCheck)


def test_a_checkpoint_is_written_only_after_its_skips_are_read(tmp_path, cuda_kernels):
    # Step 15 has no log row (a row every 2 steps): only the save at 15 reads its verdict.
    t = make_trainer(tmp_path, "ckpt", "train.checkpoint_every=5", "train.keep_last=4", "train.max_steps=20")
    poison(t, 15)
    t.train()
    meta = ckpt.read_meta(tmp_path / "ckpt" / "checkpoints" / "step_0000015")
    assert meta["trainer"]["nan_skips"] == 1 and meta["trainer"]["protected"] == ["step_0000010"]
    assert ckpt.read_meta(tmp_path / "ckpt" / "checkpoints" / "step_0000010")["trainer"]["nan_skips"] == 0


def test_max_nan_skips_still_stops_and_saves_nothing_after_the_fault(tmp_path, cuda_kernels):
    t = make_trainer(tmp_path, "budget", "train.checkpoint_every=3", "train.max_nan_skips=1")
    poison(t, 4, 7)
    with pytest.raises(TrainingStopped, match=r"^non-finite values at step 7: .*more than train.max_nan_skips=1"):
        t.train()
    # Step 4 was read with the row of step 4; step 7 at the row of step 8, before anything was saved.
    assert t.step == 8 and t.nan_skips == 2
    names = sorted(p.name for p in (tmp_path / "budget" / "checkpoints").iterdir())
    assert names == ["step_0000003", "step_0000006"]
    assert ckpt.read_meta(tmp_path / "budget" / "checkpoints" / "step_0000006")["trainer"]["nan_skips"] == 1


# ---- through the command line: a pipe, and two processes ---------------------------------
TWELVE = [*RUN, "train.max_steps=12", "log.every=1"]
MUON = ["optim.name=muon", "optim.muon.ns_dtype=fp32"]


def world_scenarios(root: Path, data: Path) -> dict[int, list[dict]]:
    base = [*TWELVE, f"log.root={root}"]
    return {2: [{"kind": "nan", "name": "ddp2", "nan_at": [5], "cuda_kernels": True,
                 "overrides": [*base, "log.name=ddp2", "parallel.dp_replicate=2"]},
                {"kind": "nan", "name": "fsdp2", "nan_at": [5], "cuda_kernels": True,
                 "overrides": [*base, *MUON, "log.name=fsdp2", "parallel.dp_shard=2"]}]}


def _rows(run: Path) -> dict:
    with open(run / "metrics.csv") as f:
        return {int(r["step"]): (float(r["loss"]), float(r["grad_norm"])) for r in csv.DictReader(f) if r.get("loss")}


@pytest.mark.dist
def test_through_a_pipe_and_on_two_processes_a_skipped_step_is_the_one_process_run(tmp_path, worlds):
    """One process through the command line, read through a pipe: an AdamW run with NaN
    gradients at steps 5 and 9 and max_nan_skips=1 (warning for 5 on stdout, exit 3 naming 9).
    In the 2-rank world: DDP with AdamW, FSDP2 with Muon, each with a NaN gradient at step 5
    only: the same losses and norms as one process (here, with the same poison)."""
    from helpers import nan_jobs
    stop = [*TWELVE, f"log.root={tmp_path}", "log.name=stop", "train.max_nan_skips=1", "train.checkpoint_every=4"]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"nan_at": [5, 9], "cuda_kernels": True, "jobs": [stop]}))
    one = subprocess.run([sys.executable, nan_jobs.__file__, str(plan)], cwd=str(ROOT), env=fh.child_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=fh.WAIT_S)
    assert one.returncode == 3, one.stdout + one.stderr
    warnings = [line for line in one.stdout.splitlines() if line.startswith("warning: non-finite")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: non-finite values at step 5: loss "), one.stdout
    err = one.stderr.strip().splitlines()
    assert err[-1].startswith("error: non-finite values at step 9: ") and "max_nan_skips=1" in err[-1], one.stderr
    assert "step_0000008 (before the fault) is kept" in err[-1]

    for name, extra in (("ref-adamw", []), ("ref-muon", MUON)):
        nan_jobs.run({"nan_at": [5], "cuda_kernels": True,
                      "overrides": [*TWELVE, *extra, f"log.root={tmp_path}", f"log.name={name}"]})
    two, root = worlds.results(__name__, 2), worlds.root(__name__)
    for run, ref in (("ddp2", "ref-adamw"), ("fsdp2", "ref-muon")):
        assert two[run]["nan_skips"] == 1
        assert two.stdout(run).count("warning: non-finite values at step 5: ") == 1, two.stdout(run)  # rank 0's
        got, want = _rows(root / run), _rows(tmp_path / ref)
        assert sorted(got) == sorted(want) == list(range(1, 13)), run
        assert math.isnan(got[5][1]) and math.isnan(want[5][1])
        for s in got:
            for a, b in zip(got[s], want[s]):
                assert (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6), (run, s)
