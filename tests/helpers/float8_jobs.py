"""Float8 layers under FSDP2 and DDP: scenarios of kind "float8" for tests/helpers/world.py.

Each job builds the model through distlm.parallel.parallelize with train.fp8 set (so the swap
happens where a training run does it, before the parallel wrappers), takes a few AdamW steps on
fixed global batches with the float8 matmuls running on torch._scaled_mm's CPU kernel, and
returns the full parameters, the losses, the number of float8 layers and the state dict's keys
and dtypes. ``build`` and ``run_steps`` (tests/helpers/muon_jobs.py's) are also the
single-process reference.
"""
from __future__ import annotations

import torch

from distlm.config import load_config
from distlm.model.float8 import Float8Linear
from distlm.model.gpt import GPT
from distlm.parallel import ParallelDims, init_distributed, parallelize
from distlm.train.optim import build_optimizer

# The same fixed global batches and the same loss mean over the data ranks as the Muon tests.
from helpers.muon_jobs import full, run_steps

# Widths that are multiples of 16 (float8 tiles); each rank's 4 x 16 tokens are too.
# AdamW's eps is raised to 1e-5: the k-projection's bias gets no gradient but rounding noise
# (softmax ignores a shift of all keys), which eps=1e-8 turns into full +-lr steps.
MODEL = ["model.n_layer=2", "model.n_head=4", "model.d_model=64", "model.d_ff=96", "model.block_size=16",
         "model.vocab_size=256", "model.position=learned", "model.tie_embeddings=false", "optim.adamw.lr=1e-3",
         "optim.adamw.eps=1e-5", "train.global_batch_size=8", "train.micro_batch_size=4", "train.compile=false",
         "parallel.timeout_s=60"]
JOBS = {"fsdp2-tensorwise": ["parallel.dp_shard=2", "train.fp8=tensorwise"],
        "fsdp2-rowwise": ["parallel.dp_shard=2", "train.fp8=rowwise"],
        "ddp2-tensorwise": ["parallel.dp_replicate=2", "train.fp8=tensorwise"]}


def build(overrides: list[str], dims: ParallelDims | None = None):
    """(config, model to train, plain GPT, optimizer) for this layout (one process: dims=None)."""
    cfg = load_config(None, MODEL + overrides)
    dims = dims or ParallelDims()
    with torch.device("meta"):
        gpt = GPT(cfg.model)

    def materialize(m):
        m.to_empty(device=torch.device("cpu"))
        m.init_weights(cfg.train.seed)

    model = parallelize(gpt, dims, cfg, materialize)[0]
    return cfg, model, gpt, build_optimizer(model, cfg, "cpu")


def summary(gpt, losses: list[float]) -> dict:
    """What the test compares. Collective (full_tensor)."""
    return {"params": {n: full(p) for n, p in gpt.named_parameters()}, "losses": losses,
            "float8_layers": sum(isinstance(m, Float8Linear) for m in gpt.modules()),
            "state_dict": {k: str(v.dtype) for k, v in gpt.state_dict().items()}}


def run(job: dict) -> dict:
    """A scenario of kind "float8": the layout's overrides in "overrides"; the result is
    ``summary``'s."""
    cfg = load_config(None, MODEL + job["overrides"])
    dims = init_distributed(cfg.parallel, "cpu")
    cfg, model, gpt, opt = build(job["overrides"], dims)
    return summary(gpt, run_steps(cfg, model, opt, dims))
