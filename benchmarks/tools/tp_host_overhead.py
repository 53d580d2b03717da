"""The host's cost of one tensor-parallel block call, without the GPU or the network.

    python benchmarks/tools/tp_host_overhead.py [--layers 24] [--compile] [--scope block|model] [--reps 20]

On 2 x H100, TP2 of gpt2-1.5b at micro-batch 8 left the GPU idle 42% of its step: each block
call's Python (DTensor wrapping and unwrapping, redistributions, the compiled graph's runtime
wrappers) took longer than the GPU's work for it. This measures that Python alone: one process,
a gloo group of one, a narrow model (so the arithmetic is negligible), forward + backward of
every block, as the plain model and with the TP plan applied on a one-rank mesh (every DTensor
path taken; each collective a no-op). It prints milliseconds per block call for both and the
difference: the host cost TP adds per block per micro-step. ``--scope model`` compiles the
whole forward as one graph (train.compile_scope=model) instead of each block.
"""
import argparse
import contextlib
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel

from distlm.config import load_config
from distlm.model.gpt import GPT
from distlm.parallel.parallelize import apply_compile
from distlm.parallel.tp import apply_tp


def build(layers: int, tp: bool, compile_: bool, scope: str = "block"):
    cfg = load_config("tiny", [f"model.n_layer={layers}", "model.d_model=64", "model.n_head=4", "model.d_ff=128",
                               "model.block_size=64", "model.vocab_size=256", "model.dropout=0.0"])
    model = GPT(cfg.model)
    if tp:
        apply_tp(model, init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)), cfg.parallel)
    if compile_:
        apply_compile(model, scope)
    return model, cfg


def per_block_ms(model, cfg, reps: int, tp: bool) -> float:
    x = torch.randint(0, cfg.model.vocab_size, (1, 64))
    y = torch.randint(0, cfg.model.vocab_size, (1, 64))
    times = []
    for i in range(reps + 3):
        t0 = time.perf_counter()
        with loss_parallel() if tp else contextlib.nullcontext():
            loss = model(x, targets=y)
            loss.backward()
        if i >= 3:  # the first calls compile
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times) / cfg.model.n_layer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--scope", choices=("block", "model"), default="block")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    plain = per_block_ms(*build(args.layers, False, args.compile, args.scope), args.reps, tp=False)
    tp = per_block_ms(*build(args.layers, True, args.compile, args.scope), args.reps, tp=True)
    print(f"compiled={args.compile} (scope {args.scope}): forward+backward per block call, plain {plain:.2f} ms, TP plan {tp:.2f} ms, "
          f"TP adds {tp - plain:.2f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
