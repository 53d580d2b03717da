"""CUDA's driver started on a thread of its own while the process is still importing torch.

Starting the driver (cuInit) and creating the device's primary context take a few tenths of a
second on a GPU machine, more with many GPUs. torch does both the first time it touches CUDA,
in the set-up, holding the GIL, so nothing else runs meanwhile. Called through the driver library
directly (ctypes releases the GIL for the call), they run while the main thread imports torch
and distlm. torch then finds the driver started and the context made: the primary context is
the one torch's runtime uses for the device, so nothing is made twice. A machine without the
driver library, or a driver that refuses, leaves everything to torch, as before.

This module imports nothing heavy: the train verb starts it before it imports the Trainer.
"""
from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Mapping, Optional

DRIVER_LIBRARY = "libcuda.so.1"


def local_rank(environ: Mapping[str, str]) -> int:
    """This process's GPU on its machine: torchrun sets LOCAL_RANK; horovodrun only
    HOROVOD_LOCAL_RANK (without it every Horovod rank took cuda:0 and NCCL refused:
    "ncclCommInitRank failed: invalid usage", 2x H200)."""
    return int(environ.get("LOCAL_RANK", environ.get("HOROVOD_LOCAL_RANK", 0)))


class CudaDriverStart:
    """cuInit and cuDevicePrimaryCtxRetain of one device, on a daemon thread. ``outcome``
    says what happened, for the set-up line; the context is kept for the process's life,
    as torch keeps it."""

    def __init__(self, device_index: int, library: str = DRIVER_LIBRARY) -> None:
        self.device_index, self.library = device_index, library
        self.seconds: Optional[float] = None
        self.outcome = "not started"
        self._thread = threading.Thread(target=self._run, name="distlm cuda driver start", daemon=True)

    @classmethod
    def for_run(cls, device: str, environ: Optional[Mapping[str, str]] = None) -> Optional["CudaDriverStart"]:
        """Started for a run whose train.device may be CUDA (auto or cuda), on the device the
        Trainer will take (cuda:LOCAL_RANK); None for train.device=cpu."""
        if device == "cpu":
            return None
        return cls(local_rank(os.environ if environ is None else environ)).start()

    def start(self) -> "CudaDriverStart":
        self.outcome = "running"
        self._thread.start()
        return self

    def join(self) -> None:
        self._thread.join()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            self.outcome = self._start_driver()
        except OSError as e:  # no driver library on this machine: a CPU run, torch decides
            self.outcome = f"no CUDA driver ({e})"
        finally:
            self.seconds = time.perf_counter() - t0

    def _start_driver(self) -> str:
        lib = ctypes.CDLL(self.library)
        if (rc := lib.cuInit(0)) != 0:
            return f"cuInit refused ({rc})"
        dev = ctypes.c_int()
        if (rc := lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(self.device_index))) != 0:
            return f"no device {self.device_index} ({rc})"
        ctx = ctypes.c_void_p()
        if (rc := lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)) != 0:
            return f"context of device {self.device_index} refused ({rc})"
        return "done"

    def describe(self) -> Optional[str]:
        """For the set-up line's background part; None where there was no driver to start."""
        if self.outcome.startswith("no CUDA driver"):
            return None
        took = f"{self.seconds:.1f} s" if self.seconds is not None else "still running"
        return f"cuda driver start {took} in the background from the imports on ({self.outcome})"
