"""Learning rate: warm-up, then linear / cosine / WSD / constant decay to min_lr_ratio x the peak.

The schedule is the run's (train.*), not an optimizer's: it gives a value from one peak, the
rate of the optimizer's first group (``Spec.peak_lr``: optim.adamw.lr for AdamW and Muon,
optim.lion.lr for Lion), and every group follows it from its own peak (Muon's ``lr_scale``).

Two clocks say how far along the schedule a step is:

    steps   progress = step / max_steps: the rate is a pure function of the step, so there is
            nothing to checkpoint but the step and a resumed run is the uninterrupted one,
            bit for bit. The clock of every run without a time budget.
    time    train.time_budget_s > 0: progress = max(step share, time share), the time share
            measured against the budget: on a machine too slow for max_steps in the budget, the
            decay still runs whole and ends at the budget, and the run ends with it. A budget
            of steps measured in the first steps would be deterministic, but a shared or
            throttled machine changes speed during a run (the demo's step took 2.8 to 5.4 s
            within one run on a loaded 2-core box), and then the limit cuts the
            cooldown off or leaves time unused; the time share follows the machine to the end. The rates depend on the clock, so this
            clock is for runs that must end on time (the CPU demo), not for resume tests.

train.time_limit_s is another thing: a stop, wherever the schedule is (a job's wall-clock
limit, after which the run resumes), checked by the loop (distlm/train/faults.py).
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Optional

from distlm.config import ConfigError, TrainConfig


def lr_at(step: int, cfg: TrainConfig, peak: float) -> float:
    """Linear warmup to ``peak``, then linear / cosine / WSD / constant decay to
    cfg.min_lr_ratio x ``peak``."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return peak
    total = max(1, cfg.max_steps - cfg.warmup_steps)
    t = min(1.0, (step - cfg.warmup_steps) / total)
    return decayed(peak, cfg, decay_fraction(t, cfg))


def decayed(peak: float, cfg: TrainConfig, left: float) -> float:
    """The rate with ``left`` of the way from min_lr_ratio x peak up to the peak still to go."""
    floor = peak * cfg.min_lr_ratio
    return floor + (peak - floor) * left


def decay_fraction(t: float, cfg: TrainConfig) -> float:
    """The share of (peak - floor) left at decay progress t in [0, 1]."""
    if cfg.decay == "linear":
        return 1.0 - t
    if cfg.decay == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * t))
    if cfg.decay == "constant":
        return 1.0
    # wsd: warmup, stable at the peak, then a linear decay over the last fraction
    start = 1.0 - cfg.wsd_decay_fraction
    return 1.0 if t < start else 1.0 - (t - start) / max(cfg.wsd_decay_fraction, 1e-9)


class StepClock:
    """No time budget: lr_at(step), nothing else."""

    def __init__(self, cfg: TrainConfig, peak: float):
        self.cfg, self.peak = cfg, peak

    def start(self) -> None:
        pass

    def lr(self, step: int) -> float:
        return lr_at(step, self.cfg, self.peak)

    def complete(self, step: int) -> bool:
        """Whether the schedule has ended after ``step`` steps (the loop stops there)."""
        return step >= self.cfg.max_steps

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class TimeClock:
    """train.time_budget_s > 0. The rate of step k is the schedule's value at the progress
    this step will have reached when it ends, with a step to spare:

        p = max((k + 1) / max_steps, p0 + (1 - p0) * (elapsed + 2 step_s) / time_budget_s)

    with elapsed the seconds since start(), step_s the median of the last few steps'
    durations (an evaluation or a save between two steps does not count as a slow step), and
    p0 the progress a resumed run starts from (its checkpoint's; 0 for a new run: each process
    gets the whole budget, so a resume spreads what was left of the schedule over it). A
    step with p = 1 trains at the floor (min_lr_ratio x peak) and is the last. The spare step
    keeps one that runs slower than the median from crossing the budget short of the floor; a
    step slower than that still leaves p < 1, and the next step, starting past the budget, is
    the last at the floor: the run ends within about a step of the budget, always at the
    schedule's end. Warm-up stays in
    steps: the rate is the smaller of the warm-up ramp and the decay.

    ``agree(seconds) -> seconds`` makes the elapsed time one value on every rank (a max over
    the ranks), so every replica steps with the same rate; ``clock`` is the wall clock.
    """

    WINDOW = 5  # steps in the median of step durations

    def __init__(self, cfg: TrainConfig, peak: float, agree: Callable[[float], float] = float,
                 clock: Callable[[], float] = time.perf_counter):
        if cfg.time_budget_s <= 0:
            raise ConfigError("a time clock needs train.time_budget_s > 0 (the time the schedule ends at), "
                              f"got train.time_budget_s={cfg.time_budget_s:g}")
        self.cfg, self.peak, self.agree, self.clock = cfg, peak, agree, clock
        self.start_progress = 0.0  # p0
        self.progress = 0.0        # of the newest step asked for
        self._t_start: Optional[float] = None
        self._last: Optional[float] = None  # when lr() was last asked (a step's start)
        self._durations: list[float] = []

    def start(self) -> None:
        """The training loop begins: elapsed time counts from now (on ``clock``)."""
        self._t_start, self._last, self._durations = self.clock(), None, []

    def lr(self, step: int) -> float:
        now = self.clock()
        if self._t_start is None:  # a step outside train() (distlm bench): the clock starts here
            self._t_start = now
        if self._last is not None:
            self._durations = (self._durations + [now - self._last])[-self.WINDOW:]
        self._last = now
        step_s = statistics.median(self._durations) if self._durations else 0.0
        elapsed = self.agree(now - self._t_start + 2 * step_s)
        time_share = min(1.0, elapsed / self.cfg.time_budget_s)
        p0 = self.start_progress
        self.progress = min(1.0, max((step + 1) / self.cfg.max_steps, p0 + (1.0 - p0) * time_share))
        cfg, peak = self.cfg, self.peak
        if self.progress >= 1.0:
            return peak * cfg.min_lr_ratio
        rate = decayed(peak, cfg, decay_fraction(self.progress, cfg))
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return min(peak * (step + 1) / cfg.warmup_steps, rate)
        return rate

    def complete(self, step: int) -> bool:
        return step >= self.cfg.max_steps or self.progress >= 1.0

    def state_dict(self) -> dict:
        return {"progress": self.progress}

    def load_state_dict(self, state: dict) -> None:
        self.start_progress = self.progress = float(state.get("progress", 0.0))


def lr_clock(cfg: TrainConfig, peak: float, agree: Callable[[float], float] = float):
    """The clock of this run: a time clock with train.time_budget_s, else the step clock."""
    return TimeClock(cfg, peak, agree) if cfg.time_budget_s > 0 else StepClock(cfg, peak)
