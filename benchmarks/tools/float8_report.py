"""The float8 suite's tables: bf16 against train.fp8 recipes, from the steps' own outputs.

    python benchmarks/tools/float8_report.py OUT_DIR ITEM:MODEL:RECIPE=PATH ...

ITEM is speed (PATH: a `distlm bench --json` file), loss (PATH: a run folder with metrics.csv) or
speedrun (PATH: a run folder, then @FILE holding the launch's Unix time). RECIPE "off" is the bf16
row each float8 row is compared with. A missing or failed step shows as a row of dashes. Prints the
tables (Markdown) and writes OUT_DIR/result.json (every row) and OUT_DIR/float8-table.md.
"""
from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path


def read_csv(run: Path) -> list[dict]:
    with open(run / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def speed_row(path: Path) -> dict:
    r = json.loads(path.read_text())
    return {"tokens_per_s": r["tokens_per_s"], "mfu": r.get("mfu"), "peak_mem_gb": r.get("peak_mem_gb"),
            "step_s": r["step_s"], "device": r.get("device"), "world_size": r.get("world_size")}


def loss_row(run: Path) -> dict:
    rows = read_csv(run)
    train = [(int(r["step"]), float(r["loss"])) for r in rows if r.get("loss")]
    val = [float(r["val_loss"]) for r in rows if r.get("val_loss")]
    last = train[-max(1, len(train) // 10):]  # the last tenth of the logged steps: one step's loss is noisy
    tps = [float(r["tokens_per_s"]) for r in rows if r.get("tokens_per_s")][1:]  # the first window compiles
    return {"steps": train[-1][0] if train else None, "train_loss_last_tenth": statistics.fmean(l for _, l in last)
            if last else None, "val_loss": val[-1] if val else None,
            "tokens_per_s": statistics.median(tps) if tps else None}


def speedrun_row(spec: str) -> dict:
    run, _, launch_file = spec.partition("@")
    row = loss_row(Path(run))
    rows = read_csv(Path(run))
    if launch_file and rows:
        row["seconds"] = float(rows[-1]["wall_time"]) - float(Path(launch_file).read_text().strip())
    return row


READERS = {"speed": lambda p: speed_row(Path(p)), "loss": lambda p: loss_row(Path(p)), "speedrun": speedrun_row}


def num(v, fmt: str) -> str:
    return "–" if v is None else format(v, fmt)


def tables(rows: list[dict]) -> str:
    out = []
    base = {(r["item"], r["model"]): r for r in rows if r["recipe"] == "off" and r.get("ok")}

    def ratio(r, key):
        b = base.get((r["item"], r["model"]))
        return None if not (r.get("ok") and b and b.get(key) and r.get(key)) else r[key] / b[key]

    def delta(r, key):
        b = base.get((r["item"], r["model"]))
        return None if not (r.get("ok") and b and b.get(key) is not None and r.get(key) is not None) \
            else r[key] - b[key]

    speed = [r for r in rows if r["item"] == "speed"]
    if speed:
        out += ["| model | train.fp8 | tok/s | × bf16 | MFU (bf16 peak) | peak GiB/GPU |", "|---|---|---|---|---|---|"]
        out += [f"| {r['model']} | {r['recipe']} | {num(r.get('tokens_per_s'), ',.0f')} | {num(ratio(r, 'tokens_per_s'), '.3f')} "
                f"| {num(r['mfu'] * 100 if r.get('mfu') else None, '.1f')}% | {num(r.get('peak_mem_gb'), '.1f')} |"
                for r in speed]
        out.append("")
    loss = [r for r in rows if r["item"] == "loss"]
    if loss:
        out += ["| model | train.fp8 | steps | train loss (last tenth) | val loss | Δ val vs bf16 | tok/s |",
                "|---|---|---|---|---|---|---|"]
        out += [f"| {r['model']} | {r['recipe']} | {num(r.get('steps'), 'd')} | {num(r.get('train_loss_last_tenth'), '.4f')} "
                f"| {num(r.get('val_loss'), '.4f')} | {num(delta(r, 'val_loss'), '+.4f')} "
                f"| {num(r.get('tokens_per_s'), ',.0f')} |" for r in loss]
        out.append("")
    speedrun = [r for r in rows if r["item"] == "speedrun"]
    if speedrun:
        out += ["| recipe | train.fp8 | seconds from launch | final val loss | Δ val vs bf16 | tok/s | × bf16 |",
                "|---|---|---|---|---|---|---|"]
        out += [f"| {r['model']} | {r['recipe']} | {num(r.get('seconds'), '.1f')} | {num(r.get('val_loss'), '.4f')} "
                f"| {num(delta(r, 'val_loss'), '+.4f')} | {num(r.get('tokens_per_s'), ',.0f')} "
                f"| {num(ratio(r, 'tokens_per_s'), '.3f')} |" for r in speedrun]
        out.append("")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    out_dir, rows = Path(argv[0]), []
    for spec in argv[1:]:
        key, sep, path = spec.partition("=")
        parts = key.split(":")
        if not sep or len(parts) != 3 or parts[0] not in READERS:
            print(f"error: {spec!r} is not ITEM:MODEL:RECIPE=PATH with ITEM one of {', '.join(READERS)}",
                  file=sys.stderr)
            return 2
        item, model, recipe = parts
        row = {"item": item, "model": model, "recipe": recipe, "path": path}
        try:
            row.update(READERS[item](path), ok=True)
        except (OSError, ValueError, KeyError, IndexError) as e:  # the step failed or wrote nothing
            row.update(ok=False, error=f"{type(e).__name__}: {e}")
        rows.append(row)
    text = tables(rows)
    print(text)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "float8-table.md").write_text(text + "\n")
    (out_dir / "result.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
