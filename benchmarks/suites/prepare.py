"""`distlm prepare` throughput: MB/s of GPT-2 BPE against worker processes, by corpus shape.

    python benchmarks/run.py prepare --mb-per-worker 40 [--workers 1,4,8,16] [--shapes small-files,jsonl,huge]
    python benchmarks/run.py prepare [--size-mb 512] [--workers 1,4,8,16] [--shapes ...]

Runs `python benchmarks/tools/prepare_speed.py` with these options (and any after --) into the step's
folder. Where this checkout has no such tool the suite says so and runs nothing.

`--mb-per-worker 40` gives the run with N workers N x 40 MiB of each shape, so every run lasts
about as long (~6 s at the one-process rates of the 16-vCPU GPU machine, 2026-11-27); 1, 4, 8 and
16 workers on all three shapes (five rows: Parquet and the huge JSONL file too), with the corpora
written first (~4 GB) and the references, come to about 4-5 minutes there by those rates.
`--size-mb` gives every worker count the same corpus and checks that they write the same bytes.
"""
from __future__ import annotations

from pathlib import Path

from run import Context, Step
from suites import int_list

TOOL = "benchmarks/tools/prepare_speed.py"


def add_arguments(p) -> None:
    p.add_argument("--shapes", default="small-files,jsonl,huge", help="corpus shapes to generate and prepare")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--size-mb", type=int, default=None,
                      help="MiB of text per shape, the same for every worker count (default 512)")
    size.add_argument("--mb-per-worker", type=float, default=None,
                      help="N x this many MiB for the run with N workers: 40 runs 1,4,8,16 workers on all three "
                           "shapes in about 4-5 minutes on a 16-core machine")
    p.add_argument("--workers", default="1,4,8,16", help="worker counts (default 1,4,8,16)")
    p.add_argument("rest", nargs="*", help="more flags for the module, after --")


def available() -> bool:
    return (Path(__file__).resolve().parents[2] / TOOL).is_file()


def plan(args, ctx: Context) -> list[Step]:
    int_list(args.workers)
    if args.mb_per_worker is not None:
        size = ["--mb-per-worker", str(min(args.mb_per_worker, 4) if ctx.cpu else args.mb_per_worker)]
    else:
        mb = args.size_mb if args.size_mb is not None else 512
        size = ["--size-mb", str(min(mb, 8) if ctx.cpu else mb)]
    workers = "1,2" if ctx.cpu else args.workers
    argv = [ctx.python, TOOL, "--shapes", args.shapes, *size, "--workers", workers,
            "--out", "{dir}", *args.rest]
    if not available() and not args.dry_run:
        print(f"prepare: {TOOL} is not in this checkout; nothing run")
        return []
    return [Step("prepare-speed", argv)]
