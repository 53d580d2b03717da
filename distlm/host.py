"""This machine as the processes on it see it: the cores a process may use, the RAM it may still take, how many of
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


def host_available_bytes() -> int:
    """The RAM this process may still take on this host: MemAvailable (free pages plus the
    page cache the kernel can drop) where /proc/meminfo exists, else the free pages, and no
    more than what its cgroup's memory limit leaves (a container's --memory)."""
    have = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    have = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if have is None:
        have = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit_file, used_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                  ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                   "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(used_file) as f:
                used = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit():  # "max": no limit (v2); v1 writes a huge number instead
            have = min(have, max(0, int(limit) - used))
        break
    return have
