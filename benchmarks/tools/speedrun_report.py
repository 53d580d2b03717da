"""Time to quality, read from the runs' metrics.csv files.

    python benchmarks/tools/speedrun_report.py OUT_DIR RUN_DIR=LAUNCH_UNIX_TIME ...
    python benchmarks/tools/speedrun_report.py OUT_DIR RUN_DIR=@FILE ...   (FILE holds the launch time)

Each run's validation rows are timed from its own process start (the launch time the
time-to-loss suite recorded before starting the process, so imports, data checks and
compilation all count). A run folder named <UTC time>-NAME-run (the suite's) is reported as NAME.
Runs are grouped by GPU layout (NAME-at-ddp4 is on 4 GPUs; no layout is one GPU), and each group
has its own target: the final validation loss of its cold nanogpt run (nanoGPT's own train.py,
scored over the whole val split by tools/nanogpt_recipe.py), else of its baseline run, else of
the first run of the first group; every other run is timed to its first validation at or below
it. TARGET (env) gives one target to every group. Writes OUT_DIR/speedrun-table.md, .json and
the two plots (loss against wall time, against tokens).

Beside a run's launch-time file, the suite keeps the run's log.txt: the report takes from it when
distlm's set-up ended (seconds from process start) and whether its compile cache was cold or warm
(the line after the first step). CONCURRENT (env, comma-separated names) marks the runs that
ran at the same time, one per GPU.

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


SETUP = re.compile(r"^set-up [0-9.]+ s \(.*\); ([0-9.]+) s since the process started", re.M)
CACHE = re.compile(r"first step ([0-9.]+) s after set-up, compilation included; compile cache ([a-z ]+):")


def layout_of(name: str) -> str:
    m = re.search(r"-at-([a-z]+\d+)", name) or re.search(r"@([a-z]+\d+)", name)
    return m.group(1) if m else "1 GPU"


def is_recipe(name: str, recipe: str) -> bool:
    """NAME is RECIPE's cold run (on any corpus prefix and layout)."""
    return re.search(rf"(^|-){recipe}(-at-[a-z]+\d+|@[a-z]+\d+)?$", name) is not None


def read_log(log: Path) -> dict:
    """When set-up ended and the compile cache's state, from a distlm run's log (None: absent)."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    setup, cache = SETUP.search(text), CACHE.search(text)
    return {"setup_done_s": float(setup.group(1)) if setup else None,
            "first_step_s": float(cache.group(1)) if cache else None, "cache": cache.group(2) if cache else None}


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


def _ends(r: dict, base: dict) -> str:
    """'process end | after the last validation | speed-up to process end' cells: the whole wait,
    each run's against the baseline's, counted only for a run whose final loss reached the target."""
    if r["process_s"] is None:
        return "— | — | — |"
    after = r["process_s"] - r["val"][-1][0]
    reached = r["val"][-1][2] <= base["val"][-1][2]
    speed = f"{base['process_s'] / r['process_s']:.2f}x" if base.get("process_s") and reached else "—"
    return f"{r['process_s']:.1f} | {after:.1f} | {speed} |"


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for spec in argv[1:]:
        path, _, launch = spec.partition("=")
        log = None
        if launch.startswith("@"):
            log = Path(launch[1:]).parent / "log.txt"
            launch = Path(launch[1:]).read_text().strip()
        if not (Path(path) / "metrics.csv").is_file():
            print(f"{path}: no metrics.csv (the run failed; see its log)")
            continue
        run = read_run(Path(path), float(launch))
        run.update(read_log(log) if log is not None else read_log(Path("/nonexistent")))
        # The process's end, beside its launch time (benchmarks/run.py writes both): None when absent.
        ended = log.parent / "end_time.txt" if log is not None else None
        run["process_s"] = (float(ended.read_text()) - float(launch)
                            if ended is not None and ended.is_file() else None)
        runs.append(run)
    if not runs:
        print("no run finished: nothing to report")
        return 1
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(layout_of(r["name"]), []).append(r)
    together = [n for n in os.environ.get("CONCURRENT", "").split(",") if n]
    lines, table = [], []
    if together:
        lines += [f"Ran at the same time, one per GPU (CUDA_VISIBLE_DEVICES): "
                  f"{', '.join(n for n in together if any(r['name'] == n for r in runs)) or 'none of these'}; "
                  f"every other run ran alone. Runs that ran together shared the host's CPU cores, so their "
                  f"compilation (part of the start-up) may be slower than alone.", ""]
    fallback = runs[0]
    for layout, members in groups.items():
        base = next((r for r in members if is_recipe(r["name"], "nanogpt")), None) or \
            next((r for r in members if is_recipe(r["name"], "baseline")), None) or fallback
        # TARGET (env): a loss measured elsewhere, for a set of runs without a baseline.
        target = float(os.environ["TARGET"]) if os.environ.get("TARGET") else base["val"][-1][2]
        what = "given in TARGET" if os.environ.get("TARGET") else f"the final validation loss of {base['name']}"
        lines += [f"{layout}: target {target:.4f}, {what}, over the whole val split.", "",
                  "| run | seconds from process start to target | tokens to target | final val loss | "
                  "final at (s) | steady tok/s | MFU | speed-up vs baseline | start-up: s to the first logged step | "
                  "s from it to target | speed-up after start-up | set-up done (s) | first step after it (s) | "
                  "compile cache | process start to process end (s) | of it after the last validation (s) | "
                  "speed-up, process start to end |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        base_s = base["val"][-1][0]
        base_after = base_s - base["first_log_s"] if base["first_log_s"] is not None else None
        for r in members:
            hit = next(((t, tok) for t, tok, v, _ in r["val"] if v <= target), None)
            t_hit, tok_hit = hit if hit else (None, None)
            table.append({"run": r["name"], "layout": layout, "baseline": base["name"], "target": target,
                          "s_to_target": t_hit, "tokens_to_target": tok_hit, "final_val_loss": r["val"][-1][2],
                          "final_at_s": r["val"][-1][0], "steady_tok_s": r["tok_s"], "mfu": r["mfu"],
                          "startup_s": r["first_log_s"], "setup_done_s": r["setup_done_s"],
                          "first_step_s": r["first_step_s"], "compile_cache": r["cache"],
                          "concurrent": r["name"] in together, "process_s": r["process_s"],
                          "after_last_val_s": None if r["process_s"] is None else r["process_s"] - r["val"][-1][0]})
            final_t, _, final_v, _ = r["val"][-1]
            tok_s = "n/a" if r["tok_s"] is None else f"{r['tok_s']:,.0f}"
            mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
            setup = "—" if r["setup_done_s"] is None else f"{r['setup_done_s']:.1f}"
            first = "—" if r["first_step_s"] is None else f"{r['first_step_s']:.1f}"
            lines.append(f"| {r['name']} | {'not reached' if hit is None else f'{t_hit:.1f}'} | "
                         f"{'—' if hit is None else f'{tok_hit / 1e6:.1f}M'} | {final_v:.4f} | {final_t:.1f} | "
                         f"{tok_s} | {mfu} | {'—' if hit is None else f'{base_s / t_hit:.2f}x'} | "
                         + _split(r["first_log_s"], t_hit, base_after) + f" | {setup} | {first} | {r['cache'] or '—'} | "
                         + _ends(r, base))
        lines.append("")
    text = "\n".join(lines)
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
        for t in sorted({row["target"] for row in table}):
            ax.axhline(t, color="gray", linestyle="--", linewidth=1, label=f"target {t:.3f}")
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
