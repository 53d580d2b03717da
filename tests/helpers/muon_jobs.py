"""Muon under data and tensor parallel layouts: scenarios of kind "muon" for tests/helpers/world.py.

Each job builds the model through distlm.parallel.parallelize (meta device, per-name
init, so every layout starts from the same weights), takes a few Muon steps on fixed
global batches, and returns the full parameters and momentum buffers, with how many
matrices each rank orthogonalised. A job may also save a DCP checkpoint that the test loads
into one process. ``build`` and ``run_steps`` are also the single-process reference the test
computes.
"""
from __future__ import annotations

from pathlib import Path

import torch

from distlm.config import load_config
from distlm.model.gpt import GPT
from distlm.model.loss import lm_loss
from distlm.parallel import ParallelDims, init_distributed, parallelize
from distlm.train.optim import build_optimizer

STEPS, BATCH = 3, 8
# Learned positions, untied head, biases, SwiGLU (a third matrix shape) and a d_ff that is
# not d: AdamW and Muon groups (the embedding tables in their own, optim.muon.embed_lr), square, tall and
# wide matrices, Shard(0) and Shard(1) under TP.
# AdamW's eps is raised to 1e-5: the k-projection's bias gets no gradient but rounding noise
# (softmax ignores a shift of all keys), which eps=1e-8 turns into full +-lr steps that
# differ between layouts (measured 4e-6 .. 1.6e-5 after 3 steps; Muon's matrices 1e-7).
MODEL = ["model.n_layer=2", "model.n_head=4", "model.d_model=64", "model.d_ff=96", "model.block_size=16",
         "model.vocab_size=256", "model.position=learned", "model.mlp=swiglu", "model.tie_embeddings=false",
         "optim.name=muon", "optim.adamw.lr=1e-3", "optim.adamw.eps=1e-5", "optim.muon.lr=0.02", "optim.muon.embed_lr=3e-3", "optim.adamw.weight_decay=0.1",
         "optim.muon.weight_decay=0.1", "train.global_batch_size=8", "train.micro_batch_size=2",
         "parallel.timeout_s=60", "parallel.loss_parallel=false"]
LAYOUTS = {"ddp2": ["parallel.dp_replicate=2"], "fsdp2": ["parallel.dp_shard=2"], "tp2": ["parallel.tp=2"]}
LAYOUTS_4 = {"ddp4": ["parallel.dp_replicate=4"], "hsdp2x2": ["parallel.dp_replicate=2", "parallel.dp_shard=2"],
             "tp2_fsdp2": ["parallel.tp=2", "parallel.dp_shard=2"], "tp2_ddp2": ["parallel.tp=2", "parallel.dp_replicate=2"]}


def build(overrides: list[str], dims: ParallelDims | None = None, ns_dtype: torch.dtype = torch.float32):
    """(config, model to train, plain GPT, optimizer) for this layout (one process: dims=None)."""
    cfg = load_config(None, MODEL + overrides)
    if dims is None:
        dims = ParallelDims()
    with torch.device("meta"):
        gpt = GPT(cfg.model)

    def materialize(m):
        m.to_empty(device=torch.device("cpu"))
        m.init_weights(cfg.train.seed)

    model = parallelize(gpt, dims, cfg, materialize)[0]
    opt = build_optimizer(model, cfg, "cpu")
    opt.ns_dtype = ns_dtype
    return cfg, model, gpt, opt


def batch(step: int, vocab: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    t = torch.randint(0, vocab, (BATCH, block + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def run_steps(cfg, model, opt, dims: ParallelDims | None = None) -> list[float]:
    """STEPS optimizer steps on the same global batches whatever the layout; the lr is set
    on every group, as the Trainer's schedule does."""
    losses = []
    dp_rank, dp_size = (dims.dp_rank, dims.dp_size) if dims is not None else (0, 1)
    per = BATCH // dp_size
    for step in range(STEPS):
        x, y = batch(step, cfg.model.vocab_size, cfg.model.block_size)
        x, y = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
        for g in opt.param_groups:
            g["lr"] = cfg.optim.adamw.lr
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        if dp_size > 1:  # the mean over the global batch, as one process computes it
            import torch.distributed as dist
            dist.all_reduce(loss, group=dims.dp_mesh.get_group())
            loss = loss / dp_size
        losses.append(float(loss))
    return losses


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def snapshot(gpt, opt) -> dict:
    """Full (unsharded) parameters and Muon momentum buffers by name. Collective."""
    params = {n: full(p) for n, p in gpt.named_parameters()}
    momentum = {n: full(opt.state[p]["momentum_buffer"]) for n, p in gpt.named_parameters()
                if "momentum_buffer" in opt.state.get(p, {})}
    return {"params": params, "momentum": momentum}


def run(job: dict) -> dict:
    """A scenario of kind "muon": {"layout": [overrides], "ns_dtype": "bf16" or "fp32",
    "checkpoint": a folder to save the end state in, or absent}. The result: full parameters
    and momentum buffers, losses, and how many matrices each rank orthogonalised."""
    import torch.distributed as dist
    from distlm.checkpoint import save_checkpoint
    extra = job["layout"]
    ns_dtype = torch.bfloat16 if job.get("ns_dtype") == "bf16" else torch.float32
    cfg = load_config(None, MODEL + extra)
    dims = init_distributed(cfg.parallel, "cpu")
    cfg, model, gpt, opt = build(extra, dims, ns_dtype)
    losses = run_steps(cfg, model, opt, dims)
    snap = snapshot(gpt, opt)
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, opt.last_orthogonalised)
    model_type = type(model).__name__
    same = None
    if model_type == "DistributedDataParallel":
        # Each rank updates its own replica from the shared updates: they must stay bit-identical.
        replicas = [None] * dist.get_world_size()
        dist.all_gather_object(replicas, {n: p.detach().clone() for n, p in gpt.named_parameters()})
        same = all(torch.equal(r[n], replicas[0][n]) for r in replicas for n in replicas[0])
    if job.get("checkpoint"):
        save_checkpoint(Path(job["checkpoint"]), STEPS, model, opt, {"config": cfg.to_dict(), "trainer": {"step": STEPS}})
    return {**snap, "losses": losses, "orthogonalised": counts, "model_type": model_type, "replicas_identical": same,
            "param_types": sorted({type(p).__name__ for p in gpt.parameters()})}
