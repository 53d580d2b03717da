"""What the Trainer does when things go wrong: signals, hangs, non-finite numbers.

- SIGTERM / SIGINT (SLURM preemption, Ctrl-C) only set a flag; the loop finishes the
  current step, saves, and exits 128 + the signal (143, 130), as a process the signal
  ended would, so that a script tells it from a finished run. A second Ctrl-C interrupts
  at once.
- A crash no handler sees (kill -9, the OOM killer, a power loss) loses the steps since the
  newest checkpoint: ``checkpoint_schedule`` says at the start how many that can be.
- The watchdog is re-armed after every step: if a rank makes no progress for
  ``train.watchdog_s`` it prints its rank, its last step and every thread's Python stack
  to stderr and exits, so a hung collective ends with the place each rank stood instead
  of waiting forever.
- A NaN/Inf loss or gradient norm (train.on_nan): a guard decides each step whether the
  optimizer steps. ``DeviceSkip`` (on_nan=skip, the default, with an optimizer whose step takes
  a found_inf flag) decides on the device and is read when the Trainer reads the loss anyway;
  ``HostCheck`` (on_nan=stop, or an optimizer without the flag) reads two numbers on the host
  before the step, which waits for the device every step; ``Unchecked`` (off) does neither.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from distlm.local_shard import local_shard


class TrainingStopped(RuntimeError):
    """Training cannot go on (non-finite values, an unwritable checkpoint); the message says why."""


def nonfinite_verdict(step: int, loss: float, grad_norm: float, bad_grads: Optional[list], kept_ckpt,
                      skips: int, train_cfg) -> str:
    """A step with a NaN/Inf loss or gradient: the warning to print when it is skipped, or
    TrainingStopped under train.on_nan=stop or past train.max_nan_skips. Names the bad
    gradients (None: not looked at, the step was left out on the device and its gradients are
    gone) and the last checkpoint from before the fault."""
    where = f"non-finite values at step {step}: loss {loss}, grad norm {grad_norm}" + (
        f"; gradients of {', '.join(bad_grads)}" if bad_grads else "")
    kept = f"; checkpoint {kept_ckpt} (before the fault) is kept" if kept_ckpt else ""
    if bad_grads is None:
        kept += "; train.on_nan=stop would name the gradients"
    if train_cfg.on_nan == "stop" or skips > train_cfg.max_nan_skips:
        why = "train.on_nan=stop" if train_cfg.on_nan == "stop" else \
            f"more than train.max_nan_skips={train_cfg.max_nan_skips} skipped steps"
        raise TrainingStopped(f"{where} ({why}){kept}")
    return f"warning: {where}: step skipped ({skips}/{train_cfg.max_nan_skips}){kept}"


@dataclass(frozen=True)
class Fault:
    """A step whose mean loss or global gradient norm was not finite (1-based, as logged)."""
    step: int
    loss: float
    grad_norm: float
    bad_grads: Optional[list]  # parameters with a non-finite gradient; None: not looked at


# What a guard is handed each step: the optimizer step, given found_inf (a 0-d float32 tensor on
# the device, 1.0: leave the step out; distlm/optim/base.py) or None.
OptimizerStep = Callable[[Optional[torch.Tensor]], None]
OnFaults = Callable[[list], None]


class Unchecked:
    """train.on_nan=off: every step is taken, nothing is read."""

    def step(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, optimizer_step: OptimizerStep) -> None:
        optimizer_step(None)

    def read(self) -> None:
        pass


class HostCheck:
    """The loss and the gradient norm read on the host before the step: the host waits for the
    device every step. train.on_nan=stop must stop before the faulty step is taken (and names
    the gradients while they exist); on_nan=skip comes here with an optimizer that cannot skip
    on the device. ``on_faults`` hears of a fault at once (it may raise TrainingStopped)."""

    def __init__(self, model: torch.nn.Module, on_faults: OnFaults):
        self.model, self.on_faults = model, on_faults

    def step(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, optimizer_step: OptimizerStep) -> None:
        if bool(torch.isfinite(grad_norm)) and bool(torch.isfinite(loss)):
            optimizer_step(None)
        else:
            self.on_faults([Fault(step, float(loss), float(grad_norm), nonfinite_grads(self.model))])

    def read(self) -> None:
        pass


class DeviceSkip:
    """train.on_nan=skip decided on the device: the optimizer gets found_inf and leaves the step
    out itself, so the host never waits for the verdict. The verdicts of the steps since the
    last read are kept on the device (a flag, the loss and the norm of each: a few bytes a step)
    and read together, in one transfer, by ``read``: the Trainer reads them where it reads the
    loss anyway (a log row, an evaluation, before a checkpoint, at the end), and ``on_faults``
    then hears of the steps left out, in order. Every rank holds the same flags (global norm,
    mean loss), so every rank hears the same faults at the same read."""

    # Read at least this often even if no one asks (a benchmark steps without logging).
    MAX_PENDING = 1000

    def __init__(self, on_faults: OnFaults):
        self.on_faults = on_faults
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def step(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, optimizer_step: OptimizerStep) -> None:
        found_inf = torch.logical_not(torch.isfinite(grad_norm) & torch.isfinite(loss)).float()
        optimizer_step(found_inf)
        self._pending.append((step, found_inf, loss.detach(), grad_norm.detach()))
        if len(self._pending) >= self.MAX_PENDING:
            self.read()

    def read(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        device = pending[0][1].device
        columns = [torch.stack([entry[i].float().to(device) for entry in pending]) for i in (1, 2, 3)]
        flags, losses, norms = torch.stack(columns).tolist()  # the one host read
        faults = [Fault(entry[0], loss, norm, None)
                  for entry, flag, loss, norm in zip(pending, flags, losses, norms) if flag]
        if faults:
            self.on_faults(faults)


def nonfinite_guard(train_cfg, skips_on_device: bool, model: torch.nn.Module, on_faults: OnFaults):
    """The guard train.on_nan names; ``skips_on_device``: the optimizer's step takes found_inf
    (its Spec.skips_on_device)."""
    if train_cfg.on_nan == "off":
        return Unchecked()
    if train_cfg.on_nan == "skip" and skips_on_device:
        return DeviceSkip(on_faults)
    return HostCheck(model, on_faults)


def stop_reason(stop, t_start: float, train_cfg, step: int, dims, comm, device) -> str | None:
    """Why the loop should stop now (time limit, a signal), agreed by every rank: ranks see
    signals and clocks at different moments, and must stop together or not at all."""
    reason = None
    if train_cfg.time_limit_s and time.perf_counter() - t_start > train_cfg.time_limit_s:
        reason = f"train.time_limit_s={train_cfg.time_limit_s:g} reached"
    if stop.signal:
        reason = f"{stop.signal} received"
    if not dims.is_distributed:
        return reason
    # Every step: one all-reduce of one integer, microseconds beside a step, and a SIGTERM (a
    # scheduler's notice before the kill) is answered at the next step, every rank at the same one.
    flag = comm.max(torch.tensor([1 if reason else 0], device=device))
    return (reason or "another rank asked to stop") if flag.item() else None


def checkpoint_schedule(train_cfg) -> str:
    """The run's line on what a crash would cost: when checkpoints are written."""
    every, steps = train_cfg.checkpoint_every, train_cfg.max_steps
    if every and every < steps:
        return (f"checkpoints: every {every} steps (train.checkpoint_every) and at the end; a crash loses at most "
                f"{every} steps")
    why = f"train.checkpoint_every={every}" + (f" >= train.max_steps={steps}" if every else "")
    return (f"checkpoints: only at the end ({why}); Ctrl-C and SIGTERM save, but a kill -9 or a crash loses "
            f"the whole run (set train.checkpoint_every=N to save every N steps)")


class StopFlag:
    """Records SIGTERM/SIGINT instead of dying mid-step."""

    def __init__(self):
        self.signal: str | None = None
        self._old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: the user means it
        self.signal = signal.Signals(signum).name

    def restore(self):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()


class Watchdog:
    """Re-armed after every step. If a rank makes no progress for ``seconds``, a monitor
    thread writes which rank and step it is, then every thread's Python stack, and exits
    (code 124) so torchrun tears the job down. faulthandler's C timer at twice the
    limit backs it up for a main thread that holds the GIL and starves the monitor."""

    def __init__(self, seconds: float, rank: int):
        self.seconds, self.rank = seconds, rank
        self._deadline = None
        self._step = 0
        self._lock = threading.Condition()
        self._thread = None

    def _stream(self):
        return sys.__stderr__ or sys.stderr

    def arm(self, step: int):
        if self.seconds <= 0:
            return
        with self._lock:
            self._deadline, self._step = time.monotonic() + self.seconds, step
            self._lock.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="distlm-watchdog", daemon=True)
            self._thread.start()
        faulthandler.cancel_dump_traceback_later()
        faulthandler.dump_traceback_later(2 * self.seconds, repeat=False, file=self._stream(), exit=True)

    def disarm(self):
        if self.seconds <= 0:
            return
        with self._lock:
            self._deadline = None
            self._lock.notify()
        faulthandler.cancel_dump_traceback_later()

    def _watch(self):
        with self._lock:
            while True:
                if self._deadline is None:
                    self._lock.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._lock.wait(left)
                    continue
                out = self._stream()
                out.write(f"\nwatchdog: rank {self.rank} made no progress for {self.seconds:g} s after step "
                          f"{self._step} (train.watchdog_s); Python stacks of rank {self.rank}:\n")
                out.flush()
                faulthandler.dump_traceback(file=out, all_threads=True)
                out.flush()
                os._exit(124)


def nonfinite_grads(model: torch.nn.Module, limit: int = 8) -> list[str]:
    """Names of parameters whose (local shard of the) gradient holds NaN or Inf."""
    bad = []
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        local = local_shard(g)
        if not bool(torch.isfinite(local).all()):
            bad.append(name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""))
            if len(bad) >= limit:
                break
    return bad
