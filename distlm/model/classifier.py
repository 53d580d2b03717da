"""The classifier: the GPT trunk (same blocks, same names), a pooling step, a linear head.

A subclass of GPT, so everything that parallelizes, initialises and checkpoints a GPT
(``parallelize``: FSDP2 per block, DDP, activation checkpointing, compile; the
per-parameter init from (seed, name); DCP state dicts keyed by name) applies unchanged,
and an LM checkpoint's trunk loads by name. Only the LM head is dropped.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from distlm.config import ModelConfig
from distlm.model.gpt import GPT


class TextBatch(NamedTuple):
    """A micro-batch of right-padded rows. A NamedTuple so DDP/FSDP2 input handling (which
    recurses into named tuples) moves its tensors like any other input."""
    ids: torch.Tensor      # (B, T) token ids; positions >= length hold the pad id
    lengths: torch.Tensor  # (B,) real tokens per row, >= 1
    padded: bool           # some row is shorter than T. Known on the host: no device sync decides the mask

    def to(self, device, non_blocking: bool = False) -> "TextBatch":
        return TextBatch(self.ids.to(device, non_blocking=non_blocking),
                         self.lengths.to(device, non_blocking=non_blocking), self.padded)

    def pin_memory(self) -> "TextBatch":
        return TextBatch(self.ids.pin_memory(), self.lengths.pin_memory(), self.padded)


def valid_positions(lengths: torch.Tensor, T: int) -> torch.Tensor:
    """(B, T) bool: True where a row has a real token."""
    return torch.arange(T, device=lengths.device)[None, :] < lengths[:, None]


def pool(h: torch.Tensor, lengths: torch.Tensor, how: str) -> torch.Tensor:
    """(B, T, d) -> (B, d) over each row's real tokens only, so padding never reaches the head."""
    if how == "first":
        return h[:, 0]
    if how == "last":
        return h[torch.arange(h.shape[0], device=h.device), lengths - 1]
    keep = valid_positions(lengths, h.shape[1]).unsqueeze(-1).to(h.dtype)
    return (h * keep).sum(1) / lengths[:, None].to(h.dtype)


class Classifier(GPT):
    """TextBatch -> logits (B, num_classes)."""

    def __init__(self, cfg: ModelConfig, num_classes: int, pooling: str = "mean", attention: str = "bidirectional"):
        super().__init__(cfg)
        self.head = None  # the trunk ends at the final norm
        self.pooling = pooling
        self.causal = attention == "causal"
        self.cls_head = nn.Linear(cfg.d_model, num_classes)
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()  # again, now that cls_head exists (drawn from its own (seed, name))

    def forward(self, batch: TextBatch) -> torch.Tensor:
        ids, lengths, padded = batch
        mask = None
        # Causal attention with right padding needs no mask: a real token never looks
        # right, so it never sees a pad. Bidirectional attention masks padded keys, and
        # only when the batch has padding (a full batch runs the unmasked kernel).
        if padded and not self.causal:
            mask = valid_positions(lengths, ids.shape[1])[:, None, None, :]  # (B, 1, 1, T): keys only
        if mask is not None and ids.is_cuda:
            # The Trainer puts cuDNN attention first; its masked path has known failures on some
            # shape/mask combinations (pytorch/pytorch#122695, #134001). Memory-efficient
            # attention takes any broadcastable mask; unmasked batches keep the Trainer's order.
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
                h = self.trunk(ids, mask)
        else:
            h = self.trunk(ids, mask)
        return self.cls_head(pool(h, lengths, self.pooling))

    def trunk(self, ids: torch.Tensor, mask) -> torch.Tensor:
        """GPT's embedding and blocks, with the mask and attention direction passed to every
        block, ending at the final norm."""
        x = self.embed(ids)
        rope = self.rope_at(0, ids.shape[1])
        for block in self.blocks.values():
            x = block(x, rope, None, 0, mask, self.causal)
        return self.norm(x)

    def num_params(self, non_embedding: bool = True) -> int:
        cfg = self.cfg
        n = sum(p.numel() for p in self.parameters()) - (cfg.padded_vocab_size - cfg.vocab_size) * cfg.d_model
        if non_embedding:
            n -= cfg.vocab_size * cfg.d_model + (self.pos_emb.weight.numel() if self.pos_emb is not None else 0)
        return n


def classify_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels)
