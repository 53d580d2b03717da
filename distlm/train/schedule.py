"""Learning rate: warm-up, then linear / cosine / WSD / constant decay to min_lr.

Two clocks say how far along the schedule a step is (train.schedule_clock):

    steps   progress = step / max_steps: the rate is a pure function of the step, so there is
            nothing to checkpoint but the step and a resumed run is the uninterrupted one,
            bit for bit.
    time    progress = max(step share, time share), the time share measured against
            train.time_limit_s: on a machine too slow for max_steps in the time limit, the
            decay still runs whole and ends at the limit, and the run ends with it. A budget
            of steps measured in the first steps would be deterministic, but a shared or
            throttled machine changes speed during a run (the demo's step took 2.8 to 5.4 s
            within one run on a loaded 2-core box), and then the limit cuts the
            cooldown off or leaves time unused; the time share follows the machine to the end. The rates depend on the clock, so this
            clock is for runs that must end on time (the CPU demo), not for resume tests.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Callable, Optional

from distlm.config import ConfigError, TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr, then linear / cosine / WSD / constant decay to cfg.min_lr."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return cfg.lr
    total = max(1, cfg.max_steps - cfg.warmup_steps)
    t = min(1.0, (step - cfg.warmup_steps) / total)
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * decay_fraction(t, cfg)


def decay_fraction(t: float, cfg: TrainConfig) -> float:
    """The share of (lr - min_lr) left at decay progress t in [0, 1]."""
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
    """train.schedule_clock=steps: lr_at(step), nothing else."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg

    def start(self) -> None:
        pass

    def lr(self, step: int) -> float:
        return lr_at(step, self.cfg)

    def complete(self, step: int) -> bool:
        """Whether the schedule has ended after ``step`` steps (the loop stops there)."""
        return step >= self.cfg.max_steps

    def stop_config(self, cfg: TrainConfig) -> TrainConfig:
        """The settings the stop check enforces: train.time_limit_s stops this clock's run."""
        return cfg

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class TimeClock:
    """train.schedule_clock=time. The rate of step k is the schedule's value at the progress
    this step will have reached when it ends, with a step to spare:

        p = max((k + 1) / max_steps, p0 + (1 - p0) * (elapsed + 2 step_s) / time_limit_s)

    with elapsed the seconds since start(), step_s the median of the last few steps'
    durations (an evaluation or a save between two steps does not count as a slow step), and
    p0 the progress a resumed run starts from (its checkpoint's; 0 for a new run: each process
    gets the whole time limit, so a resume spreads what was left of the schedule over it). A
    step with p = 1 trains at min_lr and is the last. The spare step keeps one that runs slower
    than the median from crossing the limit short of min_lr; a step slower than that still
    leaves p < 1, and the next step, starting past the limit, is the last at min_lr: the run
    ends within about a step of the limit, always at the schedule's end. Warm-up stays in
    steps: the rate is the smaller of the warm-up ramp and the decay.

    ``agree(seconds) -> seconds`` makes the elapsed time one value on every rank (a max over
    the ranks), so every replica steps with the same rate; ``clock`` is the wall clock.
    """

    WINDOW = 5  # steps in the median of step durations

    def __init__(self, cfg: TrainConfig, agree: Callable[[float], float] = float,
                 clock: Callable[[], float] = time.perf_counter):
        if cfg.time_limit_s <= 0:
            raise ConfigError("train.schedule_clock=time needs train.time_limit_s > 0 (the time the schedule "
                              f"ends at), got train.time_limit_s={cfg.time_limit_s:g}")
        self.cfg, self.agree, self.clock = cfg, agree, clock
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
        time_share = min(1.0, elapsed / self.cfg.time_limit_s)
        p0 = self.start_progress
        self.progress = min(1.0, max((step + 1) / self.cfg.max_steps, p0 + (1.0 - p0) * time_share))
        cfg = self.cfg
        if self.progress >= 1.0:
            return cfg.min_lr
        decayed = cfg.min_lr + (cfg.lr - cfg.min_lr) * decay_fraction(self.progress, cfg)
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return min(cfg.lr * (step + 1) / cfg.warmup_steps, decayed)
        return decayed

    def complete(self, step: int) -> bool:
        return step >= self.cfg.max_steps or self.progress >= 1.0

    def stop_config(self, cfg: TrainConfig) -> TrainConfig:
        """This clock ends the run at the time limit itself, after a step at min_lr; the stop
        check's own time limit, on each rank's clock, would cut it off a step short."""
        return dataclasses.replace(cfg, time_limit_s=0.0)

    def state_dict(self) -> dict:
        return {"progress": self.progress}

    def load_state_dict(self, state: dict) -> None:
        self.start_progress = self.progress = float(state.get("progress", 0.0))


def lr_clock(cfg: TrainConfig, agree: Callable[[float], float] = float):
    """The clock train.schedule_clock names."""
    return TimeClock(cfg, agree) if cfg.schedule_clock == "time" else StepClock(cfg)
