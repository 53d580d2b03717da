"""Pipeline parallelism with torch.distributed.pipelining.

    torchrun --nproc_per_node 4 -m distlm train model=gpt2-1.5b parallel.pp=4 parallel.pp_schedule=1f1b

The model is cut into stages of whole blocks; the embedding rides with the first stage
and the final norm + head with the last, and the cut is balanced by estimated FLOPs, so
the head (a V x d matmul, several blocks' worth for GPT-2) counts. Each rank keeps one
pruned GPT (``PipelineParts.model``) holding every block it runs, under the blocks'
original names, so checkpoints, the optimizer and clipping see an ordinary module whose
state-dict keys match any other layout. The stages the schedule drives are thin views
(``StageView``) onto slices of it; an interleaved schedule gives a rank several.

With tied embeddings the first and last stage both need the (vocab x d) matrix: each
keeps a copy, under the same name, and after the backward their gradients are summed
over a two-rank group (as Megatron's "embedding group" does), so the copies stay
identical under AdamW and a checkpoint holds the matrix once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from distlm.config import ConfigError, ModelConfig, ParallelConfig
from distlm.local_shard import local_shard

# name -> (schedule class name in torch.distributed.pipelining, stages per rank > 1)
SCHEDULES = {
    "naive": ("ScheduleGPipe", False),      # the whole local batch as one microbatch: no overlap at all
    "gpipe": ("ScheduleGPipe", False),
    "1f1b": ("Schedule1F1B", False),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", True),
    "zero-bubble": ("ScheduleInterleavedZeroBubble", True),
}


def stage_costs(m: ModelConfig) -> tuple[float, float, float]:
    """Forward FLOPs per token of (embedding, one block, norm + head). The embedding is a
    lookup (no matmul); its cost is set to a fraction of a block so it still counts."""
    d, ff, T = m.d_model, m.d_ff, m.block_size
    mlp = (3 if m.mlp == "swiglu" else 2) * d * ff
    block = 2 * (4 * d * d + mlp) + 4 * T * d  # projections + attention scores/values
    head = 2 * d * m.padded_vocab_size
    return 0.1 * block, float(block), float(head)


def split_layers(m: ModelConfig, n_stages: int, explicit: Optional[str] = None) -> list[list[int]]:
    """Contiguous block ranges, one per stage, minimising the most expensive stage.

    ``explicit`` ("4,4,3,1") fixes the block count per stage instead. A stage may hold
    no block only if it holds the embedding or the head."""
    L = m.n_layer
    if explicit:
        try:
            counts = [int(c) for c in explicit.split(",")]
        except ValueError:
            raise ConfigError(f"parallel.pp_layers={explicit!r}: expected comma-separated block counts") from None
        if len(counts) != n_stages or sum(counts) != L or min(counts) < 0:
            raise ConfigError(f"parallel.pp_layers={explicit!r}: needs {n_stages} non-negative counts summing to "
                              f"model.n_layer={L}")
    else:
        if n_stages > L + 2:
            raise ConfigError(f"{n_stages} pipeline stages for model.n_layer={L} blocks: at most {L + 2}")
        emb, block, head = stage_costs(m)
        counts = _balanced_counts(L, n_stages, emb, block, head)
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    for i, blocks in enumerate(out):
        if not blocks and 0 < i < n_stages - 1:
            raise ConfigError(f"pipeline stage {i} would hold no block (parallel.pp_layers={explicit!r})")
    return out


def _balanced_counts(L: int, S: int, emb: float, block: float, head: float) -> list[int]:
    """Exact minimax over contiguous splits by dynamic programming (L and S are small)."""
    inf = float("inf")

    def cost(stage: int, n: int) -> float:
        return n * block + (emb if stage == 0 else 0.0) + (head if stage == S - 1 else 0.0)

    # best[s][l]: minimal max-cost placing the first l blocks on the first s stages
    best = [[inf] * (L + 1) for _ in range(S + 1)]
    choice = [[0] * (L + 1) for _ in range(S + 1)]
    best[0][0] = 0.0
    for s in range(1, S + 1):
        for l in range(L + 1):
            for n in range(l + 1):
                if n == 0 and 0 < s - 1 < S - 1:
                    continue  # an empty middle stage does nothing but pass data on
                v = max(best[s - 1][l - n], cost(s - 1, n))
                if v < best[s][l]:
                    best[s][l], choice[s][l] = v, n
    counts, l = [], L
    for s in range(S, 0, -1):
        counts.append(choice[s][l])
        l -= choice[s][l]
    return counts[::-1]


def stages_of_rank(pp_rank: int, pp: int, virtual: int) -> list[int]:
    """Loop placement: rank r runs stages r, r + pp, r + 2pp, ... (what the interleaved
    schedules expect)."""
    return [pp_rank + k * pp for k in range(virtual)]


class StageView(nn.Module):
    """One pipeline stage: a slice of the rank's pruned GPT, sharing its modules.

    Registers only the modules this stage runs, so ``parameters()`` (which the
    pipeline stage scales and FSDP2 wraps) never counts another stage's weights."""

    def __init__(self, gpt: nn.Module, block_ids: list[int], first: bool, last: bool, seq_shards: int):
        super().__init__()
        self.first, self.last, self.seq_shards = first, last, seq_shards
        object.__setattr__(self, "owner", gpt)  # not a submodule: buffers and embed() only
        self.tok_emb = gpt.tok_emb if first or (last and gpt.cfg.tie_embeddings) else None
        self.pos_emb = gpt.pos_emb if first else None
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[str(i)] for i in block_ids})
        self.norm = gpt.norm if last else None
        self.head = gpt.head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gpt = self.owner
        if self.first:
            x = gpt.embed(x)
            T = x.shape[1]
        else:  # under sequence parallelism the stream between stages is this rank's slice
            T = x.shape[1] * self.seq_shards
        rope = gpt.rope_at(0, T)
        for block in self.blocks.values():
            x = block(x, rope)
        if self.last:
            x = self.head(self.norm(x))
        return x


@dataclass
class PipelineParts:
    model: nn.Module                     # the rank's pruned GPT: optimizer, checkpoints, clipping
    views: list[StageView]               # the stages this rank runs, in schedule order
    stage_ids: list[int]
    n_stages: int
    layers: list[list[int]]              # blocks per stage (all stages)
    group: object = None                 # the pipeline process group
    tied_group: object = None            # first + last stage's ranks, when embeddings are tied
    schedule: object = None
    n_microbatches: int = 1
    stages: list = field(default_factory=list)

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.n_stages - 1 in self.stage_ids


    def refresh_views(self) -> None:
        """Rebuild the views after blocks were wrapped (activation checkpointing)."""
        self.views = [StageView(self.model, self.layers[s], v.first, v.last, v.seq_shards)
                      for s, v in zip(self.stage_ids, self.views)]


def prune_for_stages(gpt: nn.Module, layers: list[list[int]], stage_ids: list[int], n_stages: int) -> nn.Module:
    """Drop from a (meta) GPT every block and end piece this rank's stages do not run."""
    keep = {i for s in stage_ids for i in layers[s]}
    first, last = 0 in stage_ids, n_stages - 1 in stage_ids
    for name in list(gpt.blocks.keys()):
        if int(name) not in keep:
            del gpt.blocks[name]
    if not first:
        gpt.pos_emb = None
        if not (gpt.cfg.tie_embeddings and last):  # tied: the last stage keeps the shared matrix
            gpt.tok_emb = None
    if not last:
        gpt.norm = None
        gpt.head = None
    return gpt


def build_pipeline(gpt: nn.Module, dims, pcfg: ParallelConfig, m: ModelConfig) -> PipelineParts:
    """Prune a meta-device GPT to this rank's stages and make their views. Sharding (TP,
    FSDP) and allocation come next; ``make_schedule`` comes last."""
    name = pcfg.pp_schedule
    virtual = pcfg.pp_virtual_stages if SCHEDULES[name][1] else 1
    if SCHEDULES[name][1] and virtual < 2:
        raise ConfigError(f"parallel.pp_schedule={name} needs parallel.pp_virtual_stages >= 2, got {virtual}")
    n_stages = dims.pp * virtual
    layers = split_layers(m, n_stages, pcfg.pp_layers)
    pp_rank = dims.mesh["pp"].get_local_rank()
    stage_ids = stages_of_rank(pp_rank, dims.pp, virtual)
    model = prune_for_stages(gpt, layers, stage_ids, n_stages)
    seq_shards = dims.tp if (dims.tp > 1 and pcfg.sequence_parallel) else 1
    views = [StageView(model, layers[s], s == 0, s == n_stages - 1, seq_shards) for s in stage_ids]
    return PipelineParts(model, views, stage_ids, n_stages, layers, group=dims.mesh["pp"].get_group(),
                         tied_group=_tied_group(dims, pcfg) if m.tie_embeddings else None)


def _tied_group(dims, pcfg: ParallelConfig):
    """For each (dp, tp) position, a group of the ranks holding pipeline rank 0 and pp-1.
    Every rank creates every group (new_group is collective); it keeps its own."""
    import datetime
    grid = dims.mesh.mesh  # (pp, dp_replicate, dp_shard, tp) -> global rank
    mine = None
    ends = torch.stack([grid[0], grid[-1]], dim=-1).reshape(-1, 2).tolist()
    for pair in ends:
        g = dist.new_group(pair, timeout=datetime.timedelta(seconds=pcfg.timeout_s))
        if dims.rank in pair:
            mine = g
    return mine


def make_schedule(parts: PipelineParts, pcfg: ParallelConfig, n_microbatches: int, device: torch.device,
                  loss_fn) -> None:
    """PipelineStages over the (sharded, allocated) views, and the named schedule."""
    from torch.distributed import pipelining
    cls_name, multi = SCHEDULES[pcfg.pp_schedule]
    parts.n_microbatches = 1 if pcfg.pp_schedule == "naive" else n_microbatches
    parts.stages = [pipelining.PipelineStage(v, s, parts.n_stages, device, group=parts.group)
                    for v, s in zip(parts.views, parts.stage_ids)]
    cls = getattr(pipelining, cls_name)
    stages = parts.stages if multi else parts.stages[0]
    try:
        parts.schedule = cls(stages, n_microbatches=parts.n_microbatches, loss_fn=loss_fn, scale_grads=True)
    except ValueError as e:  # e.g. a microbatch count the interleaved schedules cannot use
        raise ConfigError(f"parallel.pp_schedule={pcfg.pp_schedule} with {parts.n_microbatches} microbatches "
                          f"on {parts.n_stages} stages: {e}") from None


def run_pipeline(parts: PipelineParts, x: torch.Tensor, y: torch.Tensor, train: bool) -> Optional[torch.Tensor]:
    """One pass over the local batch (forward+backward, or forward only). Returns the
    mean microbatch loss on ranks holding the last stage, None elsewhere."""
    losses: list = []
    args = (x,) if parts.has_first else ()
    kw = dict(target=y, losses=losses) if parts.has_last else {}
    (parts.schedule.step if train else parts.schedule.eval)(*args, **kw)
    if not parts.has_last:
        return None
    return torch.stack([l.detach().float() for l in losses]).mean()


@torch.no_grad()
def sync_tied_grads(parts: PipelineParts) -> None:
    """Sum the tied embedding/head gradient over the pipeline group (see module doc)."""
    gpt = parts.model
    if parts.tied_group is None or gpt.tok_emb is None:
        return
    p = gpt.tok_emb.weight
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    if hasattr(p.grad, "placements") and p.grad.placements != p.placements:
        # Under TP the embedding's backward yields a replicated gradient for the
        # vocabulary-sharded matrix, the head's a sharded one: bring both to the
        # parameter's layout (a local slice, no communication) so the two ends match.
        p.grad = p.grad.redistribute(p.device_mesh, p.placements)
    g = local_shard(p.grad)
    dist.all_reduce(g, group=parts.tied_group)


def duplicate_params(parts: PipelineParts) -> set:
    """Parameters held by several pipeline ranks (the tied matrix off stage 0): counted
    once in the global gradient norm."""
    gpt = parts.model
    if gpt.cfg.tie_embeddings and gpt.tok_emb is not None and not parts.has_first:
        return {id(gpt.tok_emb.weight)}
    return set()

