"""`distlm bench --scaling 1,2,4`: the same config at each world size, then a report.

Each world size is its own `torchrun --standalone` launch of `distlm bench`, so the
numbers are exactly what a user's launch would see. Weak scaling keeps the per-GPU
batch (global batch grows with N); strong scaling keeps the global batch.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ADVICE_THRESHOLD = 0.70


def launch(n: int, config: str | None, overrides: list[str], axis: str, global_batch: int | None,
           warmup: int, steps: int, allow_cpu: bool = False) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"distlm-scaling-{n}-")) / "bench.json"
    args = [] if not config else ["--config", config]
    extra = [f"parallel.{axis}={n}"] + ([f"train.global_batch_size={global_batch}"] if global_batch else [])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", "-m", "distlm",
           "bench", *args, "--warmup", str(warmup), "--steps", str(steps), "--json", str(out),
           *(["--allow-cpu"] if allow_cpu else []), *overrides, *extra]
    env = {**os.environ, "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0")}
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"bench at {n} GPUs failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return json.loads(out.read_text())


def amdahl_serial_fraction(ns: list[int], speedups: list[float]) -> float:
    """Least-squares s in S(n) = 1 / (s + (1 - s) / n), by a fine grid (robust, no scipy)."""
    best, best_err = 0.0, float("inf")
    for i in range(10001):
        s = i / 10000
        err = sum((1 / (s + (1 - s) / n) - sp) ** 2 for n, sp in zip(ns, speedups))
        if err < best_err:
            best, best_err = s, err
    return best


def analyse(results: list[dict], mode: str) -> list[dict]:
    base = results[0]
    rows = []
    for r in results:
        n = r["world_size"] / base["world_size"]
        speedup = r["tokens_per_s"] / base["tokens_per_s"]
        rows.append({
            "gpus": r["world_size"], "tokens_per_s": r["tokens_per_s"], "per_gpu": r["tokens_per_s_per_gpu"],
            "step_ms": 1e3 * r["step_s"], "speedup": speedup,
            # weak: per-GPU throughput kept; strong: time-to-solution speedup per GPU added
            "weak_eff": r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"] if mode == "weak" else None,
            "strong_eff": speedup / n if mode == "strong" else None,
            "mem_gb": r["peak_mem_gb"], "exposed_ms": r["exposed_comm_s"] and 1e3 * r["exposed_comm_s"],
            "R": r["compute_comm_ratio"], "global_batch": r["global_batch_size"], "micro": r["micro_batch_size"],
            "device": r["device"],
            # classify runs: time per epoch of the training split (an epoch is steps_per_epoch steps)
            "epoch_s": r.get("epoch_s"), "examples_per_s": r.get("examples_per_s"),
        })
    return rows


def advice(rows: list[dict], axis: str) -> list[str]:
    notes = []
    for row in rows[1:]:
        eff = row["weak_eff"] if row["weak_eff"] is not None else row["strong_eff"]
        if row["speedup"] >= 1.0 and eff >= ADVICE_THRESHOLD:
            continue
        why = (f"{row['gpus']} GPUs: speedup {row['speedup']:.2f}x, efficiency {100 * eff:.0f}%. ")
        if row["exposed_ms"] is not None:
            share = row["exposed_ms"] / row["step_ms"]
            why += (f"Exposed communication is {row['exposed_ms']:.1f} ms of a {row['step_ms']:.1f} ms step "
                    f"({100 * share:.0f}%), compute/comm R = {row['R'] or 0:.1f}. ")
            if share >= 0.15:  # more than a seventh of each step waits on gradients
                why += ("The model is too small for its gradient all-reduce: each step computes too little to hide "
                        "the communication. Try: a larger micro-batch per GPU (train.micro_batch_size), gradient "
                        "accumulation (a larger train.global_batch_size: one all-reduce per several micro-steps), "
                        "a larger DDP bucket (parallel.ddp_bucket_mb) so fewer all-reduce calls, a larger model, "
                        "or fewer GPUs.")
            else:
                why += ("Little communication is exposed: look at data wait, per-step overhead (launch, Python) "
                        "and compute that slows under the data-parallel wrapper.")
        else:
            why += "No communication probe ran; rerun with the probe on."
        if axis == "dp_shard":
            why += " FSDP adds all-gathers in the forward pass; at this size DDP (parallel.dp_replicate) may do better."
        notes.append(why)
    return notes


def markdown(rows: list[dict], mode: str, serial: float, notes: list[str]) -> str:
    def f(v, spec):
        return "n/a" if v is None else format(v, spec)

    def pct(v):
        return "n/a" if v is None else f"{100 * v:.1f}%"
    lines = [f"{mode} scaling on {rows[0]['device']}; Amdahl serial fraction s = {serial:.3f}", "",
             "| GPUs | global/micro batch | tok/s | tok/s/GPU | step ms | speedup | weak eff | strong eff | "
             "mem GiB/GPU | exposed comm ms | R = T_comp/T_comm |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['gpus']} | {r['global_batch']}/{r['micro']} | {r['tokens_per_s']:,.0f} | "
                     f"{r['per_gpu']:,.0f} | {r['step_ms']:.1f} | {r['speedup']:.2f} | "
                     f"{pct(r['weak_eff'])} | {pct(r['strong_eff'])} | {f(r['mem_gb'], '.1f')} | "
                     f"{f(r['exposed_ms'], '.1f')} | {f(r['R'], '.1f')} |")
    if any(r.get("epoch_s") is not None for r in rows):  # classify runs: two more columns
        lines[2] += " examples/s | epoch s |"
        lines[3] += "---|---|"
        for i, r in enumerate(rows):
            lines[4 + i] += f" {f(r.get('examples_per_s'), ',.0f')} | {f(r.get('epoch_s'), '.2f')} |"
    if notes:
        lines += ["", "Advisor:"] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], out: Path, mode: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    g = [r["gpus"] for r in rows]
    epochs = all(r.get("epoch_s") for r in rows)  # classify runs: a third panel, time per epoch
    fig, axes = plt.subplots(1, 3 if epochs else 2, figsize=(13.5 if epochs else 9, 3.6), dpi=110)
    a, b = axes[0], axes[1]
    a.plot(g, [r["tokens_per_s"] for r in rows], "o-", label="measured")
    a.plot(g, [rows[0]["tokens_per_s"] * n / g[0] for n in g], "--", color="gray", label="linear")
    a.set(xlabel="GPUs", ylabel="tokens/s", title="throughput")
    a.legend()
    eff = [(r["weak_eff"] if r["weak_eff"] is not None else r["strong_eff"]) * 100 for r in rows]
    b.plot(g, eff, "o-")
    b.axhline(100, color="gray", ls="--")
    b.set(xlabel="GPUs", ylabel="%", title=f"{mode}-scaling efficiency", ylim=(0, 110))
    if epochs:
        axes[2].plot(g, [r["epoch_s"] for r in rows], "o-", label="measured")
        axes[2].plot(g, [rows[0]["epoch_s"] * g[0] / n for n in g], "--", color="gray", label="linear")
        axes[2].set(xlabel="GPUs", ylabel="s", title="time per epoch")
        axes[2].legend()
    for ax in axes:
        ax.set_xticks(g)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    from distlm.report.plot import save_figure
    save_figure(fig, out)


def run_scaling(sizes: list[int], config, overrides, axis: str, mode: str, warmup: int, steps: int,
                out_dir: Path, allow_cpu: bool = False) -> str:
    from distlm.config import load_config
    base_gbs = load_config(config, overrides).train.global_batch_size
    results = []
    for n in sizes:
        gbs = base_gbs * n // sizes[0] if mode == "weak" else base_gbs
        print(f"scaling: {n} process(es), global batch {gbs} ...", flush=True)
        results.append(launch(n, config, overrides, axis, gbs, warmup, steps, allow_cpu))
    rows = analyse(results, mode)
    serial = amdahl_serial_fraction([r["gpus"] / rows[0]["gpus"] for r in rows], [r["speedup"] for r in rows])
    notes = advice(rows, axis)
    text = markdown(rows, mode, serial, notes)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"scaling-{mode}.md").write_text(text)
    (out_dir / f"scaling-{mode}.json").write_text(json.dumps({"rows": rows, "raw": results, "serial": serial}, indent=1))
    plot(rows, out_dir / f"scaling-{mode}.png", mode)
    return text
