"""distlm.bench.timing: the median of timed calls, after untimed warm-up calls."""
import torch

from distlm.bench import timing


def test_median_of_the_timed_calls_after_the_warmup(monkeypatch):
    ticks = iter([0.0, 1.0, 1.0, 4.0, 4.0, 6.0])  # three timed calls of 1, 3 and 2 s
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(ticks))
    calls = []
    assert timing.median_seconds(lambda: calls.append(1), torch.device("cpu"), repeats=3, warmup=2) == 2.0
    assert len(calls) == 5
