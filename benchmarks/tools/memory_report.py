"""Planned against measured memory of `distlm bench` runs (benchmarks/suites/memory.py).

    python benchmarks/tools/memory_report.py RUN_FOLDER... [--tolerance 0.10] [--json OUT]

Reads each folder's result.json (peak_mem_gb measured on the busiest rank, planned_mem_gb the
planner's estimate) and prints one row per run: optimizer, micro-batch, planned, measured, the
relative error and the planner's terms. Exit 1 when a measured run is off by more than the
tolerance; runs without a measurement (a CPU) are listed as n/a and do not fail.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def rows(folders: list[Path]) -> list[dict]:
    out = []
    for folder in folders:
        path = folder / "result.json"
        if not path.is_file():
            out.append({"run": folder.name, "missing": True})
            continue
        r = json.loads(path.read_text())
        planned, measured = r.get("planned_mem_gb"), r.get("peak_mem_gb")
        out.append({"run": folder.name, "optimizer": r.get("optimizer"), "micro_batch": r.get("micro_batch_size"),
                    "planned_gib": planned, "measured_gib": measured,
                    "error": (planned - measured) / measured if planned is not None and measured else None,
                    "terms_gib": r.get("planned_mem_terms_gb"), "device": r.get("device")})
    return out


def table(result: list[dict]) -> str:
    lines = ["| run | optimizer | micro-batch | planned GiB | measured GiB | error | optimizer state GiB |",
             "|---|---|---|---|---|---|---|"]
    for r in result:
        if r.get("missing"):
            lines.append(f"| {r['run']} | (no result.json) | | | | | |")
            continue
        f = lambda v, fmt: "n/a" if v is None else format(v, fmt)
        state = (r["terms_gib"] or {}).get("optimizer_state")
        lines.append(f"| {r['run']} | {r['optimizer']} | {r['micro_batch']} | {f(r['planned_gib'], '.2f')} | "
                     f"{f(r['measured_gib'], '.2f')} | {f(r['error'], '+.1%')} | {f(state, '.2f')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("folders", nargs="+", type=Path)
    p.add_argument("--tolerance", type=float, default=0.10)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    result = rows(args.folders)
    print(table(result))
    off = [r["run"] for r in result if r.get("missing") or (r["error"] is not None and abs(r["error"]) > args.tolerance)]
    if args.json:
        args.json.write_text(json.dumps({"rows": result, "tolerance": args.tolerance, "failed": off}, indent=1) + "\n")
    if off:
        print(f"off by more than {args.tolerance:.0%} (or missing): {', '.join(off)}")
        return 1
    measured = [r for r in result if r["error"] is not None]
    print(f"{len(measured)} measured run(s) within {args.tolerance:.0%}" if measured else
          "nothing measured (no GPU): the planned figures only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
