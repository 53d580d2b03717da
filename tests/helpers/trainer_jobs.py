"""Scenarios of kind "train" for tests/helpers/world.py: one ``distlm train`` job each.

A job is {"kind": "train", "name": ..., "overrides": [...]}, the same Trainer the CLI builds;
"grad_norms": true also takes the gradient norm two ways before training (FSDP and TP), and
"count_collectives": true records the collectives of one update (TP only) and the norms. Losses and
grad norms land in each run's metrics.csv; the result is what only a live process can see
(weights at init, tying, FSDP units, group timeouts), one entry per rank.
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from distlm.config import load_config
from distlm.parallel import ParallelDims
from distlm.parallel.grad import clip_grad_norm
from distlm.optim.groups import one_mesh_per_group
from distlm.train.setup import build_model
from distlm.train.trainer import Trainer


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _timeout_s(group) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def inspect_model(trainer: Trainer) -> dict:
    """What the tests check before the first step. Collective (full_tensor)."""
    gpt, dims = trainer.module, trainer.dims
    ref = build_model(trainer.cfg, ParallelDims(), torch.device("cpu"), trainer.task)[1]  # the single-process init
    ref_params = dict(ref.named_parameters())
    mismatched = [n for n, p in gpt.named_parameters() if not torch.equal(_full(p.detach()), ref_params[n])]
    axes = {n: _timeout_s(dims.mesh[n].get_group()) for n, k in
            zip(("dp_replicate", "dp_shard"), (dims.dp_replicate, dims.dp_shard)) if k > 1}
    axes["dp"] = _timeout_s(dims.dp_mesh.get_group())
    return {
        "init_mismatched": mismatched,
        "n_params": len(ref_params),
        "tied": _tied(gpt),
        "fsdp_root": isinstance(gpt, FSDPModule),
        "fsdp_blocks": [isinstance(b, FSDPModule) for b in gpt.blocks.values()],
        "embedding_units": [isinstance(m, FSDPModule) for m in (gpt.tok_emb, gpt.head)],
        "group_timeouts_s": axes,
        # the data and loss meshes: an axis of the root mesh where one axis spans the ranks
        "dp_mesh_dims": list(dims.dp_mesh.mesh_dim_names),
        "loss_mesh_is_dp_mesh": dims.loss_mesh is dims.dp_mesh,
        "model_type": type(trainer.model).__name__,
        # fused AdamW (CUDA) refuses a group mixing plain tensors and DTensors, or two meshes
        "optimizer_groups_one_mesh": one_mesh_per_group(trainer.optimizer.param_groups),
        "optimizer_groups": len(trainer.optimizer.param_groups),
    }


def _tied(gpt) -> bool | None:
    """Head and embedding share one Parameter (None where a pipeline rank holds only one)."""
    if gpt.head is None or gpt.tok_emb is None:
        return None
    return gpt.head.weight is gpt.tok_emb.weight


def norm_paths(trainer: Trainer) -> list[float]:
    """One backward, then the gradient norm two ways: clip_grad_norm's (local squares, one
    all-reduce per group of gradients) and DTensor's own, gradient by gradient, with the
    full values it reduces to."""
    x, y = trainer.loader.micro_batches(0)[0]
    trainer.stepper.forward_backward([(x, y)], trainer.compute)  # under TP: inside loss_parallel
    params = [p for p in trainer.model.parameters() if p.grad is not None]
    by_dtensor = 0.0
    for p in params:
        n = torch.linalg.vector_norm(p.grad, 2.0, dtype=torch.float64)
        by_dtensor += float(n.full_tensor() if hasattr(n, "full_tensor") else n) ** 2
    by_local = float(clip_grad_norm(params, 0.0))
    trainer.optimizer.zero_grad(set_to_none=True)
    return [by_local, by_dtensor ** 0.5]


class CollectiveDtypes(TorchDispatchMode):
    """Counts the functional collectives DTensor issues, by op and by the dtype they move."""

    def __init__(self):
        super().__init__()
        self.counts: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and args and isinstance(args[0], torch.Tensor):
            by_dtype = self.counts.setdefault(func._opname, {})
            dtype = str(args[0].dtype).removeprefix("torch.")
            by_dtype[dtype] = by_dtype.get(dtype, 0) + 1
        return func(*args, **(kwargs or {}))


def update_collectives(trainer: Trainer) -> dict:
    """One backward, then the collectives each phase of the update issues: reducing what
    TP left as partial sums, the gradient norm, and the optimizer step (which should issue
    none: hundreds of per-parameter all-reduces hid there). Counted by DTensor's
    CommDebugMode, which sees c10d and functional collectives alike. The step runs at
    learning rate 0 (weights unchanged); gradients and optimizer state are discarded after."""
    from torch.distributed.tensor.debug import CommDebugMode
    rates = [g["lr"] for g in trainer.optimizer.param_groups]
    for g in trainer.optimizer.param_groups:
        g["lr"] = 0.0
    x, y = trainer.loader.micro_batches(0)[0]
    with CommDebugMode() as mode:
        trainer.stepper.forward_backward([(x, y)], trainer.compute)
    # by kind: the forward and backward's own collectives (TP's all-gathers, reduce-scatters)
    counts = {"forward_backward": {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}}
    for phase, fn in (("reduce", lambda: trainer.engine.finish_grad_reduction(trainer.optimizer)),
                      ("clip", lambda: trainer.stepper.clip(1e9)),
                      ("optimizer", lambda: trainer.optimizer.step())):
        with CommDebugMode() as mode:
            fn()
        counts[phase] = mode.get_total_counts()
    # The same forward/backward under bf16 autocast: which dtype each collective moves.
    with CollectiveDtypes() as seen, torch.autocast("cpu", dtype=torch.bfloat16):
        trainer.stepper.forward_backward([(x, y)], trainer.compute)
    counts["autocast_dtypes"] = seen.counts
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.optimizer.state.clear()
    for g, lr in zip(trainer.optimizer.param_groups, rates):
        g["lr"] = lr
    return counts


def _crash_after_save(trainer: Trainer, hang: bool = False) -> None:
    """Rank 1 dies right after the first checkpoint, as a lost GPU would; torchrun
    --max_restarts then starts every worker again, and train.resume=auto continues.
    ``hang``: rank 1 stops instead, so that the test can kill its whole node (agent and
    worker, SIGKILL) as a lost host goes: an agent whose worker merely fails shuts the
    rendezvous down cleanly, which no replacement node could join."""
    save = trainer.save

    def save_then_crash(*args, **kwargs):
        path = save(*args, **kwargs)
        if trainer.dims.rank == 1:
            if hang:
                time.sleep(600)
            os._exit(3)
        return path
    trainer.save = save_then_crash


def run(job: dict) -> list[dict]:
    """One ``distlm train`` job (a scenario of kind "train"): what each rank saw, rank by rank."""
    cfg = load_config(None, job["overrides"])
    trainer = Trainer(cfg)
    if job.get("crash_after_first_save") and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        _crash_after_save(trainer)
    # A replacement node's agent starts its count at 0 too: DISTLM_TEST_NO_CRASH marks it.
    if job.get("hang_after_first_save") and os.environ.get("DISTLM_TEST_NO_CRASH") != "1" \
            and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        _crash_after_save(trainer, hang=True)
    info = {"start_step": trainer.step, "resumed_from": str(trainer.resumed_from or ""),
            "world_size": trainer.dims.world_size, "dp_rank": trainer.dims.dp_rank}
    if trainer.step == 0 and trainer.device.type == "cpu":  # the inspection reads gloo groups
        info.update(inspect_model(trainer))
        # One more forward/backward: only for the jobs whose norms a test compares.
        sharded = trainer.dims.dp_shard > 1 or trainer.dims.tp > 1
        if (job.get("grad_norms") or job.get("count_collectives")) and sharded and trainer.stepper.parts is None:
            info["grad_norms"] = norm_paths(trainer)
        # Three more forward/backward passes under dispatch modes: only for the jobs whose
        # collectives a test counts (a few seconds each on two cores).
        if job.get("count_collectives") and trainer.dims.tp > 1 and trainer.stepper.parts is None:
            info["update_collectives"] = update_collectives(trainer)
    trainer.train()
    info["tied_after_training"] = _tied(trainer.module)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, info)
    return gathered
