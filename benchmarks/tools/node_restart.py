"""Two "nodes" on one host train together; node 1 is killed after a checkpoint and started again.

    python benchmarks/tools/node_restart.py --dir DIR --nproc-per-node N [--device cuda|cpu]
        [--emulate hostid|disable] [--port 29611] -- DISTLM_TRAIN_ARGS...

Both launchers use c10d rendezvous with --max_restarts 3 and train.resume=auto (the arguments
after -- must save checkpoints, e.g. train.checkpoint_every=20). Once DIR/runs/elastic holds
its first checkpoint, node 1's launcher and its workers get SIGKILL; a new node-1 launcher
starts 3 s later; the run must end. Writes DIR/result.json: when node 1 was killed, whether the
run resumed and finished, the checkpoints, and the wall time; exit 0 only when it finished.
Node 0 starts first and hosts the rendezvous store: on one host either launcher could bind the
endpoint, and killing the store's host ends the job on every node.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def node_env(rank: int, per: int, device: str, emulate: str) -> dict:
    env = dict(os.environ)
    if device == "cuda":  # on one host both nodes' local rank 0 would take GPU 0
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(rank * per + i) for i in range(per))
    if emulate == "hostid":  # NCCL sees two hosts: NVLink inside a node, sockets between
        env["NCCL_HOSTID"] = f"distlm-node{rank}"
    else:  # every link on sockets, inside a node too
        env.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1")
    # A replaced node's agent counts restarts from 0 while the survivor's count on; one store per
    # rendezvous round keeps their keys apart.
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return env


def start(rank: int, args, train: list[str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", str(args.nproc_per_node),
           "--node_rank", str(rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{args.port}",
           "--rdzv-id", "elastic", "--max_restarts", "3", "--rdzv-conf", f"join_timeout=120,is_host={int(rank == 0)}",
           "-m", "distlm", "train", *train]
    with open(log, "a") as f:  # its own process group: the "node" is the launcher and its workers
        return subprocess.Popen(cmd, env=node_env(rank, args.nproc_per_node, args.device, args.emulate), stdout=f,
                                stderr=subprocess.STDOUT, preexec_fn=os.setpgrp)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--emulate", choices=("hostid", "disable"), default="hostid")
    p.add_argument("--port", type=int, default=29611)
    p.add_argument("--limit-s", type=float, default=400)
    p.add_argument("train", nargs=argparse.REMAINDER)
    args = p.parse_args()
    train = [a for a in args.train if a != "--"] + [f"log.root={args.dir}/runs", "log.name=elastic", "train.resume=auto"]
    ckpts = args.dir / "runs" / "elastic" / "checkpoints"
    t0 = time.time()
    node0 = start(0, args, train, args.dir / "node0.log")
    time.sleep(5)
    node1 = start(1, args, train, args.dir / "node1.log")
    while not (ckpts.is_dir() and any(ckpts.iterdir())) and node0.poll() is None and time.time() - t0 < args.limit_s:
        time.sleep(0.5)
    os.killpg(node1.pid, signal.SIGKILL)
    killed_at = time.time() - t0
    time.sleep(3)
    node1 = start(1, args, train, args.dir / "node1-restarted.log")
    try:
        rc = node0.wait(timeout=max(args.limit_s - (time.time() - t0), 1))
    except subprocess.TimeoutExpired:
        rc = 124
    for proc in (node0, node1):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    log0 = (args.dir / "node0.log").read_text(errors="replace")
    result = {"node1_killed_at_s": round(killed_at, 1), "node0_exit": rc, "wall_s": round(time.time() - t0, 1),
              "resumed": "resumed from" in log0, "checkpoints": sorted(p.name for p in ckpts.iterdir())
              if ckpts.is_dir() else []}
    (args.dir / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
