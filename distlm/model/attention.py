"""Which keys a query may see, beyond plain causal attention.

``model.attn_mask=doc``: causal attention that does not cross end-of-text tokens. Training
sequences are cut from a stream of documents joined by ``eot_id``; without this mask a
token attends to the unrelated documents before it in the same row. A document here
*starts* at its end-of-text token: the data writes each document followed by ``eot_id``,
so that token is the one whose target is the next document's first token, and it should
see nothing of the document it closes.

``model.attn_window=W``: each query sees at most the W most recent positions, itself
included (sliding-window attention), alone or with document masks.

Three forms of the same rule, chosen by ``GPT.attention_mask`` once per forward and
shared by every block:
  - None: the plain causal path (SDPA ``is_causal``), the default, unchanged;
  - a dense boolean mask (B, 1, Tq, Tk) for ``F.scaled_dot_product_attention``: CPU,
    KV-cache generation, or where FlexAttention is missing. O(B T^2) memory;
  - a FlexAttention ``BlockMask`` on CUDA: only the (128 x 128) tiles that hold a visible
    pair are computed, and those wholly visible skip the mask function.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

try:  # torch >= 2.5
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - older torch: the dense path serves every device
    BlockMask, flex_attention = None, None

TILE = 128  # FlexAttention's default sparse block size


def document_ids(idx: torch.Tensor, eot_id: int) -> torch.Tensor:
    """(B, T) token ids -> (B, T) document index within each row, non-decreasing. The
    end-of-text token opens the document that follows it (see the module docstring)."""
    return (idx == eot_id).cumsum(dim=1, dtype=torch.int32)


def dense_mask(t_q: int, t_k: int, device, start_pos: int = 0, docs: Optional[torch.Tensor] = None,
               window: int = 0) -> torch.Tensor:
    """Boolean (B or 1, 1, t_q, t_k), True where query i (absolute position start_pos + i)
    may attend to key j. ``docs`` (B, t_k) requires start_pos = 0 and t_q = t_k."""
    q = torch.arange(start_pos, start_pos + t_q, device=device)[:, None]
    k = torch.arange(t_k, device=device)[None, :]
    ok = k <= q
    if window:
        ok = ok & (q - k < window)
    ok = ok[None, None]
    if docs is not None:
        ok = ok & (docs[:, None, :, None] == docs[:, None, None, :])
    return ok


def flex_usable(device: torch.device) -> bool:
    """FlexAttention on CUDA only: its CPU path has no backward, and the dense mask is
    cheap at the sizes a CPU trains."""
    return flex_attention is not None and device.type == "cuda"


def block_mask(docs: Optional[torch.Tensor], batch: int, seq: int, window: int, device) -> "BlockMask":
    """The FlexAttention BlockMask of causal + same-document + window, built from the
    tile structure directly: O(B (T/128)^2) work, where create_block_mask would evaluate
    the rule at all B T^2 pairs.

    Per (query tile i, key tile j) it decides whether some pair may be visible ("any") and
    whether every pair is ("full"). Both are allowed to err only towards "partial": a tile
    marked partial is computed with the exact rule (``mask_mod``), so over-counting costs
    speed, never correctness; a tile wrongly left out or wrongly marked full would.
    Document ids are non-decreasing along a row, which makes each test a comparison of a
    tile's first and last id.
    """
    n = -(-seq // TILE)
    pad = n * TILE - seq
    i = torch.arange(n, device=device)[:, None]  # query tile
    j = torch.arange(n, device=device)[None, :]  # key tile
    any_ = (j <= i)[None].expand(batch, n, n)
    full = (j < i)[None].expand(batch, n, n)
    if window:
        # nearest pair of the two tiles is (iT, jT + T - 1), farthest (iT + T - 1, jT)
        any_ = any_ & ((i - j - 1) * TILE + 1 < window)
        full = full & ((i - j + 1) * TILE - 1 < window)
    if docs is not None:
        # padding repeats the last id, so a tile's last column is its last real token
        padded = F.pad(docs, (0, pad), mode="replicate") if pad else docs
        first, last = padded[:, ::TILE], padded[:, TILE - 1::TILE]
        # j <= i: key tile j starts no later than query tile i, so they share a document
        # iff j's last id reaches i's first; all pairs share one iff j's first equals i's last.
        any_ = any_ & (last[:, None, :] >= first[:, :, None])
        full = full & (first[:, None, :] == last[:, :, None])
        mask_docs = padded
    else:
        mask_docs = None
    partial = any_ & ~full

    def ordered(dense: torch.Tensor):
        # counts (B, 1, n) and key-tile indices (B, 1, n, n), the listed tiles first
        counts = dense.sum(-1, dtype=torch.int32)
        order = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return counts[:, None], order[:, None]

    def mask_mod(b, h, q_idx, kv_idx):
        ok = q_idx >= kv_idx
        if window:
            ok = ok & (q_idx - kv_idx < window)
        if mask_docs is not None:
            ok = ok & (mask_docs[b, q_idx] == mask_docs[b, kv_idx])
        return ok

    kv_num, kv_idx = ordered(partial)
    full_num, full_idx = ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=TILE, mask_mod=mask_mod,
                                    seq_lengths=(seq, seq))


@functools.cache
def compiled_flex():
    """One compiled FlexAttention for the process. Called eagerly, flex_attention runs an
    unfused reference that materialises the scores; compiled, it is one fused kernel.
    A single wrapper, because each torch.compile call keys its own cache of graphs."""
    return torch.compile(flex_attention, dynamic=False)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, causal: bool, dropout_p: float) -> torch.Tensor:
    """q, k, v (B, H, T, hd) -> (B, H, Tq, hd) under ``mask`` (None, dense or BlockMask)."""
    if BlockMask is not None and isinstance(mask, BlockMask):
        # Inside a compiled block the plain function is traced into the graph; eager calls
        # go through the compiled wrapper. FlexAttention has no attention dropout: the model
        # refuses dropout > 0 with these masks (check_options), so CPU and GPU agree.
        fn = flex_attention if torch.compiler.is_compiling() else compiled_flex()
        return fn(q, k, v, block_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                          dropout_p=dropout_p)
