"""Time to quality, read from the runs' metrics.csv files.

    python benchmarks/tools/speedrun_report.py OUT_DIR RUN_DIR=LAUNCH_UNIX_TIME ...
    python benchmarks/tools/speedrun_report.py OUT_DIR RUN_DIR=@FILE ...   (FILE holds the launch time)

Each run's validation rows are timed from its own process start (the launch time the
time-to-loss suite recorded before starting the process, so imports, data checks and
compilation all count). A run folder named <UTC time>-NAME-run (the suite's) is reported as NAME. The target is the final validation loss of the run named
"baseline" or "baseline@LAYOUT" (else the first run); every other run is timed to its first validation at or below it. Writes
OUT_DIR/speedrun-table.md and the two plots (loss against wall time, against tokens).

The table also splits each time at the run's first logged step (step 10): before it, the fixed
start-up (imports, set-up, compilation of the first graphs); after it, training and evaluation.
On 4 GPUs the start-up is as long as the recipe's training, so the two speed-ups differ.
"""
from __future__ import annotations

import csv
import json
import os
import re
import sys
from pathlib import Path


def run_name(run_dir: Path) -> str:
    m = re.fullmatch(r"\d{8}T\d{6}Z-(.+)-run", run_dir.name)
    return m.group(1) if m else run_dir.name


def read_run(run_dir: Path, launch: float) -> dict:
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    val = [(float(r["wall_time"]) - launch, int(r["tokens"]), float(r["val_loss"]), int(r["step"]))
           for r in rows if r.get("val_loss")]
    # The first training row: start-up and the first graphs' compilation are behind it.
    first = next((float(r["wall_time"]) - launch for r in rows if r.get("tokens_per_s")), None)
    train = [float(r["tokens_per_s"]) for r in rows if r.get("tokens_per_s")]
    mfu = [float(r["mfu"]) for r in rows if r.get("mfu")]
    # The steady state: the median of the logged windows after the first (which holds compilation).
    steady = sorted(train[1:] or train)
    steady_mfu = sorted(mfu[1:] or mfu)
    return {"name": run_name(run_dir), "val": val, "first_log_s": first, "tok_s": steady[len(steady) // 2] if steady else None,
            "mfu": steady_mfu[len(steady_mfu) // 2] if steady_mfu else None}


def _split(first_s, t_hit, base_after) -> str:
    """'start-up | after it | speed-up after it' cells of one run."""
    if first_s is None:
        return "n/a | n/a | n/a"
    if t_hit is None:
        return f"{first_s:.1f} | not reached | —"
    after = t_hit - first_s
    speed = f"{base_after / after:.2f}x" if base_after and after > 0 else "n/a"
    return f"{first_s:.1f} | {after:.1f} | {speed}"


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for spec in argv[1:]:
        path, _, launch = spec.partition("=")
        if launch.startswith("@"):
            launch = Path(launch[1:]).read_text().strip()
        if not (Path(path) / "metrics.csv").is_file():
            print(f"{path}: no metrics.csv (the run failed; see its log)")
            continue
        runs.append(read_run(Path(path), float(launch)))
    if not runs:
        print("no run finished: nothing to report")
        return 1
    base = next((r for r in runs if re.split("@|-at-", r["name"])[0] == "baseline"), runs[0])  # baseline@ddp4 too
    # TARGET (env): a loss measured elsewhere (the baseline's), for a set of runs without a baseline.
    target = float(os.environ["TARGET"]) if os.environ.get("TARGET") else base["val"][-1][2]
    what = "given in TARGET" if os.environ.get("TARGET") else f"the final validation loss of {base['name']}"
    lines = [f"Target: {target:.4f}, {what}, over the whole val split.", "",
             "| run | seconds from process start to target | tokens to target | final val loss | "
             "final at (s) | steady tok/s | MFU | speed-up vs baseline | start-up: s to the first logged step | "
             "s from it to target | speed-up after start-up |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    base_s = base["val"][-1][0]
    base_after = base_s - base["first_log_s"] if base["first_log_s"] is not None else None
    table = []
    for r in runs:
        hit = next(((t, tok) for t, tok, v, _ in r["val"] if v <= target), None)
        t_hit, tok_hit = hit if hit else (None, None)
        table.append({"run": r["name"], "target": target, "s_to_target": t_hit, "tokens_to_target": tok_hit,
                      "final_val_loss": r["val"][-1][2], "final_at_s": r["val"][-1][0], "steady_tok_s": r["tok_s"],
                      "mfu": r["mfu"], "startup_s": r["first_log_s"]})
        final_t, _, final_v, _ = r["val"][-1]
        tok_s = "n/a" if r["tok_s"] is None else f"{r['tok_s']:,.0f}"
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        lines.append(f"| {r['name']} | {'not reached' if hit is None else f'{t_hit:.1f}'} | "
                     f"{'—' if hit is None else f'{tok_hit / 1e6:.1f}M'} | {final_v:.4f} | {final_t:.1f} | "
                     f"{tok_s} | {mfu} | {'—' if hit is None else f'{base_s / t_hit:.2f}x'} | "
                     + _split(r["first_log_s"], t_hit, base_after) + " |")
    text = "\n".join(lines) + "\n"
    (out / "speedrun-table.md").write_text(text)
    (out / "speedrun-table.json").write_text(json.dumps(table, indent=1) + "\n")
    print(text)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    for xkey, xlabel, fname in ((0, "seconds from process start", "speedrun-loss-vs-time.png"),
                                (1, "training tokens", "speedrun-loss-vs-tokens.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in runs:
            xs = [p[xkey] for p in r["val"]]
            ax.plot(xs, [p[2] for p in r["val"]], marker="o", markersize=3, label=r["name"])
        ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target:.3f}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss (whole val split)")
        ax.set_ylim(top=min(6.0, ax.get_ylim()[1]))
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
