"""`distlm bench --profile DIR`: where a training step's device time goes.

The torch profiler records a few real training steps; every kernel (on CUDA) or aten
operator (on CPU) is put in one category, so the gap between achieved and peak FLOP/s
is explained by measurement: how much is matmul, attention, fused element-wise work,
the optimizer, communication, copies. Writes profile.md (the split and the top
kernels, and how busy the host's threads were), profile.json and a Chrome trace (open it in
Perfetto).
"""
from __future__ import annotations

import gzip
import json
import re
import shutil
from pathlib import Path

import torch

from distlm.bench.host_time import host_summary
from distlm.io import atomic_write_text

# First match wins. Kernel names differ by library and torch version, hence the patterns:
# cuBLAS/CUTLASS gemms (sm90_xmma, nvjet, cutlass), cuDNN/flash attention, NCCL, the
# fused optimizer (multi_tensor_apply / fused_adam), Triton kernels from Inductor.
CATEGORIES = [
    # Not a Triton kernel: inductor names its fused kernels after the ops they absorb, so the
    # element-wise work beside a TP collective ("triton_poi_fused_..._reduce_scatter_tensor_split")
    # is compute, not communication (41 ms a step of TP2's were counted as communication).
    # "Memcpy PtoP" is a copy from another GPU: async TP's symmetric-memory transfers.
    ("communication", r"^(?!triton_).*(nccl|c10d::|gloo|all_reduce|allreduce|reduce_scatter|all_gather|broadcast)"
                      r"|memcpy ptop"),
    ("attention", r"flash|fmha|cudnn.*attn|attention|sdpa|_efficient_attention|_scaled_dot_product"),
    ("optimizer", r"adam|multi_tensor|foreach|optimizer"),
    ("matmul", r"gemm|xmma|nvjet|cutlass|cublas|triton_tem|\bmm\b|aten::mm|aten::addmm|aten::bmm|aten::matmul"
               r"|aten::linear|sm90_|sm80_|wgmma"),
    ("loss (cross-entropy)", r"cross_entropy|log_softmax|nll_loss|logsumexp"),
    ("fused element-wise/norm (Triton)", r"triton_"),
    ("copies/casts/fills", r"memcpy|memset|copy_|aten::copy|to_copy|aten::fill|aten::zero"),
    ("element-wise/norm (eager)", r"elementwise|vectorized|layer_norm|rms_norm|gelu|silu|softmax|reduce_kernel|"
                                  r"aten::(add|mul|sub|div|gelu|layer_norm|native_layer_norm|silu|embedding|sum|mean)"),
]
_PATTERNS = [(name, re.compile(p, re.IGNORECASE)) for name, p in CATEGORIES]


def categorize(name: str) -> str:
    for cat, pat in _PATTERNS:
        if pat.search(name):
            return cat
    return "other"


def kernel_times(prof, cuda: bool) -> list[tuple[str, float, int]]:
    """(name, total self time in seconds, calls) of every kernel (CUDA) or aten op (CPU)."""
    rows = []
    for evt in prof.key_averages():
        if cuda:
            t = getattr(evt, "self_device_time_total", None)
            if t is None:
                t = evt.self_cuda_time_total
            # CPU-side ops report device time inherited from their kernels; count kernels only.
            # A record_function range seen on the GPU (c10d's "nccl:all_gather...", the
            # optimizer's "Optimizer.step#...", DDP's forward) spans kernels that are counted
            # on their own: counting it too put TP2's communication at 3.1 s of a 2.4 s step.
            if t <= 0 or evt.device_type != torch.autograd.DeviceType.CUDA or getattr(evt, "is_user_annotation", False):
                continue
        else:
            t = evt.self_cpu_time_total
            if t <= 0 or not evt.key.startswith(("aten::", "c10d::", "gloo")):
                continue
        rows.append((evt.key, t / 1e6, evt.count))
    return sorted(rows, key=lambda r: -r[1])


def summarize(rows: list[tuple[str, float, int]], steps: int, step_s: float) -> dict:
    """Per-step seconds by category and the top kernels; 'idle' is step time no kernel filled."""
    by_cat: dict[str, float] = {}
    for name, t, _ in rows:
        cat = categorize(name)
        by_cat[cat] = by_cat.get(cat, 0.0) + t / steps
    busy = sum(by_cat.values())
    return {
        "steps": steps, "step_s": step_s, "busy_s": busy,
        "idle_s": max(0.0, step_s - busy),
        "categories_s": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
        "top": [{"name": n, "s_per_step": t / steps, "calls_per_step": c / steps, "category": categorize(n)}
                for n, t, c in rows[:20]],
    }


def kernel_intervals(prof) -> list[tuple[float, float, bool]]:
    """(start s, end s, is communication) of every CUDA kernel the profiler saw, user
    annotations left out as in kernel_times."""
    out = []
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA or getattr(evt, "is_user_annotation", False):
            continue
        tr = evt.time_range
        if tr.end > tr.start:
            out.append((tr.start / 1e6, tr.end / 1e6, categorize(evt.name) == "communication"))
    return out


def _merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(spans) -> float:
    return sum(b - a for a, b in spans)


def _intersection(xs, ys) -> float:
    """Total overlap of two merged, sorted interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, hi - lo)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def timeline(intervals: list[tuple[float, float, bool]], steps: int, step_s: float) -> dict:
    """Per-step seconds on the GPU's clock, from when kernels ran rather than how long they
    ran in total: communication a compute kernel ran beside (overlapped, hidden) against
    communication alone on the GPU (exposed: the step waits for it), compute, and idle (no
    kernel at all: the host or a synchronisation). Summed kernel times cannot tell these apart:
    a NCCL kernel counts its wait for the other ranks, and streams overlap."""
    comm = _merge([(a, b) for a, b, c in intervals if c])
    compute = _merge([(a, b) for a, b, c in intervals if not c])
    busy = _length(_merge([(a, b) for a, b, _ in intervals]))
    hidden = _intersection(comm, compute)
    return {"compute_s": _length(compute) / steps, "comm_hidden_s": hidden / steps,
            "comm_exposed_s": (_length(comm) - hidden) / steps,
            "idle_s": max(0.0, step_s * steps - busy) / steps}


def markdown(s: dict, title: str) -> str:
    step = s["step_s"]
    lines = [f"# Profile: {title}", "",
             f"{s['steps']} profiled steps, {1e3 * step:.1f} ms per step (wall, synchronised). Device time "
             "by category, summed over kernels (kernels on different streams can overlap, so the busy "
             "total can exceed the step when communication overlaps compute):", "",
             "| category | ms/step | % of step |", "|---|---|---|"]
    for cat, t in s["categories_s"].items():
        lines.append(f"| {cat} | {1e3 * t:.2f} | {100 * t / step:.1f} |")
    how = "" if s.get("timeline") else "; the step minus the kernels' summed time"
    lines.append(f"| idle (no kernel running: launch gaps, host sync, data{how}) | {1e3 * s['idle_s']:.2f} | "
                 f"{100 * s['idle_s'] / step:.1f} |")
    t = s.get("timeline")
    if t:
        lines += ["", "On the GPU's timeline (when kernels ran, all streams of this rank):", "",
                  "| | ms/step | % of step |", "|---|---|---|"]
        for key, label in (("compute_s", "compute (any non-communication kernel running)"),
                           ("comm_hidden_s", "communication beside compute (hidden)"),
                           ("comm_exposed_s", "communication alone (exposed)"),
                           ("idle_s", "no kernel (host, launch gaps, waits)")):
            lines.append(f"| {label} | {1e3 * t[key]:.2f} | {100 * t[key] / step:.1f} |")
    host = s.get("host")
    if host:
        lines += ["", "On the host (the threads that issued the most work; the profiler slows them, so these are upper "
                  "bounds). A GPU with idle time whose host threads are busy for most of the step waits for the host:", "",
                  "| thread | busy ms/step | largest own times (ms/step) |", "|---|---|---|"]
        for t in host:
            largest = ", ".join(f"`{k['name'].replace('|', '/')}` {1e3 * k['s_per_step']:.2f}" for k in t["top"][:5])
            lines.append(f"| {t['thread']} | {1e3 * t['busy_s']:.2f} | {largest} |")
    lines += ["", "Top kernels:", "", "| kernel | category | ms/step | calls/step |", "|---|---|---|---|"]
    for k in s["top"]:
        name = k["name"] if len(k["name"]) <= 90 else k["name"][:87] + "..."
        lines.append(f"| `{name.replace('|', '/')}` | {k['category']} | {1e3 * k['s_per_step']:.2f} | "
                     f"{k['calls_per_step']:g} |")
    return "\n".join(lines) + "\n"


def profile_steps(trainer, steps: int, out_dir: Path, title: str) -> dict:
    """Profile ``steps`` training steps (after the caller's warm-up) and write the reports."""
    import time

    from torch.profiler import ProfilerActivity, profile
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cuda = trainer.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            trainer.train_step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    s = summarize(kernel_times(prof, cuda), steps, wall / steps)
    if cuda:
        s["timeline"] = timeline(kernel_intervals(prof), steps, wall / steps)
        # The step minus the summed kernel times undercounts the idle time wherever streams
        # overlap (async TP's copies beside its matmuls: 214 against 285 ms); the timeline's is exact.
        s["idle_s"] = s["timeline"]["idle_s"]
    s["title"] = title
    tmp = out_dir / "trace.json.tmp"
    prof.export_chrome_trace(str(tmp))
    # The host's threads, read back from the trace (the profiler's own event list does not
    # nest them); a trace that cannot be read costs only this table.
    try:
        with open(tmp) as f:
            s["host"] = host_summary(json.load(f).get("traceEvents", []), steps)
    except (OSError, ValueError):
        s["host"] = []
    with open(tmp, "rb") as src, gzip.open(out_dir / "trace.json.gz.tmp", "wb") as dst:
        shutil.copyfileobj(src, dst)
    tmp.unlink()
    (out_dir / "trace.json.gz.tmp").replace(out_dir / "trace.json.gz")
    atomic_write_text(out_dir / "profile.json", json.dumps(s, indent=1))
    atomic_write_text(out_dir / "profile.md", markdown(s, title))
    return s
