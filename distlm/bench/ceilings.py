"""`distlm bench --ceilings`: the two hardware ceilings a training step lives under.

MFU is quoted against the datasheet peak, but no kernel reaches it; what this device
really does is the ceiling worth knowing: the dense matmul rate (bf16 on CUDA, fp32 on
CPU) of large square matmuls, and the memory bandwidth of a large copy. A layer is
compute-bound when its FLOPs per byte moved exceed their ratio.
"""
from __future__ import annotations

import time

import torch


def _timed(fn, device: torch.device, reps: int) -> float:
    fn()  # warm-up: allocation, cuBLAS heuristics, clocks
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / reps


def matmul_tflops(device: torch.device, n: int, dtype: torch.dtype, reps: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / _timed(lambda: torch.mm(a, b, out=out), device, reps) / 1e12


def copy_gbs(device: torch.device, n_bytes: int, reps: int) -> float:
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    # a copy reads and writes every byte
    return 2 * n_bytes / _timed(lambda: dst.copy_(src), device, reps) / 1e9


def measure(device: torch.device, quick: bool = False) -> dict:
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    sizes = ([8192, 16384] if cuda else [512]) if not quick else [256]
    reps = 20 if cuda else 3
    rates = {n: matmul_tflops(device, n, dtype, reps) for n in sizes}
    gbs = copy_gbs(device, (4 << 30) if cuda and not quick else (64 << 20), reps)
    best = max(rates.values())
    return {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "dtype": str(dtype),
            "matmul_tflops": {str(n): r for n, r in rates.items()}, "matmul_tflops_best": best,
            "copy_gbs": gbs, "ridge_flops_per_byte": best * 1e12 / (gbs * 1e9), "torch": torch.__version__}


def flop_rate(tflops: float) -> str:
    """A FLOP rate in the unit that fits the device: a CPU's tens of GFLOP/s would print as
    "0.0 TFLOP/s" in a GPU's unit."""
    return f"{tflops:,.1f} TFLOP/s" if tflops >= 1 else f"{tflops * 1e3:.3g} GFLOP/s"


def _figure(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def report(r: dict) -> str:
    mm = ", ".join(f"{n}^3: {flop_rate(t)}" for n, t in r["matmul_tflops"].items())
    return (f"{r['device']}: dense {r['dtype'].replace('torch.', '')} matmul {flop_rate(r['matmul_tflops_best'])} "
            f"({mm}); copy bandwidth {_figure(r['copy_gbs'])} GB/s (read + write); ridge point "
            f"{_figure(r['ridge_flops_per_byte'])} FLOP/byte")
