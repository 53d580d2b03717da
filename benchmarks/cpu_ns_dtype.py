"""The CPU demo's training step with Muon's Newton-Schulz in bf16 and in fp32, interleaved.

    PYTHONPATH=. python benchmarks/cpu_ns_dtype.py [--threads N] [--steps S]
    # a CPU without a fast bf16 path, emulated on one that has it (x86, oneDNN):
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 PYTHONPATH=. python benchmarks/cpu_ns_dtype.py

Two Trainers of the `demo` preset on synthetic tokens of its vocabulary (4,096), one per dtype,
step in turn, so a box whose load changes during the run slows both alike. Prints the median
step time and tokens/s of each, and what optim.muon_ns_dtype=auto picks here.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from distlm.config import load_config
from distlm.train.matmul_dtype import MatmulDtypeProbe
from distlm.train.trainer import Trainer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    root = tempfile.mkdtemp(prefix="ns-dtype-")
    trainers = {}
    for name in ("bf16", "fp32"):
        cfg = load_config("demo", ["data.source=synthetic", "model.vocab_size=4096", "train.device=cpu",
                                   "log.samples=0", "log.progress=false", f"log.root={root}", f"log.name={name}",
                                   f"optim.muon_ns_dtype={name}"])
        trainers[name] = Trainer(cfg)
    for t in trainers.values():  # the first steps pay for kernel selection
        t.train_step()
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for _ in range(args.steps):
        for name, t in trainers.items():
            t0 = time.perf_counter()
            t.train_step()
            times[name].append(time.perf_counter() - t0)
    # Tokens of a step after the sequence-length warm-up are the same: 16 blocks of 128.
    tokens = 16 * 128
    choice = MatmulDtypeProbe().choose(torch.device("cpu"))
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads, "
          f"{args.steps} steps each, interleaved")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  Newton-Schulz {name}: median step {1e3 * med:.1f} ms, {tokens / med:,.0f} tok/s "
              f"(min {1e3 * min(ts):.1f}, max {1e3 * max(ts):.1f} ms)")
    name = {torch.bfloat16: "bf16", torch.float32: "fp32"}[choice.dtype]
    print(f"  optim.muon_ns_dtype=auto picks {name} ({choice.describe()})")


if __name__ == "__main__":
    main()
