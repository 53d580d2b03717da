"""What the Trainer does when things go wrong: signals, hangs, non-finite numbers.

- SIGTERM / SIGINT (SLURM preemption, Ctrl-C) only set a flag; the loop finishes the
  current step, saves, and exits 0. A second Ctrl-C interrupts at once.
- The watchdog is faulthandler's timer, re-armed after every step: if a rank makes no
  progress for ``train.watchdog_s`` it prints every thread's Python stack to stderr
  (torchrun prefixes each line with the rank) and exits, so a hung collective ends
  with the place each rank stood instead of waiting forever.
"""
from __future__ import annotations

import faulthandler
import signal
import sys
import threading

import torch


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
    def __init__(self, seconds: float, rank: int):
        self.seconds, self.rank = seconds, rank

    def arm(self, step: int):
        if self.seconds > 0:
            faulthandler.cancel_dump_traceback_later()
            faulthandler.dump_traceback_later(self.seconds, repeat=False, file=sys.__stderr__ or sys.stderr, exit=True)

    def disarm(self):
        if self.seconds > 0:
            faulthandler.cancel_dump_traceback_later()

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
