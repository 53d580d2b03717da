"""How fast NCCL moves the message sizes tensor parallelism sends.

    torchrun --standalone --nproc_per_node 2 benchmarks/tools/nccl_sizes.py [--json FILE]

Times all-gather, reduce-scatter and all-reduce of bf16 and fp32 tensors from 1 MB to 256 MB
(median of 20 runs, CUDA events, after 5 warm-up runs) and prints the bus bandwidth in NCCL's
own convention (nccl-tests' busBw: all-gather and reduce-scatter move (n-1)/n of the whole
buffer per rank, all-reduce 2(n-1)/n). TP2's per-block collectives at gpt2-1.5b, micro-batch 8,
are 8 x 1024 x 1600 activations: 26 MB in bf16, 52 MB in fp32. Run it under different
`NCCL_PROTO` / `NCCL_ALGO` settings to see which protocol NCCL picks and what it costs.
"""
import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from distlm.bench.timing import median_seconds  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--sizes-mb", default="1,4,13,26,52,104,256")
    args = parser.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", timeout=timedelta(seconds=120), device_id=torch.device("cuda", local))
    n, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for mb in (float(s) for s in args.sizes_mb.split(",")):
            numel = int(mb * 2**20) // torch.finfo(dtype).bits * 8 // n * n
            whole = torch.randn(numel, device="cuda", dtype=dtype)
            part = torch.randn(numel // n, device="cuda", dtype=dtype)
            nbytes = whole.numel() * whole.element_size()
            ops = {
                "all_gather": (lambda: dist.all_gather_into_tensor(whole, part), (n - 1) / n),
                "reduce_scatter": (lambda: dist.reduce_scatter_tensor(part, whole), (n - 1) / n),
                "all_reduce": (lambda: dist.all_reduce(whole), 2 * (n - 1) / n),
            }
            for op, (fn, factor) in ops.items():
                s = median_seconds(fn, torch.device("cuda", torch.cuda.current_device()), repeats=20, warmup=5)
                rows.append({"op": op, "dtype": str(dtype).removeprefix("torch."), "mb": nbytes / 2**20,
                             "ms": 1e3 * s, "bus_gbps": factor * nbytes / s / 1e9})
    if rank == 0:
        settings = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
        print(f"world {n}, nccl {torch.cuda.nccl.version()}, settings {settings}")
        print(f"{'op':15s} {'dtype':9s} {'MB':>7s} {'ms':>8s} {'bus GB/s':>9s}")
        for r in rows:
            print(f"{r['op']:15s} {r['dtype']:9s} {r['mb']:7.1f} {r['ms']:8.3f} {r['bus_gbps']:9.1f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": n, "settings": settings, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
