"""All-reduce bus bandwidth of one large buffer, under whatever launcher started this process.

    torchrun --standalone --nproc_per_node N benchmarks/tools/allreduce.py [cuda|cpu] [--mb 256] [--json FILE]

The multi-node suite runs it under one launcher (NVLink / shared memory) and under two
launchers that NCCL sees as two hosts, so the second figure is the emulated inter-node link.
Bus bandwidth follows nccl-tests: 2(n-1)/n x bytes / time.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("device", nargs="?", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--mb", type=int, default=0, help="buffer size (default 256 on GPUs, 16 on the CPU)")
    p.add_argument("--json")
    args = p.parse_args()
    dev = args.device
    dist.init_process_group("nccl" if dev == "cuda" else "gloo")
    if dev == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    n, w = (args.mb or (256 if dev == "cuda" else 16)) * 2**20 // 4, dist.get_world_size()
    x = torch.ones(n, device=dev)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    for _ in range(3):
        dist.all_reduce(x)
    sync()
    t0, k = time.perf_counter(), 10
    for _ in range(k):
        dist.all_reduce(x)
    sync()
    dt = (time.perf_counter() - t0) / k
    busbw = 2 * (w - 1) / w * 4 * n / dt / 1e9
    if dist.get_rank() == 0:
        print(f"all-reduce {4 * n / 1e6:.0f} MB over {w}: {dt * 1e3:.2f} ms, bus bandwidth {busbw:.1f} GB/s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"mb": 4 * n / 1e6, "world_size": w, "ms": dt * 1e3, "bus_gbs": busbw}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
