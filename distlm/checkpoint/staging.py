"""Pinned host memory a synchronous checkpoint save copies the state into before DCP writes it."""
from __future__ import annotations

import os
import threading
from typing import Iterator, Optional

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

from distlm.host import host_available_bytes, local_ranks


class HostStaging:
    """Pinned host memory for a checkpoint's state, allocated on a thread while training runs, so
    that a synchronous save copies the device state into it at the link's speed and DCP's writer
    threads only serialise and write. Written from the device, DCP copies each tensor into new
    pageable memory as it writes, and faulting in those pages is most of the write: on one H200,
    speedrun-124m's 3.0 GB took 1.6-2.4 s to copy into new memory and 0.06 s into memory already
    pinned, and DCP wrote it in 1.7 s from the host against 3.4-4.5 s from the device
    (benchmarks/tools/final_save.py, docs/results/time-to-loss.md).

    Only plain device tensors are staged, where their pinned blocks fit in a quarter of the host's
    free memory (shared among its local ranks); DTensors (FSDP2, TP) and anything not prepared are written
    from where they are. The memory is held for the run and reused by every save, which is safe
    because a synchronous save has finished writing before it returns."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._thread: Optional[threading.Thread] = None

    def prepare(self, model, optimizer) -> bool:
        """Start allocating the buffers for this model's and optimizer's state (every state tensor
        must exist: call it after the first step). False where there is nothing to stage or it
        would not fit."""
        model_sd, optim_sd = get_state_dict(model, optimizer)
        leaves = [(path, t.shape, t.dtype, t.device) for path, t in _tensor_paths({"model": model_sd, "optim": optim_sd})
                  if _stageable(t)]
        need = sum(_pinned_bytes(shape.numel() * dtype.itemsize) for _, shape, dtype, _ in leaves)
        if not leaves or need > host_available_bytes() // (4 * local_ranks(os.environ)):
            return False
        device = leaves[0][3]

        def allocate() -> None:
            torch.cuda.set_device(device)  # a new thread's current device is 0: pin in this rank's context
            try:
                for path, shape, dtype, _ in leaves:
                    self._buffers[path] = torch.empty(shape, dtype=dtype, pin_memory=True)
            except RuntimeError:
                pass  # the host would not pin more: what is not staged is written from the device

        self._thread = threading.Thread(target=allocate, name="distlm-host-staging", daemon=True)
        self._thread.start()
        return True

    def stage(self, state: dict) -> dict:
        """The state with each prepared tensor copied into its buffer (waits for the allocation
        if it is still going on); the others as they are."""
        if self._thread is None:
            return state
        self._thread.join()
        copied = []

        def host(x, path: tuple):
            if isinstance(x, dict):
                return {k: host(v, path + (k,)) for k, v in x.items()}
            if isinstance(x, (list, tuple)):
                return type(x)(host(v, path + (i,)) for i, v in enumerate(x))
            buf = self._buffers.get(path)
            if buf is not None and _stageable(x) and buf.shape == x.shape and buf.dtype == x.dtype:
                copied.append(x.device)
                return buf.copy_(x.detach(), non_blocking=True)
            return x

        out = host(state, ())
        for device in set(copied):
            torch.cuda.synchronize(device)
        return out


def _pinned_bytes(nbytes: int) -> int:
    """What torch's caching host allocator takes for a pinned tensor of ``nbytes``: it rounds each
    block up to a power of two, so the buffers may hold up to twice the state's size."""
    return 1 << max(0, nbytes - 1).bit_length()


def _stageable(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cuda" and not isinstance(t, DTensor)


def _tensor_paths(x, path: tuple = ()) -> Iterator[tuple[tuple, torch.Tensor]]:
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _tensor_paths(v, path + (k,))
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _tensor_paths(v, path + (i,))
    elif isinstance(x, torch.Tensor):
        yield path, x
