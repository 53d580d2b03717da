"""Repeated scaling measurements side by side: does the efficiency hold every time?

    python benchmarks/tools/scaling_repeats.py OUT_DIR RUN_DIR [RUN_DIR ...] [--goal 0.95]

Each RUN_DIR holds the scaling-weak.json (or scaling-strong.json) of one `distlm bench --scaling`
launch; the scaling suite's --repeat N runs N of them in turn (1 GPU, N GPUs, 1, N, ...), so the
repetitions interleave on one machine and a slow spell shows in one repetition, not all. Writes
OUT_DIR/repeats.md (a row per repetition and GPU count: tokens/s, per-GPU, efficiency, step and
exposed communication in ms) and repeats.json, with the lowest and highest efficiency at each GPU
count and whether the lowest reaches --goal.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read(folder: Path) -> tuple[str, list[dict]]:
    for mode in ("weak", "strong"):
        path = folder / f"scaling-{mode}.json"
        if path.is_file():
            return mode, json.loads(path.read_text())["rows"]
    raise FileNotFoundError(f"{folder}: no scaling-weak.json or scaling-strong.json (the launch failed; see its log)")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="scaling_repeats.py", description=__doc__.strip().splitlines()[0])
    p.add_argument("out")
    p.add_argument("runs", nargs="+")
    p.add_argument("--goal", type=float, default=0.95, help="the efficiency every repetition should reach")
    args = p.parse_args(argv)
    rows, missing = [], []
    for i, folder in enumerate(args.runs, 1):
        try:
            mode, found = read(Path(folder))
        except FileNotFoundError as e:
            missing.append(str(e))
            continue
        for r in found:
            eff = r["weak_eff"] if mode == "weak" else r["strong_eff"]
            rows.append({"repetition": i, "mode": mode, "gpus": r["gpus"], "tokens_per_s": r["tokens_per_s"],
                         "per_gpu": r["per_gpu"], "efficiency": eff, "step_ms": r["step_ms"],
                         "exposed_ms": r["exposed_ms"]})
    for m in missing:
        print(m)
    if not rows:
        print("no repetition finished: nothing to report")
        return 1
    f = lambda v, spec: "n/a" if v is None else format(v, spec)  # noqa: E731
    lines = ["| repetition | GPUs | tok/s | tok/s per GPU | efficiency | step ms | exposed comm ms |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['repetition']} | {r['gpus']} | {r['tokens_per_s']:,.0f} | {r['per_gpu']:,.0f} | "
                     f"{f(r['efficiency'] and 100 * r['efficiency'], '.1f')}% | {r['step_ms']:.1f} | "
                     f"{f(r['exposed_ms'], '.1f')} |")
    summary = []
    for gpus in sorted({r["gpus"] for r in rows if r["gpus"] != min(x["gpus"] for x in rows)}):
        effs = [r["efficiency"] for r in rows if r["gpus"] == gpus and r["efficiency"] is not None]
        if not effs:
            continue
        low, high = min(effs), max(effs)
        summary.append({"gpus": gpus, "repetitions": len(effs), "lowest": low, "highest": high,
                        "goal": args.goal, "met": low >= args.goal})
        lines.append(f"\n{gpus} GPUs, {len(effs)} repetitions: efficiency {100 * low:.1f}% to {100 * high:.1f}%; "
                     f"the goal of {100 * args.goal:.0f}% in every repetition is "
                     f"{'met' if low >= args.goal else 'not met'}.")
    text = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "repeats.md").write_text(text)
    (out / "repeats.json").write_text(json.dumps({"rows": rows, "summary": summary, "missing": missing}, indent=1) + "\n")
    print(text)
    return 0 if not missing else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
