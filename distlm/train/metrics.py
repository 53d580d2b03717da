"""Throughput, MFU and memory, computed rather than assumed.

MFU = achieved model FLOP/s / peak FLOP/s, with model FLOPs per token = 6N + 12*L*d*T
(N = non-embedding parameters plus the head; see distlm.model.gpt.flops_per_token) and
the peak looked up by the device's name in PEAK_TFLOPS below (dense bf16 tensor-core
datasheet numbers). The fallback for a device the table does not name (every CPU, a GPU not
listed) is no peak at all: MFU reads n/a, and the run's first line says which device was not
found (``mfu_basis``), rather than a guess from the compute capability, which one chip
generation shares across parts several times apart in speed (an H20 is sm_90 like an H100,
at 148 TFLOP/s against 989). A GPU missing here is one line in the table.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

import torch

# Dense (no sparsity) bf16 peak TFLOP/s, from the vendors' datasheets.
PEAK_TFLOPS = [
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),   # SXM
    ("H200", 989.0),
    ("H800", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("A10G", 70.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("RTX 4090", 165.0),
    ("RTX 3090", 71.0),
    ("V100", 125.0),
]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def peak_tflops(device: torch.device) -> Optional[float]:
    """Peak dense bf16 TFLOP/s of one device from PEAK_TFLOPS, or None where the table does not
    name it (CPUs included)."""
    name = device_name(device)
    for key, tf in PEAK_TFLOPS:
        if key in name:
            return tf
    return None


def mfu_basis(device: torch.device) -> str:
    """What the run's MFU column is, for its first line: the formula and the peak it divides by,
    or why there is none."""
    peak = peak_tflops(device)
    if peak is None:
        return f"MFU n/a: no peak for {device_name(device)!r} in distlm/train/metrics.py's table"
    return (f"MFU = tokens/s per device x FLOPs/token / {peak:g} TFLOP/s ({device_name(device)}, dense bf16 "
            f"peak)")


def mfu(tokens_per_s_per_device: float, flops_per_token: float, peak: Optional[float]) -> Optional[float]:
    if not peak:
        return None
    return tokens_per_s_per_device * flops_per_token / (peak * 1e12)


def memory_gb(device: torch.device) -> Optional[float]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return None


def fmt(value: Optional[float], spec: str = ".3f", na: str = "n/a") -> str:
    return na if value is None else format(value, spec)


def process_age_s() -> Optional[float]:
    """Seconds since this process started (Linux /proc; None elsewhere): what a user waits
    before the first step, imports and the launcher included."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        # Field 22 of /proc/self/stat, counted after the ")" that ends the command name
        # (which may itself hold spaces): start time in clock ticks since boot.
        start = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - start)


class SetupClock:
    """Wall time of each phase of a run's set-up, for one line in the log: start-up is a
    fixed cost of every run and of every resume, and the time-to-loss figures include it."""

    def __init__(self) -> None:
        self.phases: list[tuple[str, float]] = []
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases.append((name, now - self._last))
        self._last = now

    def line(self, label: str = "set-up") -> str:
        """``label``: what the phases add up to (the set-up, or the end of a run: its last
        checkpoint, plot, ...)."""
        total = sum(s for _, s in self.phases)
        parts = ", ".join(f"{name} {s:.1f}" for name, s in self.phases)
        age = process_age_s()
        since = f"; {age:.1f} s since the process started" if age is not None else ""
        return f"{label} {total:.1f} s ({parts}){since}"
