"""Which torch device a device name (train.device, --device) means on this machine.

Below the Trainer, the tasks and the command line, which all resolve the same names.
"""
from __future__ import annotations

import torch

from distlm.config import ConfigError


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but CUDA is not available on this machine (use train.device=auto or cpu)")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", local_rank)
