"""SLURM glue: the allocation -> torchrun rendezvous, requeue bookkeeping.

    sbatch scripts/slurm/train.sbatch configs/gpt2-355m.yaml [section.key=value ...]
    python -m distlm.launch.slurm slurm-env           # KEY=VALUE lines for the batch script

Everything SLURM-specific is a pure function of an environment mapping, so it is unit
tested with fake variables (tests/test_slurm.py) on machines that have no SLURM.
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
from typing import Mapping, Optional

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


def slurm_env_lines(env: Mapping[str, str], margin_s: float = 600) -> list[str]:
    """``export KEY=VALUE`` lines (shell-quoted) for ``eval`` in the batch script; srun
    passes exported variables on to every node. TIME_LIMIT_S is
    what train.time_limit_s should be so the trainer stops and checkpoints ``margin_s``
    before SLURM kills the job (0 = no limit known)."""
    r = slurm_rendezvous(env)
    left = seconds_left(env)
    r["TIME_LIMIT_S"] = 0 if left is None else max(60, int(left - margin_s))
    return [f"export {k}={shlex.quote(str(v))}" for k, v in r.items()]


def write_slurm_meta(run_dir: Path, env: Mapping[str, str]) -> Path:
    """RUN/slurm/job_<id>_attempt_<k>.json: the allocation of one (re)queued attempt."""
    meta = {k: env[k] for k in SLURM_META_KEYS if k in env}
    meta.update(host=socket.gethostname(), started_at=time.time(), rendezvous=slurm_rendezvous(env),
                argv=sys.argv)
    folder = Path(run_dir) / "slurm"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"job_{env.get('SLURM_JOB_ID')}_attempt_{env.get('SLURM_RESTART_COUNT', '0')}.json"
    path.write_text(json.dumps(meta, indent=1))
    return path


def run_finished(run_dir: Path) -> bool:
    """True when the newest complete checkpoint has reached its config's train.max_steps."""
    from distlm.checkpoint import CheckpointError, read_meta, resolve_checkpoint
    try:
        meta = read_meta(resolve_checkpoint(run_dir))
    except CheckpointError:
        return False
    return int(meta["step"]) >= int(meta["config"]["train"]["max_steps"])


def main(argv: list[str]) -> int:
    usage = "usage: python -m distlm.launch.slurm {slurm-env [MARGIN_S] | slurm-meta RUN_DIR | finished RUN_DIR}"
    if not argv or argv[0] not in ("slurm-env", "slurm-meta", "finished"):
        print(usage, file=sys.stderr)
        return 2
    try:
        if argv[0] == "slurm-env":
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
