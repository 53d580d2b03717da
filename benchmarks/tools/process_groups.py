"""Where a distributed run's first seconds of communication go: the world group's start, the device
mesh's groups, and the first all-reduce on each, with NCCL started eagerly or lazily.

    torchrun --standalone --nproc_per_node N benchmarks/tools/process_groups.py \
        [--layout dp_replicate|dp_shard] [--nccl eager|lazy] [--cpu] [--json FILE]

`eager` is how distlm starts (`init_process_group(device_id=...)`: NCCL's world communicator is made at
once, and each mesh axis is split off it); `lazy` leaves out `device_id`, so no communicator exists
until a collective needs it. The mesh is distlm's own (`ParallelDims.build_mesh`, every axis of
MESH_ORDER, with the run's timeout), for N ranks along one axis. Rank 0 prints one line: seconds since
the interpreter started to the end of the imports, then each phase, each ended by a device sync and
timed on rank 0 (a phase that is a collective includes the wait for the slowest rank). --cpu runs it
on gloo: the plumbing, not figures.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

STARTED = time.perf_counter()
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from distlm.parallel.dims import ParallelDims  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layout", default="dp_replicate", choices=("dp_replicate", "dp_shard"),
                   help="the mesh axis the ranks span (DDP's or FSDP2's)")
    p.add_argument("--nccl", default="eager", choices=("eager", "lazy"),
                   help="start NCCL at once (distlm's way) or at the first collective; on gloo, naming only")
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds every group waits on a hang")
    p.add_argument("--json", help="also write the phases here (rank 0)")
    args = p.parse_args(argv)
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    cuda = not args.cpu
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    phases = {"imports": time.perf_counter() - STARTED}
    clock = [time.perf_counter()]

    def lap(name: str) -> None:
        if cuda:
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        phases[name] = now - clock[0]
        clock[0] = now

    eager = {"device_id": device} if cuda and args.nccl == "eager" else {}
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout), **eager)
    lap("world group")
    dims = ParallelDims(**{args.layout: world}, world_size=world, rank=rank, local_rank=local)
    dims.build_mesh(device.type, args.timeout)
    lap("device mesh")
    x = torch.ones(1 << 20, device=device)
    data = dims.dp_mesh.get_group()
    dist.all_reduce(x, group=data)
    lap("first all-reduce, data axis")
    dist.all_reduce(x)
    lap("first all-reduce, world")
    dist.all_reduce(x, group=data)
    lap("second all-reduce, data axis")
    ok = bool((x == world ** 3).all())
    dist.destroy_process_group()
    if not ok:
        print(f"rank {rank}: the all-reduces gave {x[0].item()}, expected {world ** 3}", file=sys.stderr)
        return 1
    if rank == 0:
        after = {k: v for k, v in phases.items() if k != "imports"}
        print(f"{args.nccl} {args.layout} x{world}: imports {phases['imports']:.2f} s, then "
              + ", ".join(f"{k} {v:.2f}" for k, v in after.items()) + f"; {sum(after.values()):.2f} s in all")
        if args.json:
            Path(args.json).write_text(json.dumps({"nccl": args.nccl, "layout": args.layout, "world": world,
                                                   "seconds": phases}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
