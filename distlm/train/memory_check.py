"""A run that cannot fit is refused before its run folder exists: the planner's memory
estimate against what the device has free (train.memory_check)."""
from __future__ import annotations

import os

import torch

from distlm.config import Config
from distlm.errors import AgreedError, ConfigError
from distlm.host import host_available_bytes
from distlm.model.memory import GIB, check_fits, position_table_bytes
from distlm.train.fast_defaults import Device, memory_estimate
from distlm.host import local_ranks


def check_memory(cfg: Config, device: torch.device, dims, comm=None, environ=os.environ) -> None:
    """Refuse a run the device cannot hold, in one line, before the run folder is made and
    anything allocated (train.memory_check=false starts it anyway). The need is the planner's
    estimate per process (distlm/planner.py: parameters, gradients, optimizer state, FSDP
    buffers, activations and logits at this micro-batch) plus the position tables; on a CPU
    it is times the processes of this host, which share its RAM. What the device has is the
    least over the ranks, so that every rank decides alike (collective when distributed).
    ``environ``: where the processes of this host are counted (a launcher asks for its ranks')."""
    if not cfg.train.memory_check:
        return
    distributed = comm is not None and dims.world_size > 1
    if device.type == "cuda":
        have = Device.measure(device, comm if distributed else None).free_gib * GIB
        per_host, where = 1, f"{device} (its free memory)"
    else:
        have = float(host_available_bytes())
        if distributed:
            have = -float(comm.max(torch.tensor([-have], dtype=torch.float64))[0])
        per_host = local_ranks(environ)
        where = "this machine's RAM" + (f", shared by its {per_host} processes," if per_host > 1 else "")
    est = memory_estimate(cfg, Device(device.type, have / GIB), dims, cfg.train.micro_batch_size)
    need = (est.total_gb * GIB + position_table_bytes(cfg.model)) * per_host
    m = cfg.model
    check_fits(need, have, f"model.n_layer={m.n_layer} x model.d_model={m.d_model}, model.block_size={m.block_size}, "
                           f"train.micro_batch_size={cfg.train.micro_batch_size} (params {est.params_gb:.1f} GiB, "
                           f"grads {est.grads_gb:.1f}, optimizer {est.optim_gb:.1f}, activations "
                           f"{est.activations_gb:.1f}, per process)", where,
               "use a smaller model or micro-batch, more GPUs (`distlm plan` shows the layouts that fit), or "
               "train.memory_check=false to start anyway",
               # every rank compares the same estimate with the same least free memory: one refusal
               AgreedError if distributed else ConfigError)
