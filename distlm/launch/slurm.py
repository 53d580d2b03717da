"""SLURM glue: the allocation -> torchrun rendezvous, requeue bookkeeping.

    sbatch scripts/slurm/train.sbatch configs/gpt2-355m.yaml [section.key=value ...]
    bash scripts/slurm/train.sbatch --dry-run --nodes 2 --gpus-per-node 4 CONFIG [overrides]
    python -m distlm.launch.slurm slurm-env           # export lines for the batch script
    python -m distlm.launch.slurm exec-node --python P CONFIG [overrides]   # what srun runs per node
    python -m distlm.launch.slurm dry-run [--nodes N] [--gpus-per-node G] --python P CONFIG [overrides]

What a node runs is ``node_command``: the real launch (exec-node, on every node under srun)
and the dry run (every node's command printed, nothing started) both call it, so the dry
run shows what will run.

Everything SLURM-specific is a pure function of an environment mapping, so it is unit
tested with fake variables (tests/launch/test_slurm.py) on machines that have no SLURM.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, Optional, Sequence

from distlm.io import atomic_write_text

# Variables worth keeping with a run: what ran where, and which attempt this was.
SLURM_META_KEYS = ("SLURM_JOB_ID", "SLURM_JOB_NAME", "SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES",
                   "SLURM_JOB_PARTITION", "SLURM_JOB_ACCOUNT", "SLURM_JOB_QOS", "SLURM_RESTART_COUNT",
                   "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", "SLURM_CPUS_ON_NODE", "SLURM_SUBMIT_DIR",
                   "SLURM_SUBMIT_HOST", "SLURM_CLUSTER_NAME", "SLURM_JOB_START_TIME", "SLURM_JOB_END_TIME")


class LaunchError(ValueError):
    """A launch environment that cannot work; the message names the variable."""


def expand_hostlist(spec: str) -> list[str]:
    """SLURM's compressed host list, as `scontrol show hostnames` expands it:
    'gpu[01-03,07],login1' -> gpu01 gpu02 gpu03 gpu07 login1. Several bracket groups in
    one name ('r[1-2]n[1-2]') give their product; zero padding follows the range start."""
    hosts, depth, start = [], 0, 0
    for i, ch in enumerate(spec + ","):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            if spec[start:i].strip():
                hosts.extend(_expand_one(spec[start:i].strip()))
            start = i + 1
    if depth != 0:
        raise LaunchError(f"unbalanced brackets in host list {spec!r}")
    return hosts


def _expand_one(name: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", name)
    if m is None:
        return [name]
    head, tail = name[:m.start()], name[m.end():]
    out = []
    for part in m.group(1).split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise LaunchError(f"bad range {part!r} in host name {name!r}")
        for k in range(int(lo), int(hi or lo) + 1):
            out.extend(head + str(k).zfill(len(lo)) + rest for rest in _expand_one(tail))
    return out


def _count(value: Optional[str]) -> Optional[int]:
    """'8', 'h100:8', 'gpu:h100:8(IDX:0-7)' -> 8; '8(x2)' (per-node counts) -> 8."""
    if not value:
        return None
    m = re.match(r"^(?:[^:(]*:)*(\d+)", value.split(",")[0])
    return int(m.group(1)) if m else None


def gpus_per_node(env: Mapping[str, str]) -> int:
    """torchrun's --nproc_per_node: one process per GPU of this node (1 without GPUs)."""
    for key in ("DISTLM_NPROC_PER_NODE", "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        n = _count(env.get(key))
        if n:
            return n
    visible = env.get("CUDA_VISIBLE_DEVICES", "")
    return len([d for d in visible.split(",") if d.strip()]) or 1


def slurm_rendezvous(env: Mapping[str, str]) -> dict:
    """Where the torchrun agents of this job meet: the first node of the allocation, on a
    port derived from the job id (two jobs sharing a node do not collide; a requeued job,
    which keeps its id, gets its port back). One torchrun per node, started by srun."""
    job_id = env.get("SLURM_JOB_ID")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not job_id or not nodelist:
        raise LaunchError("not inside a SLURM allocation: SLURM_JOB_ID and SLURM_JOB_NODELIST are not set")
    nodes = expand_hostlist(nodelist)
    nnodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or len(nodes))
    if nnodes != len(nodes):
        raise LaunchError(f"SLURM_JOB_NUM_NODES={nnodes} but SLURM_JOB_NODELIST={nodelist!r} names {len(nodes)} hosts")
    port = int(env.get("DISTLM_MASTER_PORT") or 20000 + int(re.sub(r"\D", "", job_id) or 0) % 20000)
    return {"MASTER_ADDR": nodes[0], "MASTER_PORT": port, "NNODES": nnodes,
            "NODE_RANK": int(env.get("SLURM_NODEID", 0)), "NPROC_PER_NODE": gpus_per_node(env),
            "RDZV_ID": f"distlm-{job_id}", "NODES": " ".join(nodes)}


def parse_slurm_duration(text: str) -> Optional[float]:
    """squeue's %L ('1-02:03:04', '2:03:04', '3:04', '45') in seconds; None if unlimited."""
    text = text.strip()
    if not text or text.upper() in ("UNLIMITED", "NOT_SET", "INVALID"):
        return None
    days, _, clock = text.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    h, m, s = parts
    return ((int(days or 0) * 24 + h) * 60 + m) * 60 + s


def seconds_left(env: Mapping[str, str], now: Optional[float] = None) -> Optional[float]:
    """Wall time left to this job; None when unknown or unlimited."""
    end = env.get("SLURM_JOB_END_TIME")  # set by Slurm >= 23.02
    if end and end.isdigit():
        return int(end) - (time.time() if now is None else now)
    try:
        out = subprocess.run(["squeue", "-h", "-j", env["SLURM_JOB_ID"], "-o", "%L"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (KeyError, OSError, subprocess.SubprocessError):
        return None
    return parse_slurm_duration(out.splitlines()[0] if out.strip() else "")


def launch_env(env: Mapping[str, str], left_s: Optional[float], margin_s: float = 600) -> dict[str, str]:
    """What the batch script exports before srun (which passes it on to every node): the
    rendezvous, the run folder, and TIME_LIMIT_S, what train.time_limit_s should be so the
    trainer stops and checkpoints ``margin_s`` before SLURM kills the job (``left_s``: wall
    time left, None = unknown or unlimited, giving 0 = no limit). A requeued job keeps its
    id, so it finds its run folder again."""
    r = slurm_rendezvous(env)
    r["TIME_LIMIT_S"] = 0 if left_s is None else max(60, int(left_s - margin_s))
    root = env.get("DISTLM_RUN_ROOT") or "runs"
    name = env.get("DISTLM_RUN_NAME") or f"{env.get('SLURM_JOB_NAME') or 'distlm'}-{env['SLURM_JOB_ID']}"
    # one thread per trainer process unless told: several per GPU oversubscribe the cores
    r.update(RUN_ROOT=root, RUN_NAME=name, RUN_DIR=f"{root}/{name}", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS") or 1,
             PYTHONUNBUFFERED=1,
             # One rendezvous store per round: with torch's shared store a node that replaces a lost one
             # waits forever for an address the survivors never republish (tests/layout/test_data.py).
             TORCH_DISABLE_SHARE_RDZV_TCP_STORE=env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") or 1,
             # torch.compile's cache (inductor's graphs and Triton's kernels) in the user's own cache
             # folder instead of the node's /tmp: a requeued job that lands on other nodes finds its
             # compiled graphs there (measured on H100s: 13-14 s of compilation saved on 4 GPUs, 27 s on
             # one). It holds code that torch runs, so it stays in the user's home, never in a run folder.
             TORCHINDUCTOR_CACHE_DIR=env.get("TORCHINDUCTOR_CACHE_DIR")
             or f"{env.get('XDG_CACHE_HOME') or env.get('HOME', '~') + '/.cache'}/distlm/torchinductor")
    return {k: str(v) for k, v in r.items()}


def slurm_env_lines(env: Mapping[str, str], margin_s: float = 600) -> list[str]:
    """``export KEY=VALUE`` lines (shell-quoted) of ``launch_env`` for ``eval`` in the batch script."""
    return [f"export {k}={shlex.quote(v)}" for k, v in launch_env(env, seconds_left(env), margin_s).items()]


# launch_env's keys that node_command reads
NODE_KEYS = ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NPROC_PER_NODE", "RDZV_ID", "RUN_ROOT", "RUN_NAME",
             "TIME_LIMIT_S")


def node_command(env: Mapping[str, str], node_rank: int, python: str, config: str,
                 overrides: Sequence[str] = ()) -> list[str]:
    """The argv node ``node_rank`` runs: one torchrun for this node's GPUs, meeting the
    others at the c10d rendezvous, around ``distlm train`` writing to the run folder,
    resuming from its newest checkpoint and stopping by TIME_LIMIT_S. ``env`` holds
    ``launch_env``'s variables (on a node: the batch script's exports)."""
    missing = [k for k in NODE_KEYS if not env.get(k)]
    if missing:
        raise LaunchError(f"{', '.join(missing)} not set: the batch script exports them "
                          "(python -m distlm.launch.slurm slurm-env)")
    nnodes = int(env["NNODES"])
    if not 0 <= node_rank < nnodes:
        raise LaunchError(f"node rank {node_rank} is outside 0..{nnodes - 1} (NNODES={nnodes})")
    return [python, "-m", "torch.distributed.run", "--nnodes", env["NNODES"], "--nproc_per_node",
            env["NPROC_PER_NODE"], "--node_rank", str(node_rank), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}", "--rdzv-id", env["RDZV_ID"],
            "-m", "distlm", "train", "--config", config, f"log.root={env['RUN_ROOT']}",
            f"log.name={env['RUN_NAME']}", "train.resume=auto", f"train.time_limit_s={env['TIME_LIMIT_S']}",
            *overrides]


def dry_run_env(env: Mapping[str, str], nodes: Optional[int] = None, gpus: Optional[int] = None) -> dict[str, str]:
    """The SLURM variables a dry run plans with: the allocation's where set, else a made-up
    job of ``nodes`` hosts (dryrun-node0...) and ``gpus`` per node; given values must agree
    with an allocation's."""
    out = dict(env)
    for flag, value in (("--nodes", nodes), ("--gpus-per-node", gpus)):
        if value is not None and value < 1:
            raise LaunchError(f"{flag} {value}: must be at least 1")
    listed = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if listed:
        hosts = expand_hostlist(listed)
        if nodes is not None and nodes != len(hosts):
            raise LaunchError(f"--nodes {nodes}, but SLURM_JOB_NODELIST={listed!r} names {len(hosts)} hosts")
    elif nodes is None:
        raise LaunchError("give --nodes N: SLURM_JOB_NODELIST is not set (not inside an allocation)")
    else:
        out["SLURM_JOB_NODELIST"] = f"dryrun-node[0-{nodes - 1}]"
        out["SLURM_JOB_NUM_NODES"] = str(nodes)
    if gpus is not None:
        out["DISTLM_NPROC_PER_NODE"] = str(gpus)
    elif not any(_count(env.get(k)) for k in ("DISTLM_NPROC_PER_NODE", "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE")):
        raise LaunchError("give --gpus-per-node G: none of SLURM_GPUS_ON_NODE, SLURM_GPUS_PER_NODE, "
                          "DISTLM_NPROC_PER_NODE is set")
    out.setdefault("SLURM_JOB_ID", "dryrun")
    out.pop("SLURM_NODEID", None)  # srun sets it per node
    return out


def dry_run(env: Mapping[str, str], python: str, config: str, overrides: Sequence[str], nodes: Optional[int] = None,
            gpus: Optional[int] = None, margin_s: float = 600) -> str:
    """What every node of the job would run, as shell text: the exported environment, then
    one command line per node (shlex-quoted: paste one to run it by hand). Checks the
    config and that the parallel degrees multiply to nodes x GPUs, as the trainer would."""
    in_job = bool(env.get("SLURM_JOB_ID"))
    plan_env = dry_run_env(env, nodes, gpus)
    left = seconds_left(plan_env) if in_job else None  # a made-up job has no clock
    exports = launch_env(plan_env, left, margin_s)
    _check_world(config, overrides, int(exports["NNODES"]) * int(exports["NPROC_PER_NODE"]))
    node_env = {**plan_env, **exports}
    hosts = exports["NODES"].split()
    limit = exports["TIME_LIMIT_S"]
    lines = [f"# dry run: {exports['NNODES']} node(s) x {exports['NPROC_PER_NODE']} GPU(s), rendezvous "
             f"{exports['MASTER_ADDR']}:{exports['MASTER_PORT']}, run {exports['RUN_DIR']}, train.time_limit_s={limit}"
             + ("" if in_job else " (no job, no time limit)") + "; srun and scontrol are not run",
             "# environment on every node (the batch script exports it; srun passes it on):"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in exports.items()]
    for rank, host in enumerate(hosts):
        lines.append(f"# node {rank} ({host}), srun task with SLURM_NODEID={rank}:")
        lines.append(shlex.join(node_command(node_env, rank, python, config, overrides)))
    return "\n".join(lines)


def _check_world(config: str, overrides: Sequence[str], world: int) -> None:
    """The config loads and its parallel degrees fill nodes x GPUs: a dry run's main catch."""
    from distlm.config import load_config
    try:
        par = load_config(config, list(overrides)).parallel
    except (ValueError, OSError) as e:  # ConfigError is a ValueError
        raise LaunchError(str(e).splitlines()[0]) from None
    product = par.dp_replicate * par.dp_shard * par.tp * par.pp
    if product != world:
        raise LaunchError(f"parallel.dp_replicate={par.dp_replicate} x dp_shard={par.dp_shard} x tp={par.tp} x "
                          f"pp={par.pp} = {product}, but the job has {world} GPUs (nodes x GPUs per node)")


def exec_node(env: Mapping[str, str], python: str, config: str, overrides: Sequence[str],
              say=lambda line: None) -> tuple[int, str]:
    """srun's task on each node: say this node's command, then run it; (exit status, what
    torchrun's run had to say). With this interpreter, torchrun's entry point runs here
    (distlm/launch/local.py: a rank's one-line error is the whole of the output, and its status
    the task's); another ``python`` is exec'd. Either way torchrun gets srun's signals directly."""
    if not env.get("SLURM_NODEID", "").isdigit():
        raise LaunchError(f"SLURM_NODEID={env.get('SLURM_NODEID')!r}: exec-node runs as an srun task")
    rank = int(env["SLURM_NODEID"])
    argv = node_command(env, rank, python, config, overrides)
    say(f"node {rank} ({socket.gethostname()}): {shlex.join(argv)}")
    if _is_this_interpreter(argv[0]):
        from distlm.launch.local import run_torchrun
        return run_torchrun(argv[3:])  # after `python -m torch.distributed.run`
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        raise LaunchError(f"cannot run {argv[0]}: {e.strerror}") from None


def _is_this_interpreter(python: str) -> bool:
    import shutil
    found = shutil.which(python)
    return found is not None and os.path.realpath(found) == os.path.realpath(sys.executable)


def write_slurm_meta(run_dir: Path, env: Mapping[str, str]) -> Path:
    """RUN/slurm/job_<id>_attempt_<k>.json: the allocation of one (re)queued attempt."""
    meta = {k: env[k] for k in SLURM_META_KEYS if k in env}
    meta.update(host=socket.gethostname(), started_at=time.time(), rendezvous=slurm_rendezvous(env),
                argv=sys.argv)
    folder = Path(run_dir) / "slurm"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"job_{env.get('SLURM_JOB_ID')}_attempt_{env.get('SLURM_RESTART_COUNT', '0')}.json"
    atomic_write_text(path, json.dumps(meta, indent=1))
    return path


def run_finished(run_dir: Path) -> bool:
    """True when the newest complete checkpoint has reached its config's train.max_steps."""
    from distlm.checkpoint import CheckpointError, read_meta, resolve_checkpoint
    try:
        meta = read_meta(resolve_checkpoint(run_dir))
    except CheckpointError:
        return False
    return int(meta["step"]) >= int(meta["config"]["train"]["max_steps"])


def _launch_args(args: list[str]) -> tuple[dict, str, list[str]]:
    """[--python P] [--nodes N] [--gpus-per-node G] [--margin S] [--] CONFIG [overrides]: the
    options, the config, the overrides (the batch script passes them in this order)."""
    opts, names = {}, {"--python": str, "--nodes": int, "--gpus-per-node": int, "--margin": float}
    while args and args[0].startswith("--"):
        flag, _, value = args.pop(0).partition("=")
        if flag == "--" and not value:
            break
        if flag not in names:
            raise LaunchError(f"unknown option {flag} (options: {', '.join(names)})")
        if not value:
            if not args:
                raise LaunchError(f"{flag} needs a value")
            value = args.pop(0)
        try:
            opts[flag] = names[flag](value)
        except ValueError:
            raise LaunchError(f"{flag} {value!r}: not a number") from None
    if not args:
        raise LaunchError("no CONFIG given (a config file or preset, then section.key=value overrides)")
    return opts, args[0], args[1:]


def main(argv: list[str]) -> int:
    usage = ("usage: python -m distlm.launch.slurm {slurm-env [MARGIN_S] | slurm-meta RUN_DIR | finished RUN_DIR | "
             "exec-node --python P CONFIG [overrides] | dry-run [--nodes N] [--gpus-per-node G] [--python P] "
             "[--margin S] CONFIG [overrides]}")
    if not argv or argv[0] not in ("slurm-env", "slurm-meta", "finished", "exec-node", "dry-run"):
        print(usage, file=sys.stderr)
        return 2
    try:
        if argv[0] in ("exec-node", "dry-run"):
            opts, config, overrides = _launch_args(list(argv[1:]))
            python = opts.get("--python") or sys.executable
            if argv[0] == "exec-node":
                if "--nodes" in opts or "--gpus-per-node" in opts:
                    raise LaunchError("--nodes and --gpus-per-node are for dry-run; srun's task takes the allocation's")
                status, said = exec_node(os.environ, python, config, overrides,
                                         say=lambda line: print(line, file=sys.stderr, flush=True))
                if said:
                    print(said, file=sys.stderr)
                return status
            print(dry_run(os.environ, python, config, overrides, opts.get("--nodes"), opts.get("--gpus-per-node"),
                          opts.get("--margin", 600)))
        elif argv[0] == "slurm-env":
            print("\n".join(slurm_env_lines(os.environ, float(argv[1]) if len(argv) > 1 else 600)))
        elif argv[0] == "slurm-meta":
            print(write_slurm_meta(Path(argv[1]), os.environ))
        else:
            return 0 if run_finished(Path(argv[1])) else 1
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
