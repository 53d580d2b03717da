"""Run one benchmark suite and record every result with where and how it was measured.

    python benchmarks/run.py SUITE [--gpus N] [--out DIR] [--dry-run] [--cpu] [suite options]
    python benchmarks/run.py --list

SUITE is one of throughput, scaling, time-to-loss, layouts, prepare, multi-node, float8, memory, context
(`python benchmarks/run.py SUITE --help` gives each one's options). Every step a suite plans is
run in turn, from the repository root, with this checkout's distlm first on PYTHONPATH. Each
step gets a folder OUT/SUITE/<UTC time>-<step>/ holding command.txt, log.txt and whatever the
step writes (bench JSON, profiles, tables), and one line is appended to OUT/results.jsonl:

    suite, step, date (UTC), card (nvidia-smi's name and count, or the CPU model), torch,
    commit (git, with "+dirty" when distlm/ has uncommitted changes), sources (sha1 of distlm's
    .py files in sorted order, the first 12 hex digits: what identifies the code where .git is
    absent or stale), the exact command and environment, exit status, wall seconds, and the
    step's JSON result when it wrote one.

--dry-run prints the commands and runs nothing. --cpu shrinks every step to a tiny model on the
CPU (gloo for several processes): it checks a suite's plumbing in a minute and measures nothing.
OUT defaults to bench-out/ (ignored by git); a results page cites the figures it takes from there.
"""
from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import importlib
import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

SUITES = {"throughput": "suites.throughput", "scaling": "suites.scaling", "time-to-loss": "suites.time_to_loss",
          "layouts": "suites.layouts", "prepare": "suites.prepare", "multi-node": "suites.multi_node",
          "float8": "suites.float8",
          "memory": "suites.memory",
          "context": "suites.context"}

# PYTHONSAFEPATH: `python -m` would otherwise put the current folder ahead of PYTHONPATH, and a
# step that measures another checkout (--before DIR) would import this one's distlm.
# NVLink multicast (NVLS) off: the shared machines these suites were written on refuse it, and
# every figure on the results pages was measured without it.
BASE_ENV = {"PYTHONUNBUFFERED": "1", "PYTHONSAFEPATH": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}

# What --cpu appends to every distlm command: a model small enough for a 2-core box.
TINY = ["model.n_layer=2", "model.d_model=64", "model.n_head=2", "model.d_ff=128", "model.block_size=32",
        "model.vocab_size=256", "train.device=cpu", "train.compile=false", "model.loss_chunk=0"]


@dataclass
class Step:
    """One command of a suite. argv may hold {dir} (this step's result folder), {out} (the
    suite's folder, shared by its steps) and {stamp} (the run's time: {out}/{stamp}-NAME is the
    folder of the step NAME); `background` commands start first and are waited for
    after argv ends (e.g. a second "node"); `env` is added to BASE_ENV."""
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    background: list[list[str]] = field(default_factory=list)
    timeout_s: int | None = None
    result: str = "result.json"  # the file in {dir} recorded as the step's result, if written


@dataclass
class Context:
    gpus: int
    cpu: bool
    python: str
    out: Path  # this suite's folder

    def distlm(self, args: list[str], nproc: int = 1) -> list[str]:
        """`python -m distlm ARGS`, under torchrun when nproc > 1 (gloo on the CPU). A bench or
        train without log.root keeps its run folder in the step's folder, not in ./runs."""
        if args and args[0] in ("bench", "train") and not any(a.startswith("log.root=") for a in args):
            args = [*args, "log.root={dir}"]
        if nproc <= 1:
            return [self.python, "-m", "distlm", *args]
        return [self.python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                "-m", "distlm", *args]

    def tiny(self, args: list[str]) -> list[str]:
        return [*args, *TINY] if self.cpu else args


def sources_fingerprint(root: Path = ROOT) -> str:
    """sha1 over distlm's .py files concatenated in byte order of their paths; equal to
    `find distlm -name '*.py' | LC_ALL=C sort | xargs cat | sha1sum | cut -c1-12`."""
    h = hashlib.sha1()
    for path in sorted((root / "distlm").rglob("*.py"), key=lambda p: str(p.relative_to(root)).encode()):
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def git_commit(root: Path = ROOT) -> str | None:
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "distlm"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return None


def card() -> str:
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=20).stdout.split("\n")
        names = [n.strip() for n in names if n.strip()]
        if names:
            return f"{len(names)} x {names[0]}" if len(set(names)) == 1 else ", ".join(names)
    except (OSError, subprocess.TimeoutExpired):
        pass
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown CPU") if Path("/proc/cpuinfo").is_file() else "CPU"
    return f"CPU: {model}, {os.cpu_count()} cores"


def torch_version(python: str) -> str | None:
    try:
        out = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                             text=True, timeout=120)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def provenance(python: str) -> dict:
    return {"card": card(), "torch": torch_version(python), "commit": git_commit(), "sources": sources_fingerprint()}


def fill(argv: list[str], **where: Path) -> list[str]:
    return [a.format(**{k: str(v) for k, v in where.items()}) if "{" in a else a for a in argv]


def resolve(step: Step, folder: Path, out: Path, stamp: str) -> Step:
    """The step with its placeholders filled in."""
    where = {"dir": folder, "out": out, "stamp": stamp}
    return Step(step.name, fill(step.argv, **where), {k: fill([v], **where)[0] for k, v in step.env.items()},
                [fill(b, **where) for b in step.background], step.timeout_s, step.result)


def shown(step: Step) -> str:
    """The shell lines that run the step: background launches (with &) first."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in step.env.items())
    env = env + " " if env else ""
    return "\n".join([*(env + shlex.join(b) + " &" for b in step.background), env + shlex.join(step.argv)])


def run_step(step: Step, ctx: Context, stamp: str, prov: dict, results: Path) -> int:
    folder = ctx.out / f"{stamp}-{step.name}"
    folder.mkdir(parents=True, exist_ok=True)
    step = resolve(step, folder, ctx.out, stamp)
    argv, background, command = step.argv, step.background, shown(step)
    (folder / "command.txt").write_text(command + "\n")
    env = {**os.environ, **BASE_ENV, **step.env}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if "PYTHONPATH" in step.env:  # a step that measures another checkout's code names it first
        env["PYTHONPATH"] = step.env["PYTHONPATH"] + os.pathsep + str(ROOT)
    print(f"[{step.name}] {command}", flush=True)
    start, launched = time.time(), []
    with open(folder / "log.txt", "w") as log:
        for i, b in enumerate(background):
            blog = open(folder / f"log-background{i}.txt", "w")
            launched.append((subprocess.Popen(b, cwd=ROOT, env=env, stdout=blog, stderr=subprocess.STDOUT,
                                              preexec_fn=os.setpgrp), blog))
        (folder / "launch_time.txt").write_text(f"{start:.3f}\n")
        try:
            rc = subprocess.run(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                timeout=step.timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = 124
        # The end of the step's process, beside its launch: a run's time from process start to
        # process end (its final checkpoint written) is the time a user waits.
        (folder / "end_time.txt").write_text(f"{time.time():.3f}\n")
        for proc, blog in launched:
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:  # a launcher left behind would hold the GPUs of the next step
                os.killpg(proc.pid, 9)
                proc.wait()
            blog.close()
    wall = time.time() - start
    result = None
    if (folder / step.result).is_file():
        try:
            result = json.loads((folder / step.result).read_text())
        except ValueError:
            result = None
    record = {"suite": ctx.out.name, "step": step.name, "date": dt.datetime.now(dt.timezone.utc).isoformat(
        timespec="seconds"), **prov, "gpus": ctx.gpus, "command": command, "folder": str(folder), "rc": rc,
        "wall_s": round(wall, 1), "result": result}
    with open(results, "a") as f:
        f.write(json.dumps(record) + "\n")
    text = (folder / "log.txt").read_text(errors="replace")
    shown_lines = text.strip().splitlines()[-3:]
    if rc:
        # Under torchrun the last lines are its summary of which rank exited, not why: the why is
        # the first error a rank printed, earlier in the log.
        shown_lines = [*(f"cause: {line}" for line in failure_causes(text)), *shown_lines]
    print(f"[{step.name}] rc {rc}, {wall:.1f} s" + "".join(f"\n    {line}" for line in shown_lines), flush=True)
    return rc


# A line that says why a run failed: distlm's one-line errors (``error: ...``, ``error (rank N): ...``),
# the last line of a Python traceback (``SomethingError: ...``), CUDA's out-of-memory message.
CAUSE = re.compile(r"(^|\] )error( \(rank \d+\))?: |^(\[rank\d+\]: )?[\w.]*(Error|Exception): |CUDA out of memory")


def failure_causes(log: str, most: int = 3) -> list[str]:
    """The first ``most`` distinct lines of the log that say why the run failed, in order."""
    causes: list[str] = []
    for line in log.splitlines():
        line = line.strip()
        if CAUSE.search(line) and line not in causes:
            causes.append(line[:300])
            if len(causes) == most:
                break
    return causes


def start_clock_sampler(path: Path) -> subprocess.Popen | None:
    """nvidia-smi sampling every second while the suite runs (read only). Four busy GPUs of one host
    ran about 3% slower than one under the software power cap: this is how that was seen."""
    query = "timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_event_reasons.active"
    try:
        return subprocess.Popen(["nvidia-smi", f"--query-gpu={query}", "--format=csv", "-lms", "1000"],
                                stdout=open(path, "w"), stderr=subprocess.DEVNULL)
    except OSError:
        print("--sample-clocks: nvidia-smi not found; no clock samples")
        return None


def parser_for(name: str, module) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"benchmarks/run.py {name}", description=module.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=1, help="GPUs of this machine the suite may use (default 1)")
    p.add_argument("--out", default="bench-out", help="results folder (default: bench-out/, ignored by git)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--cpu", action="store_true", help="tiny models on the CPU: checks the plumbing, measures nothing")
    p.add_argument("--python", default=sys.executable, help="the interpreter that runs distlm (default: this one)")
    p.add_argument("--timeout", type=int, default=None, help="seconds each step may run (default: no limit)")
    p.add_argument("--sample-clocks", action="store_true",
                   help="log nvidia-smi's clocks, power and throttle reasons every second to OUT/SUITE/<time>-clocks.csv")
    module.add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print(__doc__.strip().split("\n\n")[0])
        for name, mod in SUITES.items():
            print(f"  {name:13s} {importlib.import_module(mod).__doc__.strip().splitlines()[0]}")
        return 0
    name = argv[0]
    if name not in SUITES:
        print(f"error: unknown suite {name!r}; one of {', '.join(SUITES)}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUITES[name])
    args = parser_for(name, module).parse_args(argv[1:])
    out = Path(args.out).resolve() if not args.dry_run else Path(args.out).absolute()
    ctx = Context(gpus=args.gpus, cpu=args.cpu, python=args.python, out=out / name)
    try:
        steps = module.plan(args, ctx)
    except ValueError as e:
        print(f"error: {name}: {e}", file=sys.stderr)
        return 2
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    if args.dry_run:
        for step in steps:
            print(f"# {step.name}\n" + shown(resolve(step, ctx.out / f"{stamp}-{step.name}", ctx.out, stamp)))
        return 0
    if not steps:  # the suite said why
        return 0
    ctx.out.mkdir(parents=True, exist_ok=True)
    prov = provenance(args.python)
    print(f"{name}: {prov['card']}, torch {prov['torch']}, commit {prov['commit']}, sources {prov['sources']}")
    sampler = start_clock_sampler(ctx.out / f"{stamp}-clocks.csv") if args.sample_clocks else None
    failed = 0
    for step in steps:
        if args.timeout and step.timeout_s is None:
            step.timeout_s = args.timeout
        failed += run_step(step, ctx, stamp, prov, out / "results.jsonl") != 0
    if sampler:
        sampler.terminate()
        sampler.wait()
    print(f"{name}: {len(steps) - failed} of {len(steps)} steps ended with exit 0; records in {out / 'results.jsonl'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
