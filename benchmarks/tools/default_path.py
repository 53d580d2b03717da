"""The default path against the best settings, side by side on one GPU.

    python benchmarks/tools/default_path.py [--out DIR] [--before DIR] [--nanogpt DIR] [--nanogpt-batch 12,32]
        [--warmup 5] [--steps 20] [--dry-run] [--cpu]

Runs, one process each, in this order (the first pays the compilation; the rest reuse its
cache, a temporary folder outside OUT that is removed at the end):

    default          the README's command: distlm bench --config gpt2-124m-1024 data.source=synthetic
    default-before   the same command with the code in --before DIR (e.g. `git archive OLD distlm |
                     tar -x -C carry/old`), so the change is seen on the same card
    default-nan-off  the README's command with train.on_nan=off: no NaN/Inf check at all
    default-nan-off-before  the same with the code in --before DIR: the old and the new default
                     against the same command without the check, on the same card
    best             the best settings measured (docs/results/speed.md): on_nan=off, whole-model
                     compile, micro-batch 64 of a global 128, model.loss_chunk=8192
    nanogpt-bB       nanoGPT's own bench.py (--nanogpt DIR, a checkout in an ignored folder) at
                     batch B, synthetic tokens, compiled

and first a host probe per code version (``--probe``, a few seconds): the host's time per
step to make the README command's batch and queue its copies to the GPU, while the GPU is
busy, with the next batch made ahead and without. Each bench row gives tok/s, the step split
(data / forward+backward / optimizer, CUDA events) and the share of the best row. The table
goes to stdout and to OUT/default-path.md, the rows to OUT/default-path.json. --cpu runs a
tiny model on the CPU (plumbing only, measures nothing); --dry-run prints the commands.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ["bench", "--config", "gpt2-124m-1024", "data.source=synthetic"]
BEST = ["train.on_nan=off", "train.compile_scope=model", "train.micro_batch_size=64", "train.global_batch_size=128",
        "model.loss_chunk=8192"]
# --cpu: a model a 2-core box steps through in well under a second, compiled nowhere.
TINY = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.d_ff=64", "model.block_size=16",
        "train.device=cpu", "train.global_batch_size=4"]
TINY_BEST = ["train.on_nan=off", "train.micro_batch_size=4", "train.global_batch_size=8"]
# PYTHONSAFEPATH: `python -m distlm` would put the current folder ahead of PYTHONPATH, and the
# --before run would import this checkout's distlm.
ENV = {"PYTHONUNBUFFERED": "1", "PYTHONSAFEPATH": "1"}


def variants(args) -> list[tuple[str, str, list[str]]]:
    """(name, code folder, distlm arguments) of each bench, in running order."""
    tiny = TINY if args.cpu else []
    flags = ["--warmup", str(args.warmup), "--steps", str(args.steps)]
    out = [("default", str(ROOT), README + tiny + flags)]
    if args.before:
        out.append(("default-before", str(Path(args.before).resolve()), README + tiny + flags))
    out.append(("default-nan-off", str(ROOT), README + tiny + ["train.on_nan=off"] + flags))
    if args.before:
        out.append(("default-nan-off-before", str(Path(args.before).resolve()),
                    README + tiny + ["train.on_nan=off"] + flags))
    out.append(("best", str(ROOT), README + tiny + (TINY_BEST if args.cpu else BEST) + flags))
    return out


def probe(steps: int = 12) -> dict:
    """Host milliseconds per step (medians) to make the README command's batch and queue its
    copies to the device, while the device runs ~30 ms of matmuls queued just before (as it
    runs the step when the host is ahead), split into the rows (``_rank_rows``), the
    micro-batches (``split_micro_batches``, pinning included) and queuing the copies; and
    ``made ahead``: next() and the copies once ``prefetch()`` has made the batch, where the
    code has it. Imports whichever distlm PYTHONPATH names."""
    import torch
    from distlm.data.loader import BatchLoader, split_micro_batches
    from distlm.tasks.lm import SYNTHETIC_VOCAB
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    loader = BatchLoader(None, seed=1337, global_batch=64, micro_batch=64, synthetic_vocab=SYNTHETIC_VOCAB,
                         block_size=1024, pin_memory=cuda)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) if cuda else None

    def busy():
        if cuda:
            torch.cuda.synchronize()
            for _ in range(40):  # ~30 ms on an H100
                a @ a

    def copy(batch):
        return [(x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in batch]

    def at_step(step: int) -> list[float]:
        busy()
        t0 = time.perf_counter()
        rows = loader._rank_rows(step)
        t1 = time.perf_counter()
        batch = split_micro_batches(rows, loader.micro_batch, loader.pin_memory)
        t2 = time.perf_counter()
        copy(batch)
        t3 = time.perf_counter()
        return [t1 - t0, t2 - t1, t3 - t2, t3 - t0]

    def ahead(step: int) -> list[float]:
        loader.prefetch()
        busy()
        t0 = time.perf_counter()
        copy(loader.next())
        return [time.perf_counter() - t0]

    def medians(fn) -> list[float]:
        runs = [fn(k) for k in range(steps)][2:]  # the first ones warm the allocators
        if cuda:
            torch.cuda.synchronize()
        return [1e3 * sorted(col)[len(col) // 2] for col in zip(*runs)]

    rows_ms, split_ms, copy_ms, total_ms = medians(at_step)
    res = {"made at the step": {"total": total_ms, "rows": rows_ms, "split and pin": split_ms, "queue copies": copy_ms}}
    if hasattr(loader, "prefetch"):
        res["made ahead"] = {"total": medians(ahead)[0]}
    import distlm
    return {"distlm": distlm.__file__, "device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(), "host_ms_median": res}


def run(cmd: list[str], code: str, log: Path, timeout: int, env: dict) -> tuple[int, str]:
    full_env = {**os.environ, **ENV, **env, "PYTHONPATH": code}
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        f.write(" ".join(cmd) + f"\n# PYTHONPATH={code}\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=full_env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, log.read_text()


def nanogpt_row(text: str, batch: int) -> dict | None:
    m = re.search(r"time per iteration: ([0-9.]+)ms, MFU: ([0-9.]+)%", text)
    if not m:
        return None
    step_s = float(m.group(1)) / 1e3
    return {"tokens_per_s": batch * 1024 / step_s, "step_s": step_s, "nanogpt_mfu": float(m.group(2)) / 100}


def table(rows: list[dict]) -> str:
    best = max((r["tokens_per_s"] for r in rows if r.get("tokens_per_s")), default=0)
    ref = next((r["tokens_per_s"] for r in rows if r["name"] == "best" and r.get("tokens_per_s")), best)
    lines = ["| run | tok/s | vs best | step ms | data ms | fwd+bwd ms | optimizer ms | MFU % | batch (global/micro) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r.get("tokens_per_s"):
            lines.append(f"| {r['name']} | failed (rc {r.get('rc')}, see {r.get('log')}) |||||||")
            continue
        ph = r.get("phases_s") or {}
        ms = lambda k: f"{1e3 * ph[k]:.1f}" if k in ph else "–"
        mfu = r.get("mfu") or r.get("nanogpt_mfu")
        lines.append(f"| {r['name']} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / ref:.3f} | "
                     f"{1e3 * r['step_s']:.1f} | {ms('data')} | {ms('forward_backward')} | {ms('optimizer')} | "
                     f"{'–' if mfu is None else f'{100 * mfu:.1f}'} | "
                     f"{r.get('global_batch_size', '–')}/{r.get('micro_batch_size', '–')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench-out/default-path", help="folder for the logs and results")
    p.add_argument("--before", metavar="DIR", help="also run the README command with the code in DIR")
    p.add_argument("--nanogpt", metavar="DIR", help="also run nanoGPT's bench.py from this checkout")
    p.add_argument("--nanogpt-batch", default="32", help="nanoGPT bench.py batch sizes, e.g. 12,32")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--timeout", type=int, default=300, help="seconds per process")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--cpu", action="store_true", help="a tiny model on the CPU: the plumbing, no measurement")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # the host probe, in its own process
    args = p.parse_args(argv)
    if args.probe:
        print(json.dumps(probe()))
        return 0
    if args.cpu:
        args.warmup, args.steps = min(args.warmup, 1), min(args.steps, 2)
    out = Path(args.out).resolve()
    codes = [("new", str(ROOT))] + ([("before", str(Path(args.before).resolve()))] if args.before else [])
    plan = [(f"probe-{tag}", code, [args.python, str(Path(__file__).resolve()), "--probe"]) for tag, code in codes]
    plan += [(name, code, [args.python, "-m", "distlm", *cmd, "--json", str(out / f"{name}.json")])
             for name, code, cmd in variants(args)]
    if args.nanogpt:
        for b in (int(x) for x in args.nanogpt_batch.split(",")):
            plan.append((f"nanogpt-b{b}", str(Path(args.nanogpt).resolve()),
                         ["bash", "-c", 'cd "$0" && exec "$1" bench.py --real_data=False --compile=True '
                          f'--batch_size={b} --block_size=1024', str(Path(args.nanogpt).resolve()), args.python]))
    if args.dry_run:
        for name, code, cmd in plan:
            print(f"{name}: PYTHONPATH={code} {' '.join(cmd)}")
        return 0
    cache = tempfile.mkdtemp(prefix="default-path-inductor-")  # not under OUT: it would be fetched back with it
    env = {"TORCHINDUCTOR_CACHE_DIR": cache}
    try:
        rows, probes = measure(plan, out, env, args)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    text = table(rows)
    for name, pr in probes.items():
        text += f"\n\n{name}: " + json.dumps(pr)
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "default-path.md").write_text(text + "\n")
    (out / "default-path.json").write_text(json.dumps({"rows": rows, "probes": probes}, indent=1))
    print(f"wrote {out / 'default-path.md'} and .json")
    return 0 if rows and all(r["rc"] == 0 for r in rows) else 1


def measure(plan, out: Path, env: dict, args) -> tuple[list[dict], dict]:
    rows, probes = [], {}
    for name, code, cmd in plan:
        if name.startswith("nanogpt") and args.cpu:
            print(f"{name}: skipped (nanoGPT's bench.py needs CUDA)")
            continue
        t0 = time.perf_counter()
        rc, text = run(cmd, code, out / f"{name}.log", args.timeout, env)
        wall = time.perf_counter() - t0
        print(f"{name}: rc {rc}, {wall:.0f} s, log {out / f'{name}.log'}", flush=True)
        if name.startswith("probe"):
            line = text.strip().splitlines()[-1] if text.strip() else ""
            probes[name] = json.loads(line) if rc == 0 and line.startswith("{") else {"rc": rc}
            continue
        row = {"name": name, "rc": rc, "wall_s": wall, "log": str(out / f"{name}.log"), "command": " ".join(cmd),
               "code": code}
        if name.startswith("nanogpt"):
            row.update(nanogpt_row(text, int(name.split("-b")[1])) or {})
        elif rc == 0 and (out / f"{name}.json").is_file():
            r = json.loads((out / f"{name}.json").read_text())
            row.update({k: r[k] for k in ("tokens_per_s", "step_s", "phases_s", "mfu", "global_batch_size",
                                          "micro_batch_size", "compile", "compile_scope", "loss_chunk", "device",
                                          "torch", "peak_mem_gb")})
            row["fast_defaults"] = next((l for l in text.splitlines() if l.startswith("fast defaults")), None)
        rows.append(row)
    return rows, probes


if __name__ == "__main__":
    sys.exit(main())
