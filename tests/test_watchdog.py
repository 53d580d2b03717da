"""A hung rank prints where it stands and exits, instead of waiting forever."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_watchdog_dumps_the_stack_and_exits():
    code = textwrap.dedent("""
        import time
        from distlm.train.faults import Watchdog
        def stuck_in_a_collective():
            time.sleep(60)
        w = Watchdog(1.0, rank=0)
        w.arm(step=7)
        stuck_in_a_collective()
    """)
    p = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 124
    assert "watchdog: rank 0 made no progress for 1 s after step 7" in p.stderr
    assert "stuck_in_a_collective" in p.stderr


def test_watchdog_rearmed_each_step_does_not_fire():
    code = textwrap.dedent("""
        import time
        from distlm.train.faults import Watchdog
        w = Watchdog(1.0, rank=0)
        for step in range(6):
            w.arm(step)
            time.sleep(0.3)
        w.disarm()
        time.sleep(1.5)
        print("finished")
    """)
    p = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and "finished" in p.stdout, p.stderr
