"""benchmarks/tools/timing.py: the median of timed calls, after untimed warm-up calls."""
import sys
from pathlib import Path

# The lab's tools import as top-level modules, this checkout's distlm first.
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks" / "tools")]

import torch  # noqa: E402

import timing  # noqa: E402


def test_median_of_the_timed_calls_after_the_warmup(monkeypatch):
    ticks = iter([0.0, 1.0, 1.0, 4.0, 4.0, 6.0])  # three timed calls of 1, 3 and 2 s
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(ticks))
    calls = []
    assert timing.median_seconds(lambda: calls.append(1), torch.device("cpu"), repeats=3, warmup=2) == 2.0
    assert len(calls) == 5
