"""A hung rank prints where it stands and exits, instead of waiting forever."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_child(code: str) -> subprocess.CompletedProcess:
    # The timeout only bounds a hang: a loaded box can take a minute to import torch.
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=600)


def test_watchdog_dumps_the_stack_and_exits():
    p = run_child("""
        import threading
        from distlm.train.faults import Watchdog
        def stuck_in_a_collective():
            threading.Event().wait()  # forever: only the watchdog ends this process
        w = Watchdog(1.0, rank=0)
        w.arm(step=7)
        stuck_in_a_collective()
    """)
    assert p.returncode == 124
    assert "watchdog: rank 0 made no progress for 1 s after step 7" in p.stderr
    assert "stuck_in_a_collective" in p.stderr


def test_watchdog_rearmed_each_step_does_not_fire():
    """The monitor reads its clock through ``time.monotonic`` of distlm.train.faults; here that
    clock is one the child moves by hand, so "a step took 0.9 of the limit" holds exactly
    however slowly a loaded machine runs the child (a real 0.3 s step against a 1 s limit
    fired whenever the box stalled the child for 0.7 s). After each move the monitor is woken,
    and the child waits until it is back in its wait (it has compared the clock with its
    deadline and not fired): 12 steps of 0.9 limits, then a move of 10 limits after
    ``disarm``. The positive case is the test above, on the real clock."""
    p = run_child("""
        import threading
        import time
        import distlm.train.faults as faults
        from distlm.train.faults import Watchdog

        now = [1000.0]
        class Clock:  # the module's view of ``time``: monotonic is ours, the rest the real one
            def __getattr__(self, name):
                return getattr(time, name)
            def monotonic(self):
                return now[0]
        faults.time = Clock()

        LIMIT = 300.0  # faulthandler's backup timer (real time, 2x this) stays far away
        w = Watchdog(LIMIT, rank=0)

        def monitor_waiting():  # the monitor thread sits in Condition.wait (its one waiter)
            while len(w._lock._waiters) != 1:
                time.sleep(0.001)

        def advance(seconds):
            with w._lock:
                now[0] += seconds
                w._lock.notify()  # the monitor wakes and compares the clock with its deadline
            monitor_waiting()  # ... and waits again: had it fired, this process would be gone

        w.arm(0)
        monitor_waiting()
        for step in range(1, 13):
            advance(0.9 * LIMIT)
            w.arm(step)
        w.disarm()
        advance(10 * LIMIT)
        print("finished")
    """)
    assert p.returncode == 0 and "finished" in p.stdout, p.stderr
