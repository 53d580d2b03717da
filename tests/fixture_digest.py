"""A digest of every tensor a distlm checkpoint holds, to compare two runs' checkpoints bit for bit.

Read through distlm's own safe DCP reader (no code from the files runs). Entries that are not
tensors (the optimizer groups' hyperparameters) are left out: which keys a group carries is
the code's business, what the run computed is in the tensors."""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.distributed.checkpoint.metadata as dcp_md


def checkpoint_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    from distlm.checkpoint.safe_dcp import load_weights_only, read_dcp_metadata, safe_load
    md = read_dcp_metadata(ckpt / ".metadata")
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
             if isinstance(v, dcp_md.TensorStorageMetadata)}
    safe_load(state, ckpt)
    for f in sorted((ckpt / "rng").glob("*.pt")):
        for k, v in load_weights_only(f, f"{f}").items():
            if isinstance(v, torch.Tensor):
                state[f"rng/{f.stem}/{k}"] = v
    return state


def digest(t: torch.Tensor) -> str:
    shape = tuple(t.shape)
    t = t.detach().contiguous().cpu().reshape(-1)
    return hashlib.sha256(str(t.dtype).encode() + str(tuple(shape)).encode()
                          + t.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def checkpoint_digest(ckpt: Path) -> dict[str, str]:
    return {k: digest(v) for k, v in sorted(checkpoint_tensors(ckpt).items())}


def cpu_key() -> dict:
    """What CPU arithmetic depends on: the same kernels on as many threads give the same bits."""
    return {"torch": torch.__version__.split("+")[0], "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads()}
