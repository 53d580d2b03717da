"""Context parallelism on a GPT: scenarios of kind "context" for tests/helpers/world.py.

A job is {"kind": "context", "name", "cp", "model", "steps", ...}, cp the world size. The
module alone, without the Trainer: a job builds the model on the meta device, allocates and
initialises it (the whole-tensor draw, so it starts from the single-process weights), wraps it
in DDP over the cp ranks, and trains ``steps`` AdamW steps on the global batches of
``global_batch`` (the same function the single-process reference calls), each rank on its part
of every row. ``checkpoint_compile``: activation checkpointing and compiled blocks. A job may
save model and optimizer (DCP) after step ``save_at``, or start from ``resume``. The result is
the job's per-step (loss, grad norm).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

from distlm.config import load_config
from distlm.model.gpt import GPT
from distlm.parallel.context import ContextParallel
from distlm.parallel.grad import clip_grad_norm

B, LR, CLIP = 8, 1e-2, 0.3


def model_config(overrides: list[str]):
    return load_config(None, overrides).model


def global_batch(step: int, vocab: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s rows (B, T) and targets: a pure function of the step."""
    g = torch.Generator().manual_seed(1000 + step)
    rows = torch.randint(0, vocab, (B, seq_len + 1), generator=g)
    return rows[:, :-1], rows[:, 1:]


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, foreach=False)


def train_steps(optimizer, cfg, steps, forward_backward, clip_params, report=float) -> list:
    """(loss, grad norm) per step; ``forward_backward(x, y)`` runs this rank's part of the
    global rows forward and backward and returns its loss."""
    out = []
    for step in steps:
        x, y = global_batch(step, cfg.vocab_size, cfg.block_size)
        loss = forward_backward(x, y)
        norm = clip_grad_norm(clip_params(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append((float(report(loss)), float(norm)))
    return out


def reference(model_overrides: list[str], steps: int, start: int = 1, resume: str | None = None) -> list:
    """One process, whole rows, no shard: the numbers every layout must hit. ``resume``: a
    checkpoint (DCP) written by a job after step ``start - 1``."""
    cfg = model_config(model_overrides)
    model = GPT(cfg)
    opt = make_optimizer(model.parameters())
    if resume:
        _load(resume, model, opt)

    def forward_backward(x, y):
        loss = model(x, targets=y)
        loss.backward()
        return loss.detach()

    return train_steps(opt, cfg, range(start, steps + 1), forward_backward, model.parameters)


def run_job(job: dict) -> list:
    cp = job["cp"]
    assert cp == dist.get_world_size(), job
    cfg = model_config(job["model"])
    with torch.device("meta"):
        model = GPT(cfg)
    if job.get("checkpoint_compile"):
        # Activation checkpointing recomputes the block, its all-gather included, in the
        # backward; each block compiled (aot_eager: traced as inductor would be, without
        # its C++ build) around the attention, which is a graph break.
        from distlm.parallel.parallelize import apply_activation_checkpointing
        apply_activation_checkpointing(model, "full")
        for block in model.blocks.values():
            block.compile(backend="aot_eager")
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    group = dist.group.WORLD
    wrapped = DDP(model, process_group=group)  # the cp ranks average their gradients
    opt = make_optimizer(model.parameters())
    ctx = ContextParallel(group)

    def forward_backward(x, y):
        x, y, shard = ctx.shard(x, y)
        loss = wrapped(x, targets=y, shard=shard)
        loss.backward()
        return loss.detach()

    def report(loss):
        # The mean over every token of the global batch: each rank holds as many tokens.
        t = loss.clone()
        dist.all_reduce(t, group=group)
        return t / cp

    start = 1
    if job.get("resume"):
        _load(job["resume"], model, opt)
        start = job["resume_step"] + 1
    trace = []
    for step in range(start, job["steps"] + 1):
        trace += train_steps(opt, cfg, [step], forward_backward, model.parameters, report)
        if step == job.get("save_at"):
            _save(job["save_dir"], model, opt)
    return trace


def _save(path: str, model, opt) -> None:
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def _load(path: str, model, opt) -> None:
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def run(job: dict) -> dict:
    """A scenario of kind "context": its per-step (loss, grad norm), or the refusal it expected."""
    try:
        return {"trace": run_job(job)}
    except Exception as e:  # a refusal the test expects, or a failure it reports
        if not job.get("expect_error"):
            raise
        return {"error": f"{type(e).__name__}: {e}"}


def sharded_against_whole(cp: int, docs, window: int, device="cpu", dtype=torch.float32):
    """Every rank's attend_shard on its part of q, over the whole row's K and V, joined, and
    the one-process attention of the whole row under the same rule."""
    from distlm.model.attention import attend, dense_mask
    from distlm.parallel.context import attend_shard, shard_sequence, unshard_sequence
    g = torch.Generator().manual_seed(cp)
    B, H, T, hd = 2, 3, 8 * cp, 16
    q, k, v = (torch.randn(B, H, T, hd, generator=g).to(device, dtype) for _ in range(3))
    parts = [attend_shard(shard_sequence(q, cp, r, dim=2), torch.stack((k, v)), cp, r, docs, window)
             for r in range(cp)]
    mask = dense_mask(T, T, device, docs=docs, window=window) if docs is not None or window else None
    return unshard_sequence(parts, dim=2).float(), attend(q, k, v, mask, True, 0.0).float()
