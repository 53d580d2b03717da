"""Two training runs compared step by step: |loss(b) - loss(a)| and their validation losses.

    python benchmarks/tools/compare_curves.py RUN_A RUN_B [--plot FILE] [--json FILE]

RUN_A and RUN_B are run folders holding metrics.csv (e.g. the plain and the fast path of the
throughput suite's --loss-curves). Two runs of the same code on two GPUs differ by about 0.005 on
average over 200 steps of gpt2-124m-1024 in bf16; that is the yardstick for "trains alike".
"""
import argparse
import csv
import json
from pathlib import Path


def read(folder: Path) -> dict[int, dict]:
    with open(folder / "metrics.csv", newline="") as f:
        return {int(r["step"]): r for r in csv.DictReader(f)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--plot", type=Path)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    a, b = read(args.a), read(args.b)
    steps = sorted(s for s in a if s in b and a[s].get("loss") and b[s].get("loss"))
    if not steps:
        print("error: the two runs share no step with a loss")
        return 2
    d = [abs(float(a[s]["loss"]) - float(b[s]["loss"])) for s in steps]
    result = {"steps": len(steps), "max_abs_diff": max(d), "mean_abs_diff": sum(d) / len(d),
              "mean_abs_diff_last_50": sum(d[-50:]) / len(d[-50:]),
              "val_a": [float(r["val_loss"]) for r in a.values() if r.get("val_loss")],
              "val_b": [float(r["val_loss"]) for r in b.values() if r.get("val_loss")]}
    print(f"{len(steps)} common steps; |loss(b) - loss(a)|: max {result['max_abs_diff']:.4f}, "
          f"mean {result['mean_abs_diff']:.4f}; val a {result['val_a']}, val b {result['val_b']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        from distlm.report.plot import plot_runs
        plot_runs([args.a, args.b], args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
