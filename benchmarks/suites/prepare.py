"""`distlm prepare` throughput: MB/s of GPT-2 BPE against worker processes, by corpus shape.

    python benchmarks/run.py prepare [--shapes small-files,jsonl,huge] [--size-mb 512] [--workers 1,4,8,16]

Runs `python -m distlm.bench.prepare_speed` with these options (and any after --) into the step's
folder. Where this checkout has no distlm.bench.prepare_speed the suite says so and runs nothing.
"""
from __future__ import annotations

import importlib.util

from run import Context, Step
from suites import int_list

MODULE = "distlm.bench.prepare_speed"


def add_arguments(p) -> None:
    p.add_argument("--shapes", default="small-files,jsonl,huge", help="corpus shapes to generate and prepare")
    p.add_argument("--size-mb", type=int, default=512, help="MB of text per shape (default 512)")
    p.add_argument("--workers", default="1,4,8,16", help="worker counts (default 1,4,8,16)")
    p.add_argument("rest", nargs="*", help="more flags for the module, after --")


def available() -> bool:
    try:
        return importlib.util.find_spec(MODULE) is not None
    except ModuleNotFoundError:
        return False


def plan(args, ctx: Context) -> list[Step]:
    int_list(args.workers)
    size = min(args.size_mb, 8) if ctx.cpu else args.size_mb
    workers = "1,2" if ctx.cpu else args.workers
    argv = [ctx.python, "-m", MODULE, "--shapes", args.shapes, "--size-mb", str(size), "--workers", workers,
            "--out", "{dir}", *args.rest]
    if not available() and not args.dry_run:
        print(f"prepare: {MODULE} is not in this checkout ({'distlm/bench/prepare_speed.py'} missing); nothing run")
        return []
    return [Step("prepare-speed", argv)]
