"""benchmarks/tools/trace_ops.py: kernels joined to the operator and region that launched them,
and the host thread's self time, from a Chrome trace written as the torch profiler writes one."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _trace(path: Path) -> Path:
    """Two steps. The main thread (tid 1) runs a forward op (External id 1) outside any region and,
    inside "Optimizer.step#Muon.step", an op (id 2) that launches two kernels; the autograd
    thread (tid 2) launches one kernel from op 3."""
    def x(cat, name, ts, dur, tid, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}

    events = []
    for step in range(2):
        t = step * 1000
        events += [
            x("user_annotation", f"ProfilerStep#{step}", t, 900, 1),
            x("cpu_op", "aten::mm", t + 10, 50, 1, **{"External id": 1 + 10 * step}),
            x("cuda_runtime", "cudaLaunchKernel", t + 20, 5, 1),
            x("kernel", "nvjet_sm90_gemm", t + 30, 300, 7, **{"External id": 1 + 10 * step}),
            x("user_annotation", "Optimizer.step#Muon.step", t + 400, 200, 1),
            x("cpu_op", "aten::where", t + 420, 100, 1, **{"External id": 2 + 10 * step}),
            x("cuda_runtime", "cudaLaunchKernel", t + 430, 5, 1),
            x("cuda_runtime", "cudaLaunchKernel", t + 440, 5, 1),
            x("kernel", "elementwise_kernel<where>", t + 450, 40, 7, **{"External id": 2 + 10 * step}),
            x("kernel", "elementwise_kernel<where>", t + 500, 60, 7, **{"External id": 2 + 10 * step}),
            x("cpu_op", "aten::sum", t + 100, 30, 2, **{"External id": 3 + 10 * step}),
            x("cuda_runtime", "cudaLaunchKernel", t + 110, 5, 2),
            x("kernel", "reduce_kernel<sum>", t + 340, 20, 7, **{"External id": 3 + 10 * step}),
        ]
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_kernels_are_charged_to_their_operator_and_region(tmp_path):
    out = subprocess.run([sys.executable, "benchmarks/tools/trace_ops.py", str(_trace(tmp_path / "t.json.gz")),
                          "--steps", "2", "--host"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    rows = {tuple(c.strip() for c in line.strip("|").split("|")) for line in out.splitlines() if line.startswith("| ")}
    assert ("matmul", "step", "`aten::mm`", "0.30", "1") in rows
    # Two kernels of 40 and 60 us a step, under the optimizer's region, not the step's.
    assert ("element-wise/norm (eager)", "Optimizer.step#Muon.step", "`aten::where`", "0.10", "2") in rows
    # The autograd thread has no region around its op.
    assert ("element-wise/norm (eager)", "-", "`aten::sum`", "0.02", "1") in rows
    # Host: thread 1 is busy 900 us a step (the step's region); aten::where's own time is its
    # 100 us less its two 5 us launches; the region keeps what no child covers.
    assert "thread 1 busy 0.90 ms/step" in out
    assert "| `aten::where` | 0.09 |" in out
    assert "| `Optimizer.step#Muon.step` | 0.10 |" in out
    assert "thread 2 busy 0.03 ms/step" in out


def test_an_unreadable_trace_is_one_line_and_a_failure(tmp_path):
    bad = tmp_path / "trace.json.gz"
    bad.write_bytes(b"not gzip")
    proc = subprocess.run([sys.executable, "benchmarks/tools/trace_ops.py", str(bad)], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and str(bad) in proc.stderr
