"""Which dtype a device multiplies matrices fastest in: measured, not guessed from the name.

Muon's Newton-Schulz iterations are matmuls only. On a GPU bf16 runs on tensor cores at
several times fp32's rate. On a CPU it depends on the chip and on torch's build: with AMX or
AVX512-BF16 bf16 is the faster one (a 2-core Xeon with AMX, 4 x 256^2 matmuls: 0.30 ms in
bf16 against 1.26 ms in fp32), without them torch falls back to a slow path (a 2-core AMD
EPYC with AVX2 only: 46.4 ms against 1.08 ms, 43x slower; the Xeon with oneDNN capped at
AVX2, ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2: 67.6 ms against 1.66 ms). CPU flags
do not tell which path torch will take (the caps above leave the flags as they are), so
the choice is timed: a few small matmuls in each dtype, once per device per probe.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

# The Newton-Schulz matmuls of the models trained on CPUs (the demo's 128 x 512 blocks form
# 128 x 128 Gram matrices) are about this size; large enough that per-call overhead does not
# decide, small enough that a slow bf16 path costs ~70 ms of probing in all.
PROBE_SIZE = 256
PROBE_REPEATS = 3


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    seconds: dict  # dtype -> best seconds per matmul; empty where nothing was measured (CUDA)

    def describe(self) -> str:
        """What was measured, e.g. "a 256x256 matmul: bf16 17.10 ms, fp32 0.42 ms"."""
        if not self.seconds:
            return "not measured"
        name = {torch.bfloat16: "bf16", torch.float32: "fp32"}
        times = ", ".join(f"{name[d]} {1e3 * s:.2f} ms" for d, s in self.seconds.items())
        return f"a {PROBE_SIZE}x{PROBE_SIZE} matmul: {times}"


def time_matmul(device: torch.device, dtype: torch.dtype) -> float:
    """Best of PROBE_REPEATS wall times of one PROBE_SIZE^2 matmul in ``dtype``, after a
    warm-up (the first call pays for oneDNN's kernel selection)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(PROBE_SIZE, PROBE_SIZE, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(PROBE_SIZE, PROBE_SIZE, generator=gen).to(device=device, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(PROBE_REPEATS):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return best


class MatmulDtypeProbe:
    """The fastest matmul dtype of each device, measured on first use and kept: one probe
    lives as long as what holds it (a run's resolution makes one, before the optimizer is
    built, and the optimizer reads the dtype it chose), so no step pays for it.

    ``measure(device, dtype) -> seconds`` is the timer (time_matmul; tests give their own).
    bf16 is kept unless it is measured slower: it is Muon's reference precision and what a
    GPU run uses, so a CPU where both are fast matches the GPU's numerics.
    """

    CANDIDATES = (torch.bfloat16, torch.float32)

    def __init__(self, measure: Optional[Callable[[torch.device, torch.dtype], float]] = None):
        self._measure = measure or time_matmul
        self._chosen: dict[str, DtypeChoice] = {}

    def choose(self, device: torch.device) -> DtypeChoice:
        device = torch.device(device)
        key = str(device)
        if key not in self._chosen:
            if device.type == "cuda":
                self._chosen[key] = DtypeChoice(torch.bfloat16, {})
            else:
                seconds = {dtype: self._measure(device, dtype) for dtype in self.CANDIDATES}
                fastest = torch.bfloat16 if seconds[torch.bfloat16] <= seconds[torch.float32] else torch.float32
                self._chosen[key] = DtypeChoice(fastest, seconds)
        return self._chosen[key]
