"""Context parallelism: each rank of a cp group holds a part of every sequence.

    torchrun --nproc_per_node 4 -m distlm train --config llama-124m model.block_size=32768 parallel.cp=4

With ``cp`` ranks the sequence of length T is cut into 2*cp chunks of c = T / (2 cp)
tokens, and rank r holds chunks r and 2cp-1-r (a head chunk and a tail chunk). Under a
causal mask the work of a query grows with its position; pairing chunk r with its mirror
gives every rank the same number of visible (query, key) pairs, 2cp c^2 + c per head, where
a plain split in cp pieces would leave the last rank about 2cp - 1 times the first's.

Everything outside attention is per token, so it runs on the local tokens unchanged: the
embeddings (with the global position of each token: ``SequenceShard.positions``), the
MLPs, the norms, the head and the loss. Attention is the one place where a token needs
the others, and there the rank gathers the keys and values of the whole row.

Why all-gathered keys and values rather than a ring (torch's experimental
``context_parallel`` API, or passing K/V blocks around the ring by hand):
  - the masks stay what they are on one process: each of the rank's two query chunks is
    one ``scaled_dot_product_attention`` over the key prefix it may see, with a causal mask
    aligned to the lower right (``causal_lower_right``, which keeps the flash and
    memory-efficient kernels on GPU), or, for document masks and windows, the same dense
    rule the model uses, evaluated at the chunk's global positions. A ring computes partial
    softmaxes block by block and merges them by their log-sum-exp; masks other than plain
    causal need their own per-block logic, and torch's API takes none (it rewrites the
    causal SDPA call only);
  - torch's API replaces ``F.scaled_dot_product_attention`` for the whole process inside a
    context manager and shards named buffers in place: state outside the model that the
    rest of distlm (one Trainer, no globals) would have to keep track of;
  - the traffic is the same bytes as a ring's (each rank receives the other ranks' K and V
    once per layer, forward, and sends the gradients back, backward), in one all-gather
    instead of cp - 1 steps, so it cannot overlap with the attention the way a ring
    overlaps its steps. The cost is memory: the gathered K and V of the whole row, 2 T d
    per layer, are held for the backward (a ring holds 2 T d / cp). At 128k tokens of
    GPT-2 124M that is 0.4 GB per layer in bf16, affordable; a model whose K/V at its
    context do not fit is the case for a ring, which can later sit behind the same
    ``SequenceShard`` (the attention object is its only user).

The gather is torch's functional all-gather with autograd (``gather_sequence``): its
backward is a reduce-scatter that sums each rank's gradient of the gathered keys back to
their owner. K and V travel in one collective (stacked).

The loss is the mean over the rank's tokens; every rank of a cp group holds the same
number of tokens, so averaging gradients over the data x cp ranks (DDP or FSDP2 over the
two axes together) is the gradient of the mean over every token of the global batch, and
the mean of the ranks' losses is that mean (the layout averages the loss over cp,
distlm/layout/context.py).

Document masks (model.attn_mask=doc) are exact across shards: the document ids come from
the whole row, which every rank of the group holds before it takes its part (the loader
hands them the same rows), so a document that crosses a chunk boundary stays one
document. Windows (model.attn_window) are exact too, and each chunk's key range starts
where its window does. Both use a dense boolean mask of (rows, c, keys) per chunk: fine
up to ~32k tokens, O(T^2 / cp) bytes beyond.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.distributed._functional_collectives as funcol
from torch.nn.attention.bias import causal_lower_right

from distlm.model.attention import document_ids
from distlm.model.gpt import AttentionOverride
from distlm.parallel.applied import Batch, BatchHook


def chunk_len(seq_len: int, cp: int) -> int:
    """Tokens per chunk, c = T / (2 cp); the caller validates divisibility (a config rule)."""
    if seq_len % (2 * cp):
        raise ValueError(f"a sequence of {seq_len} tokens cannot be cut into 2 x cp = {2 * cp} equal chunks")
    return seq_len // (2 * cp)


def shard_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks rank ``rank`` holds: the head chunk r and its mirror 2cp-1-r."""
    return rank, 2 * cp - 1 - rank


def shard_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The global positions (2c,) of the tokens rank ``rank`` holds, in its local order."""
    c = chunk_len(seq_len, cp)
    return torch.cat([torch.arange(k * c, (k + 1) * c, device=device) for k in shard_chunks(cp, rank)])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s part of ``x`` along ``dim`` (the sequence): its two chunks, joined."""
    c = chunk_len(x.shape[dim], cp)
    return torch.cat([x.narrow(dim, k * c, c) for k in shard_chunks(cp, rank)], dim)


def unshard_sequence(parts: list[torch.Tensor] | tuple[torch.Tensor, ...], dim: int = 1) -> torch.Tensor:
    """The inverse of ``shard_sequence``: the parts of ranks 0..cp-1 -> the whole sequence."""
    cp = len(parts)
    c = parts[0].shape[dim] // 2
    chunks: list = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        head, tail = shard_chunks(cp, rank)
        chunks[head], chunks[tail] = part.narrow(dim, 0, c), part.narrow(dim, c, c)
    return torch.cat(chunks, dim)


# torch 2.13 renamed the autograd all-gather; the GPU machines run 2.11, which has only the old name.
_all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


def gather_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's part, with autograd: the gradient of each
    rank's part is the sum of the gradients its copies received (a reduce-scatter).

    Not ``torch.distributed.nn.functional.all_gather``: on gloo its backward scatters
    from group rank i as if it were global rank i, and fails on any group that does not
    start at global rank 0 (the cp groups of a dp x cp grid; torch 2.13)."""
    cp = dist.get_world_size(group)
    gathered = _all_gather_autograd(x.contiguous(), 0, group)  # the parts stacked along dim 0
    return unshard_sequence(gathered.chunk(cp, dim=0), dim)


class ContextParallel:
    """One rank's place in its cp group; cuts batches into ``SequenceShard``s.

    ``group``: the process group of the ranks that share each row (a DeviceMesh axis'
    group); None or a group of one is context parallelism of degree 1 (no split).
    """

    def __init__(self, group=None):
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0

    def shard(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None):
        """Whole rows (B, T), the same on every rank of the group -> this rank's
        (idx, targets, SequenceShard). The shard keeps the whole rows' token ids: document
        ids must be counted from the start of the row."""
        T = idx.shape[1]
        shard = SequenceShard(self, shard_positions(T, self.size, self.rank, idx.device), idx)
        local = shard_sequence(idx, self.size, self.rank)
        return local, (shard_sequence(targets, self.size, self.rank) if targets is not None else None), shard


class SequenceShard:
    """What a model's forward needs to know about a rank's part of the sequence: the global
    positions of its tokens, and attention across the group (``attention``). The model
    takes it as its ``shard`` argument (distlm.model.gpt.GPT.forward)."""

    def __init__(self, cp: ContextParallel, positions: torch.Tensor, rows: torch.Tensor):
        self.cp = cp
        self.positions = positions
        self.rows = rows  # (B, T): the whole rows' token ids

    def attention(self, eot_id: Optional[int] = None, window: int = 0) -> "ShardedAttention":
        """The attention every block of this forward runs: causal, within documents when
        ``eot_id`` is given (model.attn_mask=doc), within ``window`` positions when > 0."""
        docs = document_ids(self.rows, eot_id) if eot_id is not None else None
        return ShardedAttention(self.cp, docs, window)


class ShardedAttention(AttentionOverride):
    """Attention for a rank's two query chunks over the keys of the whole row."""

    def __init__(self, cp: ContextParallel, docs: Optional[torch.Tensor], window: int):
        self.cp, self.docs, self.window = cp, docs, window

    # Kept out of compiled graphs (a graph break; the blocks compile around it): the SDPA
    # kernels are the same compiled or not, and the collective and the per-chunk masks run
    # eagerly, the path the tests check against one process.
    @torch.compiler.disable
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        """q, k, v (B, H, 2c, hd) of the local tokens -> (B, H, 2c, hd)."""
        kv = torch.stack((k, v))
        if self.cp.size > 1:
            kv = gather_sequence(kv, self.cp.group, dim=3)
        return attend_shard(q, kv, self.cp.size, self.cp.rank, self.docs, self.window, dropout_p)


def attend_shard(q: torch.Tensor, kv: torch.Tensor, cp: int, rank: int, docs: Optional[torch.Tensor] = None,
                 window: int = 0, dropout_p: float = 0.0) -> torch.Tensor:
    """The attention of rank ``rank``'s queries q (B, H, 2c, hd: its head and tail chunks)
    over the whole row's keys and values kv (2, B, H, T, hd), under the causal mask, within
    documents (``docs``, (B, T) ids of the whole row) and a window when given. No
    communication: the gather is the caller's."""
    c = q.shape[2] // 2
    out = []
    for half, chunk in enumerate(shard_chunks(cp, rank)):
        q_lo = chunk * c  # global position of the chunk's first query
        k_hi = q_lo + c   # keys past the chunk's last query are never visible
        k_lo = max(0, q_lo - window + 1) if window else 0
        mask, causal = _chunk_mask(c, q_lo, k_lo, k_hi, docs, window, q.device)
        out.append(F.scaled_dot_product_attention(q[:, :, half * c:(half + 1) * c], kv[0, :, :, k_lo:k_hi],
                                                  kv[1, :, :, k_lo:k_hi], attn_mask=mask, is_causal=causal,
                                                  dropout_p=dropout_p))
    return torch.cat(out, dim=2)


def _chunk_mask(c: int, q_lo: int, k_lo: int, k_hi: int, docs: Optional[torch.Tensor], window: int, device):
    """(attn_mask, is_causal) for queries [q_lo, q_lo + c) over keys [k_lo, k_hi)."""
    if docs is None and not window:
        if k_lo == q_lo:  # a square block: plain causal
            return None, True
        return causal_lower_right(c, k_hi - k_lo), False
    q = torch.arange(q_lo, q_lo + c, device=device)[:, None]
    k = torch.arange(k_lo, k_hi, device=device)[None, :]
    ok = k <= q
    if window:
        ok = ok & (q - k < window)
    ok = ok[None, None]
    if docs is not None:
        d = docs.to(device)
        ok = ok & (d[:, None, q_lo:q_lo + c, None] == d[:, None, None, k_lo:k_hi])
    return ok, False


def apply_context(dims) -> BatchHook:
    """The per-batch hook of a layout with parallel.cp > 1 (distlm/parallel/applied.py): every
    micro-batch's rows, the same on each rank of the cp group (the loader's data mesh leaves
    cp out), become this rank's part of them, and the model gets the ``shard`` that places
    those tokens in their rows."""
    cp = ContextParallel(dims.mesh["cp"].get_group())

    def hook(batch: Batch) -> Batch:
        x, y, shard = cp.shard(batch.inputs, batch.targets)
        return Batch(x, y, {**batch.forward, "shard": shard})

    return hook
