"""Helpers for the reliability tests (tests/train/test_faults.py): launch `distlm train` as a
real process, kill it at chosen moments (one process, or a whole torchrun tree), and
read back what it left on disk.

Every run here is the same tiny configuration (2 layers, d=32, block 16, synthetic
tokens over a 256-token vocabulary), so a run of 30 steps takes about a second of
compute after start-up, and the checkpoints are small enough to save every 2 steps.
"""
from __future__ import annotations

import csv
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
STEPS = 30
# Checkpoints every 2 steps and keep_last=2: a save and a prune every other step, so
# random kills land in saves and prunes, not only in arithmetic.
CLI_TINY = ["model.n_layer=2", "model.n_head=2", "model.d_model=32", "model.d_ff=64", "model.block_size=16",
            "model.vocab_size=256", "data.source=synthetic", "train.global_batch_size=8",
            "train.micro_batch_size=4", f"train.max_steps={STEPS}", "train.checkpoint_every=2", "train.keep_last=2",
            "train.eval_every=0", "train.warmup_steps=2", "train.device=cpu", "log.every=1", "log.progress=false",
            "log.tensorboard=false", "parallel.timeout_s=60"]
COLS = ("step", "loss", "grad_norm", "lr")
# How long a wait for an event (a line, a file, a process gone) may take before the test
# gives up. Only a hang should reach it: on a 2-core box at load 15 a start-up took 90 s.
WAIT_S = 600


def child_env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID", "GROUP_RANK"):
        env.pop(k, None)
    return env


def train_cmd(root: Path, name: str, *extra: str, nproc: int = 1) -> list[str]:
    args = ["train", *CLI_TINY, f"log.root={root}", f"log.name={name}", *extra]
    if nproc == 1:
        return [sys.executable, "-m", "distlm", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "distlm", *args, f"parallel.dp_replicate={nproc}"]


def launch(cmd: list[str], log: Path) -> subprocess.Popen:
    """In a process group of its own (setsid), stdout+stderr into ``log``."""
    fh = open(log, "w")
    try:
        return subprocess.Popen(cmd, cwd=str(ROOT), env=child_env(), stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    finally:
        fh.close()


def run(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=str(ROOT), env=child_env(), capture_output=True, text=True, timeout=timeout)


# ---- reading what a run left ---------------------------------------------------------
def metric_rows(run_dir: Path) -> list[tuple[str, str, str, str]]:
    """(step, loss, grad_norm, lr) of every training row of metrics.csv, as written
    (repr of the floats, so string equality is bit equality)."""
    path = Path(run_dir) / "metrics.csv"
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return [tuple(r[c] for c in COLS) for r in csv.DictReader(f) if r.get("loss")]


def last_logged_step(run_dir: Path) -> int:
    path = Path(run_dir) / "metrics.csv"
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    best = 0
    for line in lines[1:]:
        head = line.split(",", 1)[0]
        if head.isdigit() and line.count(",") >= 4:  # a whole row, not one being written
            best = max(best, int(head))
    return best


_CONSOLE_STEP = re.compile(r"^step\s+(\d+)/\d+ \|", re.M)


def last_console_step(log: Path) -> int:
    """The last step this attempt printed (its own rows, not those a killed one left)."""
    try:
        found = _CONSOLE_STEP.findall(Path(log).read_text(errors="replace"))
    except OSError:
        return 0
    return int(found[-1]) if found else 0


def checkpoints(run_dir: Path) -> tuple[list[Path], list[Path]]:
    from distlm.checkpoint import list_checkpoints
    return list_checkpoints(Path(run_dir) / "checkpoints")


def step_of(ckpt: Path) -> int:
    return int(ckpt.name.split("_")[-1])


def fresh_model_and_optimizer(overrides: list[str]):
    """The tiny GPT and its AdamW, built the way the Trainer builds them (no process group)."""
    import torch
    from distlm.config import load_config
    from distlm.model.gpt import GPT
    from distlm.train.optim import build_optimizer
    cfg = load_config(None, overrides)
    with torch.device("meta"):
        model = GPT(cfg.model)
    model.to_empty(device="cpu")
    model.init_weights(cfg.train.seed, torch.device("cpu"))
    return model, build_optimizer(model, cfg, "cpu")


def load_into_fresh(ckpt: Path, overrides: list[str] = CLI_TINY) -> dict:
    """Load a checkpoint (model + optimizer + RNG) into a fresh model; the caller's RNG
    state is put back afterwards. Returns the checkpoint's distlm.json."""
    import torch
    from distlm.checkpoint import load_checkpoint
    rng = torch.get_rng_state()
    try:
        model, opt = fresh_model_and_optimizer(overrides)
        meta = load_checkpoint(ckpt, model, opt)
        assert all(torch.isfinite(p).all() for p in model.parameters()), f"{ckpt}: non-finite weights"
        assert opt.state, f"{ckpt}: no optimizer state loaded"
        return meta
    finally:
        torch.set_rng_state(rng)


# ---- killing ------------------------------------------------------------------------
def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(d))
    return kids


def descendants(pid: int) -> list[int]:
    kids, out, todo = _children(), [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_tree(proc: subprocess.Popen) -> list[int]:
    """SIGKILL the process we started, its process group and every descendant.

    torchrun starts each worker with setsid, in a process group of its own, so killing torchrun's process
    group alone would leave the ranks running (and writing checkpoints) as orphans; a
    lost node loses all of them at once, which is what this simulates. The launcher is
    stopped first so it cannot start anything between the listing and the kill."""
    try:
        os.kill(proc.pid, signal.SIGSTOP)
    except ProcessLookupError:
        pass
    victims = descendants(proc.pid)
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except ProcessLookupError:
        pass
    proc.wait(timeout=WAIT_S)
    survivors = lambda: [p for p in victims if _alive(p)]  # noqa: E731
    assert wait_until(lambda: not survivors(), WAIT_S), f"processes {survivors()} survived SIGKILL"
    return victims


def wait_for(pred, proc: subprocess.Popen, timeout: float = None, poll: float = 0.003) -> bool:
    """Poll ``pred()`` until true (True) or the process exits (False, unless ``pred()`` then
    holds). ``timeout`` only bounds a hang: on a loaded machine an event may come late, so
    callers pass a generous one (default WAIT_S)."""
    timeout = WAIT_S if timeout is None else timeout
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        if proc.poll() is not None:
            return pred()
        time.sleep(poll)
    return False


def wait_until(pred, timeout: float = None, poll: float = 0.01) -> bool:
    """Poll ``pred()`` until true; False only if it never became true within ``timeout``."""
    deadline = time.monotonic() + (WAIT_S if timeout is None else timeout)
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True


# ---- the kill campaign ----------------------------------------------------------------
@dataclass
class Attempt:
    index: int
    run: str
    resumed_from: int  # newest complete checkpoint when it started (0: none)
    plan: str  # "startup at EVENT", "inside a save" or "step s +d"
    killed: bool = False
    phase: str = ""  # what the kill hit: startup / step / save / prune / finished
    reached: int = 0  # last step this attempt printed
    newest_after: int = 0  # newest complete checkpoint after it died
    torn_tmp: list[str] = field(default_factory=list)
    rc: Optional[int] = None
    seconds: float = 0.0


# Moments of start-up a kill can be aimed at, each an event the attempt shows: right after
# the launch (imports under way), its first line of output (the config resolved), and the
# run banner (the model built, a checkpoint loaded, the first step about to start).
STARTUP_EVENTS = ("launch", "first line", "banner")


def _startup_event(event: str, log: Path):
    if event == "launch":
        return lambda: True
    if event == "first line":
        return lambda: log.stat().st_size > 0
    return lambda: re.search(r"^run \S+ \|", log.read_text(errors="replace"), re.M) is not None


def _new_tmp_checkpoint(run_dir: Path, since: float):
    """A save under way: a .tmp-step_* folder this attempt made (mtime after its launch)."""
    folder = run_dir / "checkpoints"

    def seen() -> bool:
        try:
            return any(p.name.startswith(".tmp-step_") and p.stat().st_mtime >= since for p in folder.iterdir())
        except OSError:  # no folder yet, or the .tmp folder renamed between listing and stat
            return False
    return seen


@dataclass
class Campaign:
    """Launch the same run with train.resume=auto again and again, SIGKILLing it at
    moments drawn from ``rng``, until ``min_kills`` kills are done; then let it finish.

    Each kill waits for an event of the attempt, never for a fixed time, so a loaded
    machine only makes the campaign slower:
      - "startup": one of STARTUP_EVENTS, then the kill at once;
      - "step s + d": the console line of a chosen step (a few steps past the resume
        point; the line follows its metrics.csv row), then a random delay of up to
        ``after_s`` (the kill moment, drawn, not a wait); a save (every even step) starts
        right after that line, so the delays cover the next step, the save and the prune;
      - "save": a .tmp-step_* folder of this attempt appearing: the kill (which stops the
        process before anything else) lands inside the save.
    Phases in ``require`` that the drawn kills did not hit are then aimed at directly
    (a "save" kill can miss a save that finishes between two polls: it is tried again).
    """
    root: Path
    name: str
    rng: random.Random
    after_s: float
    min_kills: int
    nproc: int = 1
    extra: tuple = ()
    startup_share: float = 0.2
    save_share: float = 0.15
    advance: tuple = (1, 4)  # a planned kill waits for a step this many steps past the resume point
    require: tuple = ()  # phases (startup, save) that must be among the kills
    max_attempts: int = 60
    check_loads: bool = True
    attempts: list[Attempt] = field(default_factory=list)

    victims: list[str] = field(default_factory=list)

    @property
    def run_dir(self) -> Path:
        return self.root / self.victims[-1] if self.victims else self.root / self.name

    @property
    def run_dirs(self) -> list[Path]:
        return [self.root / v for v in self.victims]

    @property
    def kills(self) -> int:
        return sum(a.killed for a in self.attempts)

    def missing(self) -> list[str]:
        hit = {a.phase for a in self.attempts if a.killed}
        return [p for p in self.require if p not in hit]

    def _newest(self) -> int:
        complete, _ = checkpoints(self.run_dir)
        return step_of(complete[-1]) if complete else 0

    def run(self) -> "Campaign":
        """Victim runs until ``min_kills`` kills are done and the required phases hit:
        normally one, but a fast machine may finish a run before that, and then a fresh one
        takes the remaining kills."""
        while not self.victims or self.kills < self.min_kills or self.missing():
            self.victims.append(self.name if not self.victims else f"{self.name}-{len(self.victims)}")
            self._one_victim()
        return self

    def _plan(self, start_step: int) -> tuple[str, Optional[str], Optional[int], float]:
        """(kind, startup event, target step, delay) of the next kill."""
        if self.kills >= self.min_kills:  # the drawn kills are done: aim at what they missed
            kind = self.missing()[0]
        else:
            r = self.rng.random()
            kind = "startup" if r < self.startup_share else "save" if r < self.startup_share + self.save_share \
                else "step"
        if kind == "startup":
            return kind, self.rng.choice(STARTUP_EVENTS), None, 0.0
        if kind == "save":
            return kind, None, None, 0.0
        target, delay = start_step + self.rng.randint(*self.advance), self.rng.uniform(0.0, self.after_s)
        return kind, None, max(start_step + 1, min(target, STEPS - 1)), delay  # while kills are due, never the last step

    def _one_victim(self) -> None:
        cmd = train_cmd(self.root, self.victims[-1], "train.resume=auto", *self.extra, nproc=self.nproc)
        while True:
            i = len(self.attempts)
            if i >= self.max_attempts:
                raise AssertionError(f"{self.victims[-1]}: not finished after {i} attempts "
                                     f"({self.kills} kills, phases not hit: {self.missing()})")
            start_step = self._newest()
            torn_before = checkpoints(self.run_dir)[1]
            kill = self.kills < self.min_kills or bool(self.missing())
            kind, event, target, delay = self._plan(start_step) if kill else ("", None, None, 0.0)
            plan = {"startup": f"startup at {event}", "save": "inside a save",
                    "step": f"step {target} +{delay:.3f}s"}.get(kind, "run to the end")
            a = Attempt(i, self.victims[-1], start_step, plan)
            log = self.root / f"{self.victims[-1]}.attempt{i:02d}.log"
            t0, wall0 = time.monotonic(), time.time()
            proc = launch(cmd, log)
            if kind == "startup":
                wait_for(_startup_event(event, log), proc)
            elif kind == "save":
                wait_for(_new_tmp_checkpoint(self.run_dir, wall0 - 0.05), proc)
            elif kind == "step":
                wait_for(lambda: last_console_step(log) >= target, proc)
                time.sleep(delay)  # the drawn kill moment inside the next step, save or prune
            if kill and proc.poll() is None:
                kill_tree(proc)
                a.killed = True
            if not a.killed:
                a.rc = proc.wait(timeout=WAIT_S)
            a.seconds = time.monotonic() - t0
            self._inspect(a, log, wall0, torn_before)
            self.attempts.append(a)
            if not a.killed:
                out = log.read_text()
                if a.rc != 0:
                    raise AssertionError(f"{self.victims[-1]} attempt {i} failed (rc {a.rc}):\n{out[-3000:]}")
                if f"done: step {STEPS}" in out:
                    return

    def _inspect(self, a: Attempt, log: Path, wall0: float, torn_before: list[Path]) -> None:
        """What the attempt left: which phase it died in, and that nothing broke."""
        text = log.read_text(errors="replace")
        if "resumed from" in text or "starting from step 0" in text:  # it got past choosing a checkpoint
            for p in torn_before:  # and said which torn folders it skipped
                assert f"resume: skipping incomplete checkpoint {p} (no distlm.json)" in text, (p, text[-2000:])
        # No lost work: an attempt starts from the newest complete checkpoint there was.
        m = re.search(r"resumed from (\S+) \(step (\d+),", text)
        if m:
            assert int(m.group(2)) == a.resumed_from and m.group(1).endswith(f"step_{a.resumed_from:07d}"), \
                f"{self.name} attempt {a.index}: resumed from {m.group(1)}, newest was step {a.resumed_from}"
        elif last_console_step(log) > 0 or not a.killed:
            assert a.resumed_from == 0 and "starting from step 0" in text, \
                f"{self.name} attempt {a.index}: did not resume from step {a.resumed_from}:\n{text[-2000:]}"
        a.reached = last_console_step(log)
        complete, torn = checkpoints(self.run_dir)
        a.newest_after = step_of(complete[-1]) if complete else 0
        a.torn_tmp = sorted(p.name for p in torn if p.name.startswith(".tmp-") and
                            p.stat().st_mtime >= wall0 - 0.05)
        if not a.killed:
            a.phase = "finished"
        elif last_console_step(log) == 0:
            a.phase = "startup"
        elif a.torn_tmp:
            a.phase = "save"
        elif len(complete) > 2 or any(p.name.startswith("step_") for p in torn):
            a.phase = "prune"  # a checkpoint renamed in place, the old ones not yet all gone
        else:
            a.phase = "step"
        assert a.newest_after >= a.resumed_from, f"{self.name}: checkpoint step went back"
        for p in complete:  # a marker means the folder is whole: every complete checkpoint loads
            meta = json.loads((p / "distlm.json").read_text())
            assert meta["step"] == step_of(p) and meta["complete"] is True, p
            if self.check_loads:
                load_into_fresh(p)

    def counts(self) -> dict:
        killed = [a for a in self.attempts if a.killed]
        phases = {}
        for a in killed:
            phases[a.phase] = phases.get(a.phase, 0) + 1
        return {"runs": self.victims, "ranks": self.nproc, "attempts": len(self.attempts), "kills": len(killed),
                "mid_save_kills": sum(bool(a.torn_tmp) for a in killed), "resumes": len(self.attempts) - 1,
                "resumes_from_checkpoint": sum(a.resumed_from > 0 for a in self.attempts),
                "phases": phases, "seconds": round(sum(a.seconds for a in self.attempts), 1),
                "plan": [f"{a.run}: {a.plan} -> {a.phase} (resumed {a.resumed_from}, reached {a.reached}, "
                         f"newest {a.newest_after}{', torn ' + ','.join(a.torn_tmp) if a.torn_tmp else ''})"
                         for a in self.attempts]}


# ---- trainers in the test's own process ---------------------------------------------
def make_trainer(root: Path, name: str, *extra: str):
    from distlm.config import load_config
    from distlm.train.trainer import Trainer
    return Trainer(load_config(None, CLI_TINY + [f"log.root={root}", f"log.name={name}", *extra]))


def params(t) -> list:
    return [p.detach().clone() for p in t.module.parameters()]


def record_steps(t) -> dict:
    """Wrap t.train_step: step -> (params before, params after, Adam step counts before/after, loss)."""
    seen, inner = {}, t.train_step

    def wrapped(*a, **k):
        before = params(t)
        adam_before = [float(s["step"]) for s in t.optimizer.state.values()]
        loss, gn = inner(*a, **k)
        seen[t.step] = (before, params(t), adam_before, [float(s["step"]) for s in t.optimizer.state.values()],
                        float(loss))
        return loss, gn

    t.train_step = wrapped
    return seen


def nan_at(t, *steps: int) -> None:
    """The loss of the given (1-based) steps becomes NaN. The LM computes its loss inside the
    model's forward (GPT.head_loss), so the poison goes there."""
    inner = t.module.head_loss
    t.module.head_loss = lambda x, y: inner(x, y) * (float("nan") if t.step + 1 in steps else 1.0)


def names(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())
