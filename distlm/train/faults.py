"""What the Trainer does when things go wrong: signals, hangs, non-finite numbers.

- SIGTERM / SIGINT (SLURM preemption, Ctrl-C) only set a flag; the loop finishes the
  current step, saves, and exits 0. A second Ctrl-C interrupts at once.
- The watchdog is re-armed after every step: if a rank makes no progress for
  ``train.watchdog_s`` it prints its rank, its last step and every thread's Python stack
  to stderr and exits, so a hung collective ends with the place each rank stood instead
  of waiting forever.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time

import torch


class TrainingStopped(RuntimeError):
    """Training cannot go on (non-finite values, an unwritable checkpoint); the message says why."""


def nonfinite_verdict(step: int, loss: float, grad_norm: float, bad_grads: list, kept_ckpt, skips: int,
                      train_cfg) -> str:
    """A step with a NaN/Inf loss or gradient: the warning to print when it is skipped, or
    TrainingStopped under train.on_nan=stop or past train.max_nan_skips. Names the bad
    gradients and the last checkpoint from before the fault."""
    where = f"non-finite values at step {step}: loss {loss}, grad norm {grad_norm}" + (
        f"; gradients of {', '.join(bad_grads)}" if bad_grads else "")
    kept = f"; checkpoint {kept_ckpt} (before the fault) is kept" if kept_ckpt else ""
    if train_cfg.on_nan == "stop" or skips > train_cfg.max_nan_skips:
        why = "train.on_nan=stop" if train_cfg.on_nan == "stop" else \
            f"more than train.max_nan_skips={train_cfg.max_nan_skips} skipped steps"
        raise TrainingStopped(f"{where} ({why}){kept}")
    return f"warning: {where}: step skipped ({skips}/{train_cfg.max_nan_skips}){kept}"


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
    if step % train_cfg.stop_check_every and not reason:
        return None
    flag = comm.max(torch.tensor([1 if reason else 0], device=device))
    return (reason or "another rank asked to stop") if flag.item() else None


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

    def banner(self) -> str:
        return (f"watchdog: a rank with no progress for {self.seconds:g} s prints its Python stack and exits "
                f"(train.watchdog_s)")


def nonfinite_grads(model: torch.nn.Module, limit: int = 8) -> list[str]:
    """Names of parameters whose (local shard of the) gradient holds NaN or Inf."""
    bad = []
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        local = g.to_local() if hasattr(g, "to_local") else g
        if not bool(torch.isfinite(local).all()):
            bad.append(name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""))
            if len(bad) >= limit:
                break
    return bad
