"""The median time of a call on a device: CUDA events on a GPU (the device's own clock, not the
host's, which returns before the kernels finish), the host's clock elsewhere."""
from __future__ import annotations

import statistics
import time

import torch


def median_seconds(fn, device: torch.device, repeats: int, warmup: int = 0) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
