"""`distlm bench` results side by side: older code against newer, variant by variant.

    python benchmarks/tools/compare_bench.py BEFORE_DIR AFTER_DIR [BEFORE_DIR AFTER_DIR ...] [--json FILE]

Each DIR is a step folder of the throughput suite holding result.json (`--before DIR` plans the
pairs: before-NAME, then NAME). Prints, per pair, tokens/s, step time, MFU, the step's phases and,
when both were profiled, the device time by category (ms per step), each with after - before.
"""
import argparse
import json
import sys
from pathlib import Path


def rows(r: dict) -> dict[str, float]:
    """The figures compared, in display units (ms, %, tok/s)."""
    out = {"tokens/s": r["tokens_per_s"], "step ms": 1e3 * r["step_s"]}
    if r.get("mfu") is not None:
        out["MFU %"] = 100 * r["mfu"]
    for phase, s in (r.get("phases_s") or {}).items():
        out[f"{phase} ms"] = 1e3 * s
    prof = r.get("profile") or {}
    for cat, s in (prof.get("categories_s") or {}).items():
        out[f"profile: {cat} ms"] = 1e3 * s
    if prof.get("idle_s") is not None:
        out["profile: idle ms"] = 1e3 * prof["idle_s"]
    if r.get("peak_mem_gb") is not None:
        out["peak GiB"] = r["peak_mem_gb"]
    return out


def compare(before: dict, after: dict) -> list[tuple[str, float | None, float | None]]:
    b, a = rows(before), rows(after)
    keys = list(b) + [k for k in a if k not in b]
    return [(k, b.get(k), a.get(k)) for k in keys]


def markdown(name: str, table) -> str:
    def fmt(v):
        return "" if v is None else f"{v:,.1f}" if abs(v) >= 100 else f"{v:.2f}"
    lines = [f"## {name}", "", "| | before | after | after - before |", "|---|---|---|---|"]
    for key, b, a in table:
        lines.append(f"| {key} | {fmt(b)} | {fmt(a)} | {fmt(a - b) if a is not None and b is not None else ''} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dirs", nargs="+", type=Path, help="BEFORE_DIR AFTER_DIR pairs")
    p.add_argument("--json", type=Path, help="write the comparison here")
    args = p.parse_args(argv)
    if len(args.dirs) % 2:
        print(f"error: {len(args.dirs)} folders given; they come in BEFORE AFTER pairs", file=sys.stderr)
        return 2
    report = {}
    for before_dir, after_dir in zip(args.dirs[::2], args.dirs[1::2]):
        missing = [str(d / "result.json") for d in (before_dir, after_dir) if not (d / "result.json").is_file()]
        if missing:
            print(f"error: no result in {', '.join(missing)} (did the step fail? see its log.txt)", file=sys.stderr)
            return 2
        before, after = (json.loads((d / "result.json").read_text()) for d in (before_dir, after_dir))
        table = compare(before, after)
        print(markdown(after_dir.name, table))
        report[after_dir.name] = [{"figure": k, "before": b, "after": a} for k, b, a in table]
    if args.json:
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        tmp.replace(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
