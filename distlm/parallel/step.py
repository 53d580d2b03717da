"""How one global batch becomes gradients: the step engines that ``parallelize()`` returns.

``PlainStep`` runs the micro-batches through a model that holds whole layers (one
process, DDP, FSDP2, TP), accumulating gradients and reducing them once, on the last
micro-batch. ``PipelineStep`` hands the local batch to a ``torch.distributed.pipelining``
schedule, which splits it into microbatches and runs forward and backward across stages.
Both give the Trainer the same four calls, so the Trainer has no pipeline branch:

    bind(task, cfg, plan, accum_steps)            once, after the model is built
    forward_backward(micro, compute, sync_grads)  -> mean loss of the local batch
    eval_losses(batches, compute)                 -> (sum of loss x rows, rows) on this rank
    clip(max_norm)                                -> global gradient norm before clipping
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from distlm.model.gpt import count_params
from distlm.parallel.grad import clip_grad_norm, grad_sync
from distlm.parallel.applied import Batch


def loss_value(t: torch.Tensor) -> torch.Tensor:
    """A loss computed under TP's loss_parallel is a replicated DTensor; the loop wants a tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class PlainStep:
    parts = None           # no pipeline
    n_microbatches = None  # accumulation is the loader's micro-batches

    def __init__(self, model: nn.Module):
        self.model = model
        self.loss = None

    def bind(self, task, cfg, plan, accum_steps: int) -> None:
        """``plan``: the ParallelPlan this step belongs to (its loss choice, per-batch hook, device)."""
        self.loss = task.loss_fn(cfg, plan)
        self.shard_batch = plan.shard_batch
        self.device = plan.device

    def forward_backward(self, micro: list, compute, sync_grads: bool = True) -> torch.Tensor:
        loss_sum = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(micro):
            b = self.shard_batch(x, y)
            # Gradients are reduced once, in the last micro-batch's backward.
            with grad_sync(self.model, enabled=sync_grads and i == len(micro) - 1), compute():
                loss = self.loss(self.model, b.inputs, b.targets, **b.forward) / len(micro)
                loss.backward()
            loss_sum += loss_value(loss.detach())
        return loss_sum

    def eval_losses(self, batches, compute) -> tuple[torch.Tensor, torch.Tensor]:
        """``batches`` yields (inputs, targets, weight), weight = the rows of the validation set
        in that micro-batch (0 for a repeat that only keeps the ranks' collectives in step).
        Returns (sum of loss x weight, sum of weights) on this rank."""
        total = torch.zeros((), device=self.device)
        count = torch.zeros((), device=self.device)
        for x, y, w in batches:
            b = self.shard_batch(x.to(self.device), y.to(self.device))
            with compute():
                # detached: evaluated through the training graphs, autograd records each loss
                total += loss_value(self.loss(self.model, b.inputs, b.targets, **b.forward)).detach() * w
            count += w
        return total, count

    def clip(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm(self.model.parameters(), max_norm)

    def num_params(self, gpt: nn.Module, cfg, non_embedding: bool = True) -> int:
        return gpt.num_params(non_embedding)


class PipelineStep:
    def __init__(self, model: nn.Module, parts):
        self.model, self.parts = model, parts

    @property
    def n_microbatches(self) -> int:
        return self.parts.n_microbatches

    def bind(self, task, cfg, plan, accum_steps: int) -> None:
        from distlm.parallel.pp import make_schedule
        self.device = plan.device
        self.per_step = accum_steps
        self.shard_batch = plan.shard_batch
        make_schedule(self.parts, cfg.parallel, cfg.parallel.pp_microbatches or accum_steps, self.device,
                      task.pipeline_loss(cfg, plan))

    def _local_batch(self, x: torch.Tensor, y: torch.Tensor) -> Batch:
        """The concatenated micro-batches through the plan's per-batch hook. The schedule
        calls each stage with the residual stream alone: a hook that needs arguments for
        the forward (a sequence shard) cannot run under a pipeline."""
        b = self.shard_batch(x, y)
        if b.forward:
            raise ValueError(f"a pipeline stage takes no forward arguments, got {sorted(b.forward)}")
        return b

    def forward_backward(self, micro: list, compute, sync_grads: bool = True) -> torch.Tensor:
        """The local batch through the schedule (it cuts the microbatches), the tied
        gradients summed; the last stage's mean loss comes back on every rank."""
        from distlm.parallel.pp import run_pipeline, sync_tied_grads
        b = self._local_batch(torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro]))
        with compute():
            loss = run_pipeline(self.parts, b.inputs, b.targets, train=True)
        sync_tied_grads(self.parts)
        return self._loss_to_all(loss)

    def eval_losses(self, batches, compute) -> tuple[torch.Tensor, torch.Tensor]:
        """As PlainStep's, a training step's worth of micro-batches at a time, since the
        schedule's microbatch count must divide what it is given; a remainder is left out.
        The schedule reports one mean per group, weighted by the group's rows: exact when the
        group's micro-batches hold equal rows (a weight-0 repeat in a group is counted as
        rows of the group's mean, a small error only on the last rank's last group)."""
        from distlm.parallel.pp import run_pipeline
        total = torch.zeros((), device=self.device)
        count = torch.zeros((), device=self.device)
        group = []
        for item in batches:
            group.append(item)
            if len(group) < self.per_step:
                continue
            b = self._local_batch(torch.cat([g[0] for g in group]).to(self.device),
                                  torch.cat([g[1] for g in group]).to(self.device))
            with compute():
                loss = run_pipeline(self.parts, b.inputs, b.targets, train=False)
            rows = sum(g[2] for g in group)
            total += self._loss_to_all(loss) * rows
            count += rows
            group = []
        return total, count

    def _loss_to_all(self, loss: Optional[torch.Tensor]) -> torch.Tensor:
        """The last stage's loss, on every rank of the pipeline group."""
        t = loss_value(loss).clone() if loss is not None else torch.zeros((), device=self.device)
        dist.all_reduce(t, group=self.parts.group)
        return t

    def clip(self, max_norm: float) -> torch.Tensor:
        from distlm.parallel.pp import duplicate_params
        return clip_grad_norm(self.model.parameters(), max_norm, pp_group=self.parts.group,
                              exclude=duplicate_params(self.parts))

    def num_params(self, gpt: nn.Module, cfg, non_embedding: bool = True) -> int:
        return count_params(cfg.model, non_embedding)  # this rank holds only some stages
