"""The host's share of a profiled step: how long the CPU threads that drive the GPU were busy.

A GPU idles when the host cannot issue work as fast as the GPU finishes it. `speedrun-124m` at
16 sequences a GPU, the share of each GPU on 2 and 4 GPUs, is such a step: its kernels take
about 40 ms, and its two host threads (the forward and the optimizer on the main thread, the
backward on autograd's own) were busy 28 ms each of a profiled step on an H200.
The kernel categories alone show only the GPU's idle time; these figures show whether the host
is why.

Read from the Chrome trace the torch profiler writes: every CPU-side event ("cpu_op",
"user_annotation", "cuda_runtime", "python_function") of a thread, nested by time. A thread's
busy time is the union of its outermost events; an event's self time is its duration less its
children's. Times are as the profiler saw them: it slows the host itself, so they are upper bounds.
"""
from __future__ import annotations

from collections import defaultdict

HOST_CATEGORIES = ("cpu_op", "user_annotation", "cuda_runtime", "python_function")


def busiest_threads(events: list[dict], n: int = 2) -> list:
    """The ``n`` CPU threads that launched the most kernels (on a CPU run: ran the most
    operators). On CUDA the backward runs on the autograd engine's own thread, so a step
    has two."""
    launches: dict = defaultdict(int)
    for e in events:
        if e.get("cat") == "cuda_runtime":
            launches[e["tid"]] += 1
    if not launches:
        for e in events:
            if e.get("cat") == "cpu_op":
                launches[e["tid"]] += 1
    return sorted(launches, key=launches.get, reverse=True)[:n]


def short_name(name: str) -> str:
    """An event's name for a table: the profiler's per-step markers as one name, long
    compiled-graph names cut."""
    if name.startswith("ProfilerStep"):
        return "step"
    return name if len(name) <= 60 else name[:57] + "..."


def thread_times(events: list[dict], tid) -> tuple[float, dict]:
    """(busy microseconds, {event name: self microseconds}) of thread ``tid``."""
    spans = sorted((e for e in events if e.get("tid") == tid and e.get("ph") == "X"
                    and e.get("cat") in HOST_CATEGORIES),
                   key=lambda e: (e["ts"], -e.get("dur", 0)))
    own: dict = defaultdict(float)
    stack: list = []  # [end, name, self time so far]
    busy = 0.0
    for e in spans:
        start, dur = e["ts"], e.get("dur", 0)
        while stack and stack[-1][0] <= start:
            end, name, mine = stack.pop()
            own[name] += mine
        if stack:
            stack[-1][2] -= dur
        else:
            busy += dur
        stack.append([start + dur, short_name(e["name"]), dur])
    for _, name, mine in stack:
        own[name] += mine
    return busy, dict(own)


def host_summary(events: list[dict], steps: int, top: int = 8) -> list[dict]:
    """Per busiest thread: its busy seconds per step and its ``top`` largest self times."""
    out = []
    for tid in busiest_threads(events):
        busy, own = thread_times(events, tid)
        largest = sorted(own.items(), key=lambda kv: -kv[1])[:top]
        out.append({"thread": tid, "busy_s": busy / 1e6 / steps,
                    "top": [{"name": name, "s_per_step": us / 1e6 / steps} for name, us in largest]})
    return out
