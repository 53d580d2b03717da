"""Where the seconds before the first step go, cold and warm, on 1 and N GPUs.

    python benchmarks/tools/startup.py [--config speedrun-124m] [--gpus 1,4] [--out DIR] [--cpu] [-- OVERRIDES]

For each GPU count, `distlm train` (torchrun above one GPU, DDP) runs 3 steps on synthetic tokens
twice with one compile-cache folder (train.compile_cache): first from an empty one (cold), then
again on what the first left (warm). From each log it takes the set-up line (its phases, and
the seconds since the process started, so what came before the Trainer: imports, CUDA's
libraries, the config) and the line after the first step (how long the first step took after
set-up, compilation included, and what it loaded from the cache). Writes OUT/startup.md and
startup.json, one row per (GPUs, cold or warm): before set-up, each set-up phase, the first
step, and the total from process start to the end of the first step. --cpu runs a tiny model
on the CPU (inductor's C++ backend): the plumbing, not figures.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SETUP = re.compile(r"^set-up ([0-9.]+) s \((.*)\); ([0-9.]+) s since the process started", re.M)
FIRST = re.compile(r"^first step ([0-9.]+) s after set-up, compilation included; compile cache ([a-z ]+): "
                   r"(\d+) graphs loaded, (\d+) compiled", re.M)
CPU = ["model.n_layer=2", "model.d_model=64", "model.n_head=2", "model.d_ff=128", "model.block_size=32",
       "model.vocab_size=256", "model.value_embeds=1", "train.device=cpu", "train.compile=true",
       "train.global_batch_size=4", "train.micro_batch_size=2", "model.loss_chunk=0"]


def parse(log: str) -> dict | None:
    """The start-up figures of one distlm train log (None when it has no set-up line)."""
    setup, first = SETUP.search(log), FIRST.search(log)
    if setup is None:
        return None
    phases = {name: float(v) for name, v in re.findall(r"([a-z][a-z -]+?) (\d+\.\d)(?=,|$)", setup.group(2))}
    row = {"setup_s": float(setup.group(1)), "phases": phases, "since_start_s": float(setup.group(3)),
           "before_setup_s": round(float(setup.group(3)) - float(setup.group(1)), 1)}
    if first:
        row.update(first_step_s=float(first.group(1)), cache=first.group(2), loaded=int(first.group(3)),
                   compiled=int(first.group(4)),
                   to_first_step_s=round(float(setup.group(3)) + float(first.group(1)), 1))
    return row


def table(rows: list[dict]) -> str:
    names = list(dict.fromkeys(n for r in rows for n in r["phases"]))
    head = ["GPUs", "cache", "before set-up (imports, CUDA libraries, config)", *names, "set-up total",
            "first step (compilation)", "process start to the end of step 1", "graphs loaded / compiled"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["gpus"]), r["run"], f"{r['before_setup_s']:.1f}", *(f"{r['phases'].get(n, 0):.1f}" for n in names),
                 f"{r['setup_s']:.1f}", f"{r.get('first_step_s', float('nan')):.1f}",
                 f"{r.get('to_first_step_s', float('nan')):.1f}", f"{r.get('loaded', '-')} / {r.get('compiled', '-')}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="startup.py", description=__doc__.strip().splitlines()[0])
    p.add_argument("--config", default="speedrun-124m")
    p.add_argument("--gpus", default="1", help="comma-separated GPU counts, e.g. 1,4")
    p.add_argument("--out", default="bench-out/startup")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--cpu", action="store_true", help="a tiny model on the CPU (checks the plumbing)")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    rows, failed = [], 0
    for gpus in (int(g) for g in args.gpus.split(",")):
        cache = out / f"cache-{gpus}"
        shutil.rmtree(cache, ignore_errors=True)  # the cold run starts from nothing
        for run in ("cold", "warm"):
            name = f"{gpus}gpu-{run}"
            shutil.rmtree(out / "runs" / name, ignore_errors=True)
            train = ["train", "--config", args.config, "data.source=synthetic", "train.max_steps=3",
                     "train.eval_every=0", "train.checkpoint_every=0", "log.progress=false", "log.tensorboard=false",
                     "log.samples=0", f"train.compile_cache={cache}", f"log.root={out / 'runs'}", f"log.name={name}",
                     *([f"parallel.dp_replicate={gpus}"] if gpus > 1 else []), *(CPU if args.cpu else []), *extra]
            launch = [args.python, "-m", "distlm"] if gpus == 1 else [
                args.python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}", "-m", "distlm"]
            t = time.time()
            proc = subprocess.run([*launch, *train], cwd=ROOT, env=env, capture_output=True, text=True)
            (out / f"log-{name}.txt").write_text(proc.stdout + proc.stderr)
            row = parse(proc.stdout)
            if proc.returncode or row is None:
                print(f"{name}: exit {proc.returncode}; see {out / f'log-{name}.txt'}")
                failed += 1
                continue
            rows.append({"gpus": gpus, "run": run, "wall_s": round(time.time() - t, 1), **row})
            print(f"{name}: {row.get('to_first_step_s')} s to the end of step 1 ({row.get('cache')})", flush=True)
    if rows:
        (out / "startup.json").write_text(json.dumps(rows, indent=1) + "\n")
        (out / "startup.md").write_text(table(rows))
        print(table(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
