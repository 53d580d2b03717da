"""Sampling with a KV cache: temperature, top-k, top-p, a seed, several samples, streaming."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from distlm.config import ConfigError
from distlm.model.gpt import GPT


class LayerCache:
    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v

    def update(self, k: torch.Tensor, v: torch.Tensor, start_pos: int):
        end = start_pos + k.shape[2]
        self.k[:, :, start_pos:end] = k
        self.v[:, :, start_pos:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """Pre-allocated keys and values, (B, H, max_len, head_dim) per layer."""

    def __init__(self, model: GPT, batch: int, max_len: int, dtype=None, device=None):
        cfg = model.cfg
        p = next(model.parameters())
        shape = (batch, cfg.n_head, max_len, cfg.head_dim)
        self.layers = [LayerCache(torch.zeros(shape, dtype=dtype or p.dtype, device=device or p.device),
                                  torch.zeros(shape, dtype=dtype or p.dtype, device=device or p.device))
                       for _ in range(cfg.n_layer)]

    def layer(self, i: int) -> LayerCache:
        return self.layers[i]


@dataclass
class SamplingConfig:
    """How tokens are drawn. Checked when built: a bad value would otherwise fail deep in
    sampling ("probability tensor contains nan") or silently mean something else. Each
    message names the field and the `distlm generate` flag that sets it."""
    max_new_tokens: int = 100
    temperature: float = 0.8        # 0 = greedy
    top_k: Optional[int] = 200      # None or 0 = off
    top_p: Optional[float] = None   # None = off; else in (0, 1]
    seed: Optional[int] = None
    stop_at_eos: bool = True

    def __post_init__(self):
        def bad(name: str, want: str, hint: str = "") -> ConfigError:
            flag = "--" + name.replace("_", "-")
            return ConfigError(f"{name} ({flag}) must be {want}, got {getattr(self, name)!r}{hint}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            raise bad("max_new_tokens", "a positive integer")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise bad("temperature", "a finite number >= 0", "; 0 = greedy")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 0):
            raise bad("top_k", "an integer >= 0", "; 0 = off")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            # top_p=0 would keep no token at all (the NaN of an all -inf softmax)
            raise bad("top_p", "in (0, 1]", "; for greedy decoding use temperature 0")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed", "an integer")


def sample_next(logits: torch.Tensor, sc: SamplingConfig, gen: torch.Generator) -> torch.Tensor:
    """logits (B, V) -> token ids (B, 1)."""
    if sc.temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / sc.temperature
    if sc.top_k:
        kth = torch.topk(logits, min(sc.top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sc.top_p is not None and sc.top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop = (cum - sorted_logits.softmax(-1)) >= sc.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs.cpu(), 1, generator=gen).to(logits.device)


@torch.no_grad()
def generate_tokens(model: GPT, prompt: list[int], sc: SamplingConfig, num_samples: int = 1,
                    eos_id: Optional[int] = None) -> Iterator[torch.Tensor]:
    """Yields the next token of every sample, (num_samples,), one step at a time.

    The prompt is prefilled once; each later step feeds one token through the cache.
    When the context would outgrow block_size, the cache is rebuilt from the last
    block_size//2 tokens (positions are absolute, so a window cannot simply slide).
    """
    model.eval()
    cfg = model.cfg
    device = next(model.parameters()).device
    if num_samples < 1:
        raise ConfigError(f"num_samples (--num-samples) must be at least 1, got {num_samples}")
    gen = torch.Generator().manual_seed(sc.seed if sc.seed is not None else torch.seed())
    tokens = torch.tensor([prompt] * num_samples, dtype=torch.long, device=device)
    if tokens.shape[1] == 0:
        raise ValueError("the prompt is empty after tokenization")
    tokens = tokens[:, -cfg.block_size:]
    cache = KVCache(model, num_samples, cfg.block_size)
    logits = model(tokens, cache=cache, start_pos=0)[:, -1, :cfg.vocab_size]
    pos = tokens.shape[1]
    finished = torch.zeros(num_samples, dtype=torch.bool, device=device)
    for _ in range(sc.max_new_tokens):
        nxt = sample_next(logits, sc, gen)
        yield nxt[:, 0]
        if eos_id is not None and sc.stop_at_eos:
            finished |= nxt[:, 0] == eos_id
            if bool(finished.all()):
                return
        tokens = torch.cat([tokens, nxt], dim=1)
        if pos >= cfg.block_size:
            keep = tokens[:, -(cfg.block_size // 2):]
            cache = KVCache(model, num_samples, cfg.block_size)
            logits = model(keep, cache=cache, start_pos=0)[:, -1, :cfg.vocab_size]
            pos = keep.shape[1]
        else:
            logits = model(nxt, cache=cache, start_pos=pos)[:, -1, :cfg.vocab_size]
            pos += 1


def generate_text(model: GPT, tokenizer, prompt: str, sc: SamplingConfig, num_samples: int = 1,
                  on_token: Callable[[int, str], None] | None = None) -> list[str]:
    """Decode samples to text. on_token(sample_index, text_piece) streams sample 0..n-1."""
    ids = tokenizer.encode(prompt) if prompt else [tokenizer.eos_id]
    out: list[list[int]] = [[] for _ in range(num_samples)]
    done = [False] * num_samples
    printed = [0] * num_samples
    for step in generate_tokens(model, ids, sc, num_samples, tokenizer.eos_id):
        for i, t in enumerate(step.tolist()):
            if done[i]:
                continue
            if t == tokenizer.eos_id and sc.stop_at_eos:
                done[i] = True
                continue
            out[i].append(t)
            if on_token is not None:
                # Decode the whole sample and emit the new suffix: a multi-byte character
                # may span tokens, and decoding one token at a time would print '\ufffd'.
                text = tokenizer.decode(out[i])
                if not text.endswith("\ufffd"):
                    on_token(i, text[printed[i]:])
                    printed[i] = len(text)
    return [tokenizer.decode(o) for o in out]
