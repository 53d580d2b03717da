"""This machine as the processes on it see it: the cores a process may use, how many of
distlm's processes share the host, and which of them this one is. Light (no torch): the program's entry reads it too."""
from __future__ import annotations

import os
from typing import Mapping


def usable_cores() -> int:
    """The cores this process may run on: its affinity, which cgroups and taskset narrow."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def local_ranks(environ: Mapping[str, str]) -> int:
    """The processes of this run on this host: torchrun's LOCAL_WORLD_SIZE, horovodrun's
    HOROVOD_LOCAL_SIZE, else 1."""
    for name in ("LOCAL_WORLD_SIZE", "HOROVOD_LOCAL_SIZE"):
        try:
            return max(1, int(environ.get(name, "")))
        except ValueError:
            continue
    return 1


def local_rank(environ: Mapping[str, str]) -> int:
    """This process's GPU on its machine: torchrun sets LOCAL_RANK; horovodrun only
    HOROVOD_LOCAL_RANK (without it every Horovod rank took cuda:0 and NCCL refused:
    "ncclCommInitRank failed: invalid usage", 2x H200)."""
    return int(environ.get("LOCAL_RANK", environ.get("HOROVOD_LOCAL_RANK", 0)))
