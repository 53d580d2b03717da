"""Where the wall time of one ``prepare`` goes with N workers: a timeline of its tasks and the
parent's CPU by part.

    python benchmarks/tools/prepare_timeline.py --rows huge-txt,small-files,jsonl --mb-per-worker 40 \
        --workers 16 --work /tmp/prepare-timeline

For each row (corpus shape) this writes a corpus of N x M MiB from the bundled Gutenberg texts
(as ``prepare_speed`` does) and runs one ``prepare`` with N workers, in a fresh process (imports
excluded from the wall time, as in ``prepare_speed``). The output is the same as without the
timeline: the workers run ``timed_encode_unit``, which calls ``worker.encode_unit`` and appends
one line per unit (its start, end, kind and bytes) to a file of its own process; the parent runs
under cProfile with a per-thread CPU clock.

Printed, per row:

- wall: the ``prepare()`` call;
- start-up: from the call to the last worker process started, and to every worker busy
  (the last worker's first task begins);
- utilisation: the workers' busy time (sum of their tasks) / (N x wall). The rest is idle
  worker time, split exactly into: before each worker's first task, between its tasks, and after
  its last task (the tail and the finish);
- tail: from the first worker going idle for good (the earliest "last task end") to the end of
  the last task; finish: from the end of the last task to the return (the last appends, the
  fallbacks, closing shards, manifest, rename);
- the tasks: count by kind, bytes, mean and longest;
- the parent's CPU by part (cProfile of the main thread with ``time.thread_time``, which adds
  its own small cost to each call; the other threads are the process CPU less the main thread's:
  the pool's, which unpickle results and feed the call queue, and OpenBLAS's, which numpy starts
  at its import (the first encode, just before the workers fork) and which spin until the fork).
  With 1 worker the tasks run in the parent: "handing out tasks" then holds the work itself.

``--chart`` draws each worker's busy time over the call, one line a worker.

Times come from CLOCK_BOOTTIME, one clock for every process; a worker process's start time is
the kernel's (/proc/self/stat, 1/100 s steps). Linux only.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from distlm.host import usable_cores  # noqa: E402

ROWS = {"small-files": (1 << 20, ".txt"), "jsonl": (16 << 20, ".jsonl"), "huge-txt": (None, ".txt"),
        "huge-jsonl": (None, ".jsonl")}  # row: (bytes a file, None for one file of the whole size; suffix)

# The parent's parts: (file name, function) -> part. Each is called from the main loop, none
# inside another, so their cumulative times add up.
PARTS = {
    ("prepare.py", "_parse_shard"): "planning units",
    ("folder.py", "inputs_fingerprint"): "planning units",
    ("sources.py", "resolve_inputs"): "planning units",
    ("sources.py", "source_files"): "planning units",
    ("sources.py", "input_files"): "planning units",
    ("units.py", "plan_units"): "planning units",
    ("tokenizer.py", "gpt2"): "start-up (tokenizer, worker pool, its shutdown)",
    ("pool.py", "open_executor"): "start-up (tokenizer, worker pool, its shutdown)",
    ("pool.py", "run"): "handing out tasks",
    ("build.py", "_result"): "waiting for futures",
    ("build.py", "_append"): "appending shards (copy + sha256)",
    ("build.py", "record"): "journal (fsync, a line a second)",
    ("journal.py", "append"): "journal (fsync, a line a second)",
    ("build.py", "finish"): "finish (fallbacks, closing shards, manifest, rename)",
    ("folder.py", "write_manifest"): "finish (fallbacks, closing shards, manifest, rename)",
    ("folder.py", "swap_in"): "finish (fallbacks, closing shards, manifest, rename)",
    ("shutil.py", "rmtree"): "finish (fallbacks, closing shards, manifest, rename)",
}


def clock() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def process_start() -> float | None:
    """This process's start on ``clock()``'s scale (the kernel counts it from boot), or None."""
    try:
        with open("/proc/self/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of the line; fields[0] is field 3
    except (OSError, IndexError, ValueError):
        return None


def timed_encode_unit(trace_dir: str, tok, k: int, unit, options: dict, folder: str) -> dict:
    """``worker.encode_unit``, and a line about it in ``trace_dir/<pid>.jsonl``: put in place of the
    pipeline's ``encode_unit`` (``profile_prepare``) as ``partial(timed_encode_unit, trace_dir)``;
    workers get it by name."""
    from distlm.corpus.worker import encode_unit
    start = clock()
    result = encode_unit(tok, k, unit, options, folder)
    end = clock()
    size = unit.end - unit.start if unit.kind == "hash" else unit.size
    line = {"pid": os.getpid(), "unit": k, "kind": unit.kind, "bytes": size, "start": start, "end": end,
            "process_start": process_start()}
    with open(os.path.join(trace_dir, f"{os.getpid()}.jsonl"), "a") as fh:
        fh.write(json.dumps(line) + "\n")
    return result


def profile_prepare(inputs: list[str], workers: int, out: Path, trace_dir: Path) -> dict:
    """One ``prepare`` of ``inputs`` with ``workers`` workers, timed; ``summarize``'s input."""
    from distlm.corpus import build
    from distlm.corpus.prepare import prepare
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(trace_dir, ignore_errors=True)
    trace_dir.mkdir(parents=True)
    profiler = cProfile.Profile(time.thread_time)
    cpu0, main0, t0 = time.process_time(), time.thread_time(), clock()
    real, build.encode_unit = build.encode_unit, partial(timed_encode_unit, str(trace_dir))
    profiler.enable()
    try:
        manifest = prepare(list(inputs), out, workers=workers, progress=False)
    finally:
        profiler.disable()
        build.encode_unit = real
    t1, main1, cpu1 = clock(), time.thread_time(), time.process_time()
    tasks = [json.loads(ln) for f in sorted(trace_dir.glob("*.jsonl")) for ln in f.read_text().splitlines()]
    shutil.rmtree(trace_dir)
    parts: dict[str, float] = {}
    for (filename, _, func), (_, _, _, cumulative, _) in pstats.Stats(profiler).stats.items():
        part = PARTS.get((os.path.basename(filename), func))
        if part:
            parts[part] = parts.get(part, 0.0) + cumulative
    parts[REST] = (main1 - main0) - sum(parts.values())
    parts["other threads (the pool's; OpenBLAS's from numpy's import)"] = (cpu1 - cpu0) - (main1 - main0)
    return {"workers": workers, "parent_pid": os.getpid(), "start": t0, "end": t1, "tasks": tasks, "parent_cpu": parts,
            "parent_cpu_s": cpu1 - cpu0, "input_bytes": sum(s["bytes"] for s in manifest["sources"]),
            "shards": [s["sha256"] for split in ("train", "val") for s in manifest["splits"][split]["shards"]]}


def summarize(run: dict) -> dict:
    """The timeline's figures (see the module docstring); the idle parts add up to N x wall - busy."""
    t0, t1, n, tasks = run["start"], run["end"], run["workers"], run["tasks"]
    wall = t1 - t0
    by_pid: dict[int, list[dict]] = {}
    for t in sorted(tasks, key=lambda t: t["start"]):
        by_pid.setdefault(t["pid"], []).append(t)
    busy = sum(t["end"] - t["start"] for t in tasks)
    before = between = after = 0.0
    for mine in by_pid.values():
        before += mine[0]["start"] - t0
        between += sum(b["start"] - a["end"] for a, b in zip(mine, mine[1:]))
        after += t1 - mine[-1]["end"]
    before += (n - len(by_pid)) * wall  # a worker that got no task idled throughout
    last_ends = [mine[-1]["end"] for mine in by_pid.values()]
    # The kernel's start times, where they fall in the call (a clock in another time namespace would not).
    starts = [t["process_start"] for t in tasks if t["process_start"] is not None and t["pid"] != run["parent_pid"]
              and t0 - 1 <= t["process_start"] <= t1]
    kinds: dict[str, list] = {}
    for t in tasks:
        kinds.setdefault(t["kind"], []).append(t["end"] - t["start"])
    return {
        "workers": n, "wall_s": wall, "input_mb": run["input_bytes"] / 1e6,
        "workers_started_s": (max(starts) - t0) if starts else None,
        "all_busy_s": (max(mine[0]["start"] for mine in by_pid.values()) - t0) if len(by_pid) == n else wall,
        "busy_s": busy, "utilisation": busy / (n * wall),
        "idle_before_first_task_s": before, "idle_between_tasks_s": between, "idle_after_last_task_s": after,
        "tail_s": (max(last_ends) - min(last_ends)) if last_ends else 0.0,
        "finish_s": (t1 - max(last_ends)) if last_ends else wall,
        "tasks": len(tasks), "task_bytes": sum(t["bytes"] for t in tasks if t["kind"] != "hash"),
        "kinds": {k: {"count": len(v), "mean_s": sum(v) / len(v), "max_s": max(v)} for k, v in kinds.items()},
        "parent_cpu_s": run["parent_cpu_s"], "parent_cpu": run["parent_cpu"],
    }


def report(name: str, s: dict) -> str:
    n, wall = s["workers"], s["wall_s"]
    lines = [f"{name}: {s['input_mb']:.0f} MB, {n} workers, wall {wall:.2f} s ({s['input_mb'] / wall:.1f} MB/s)",
             f"  start-up: last worker process started at "
             + ("n/a" if s["workers_started_s"] is None else f"{s['workers_started_s']:.2f} s")
             + ", every worker busy at "
             f"{s['all_busy_s']:.2f} s",
             f"  utilisation {s['utilisation']:.2f}: busy {s['busy_s']:.1f} of {n * wall:.1f} worker-s; idle "
             f"{s['idle_before_first_task_s']:.1f} before the first task, {s['idle_between_tasks_s']:.1f} between "
             f"tasks, {s['idle_after_last_task_s']:.1f} after the last",
             f"  tail {s['tail_s']:.2f} s (first worker idle for good -> last task ends), finish "
             f"{s['finish_s']:.2f} s (last task ends -> prepare returns)",
             "  tasks: " + "; ".join(f"{k} {v['count']} (mean {v['mean_s'] * 1e3:.0f} ms, longest "
                                     f"{v['max_s'] * 1e3:.0f} ms)" for k, v in s["kinds"].items())
             + f"; {s['task_bytes'] / s['tasks'] / 1e6 if s['tasks'] else 0:.2f} MB a task",
             f"  parent CPU {s['parent_cpu_s']:.2f} s ({s['parent_cpu_s'] / s['input_mb'] * 1e3:.2f} ms/MB): "
             + split_text(s["parent_cpu"])]
    return "\n".join(lines)


REST = "rest of the main thread"


def split_text(parts: dict) -> str:
    """The parent's CPU by part, or why not: the remainder is the main thread's CPU less the
    parts cProfile timed, so a clearly negative one means the parts are not CPU seconds (on a
    16-vCPU virtual machine, 2026-11-27, they came out tens of times too large) and are left out."""
    if parts.get(REST, 0.0) < -0.05 * sum(max(v, 0.0) for v in parts.values()):
        return (f"its split by part is not given: the parts cProfile timed exceed the main thread's CPU "
                f"by {-parts[REST]:.2f} s, so they are not CPU seconds on this machine")
    return ", ".join(f"{part} {sec:.2f}" for part, sec in sorted(parts.items(), key=lambda kv: -kv[1]))


def chart(run: dict, columns: int = 60) -> str:
    """One line per worker over the wall time: '#' busy for most of the column, '+' for part of it,
    ' ' idle; 'H' where it hashes a one-document file (its pieces wait for that hash)."""
    t0, wall = run["start"], run["end"] - run["start"]
    step = wall / columns
    by_pid: dict[int, list[dict]] = {}
    for t in run["tasks"]:
        by_pid.setdefault(t["pid"], []).append(t)
    lines = []
    for i, (_, tasks) in enumerate(sorted(by_pid.items(), key=lambda kv: min(t["start"] for t in kv[1]))):
        cells = []
        for c in range(columns):
            a, b = t0 + c * step, t0 + (c + 1) * step
            busy = sum(max(0.0, min(b, t["end"]) - max(a, t["start"])) for t in tasks)
            hashing = any(t["kind"] == "hash" and t["start"] < b and t["end"] > a for t in tasks)
            cells.append("H" if hashing else "#" if busy > step / 2 else "+" if busy > 0 else " ")
        lines.append(f"  w{i:<3}|{''.join(cells)}|")
    return "\n".join(lines + [f"      0 s{' ' * (columns - 8)}{wall:.1f} s"])


def write_row(row: str, size: int, folder: Path, seed: int = 0) -> list[str]:
    """The corpus of ``row`` (see ROWS), ``size`` bytes, under ``folder/row``; its input paths."""
    from prepare_speed import _Documents, _paragraphs_cached, _write_files
    file_bytes, suffix = ROWS[row]
    path = Path(_write_files(folder / row, _Documents(_paragraphs_cached(()), seed), size, file_bytes or size,
                             suffix))
    return [str(path / "00000.txt")] if row == "huge-txt" else \
        [str(path / "00000.jsonl")] if row == "huge-jsonl" else [str(path)]


def profile_in(inputs: list[str], workers: int, work: str) -> dict:
    """``profile_prepare`` with its output and trace folders under ``work`` (JSON arguments, for
    prepare_speed.in_fresh_process); the output is removed afterwards."""
    run = profile_prepare(inputs, workers, Path(work) / "out", Path(work) / "trace")
    shutil.rmtree(Path(work) / "out", ignore_errors=True)
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/tools/prepare_timeline.py", description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="huge-txt,small-files,jsonl", help=f"comma-separated, from {', '.join(ROWS)}")
    ap.add_argument("--workers", default=None, help="worker counts, comma-separated (default: every core)")
    ap.add_argument("--mb-per-worker", type=float, default=40.0, help="N x this many MiB of input a row")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "distlm-prepare-timeline",
                    help="folder for the corpora and the output (emptied first; default: %(default)s)")
    ap.add_argument("--chart", action="store_true", help="also draw each worker's busy time over the wall time")
    ap.add_argument("--json", type=Path, default=None, help="also write every row's figures here")
    args = ap.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    for r in rows:
        if r not in ROWS:
            raise SystemExit(f"--rows: unknown row {r!r} (choose from {', '.join(ROWS)})")
    cores = usable_cores()
    counts = [int(w) for w in args.workers.split(",")] if args.workers else [cores]
    from prepare_speed import in_fresh_process, machine
    print(machine(), flush=True)
    shutil.rmtree(args.work, ignore_errors=True)
    begun, out = time.perf_counter(), {}
    for row in rows:
        for workers in counts:
            t = time.perf_counter()
            inputs = write_row(row, int(args.mb_per_worker * workers * (1 << 20)), args.work / "corpora")
            built = time.perf_counter() - t
            run = in_fresh_process("prepare_timeline:profile_in", inputs, workers, str(args.work))
            key = row if len(counts) == 1 else f"{row}@{workers}"
            out[key] = summarize(run)
            print(f"(corpus written in {built:.1f} s)\n" + report(row, out[key]), flush=True)
            if args.chart:
                print(chart(run), flush=True)
            shutil.rmtree(args.work / "corpora" / row, ignore_errors=True)
    print(f"done in {time.perf_counter() - begun:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    shutil.rmtree(args.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
