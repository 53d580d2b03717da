"""Which operator launched each kernel of a `distlm bench --profile DIR` trace, and under which region.

    python benchmarks/tools/trace_ops.py DIR/trace.json.gz [--steps 3] [--top 40] [--category NAME ...]

profile.md splits a step's device time into categories and names the top kernels; it does not say
what asked for them. An eager element-wise kernel can come from the optimizer, from a parameter
cast, from the data path or from a graph break. This reads the Chrome trace the profiler wrote and
joins each kernel to the CPU-side operator that launched it (the profiler's "External id") and to
the innermost recorded region around that operator on its thread ("Optimizer.step#Muon.step",
"## forward ##", a compiled graph's "Torch-Compiled Region", ...). Prints one Markdown table:
category, region, operator, ms per step, kernels per step; largest first. --host adds the
host thread's own time by event, for a step the host cannot feed fast enough.
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from distlm.bench.host_time import busiest_threads, short_name, thread_times  # noqa: E402
from distlm.bench.profile import categorize  # noqa: E402


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


class Regions:
    """The recorded regions (user annotations) of each CPU thread, for finding the innermost
    one around a moment."""

    def __init__(self, events: list[dict]):
        by_tid: dict = defaultdict(list)
        for e in events:
            if e.get("cat") == "user_annotation" and e.get("ph") == "X":
                by_tid[e["tid"]].append((e["ts"], e["ts"] + e.get("dur", 0), e["name"]))
        self.by_tid = {tid: sorted(spans) for tid, spans in by_tid.items()}
        self.starts = {tid: [s for s, _, _ in spans] for tid, spans in self.by_tid.items()}

    def around(self, tid, ts: float) -> str:
        spans = self.by_tid.get(tid)
        if not spans:
            return "-"
        best = None
        # The innermost region is the latest-starting one that still contains ts.
        for i in range(bisect.bisect_right(self.starts[tid], ts) - 1, -1, -1):
            start, end, name = spans[i]
            if start <= ts <= end:
                best = name
                break
        return short_name(best) if best else "-"


def attribute(events: list[dict]) -> dict:
    """(category, region, operator) -> [device microseconds, kernel count]."""
    ops = {}
    for e in events:
        if e.get("cat") == "cpu_op" and "External id" in e.get("args", {}):
            ops[e["args"]["External id"]] = e
    regions = Regions(events)
    out: dict = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        op = ops.get(e.get("args", {}).get("External id"))
        op_name = op["name"] if op else "(no operator)"
        region = regions.around(op["tid"], op["ts"]) if op else "-"
        key = (categorize(e["name"]), region, op_name)
        out[key][0] += e.get("dur", 0)
        out[key][1] += 1
    return out


def host_table(tid, busy_us: float, own: dict, steps: int, top: int) -> str:
    lines = [f"thread {tid} busy {busy_us / 1e3 / steps:.2f} ms/step; self time by event:", "",
             "| event | self ms/step |", "|---|---|"]
    for name, us in sorted(own.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| `{name}` | {us / 1e3 / steps:.2f} |")
    return "\n".join(lines)


def table(rows: dict, steps: int, top: int, categories: set) -> str:
    items = sorted(((k, v) for k, v in rows.items() if not categories or k[0] in categories),
                   key=lambda kv: -kv[1][0])
    lines = ["| category | region | operator | ms/step | kernels/step |", "|---|---|---|---|---|"]
    for (cat, region, op), (us, n) in items[:top]:
        lines.append(f"| {cat} | {region} | `{op}` | {us / 1e3 / steps:.2f} | {n / steps:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path, help="trace.json.gz from `distlm bench --profile DIR`")
    p.add_argument("--steps", type=int, default=3, help="steps the trace holds (profile.md says)")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--category", action="append", default=[], help="only this category (repeatable)")
    p.add_argument("--host", action="store_true", help="also the host thread's time by event (self time)")
    a = p.parse_args(argv)
    try:
        events = load(a.trace)
    except (OSError, ValueError, KeyError) as e:
        print(f"trace_ops: cannot read {a.trace}: {e}", file=sys.stderr)
        return 1
    print(table(attribute(events), a.steps, a.top, set(a.category)))
    if a.host:
        for tid in busiest_threads(events):
            print()
            print(host_table(tid, *thread_times(events, tid), a.steps, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
