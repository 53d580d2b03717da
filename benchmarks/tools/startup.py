"""Where the seconds before the first step go, cold and warm, on 1 and N GPUs, for this code and,
in the same run, for another copy of distlm (the code before a change).

    python benchmarks/tools/startup.py [--config speedrun-124m] [--gpus 1,4] [--out DIR] [--cpu]
                                       [--old DIR] [--repeat N] [--importtime] [--distlm-launch]
                                       [-- OVERRIDES]

For each GPU count, `distlm train` (torchrun above one GPU, DDP) runs 3 steps on synthetic tokens
twice with one cache folder (TORCHINDUCTOR_CACHE_DIR and DISTLM_CACHE_DIR: compiled graphs, and the
imports' bytecode where the installation keeps none): first from an empty one (cold), then
again on what the first left (warm). With --old DIR (a folder holding another copy of the
`distlm` package, e.g. `git archive main distlm | tar -x -C DIR`), that copy runs the same pair
right before this one, with a cache folder of its own, so both see the same machine at the same
moment; --repeat N does the whole round N times.

From each log it takes the set-up line (its phases, what ran beside them, and the seconds since
the process started, so what came before the Trainer: interpreter, imports, CUDA's libraries, the
config) and the line after the first step (how long the first step took after set-up,
compilation included, what it loaded from the cache, and where the compiler's seconds went).
Writes OUT/startup.md and startup.json, one row per (code, GPUs, cold or warm): before set-up,
each set-up phase, the first step, and the total from process start to the end of the first
step; then the total from the launch (step 1's row in the run's metrics.csv, against the clock
read just before the command started), and the difference: the seconds before distlm's process
started at all, which above one GPU is torchrun's own start (its interpreter and torch's import)
before it starts the ranks. --importtime runs each code once more, warm on one GPU, under
`python -X importtime` and adds the slowest top-level imports to startup.md. --distlm-launch adds,
above one GPU, this code launched as `distlm train --nproc-per-node N` (torchrun's entry point run in
a distlm process, so its own import of torch reads the kept bytecode: distlm/launch/local.py). --cpu
runs a tiny model on the CPU (inductor's C++ backend): the plumbing, not figures.
"""
from __future__ import annotations

import argparse
import csv
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
SPLIT = re.compile(r"in the compiler ([0-9.]+) s \(tracing ([0-9.]+), loading from the cache ([0-9.]+), "
                   r"compiling ([0-9.]+)\), the rest ([0-9.]+) s")
PHASE = re.compile(r"([a-z][a-z -]+?) (\d+\.\d)(?=,|$)")
BESIDE = re.compile(r"([a-z][a-z -]+?) (\d+\.\d) s in the background")
END = re.compile(r"^end of run [0-9.]+ s \((.*)\)", re.M)  # the Trainer's line of the end's phases
DISTLM_LAUNCH = "this, distlm launch"  # `distlm train --nproc-per-node N` instead of torchrun
CPU = ["model.n_layer=2", "model.d_model=64", "model.n_head=2", "model.d_ff=128", "model.block_size=32",
       "model.vocab_size=256", "model.value_embeds=1", "train.device=cpu", "train.compile=true",
       "train.global_batch_size=4", "train.micro_batch_size=2", "model.loss_chunk=0"]


def parse(log: str) -> dict | None:
    """The start-up figures of one distlm train log (None when it has no set-up line)."""
    setup, first = SETUP.search(log), FIRST.search(log)
    if setup is None:
        return None
    phases, _, beside = setup.group(2).partition("; beside them: ")
    row = {"setup_s": float(setup.group(1)), "phases": {n: float(v) for n, v in PHASE.findall(phases)},
           "background": {n: float(v) for n, v in BESIDE.findall(beside)},
           "since_start_s": float(setup.group(3)),
           "before_setup_s": round(float(setup.group(3)) - float(setup.group(1)), 1)}
    if first:
        row.update(first_step_s=float(first.group(1)), cache=first.group(2), loaded=int(first.group(3)),
                   compiled=int(first.group(4)),
                   to_first_step_s=round(float(setup.group(3)) + float(first.group(1)), 1))
        split = SPLIT.search(log[first.start():])
        if split:
            row["compiler"] = dict(zip(("total", "tracing", "loading", "compiling", "rest"),
                                       map(float, split.groups())))
    return row


def launch_env(environ: dict, code: Path, cache: Path) -> dict:
    """The environment of one run: the copy of distlm in ``code`` first on the path, and every cache
    in ``cache``: TORCHINDUCTOR_CACHE_DIR puts torch.compile's there, DISTLM_CACHE_DIR the imports'
    bytecode where the installation keeps none (distlm/bytecode.py), so a cold run starts without
    either. The caller's own cache settings are dropped, or a cold run could be warm."""
    drop = ("TORCHINDUCTOR_CACHE_DIR", "PYTHONPATH", "PYTHONPYCACHEPREFIX", "DISTLM_BYTECODE_CACHE")
    return {**{k: v for k, v in environ.items() if k not in drop}, "PYTHONPATH": str(code),
            "TORCHINDUCTOR_CACHE_DIR": str(cache), "DISTLM_CACHE_DIR": str(cache)}


def launch_to_step1(run_dir: Path, launched: float) -> float | None:
    """Seconds from ``launched`` (time.time() just before the command) to the end of step 1, by
    the wall clock of step 1's row in metrics.csv (the Trainer always writes that row)."""
    try:
        with open(run_dir / "metrics.csv", newline="") as f:
            row = next((r for r in csv.DictReader(f) if r.get("step") == "1"), None)
    except OSError:
        return None
    return round(float(row["wall_time"]) - launched, 1) if row and row.get("wall_time") else None


def last_row_time(run_dir: Path) -> float | None:
    """The wall clock of the run's last training row in metrics.csv (its last step, with that
    step's evaluation if it had one): what follows it to the process's end is the end of the
    run (final checkpoint, plot, the interpreter's exit)."""
    try:
        with open(run_dir / "metrics.csv", newline="") as f:
            rows = [r for r in csv.DictReader(f) if r.get("wall_time") and r.get("tokens_per_s")]
    except OSError:
        return None
    return float(rows[-1]["wall_time"]) if rows else None


def table(rows: list[dict]) -> str:
    names = list(dict.fromkeys(n for r in rows for n in r["phases"]))
    beside = list(dict.fromkeys(n for r in rows for n in r.get("background", {})))
    head = ["code", "GPUs", "cache", "before set-up (interpreter, imports, CUDA libraries, config)", *names,
            *(f"beside the phases: {n}" for n in beside), "set-up total", "first step (compilation)",
            "of it in the compiler: tracing / loading / compiling", "process start to the end of step 1",
            "launch to the end of step 1", "of it before the process (launcher)", "graphs loaded / compiled",
            "last step to process end", "process total"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        c = r.get("compiler")
        cells = [r.get("code", "this"), str(r["gpus"]), r["run"], f"{r['before_setup_s']:.1f}",
                 *(f"{r['phases'][n]:.1f}" if n in r["phases"] else "-" for n in names),
                 *(f"{r['background'][n]:.1f}" if n in r.get("background", {}) else "-" for n in beside),
                 f"{r['setup_s']:.1f}", f"{r.get('first_step_s', float('nan')):.1f}",
                 f"{c['total']:.1f}: {c['tracing']:.1f} / {c['loading']:.1f} / {c['compiling']:.1f}" if c else "-",
                 f"{r.get('to_first_step_s', float('nan')):.1f}", _seconds(r.get("from_launch_s")),
                 _seconds(r.get("launcher_s")), f"{r.get('loaded', '-')} / {r.get('compiled', '-')}",
                 _seconds(r.get("end_of_run_s")), _seconds(r.get("wall_s"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def slowest_imports(stderr: str, top: int = 15) -> list[tuple[str, float]]:
    """The top-level imports of a `python -X importtime` run (cumulative seconds, slowest first)."""
    rows = re.findall(r"^import time:\s+\d+ \|\s+(\d+) \| (\S.*)$", stderr, re.M)  # one space: top level
    return sorted(((name, int(us) / 1e6) for us, name in rows), key=lambda r: -r[1])[:top]


def main(argv: list[str]) -> int:
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="startup.py", description=__doc__.strip().splitlines()[0])
    p.add_argument("--config", default="speedrun-124m")
    p.add_argument("--gpus", default="1", help="comma-separated GPU counts, e.g. 1,4")
    p.add_argument("--out", default="bench-out/startup")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--old", help="a folder holding another copy of the distlm package, run beside this one")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=DIR[:KEY=VALUE,...]",
                   help="one more code to run beside this one: DIR holds its distlm package ('.' for this "
                        "checkout), each KEY=VALUE is set in its environment, or with a dot in KEY given as "
                        "a config override (e.g. start-up devices switched off one at a time); repeatable")
    p.add_argument("--kinds", default="cold,warm", help="which runs of each code: cold, warm or both")
    p.add_argument("--repeat", type=int, default=1, help="rounds of (old, this) x (cold, warm)")
    p.add_argument("--importtime", action="store_true", help="each code once more under python -X importtime")
    p.add_argument("--cpu", action="store_true", help="a tiny model on the CPU (checks the plumbing)")
    p.add_argument("--distlm-launch", action="store_true",
                   help="above one GPU, this code also as `distlm train --nproc-per-node N` (row 'this, distlm launch')")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    codes = {"this": ROOT}
    if args.old:
        old = Path(args.old).resolve()
        if not (old / "distlm" / "__main__.py").is_file():
            print(f"--old {args.old}: no distlm/__main__.py there (pass the folder that holds the distlm package)")
            return 2
        codes = {"old": old, "this": ROOT}
    if args.distlm_launch:
        codes[DISTLM_LAUNCH] = ROOT
    settings: dict[str, tuple[dict, list]] = {}  # a variant's environment and config overrides
    for spec in args.variant:
        name, _, rest = spec.partition("=")
        folder, _, pairs = rest.partition(":")
        code = ROOT if folder in ("", ".") else Path(folder).resolve()
        if not name or not (code / "distlm" / "__main__.py").is_file():
            print(f"--variant {spec}: expected NAME=DIR with DIR holding a distlm package")
            return 2
        codes[name] = code
        env, overrides = {}, []
        for pair in filter(None, pairs.split(",")):
            key, _, value = pair.partition("=")
            (overrides.append(pair) if "." in key else env.__setitem__(key, value))
        settings[name] = (env, overrides)
    rows, failed, imports = [], 0, {}

    def train_args(gpus: int, name: str) -> list[str]:
        return ["train", "--config", args.config, "data.source=synthetic", "train.max_steps=3",
                "train.eval_every=0", "train.checkpoint_every=0", "log.progress=false", "log.tensorboard=false",
                "log.samples=0", f"log.root={out / 'runs'}", f"log.name={name}",
                *([f"parallel.dp_replicate={gpus}"] if gpus > 1 else []), *(CPU if args.cpu else []), *extra]

    def run(code: str, gpus: int, cache: Path, name: str, python_flags: tuple[str, ...] = ()):
        # The working folder is OUT, not a checkout: `python -m` puts it first on sys.path, and
        # the copy named by PYTHONPATH must be the one that runs.
        env = {**launch_env(os.environ, codes[code], cache), **settings.get(code, ({}, []))[0]}
        launch = [args.python, *python_flags, "-m", "distlm"] if gpus == 1 or code == DISTLM_LAUNCH else [
            args.python, *python_flags, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
            "-m", "distlm"]
        nproc = [f"--nproc-per-node={gpus}"] if gpus > 1 and code == DISTLM_LAUNCH else []
        shutil.rmtree(out / "runs" / name, ignore_errors=True)
        return subprocess.run([*launch, *train_args(gpus, name), *settings.get(code, ({}, []))[1], *nproc],
                              cwd=out, env=env,
                              capture_output=True, text=True)

    for rep in range(args.repeat):
        for gpus in (int(g) for g in args.gpus.split(",")):
            for code in codes:
                if code == DISTLM_LAUNCH and gpus == 1:
                    continue  # one process: no launcher either way
                cache = out / f"cache-{code.replace(', ', '-').replace(' ', '-')}-{gpus}"
                shutil.rmtree(cache, ignore_errors=True)  # the cold run starts from nothing
                for kind in (k for k in ("cold", "warm") if k in args.kinds.split(",")):
                    name = f"{code.replace(', ', '-').replace(' ', '-')}-{gpus}gpu-{kind}-{rep}"
                    t = time.time()
                    proc = run(code, gpus, cache, name)
                    (out / f"log-{name}.txt").write_text(proc.stdout + proc.stderr)
                    row = parse(proc.stdout)
                    if proc.returncode or row is None:
                        print(f"{name}: exit {proc.returncode}; see {out / f'log-{name}.txt'}")
                        failed += 1
                        continue
                    from_launch = launch_to_step1(out / "runs" / name, t)
                    if from_launch is not None and "to_first_step_s" in row:
                        row.update(from_launch_s=from_launch,
                                   launcher_s=round(from_launch - row["to_first_step_s"], 1))
                    ended = time.time()
                    last = last_row_time(out / "runs" / name)
                    rows.append({"code": code, "gpus": gpus, "run": kind, "round": rep,
                                 "wall_s": round(ended - t, 1), **row,
                                 "end_of_run_s": None if last is None else round(ended - last, 1),
                                 "end_line": END.findall(proc.stdout)[-1:] or None})
                    print(f"{name}: {row.get('to_first_step_s')} s to the end of step 1 ({row.get('cache')})",
                          flush=True)
    if args.importtime:
        for code in (c for c in codes if c != DISTLM_LAUNCH):
            proc = run(code, 1, out / f"cache-{code}-1", f"{code}-importtime", ("-X", "importtime"))
            imports[code] = slowest_imports(proc.stderr)
    if rows or imports:
        (out / "startup.json").write_text(json.dumps({"rows": rows, "imports": imports}, indent=1) + "\n")
        text = table(rows) if rows else ""
        for code, top in imports.items():
            text += f"\nslowest top-level imports ({code}, warm, 1 process): " + \
                ", ".join(f"{name} {s:.2f} s" for name, s in top) + "\n"
        (out / "startup.md").write_text(text)
        print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
