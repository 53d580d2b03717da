"""What a launch on this machine would use, and under torchrun one all-reduce: the report
`distlm env` prints (its command line is in distlm/cli/verbs.py).

    distlm env [--json]
    torchrun --nproc_per_node 8 -m distlm env          # versions, GPUs, and one all-reduce per rank
"""
from __future__ import annotations

import os
import socket
import sys
import time
from typing import Mapping

from distlm.launch.slurm import SLURM_META_KEYS


def env_report(env: Mapping[str, str] = os.environ) -> dict:
    """This process's view: versions, devices, and what a launch here would use."""
    import platform

    import torch
    import torch.distributed as dist
    cuda = torch.cuda.is_available()
    gpus = []
    for i in range(torch.cuda.device_count() if cuda else 0):
        p = torch.cuda.get_device_properties(i)
        gpus.append({"index": i, "name": p.name, "memory_gb": round(p.total_memory / 2**30, 1),
                     "capability": f"{p.major}.{p.minor}"})
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda and dist.is_nccl_available() else None
    keys = [k for k in env if k.startswith(("NCCL_", "TORCH_NCCL_", "TORCHELASTIC_RESTART_COUNT",
                                            "TORCHELASTIC_MAX_RESTARTS")) or k in SLURM_META_KEYS + ("SLURM_NODEID",)]
    return {
        "host": socket.gethostname(), "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if cuda else None, "nccl": nccl,
        "gpus": gpus, "backend": "nccl" if cuda else "gloo",
        "available": {"nccl": dist.is_nccl_available(), "gloo": dist.is_gloo_available(), "mpi": dist.is_mpi_available()},
        "world_size": int(env.get("WORLD_SIZE", 1)), "rank": int(env.get("RANK", 0)),
        "local_rank": int(env.get("LOCAL_RANK", 0)),
        "master": f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}" if "MASTER_ADDR" in env else None,
        # Where this process's imports keep their bytecode (distlm/bytecode.py).
        "bytecode": sys.pycache_prefix or "beside the sources",
        "env": {k: env[k] for k in sorted(keys) + ["CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"] if k in env},
    }


def check_collectives(report: dict, timeout_s: float = 60) -> list[dict]:
    """Under torchrun: start the group, all-reduce once, gather every rank's report."""
    import datetime

    import torch
    import torch.distributed as dist
    cuda = report["backend"] == "nccl"
    device = torch.device("cuda", report["local_rank"]) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(report["backend"], timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=device if cuda else None)
    try:
        x = torch.ones(1 << 20, device=device)
        t0 = time.perf_counter()
        dist.all_reduce(x)
        ok = bool((x == dist.get_world_size()).all())  # .all() on device, read back: the sync point
        report["all_reduce"] = {"ok": ok, "elements": x.numel(), "seconds": round(time.perf_counter() - t0, 4)}
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, report)
        return reports
    finally:
        dist.destroy_process_group()

