"""`distlm bench --pp-sweep 1,2,4,8`: the pipeline bubble against the microbatch count.

    torchrun --nproc_per_node 4 -m distlm bench --config gpt2-355m parallel.pp=4 --pp-sweep 1,2,4,8,16

Runs the same step under the naive mode (layers spread over the ranks, the local batch
as one piece, so only one rank works at a time), GPipe and 1F1B, for each microbatch
count m, in one launch. The bubble is measured against the naive time: a perfect
pipeline would take t_naive / pp, so bubble(m) = 1 - (t_naive / pp) / t(m). Theory for
GPipe and 1F1B: (pp - 1) / (m + pp - 1); naive: (pp - 1) / pp.
"""
from __future__ import annotations

import json
from pathlib import Path

from distlm.config import updated

SCHEDULES = ("naive", "gpipe", "1f1b")


def theory(pp: int, m: int, schedule: str) -> float:
    return (pp - 1) / pp if schedule == "naive" else (pp - 1) / (m + pp - 1)


def run_sweep(cfg, counts: list[int], warmup: int, steps: int) -> list[dict]:
    """Collective: every rank runs every configuration. Returns rows (rank 0's view)."""
    from distlm.bench.throughput import run_bench
    pp = cfg.parallel.pp
    dp = cfg.parallel.dp_replicate * cfg.parallel.dp_shard
    local = cfg.train.global_batch_size // dp
    rows, naive_s = [], None
    for schedule in SCHEDULES:
        for m in ([1] if schedule == "naive" else counts):
            if local % m or (schedule == "1f1b" and m < pp):  # 1F1B needs a microbatch per stage at least
                continue
            c = updated(cfg, parallel={"pp_schedule": schedule, "pp_microbatches": m},
                        train={"micro_batch_size": local // m}, log={"name": f"{cfg.log.name}-{schedule}-m{m}"})
            r = run_bench(c, warmup, steps, comm_probe=False)
            if schedule == "naive":
                naive_s = r["step_s"]
            rows.append({"schedule": schedule, "microbatches": m, "step_ms": 1e3 * r["step_s"],
                         "tokens_per_s": r["tokens_per_s"], "peak_mem_gb": r["peak_mem_gb"],
                         "bubble_measured": 1 - (naive_s / pp) / r["step_s"] if naive_s else None,
                         "bubble_theory": theory(pp, m, schedule), "device": r["device"], "pp": pp})
    return rows


def write_report(rows: list[dict], out_dir: Path) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = ["| schedule | microbatches | step ms | tok/s | bubble measured | bubble theory | peak mem GB |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        mem = "n/a" if r["peak_mem_gb"] is None else f"{r['peak_mem_gb']:.2f}"
        lines.append(f"| {r['schedule']} | {r['microbatches']} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['bubble_measured']:.0%} | {r['bubble_theory']:.0%} | {mem} |")
    text = "\n".join(lines)
    (out_dir / "pp-sweep.md").write_text(text + "\n")
    (out_dir / "pp-sweep.json").write_text(json.dumps(rows, indent=1))
    _plot(rows, out_dir / "pp-sweep.png")
    return text


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    naive = [r for r in rows if r["schedule"] == "naive"]
    counts = sorted({r["microbatches"] for r in rows if r["schedule"] != "naive"})
    for s in SCHEDULES[1:]:
        pts = [r for r in rows if r["schedule"] == s]
        ax.plot([r["microbatches"] for r in pts], [r["step_ms"] for r in pts], marker="o", label=s)
    if naive and counts:
        ax.plot(counts, [naive[0]["step_ms"]] * len(counts), "k--", label="naive (1 microbatch)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("microbatches per step")
    ax.set_ylabel("step time (ms)")
    pp = rows[0]["pp"] if rows else "?"
    ax.set_title(f"pipeline over {pp} ranks ({rows[0]['device'] if rows else ''})")
    ax.legend()
    fig.tight_layout()
    from distlm.report.plot import save_figure
    save_figure(fig, path, dpi=110)
