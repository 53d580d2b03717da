"""Expert parallelism (``parallel.ep``): each MoE block's routed experts spread over the ep ranks.

    torchrun --nproc_per_node 4 -m distlm train --config speedrun-moe parallel.ep=4
    torchrun --nproc_per_node 4 -m distlm train --config speedrun-moe parallel.ep=2 parallel.dp_replicate=2
    torchrun --nproc_per_node 4 -m distlm train --config speedrun-moe parallel.ep=2 parallel.dp_shard=2

The experts' weights become DTensors sharded by expert (Shard(0)) over the ep dimension: their
global shape stays (E, d, f), so a checkpoint written under one ep degree loads under any other
(DCP reshards), and ``GPT.init_weights`` gives every rank its slice of the single-process draw.

Each MoE forward routes its own tokens (the router is replicated), then sends every routed copy
to the rank that holds its expert and brings the outputs back: two
``torch.distributed.nn.functional.all_to_all_single`` calls, the autograd-aware form of the
collective, whose backward is the reverse all-to-all. The split sizes are exchanged first with a
plain all-to-all of the per-expert counts, read on the host (a sync per MoE block), and the
exchange runs outside any compiled graph. Dropless: no capacity, every copy is computed.

Gradients. The ep ranks read different rows, so everything outside the routed experts is
averaged over them with the data axes: DDP's all-reduce over (dp_replicate, ep), or FSDP2's
reduce-scatter over (dp_shard, ep) flattened. An expert's gradient already holds the sum over the ep ranks' tokens
(the all-to-all's backward brought it there); it is scaled by 1/ep in the forward, then averaged
over the other data axis: an all-reduce over dp_replicate in the backward of each forward (DDP
ignores the expert weights: it cannot hold DTensors), or FSDP2 over dp_shard, a unit of its own.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Shard, distribute_tensor

from distlm.model.moe import ExpertWeights, MoE


class _ExpertGrad(torch.autograd.Function):
    """A local expert weight, unchanged; its gradient times ``scale`` and, with a ``group`` (the
    other data axis under DDP), averaged over it. In the graph rather than a hook on the
    parameter: the parameters are replaced when a meta model is allocated. Once per forward,
    so per micro-batch: the average of the sum is the sum of the averages."""

    @staticmethod
    def forward(ctx, w, scale: float, group):
        ctx.scale, ctx.group = scale, group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        g = g * ctx.scale
        if ctx.group is not None:
            dist.all_reduce(g, group=ctx.group)  # a sum: gloo has no average
            g = g / dist.get_world_size(ctx.group)
        return g, None, None


class ExpertDispatch:
    """The part of an MoE forward that crosses ranks: routed copies sorted by expert in, their
    expert outputs in the same order out. Set on ``MoE.dispatch`` by ``apply_ep``."""

    def __init__(self, group, degree: int, n_experts: int, replicas=None):
        self.group, self.degree, self.local = group, degree, n_experts // degree
        self.replicas = replicas  # DDP's other data axis (dp_replicate), whose gradients are averaged here

    @torch.compiler.disable
    def __call__(self, xs: torch.Tensor, counts: torch.Tensor, w: ExpertWeights, act: str, kernel: str):
        from torch.distributed.nn.functional import all_to_all_single
        ep, local = self.degree, self.local
        send = counts.reshape(ep, local)  # copies for each rank's experts
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_sizes, recv_sizes = send.sum(1).tolist(), recv.sum(1).tolist()
        got = all_to_all_single(xs.new_empty(sum(recv_sizes), xs.shape[1]), xs, recv_sizes, send_sizes,
                                group=self.group)
        # Arrived grouped by source rank, then by expert: regrouped by expert (stable, so each
        # expert's copies keep the sources' order).
        ids = torch.arange(local, device=xs.device).repeat(ep).repeat_interleave(recv.reshape(-1))
        order = torch.argsort(ids, stable=True)
        prepare = lambda t: _ExpertGrad.apply(t, 1.0 / ep, self.replicas)  # noqa: E731
        out = w(got[order], ids[order], recv.sum(0), act, kernel, prepare=prepare)
        back = torch.empty_like(out).index_copy_(0, order, out)
        return all_to_all_single(back.new_empty(xs.shape[0], back.shape[1]), back, send_sizes, recv_sizes,
                                 group=self.group)


def expert_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(f"{name}.{pn}" if name else pn, p) for name, m in model.named_modules() if isinstance(m, ExpertWeights)
            for pn, p in m.named_parameters(recurse=False)]


def apply_ep(model: nn.Module, dims, pcfg) -> None:
    """In place, on the meta device or materialised, before FSDP2 and DDP."""
    mesh = dims.mesh["ep"]
    replicas = dims.mesh["dp_replicate"].get_group() if dims.dp_replicate > 1 else None
    for m in model.modules():
        if isinstance(m, MoE):
            m.dispatch = ExpertDispatch(mesh.get_group(), dims.ep, m.n_experts, replicas)
        if isinstance(m, ExpertWeights):
            for name, p in list(m.named_parameters(recurse=False)):
                m.register_parameter(name, nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)]),
                                                        requires_grad=p.requires_grad))
    if dims.dp_shard > 1:
        # The experts a unit of their own over dp_shard (before the blocks', whose units then
        # leave them out); everything else is sharded over (dp_shard, ep).
        from torch.distributed.fsdp import fully_shard
        from distlm.parallel.fsdp import offload_policy, precision_policy
        shard = dims.mesh["dp_shard"]
        for m in model.modules():
            if isinstance(m, ExpertWeights):
                fully_shard(m, mesh=shard, mp_policy=precision_policy(pcfg, shard.device_type),
                            offload_policy=offload_policy(pcfg, shard.device_type),
                            reshard_after_forward=pcfg.reshard_after_forward)
    else:
        # DDP over (dp_replicate, ep) cannot hold the experts' DTensors: it leaves them alone.
        from torch.nn.parallel import DistributedDataParallel as DDP
        DDP._set_params_and_buffers_to_ignore_for_model(model, [n for n, _ in expert_params(model)])
