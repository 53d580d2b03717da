"""Sample order: which block sample ``g`` of a run reads, as a pure function of (seed, g).

Sample g falls in epoch ``g // n`` at position ``g % n``; the block it reads is that
epoch's permutation of [0, n) at that position. Two versions exist, recorded in the
loader's checkpointed state as ``"order"``:

- **Order 2** (new runs): a keyed pseudo-random permutation evaluated per sample, so
  memory and time per sample are O(1) whatever n is. It is a Feistel network on the
  smallest power-of-two domain holding [0, n), with cycle-walking to stay inside
  [0, n). The network's halves may differ by a bit (the layout of NIST FF1 with radix
  2), so the domain is below 2n and a sample needs fewer than two walks on average.
  Round keys come from (seed, epoch) through the SplitMix64 finaliser; everything is
  numpy uint64 arithmetic, vectorised over the samples of a batch, and the same on
  every machine.
- **Order 1** (checkpoints written before order 2, whose state has no ``"order"``):
  numpy's PCG64 permutation of each epoch, materialised (8 bytes per block). Kept
  bit for bit so those runs resume on the same batches.
"""
from __future__ import annotations

import hashlib
from functools import lru_cache

import numpy as np

ORDER_V1, ORDER_V2 = 1, 2
CURRENT_ORDER = ORDER_V2
ORDERS = (ORDER_V1, ORDER_V2)

_MASK64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64's increment: 2^64 / golden ratio, odd
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
# Luby-Rackoff needs 4 rounds for a pseudo-random permutation from good round functions;
# 8 leave a wide margin at small domains (a few bits per half), for a few microseconds a batch.
ROUNDS = 8


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on a uint64 array: a bijection with full avalanche.
    (Arrays, never numpy scalars: uint64 array arithmetic wraps silently, scalars warn.)"""
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


def _round_keys(seed: int, epochs: np.ndarray) -> np.ndarray:
    """(ROUNDS, len(epochs)) uint64 keys: every (seed, epoch) pair gets its own permutation."""
    s = _mix64(np.array([seed & _MASK64], dtype=np.uint64) + _GOLDEN)
    base = _mix64(s ^ _mix64(epochs.astype(np.uint64) + _GOLDEN))
    rounds = np.arange(1, ROUNDS + 1, dtype=np.uint64)[:, None] * _GOLDEN
    return _mix64(base[None, :] + rounds)


def _feistel(x: np.ndarray, keys: np.ndarray, u: int, v: int) -> np.ndarray:
    """One pass of the network: a bijection of [0, 2^(u+v)) for each column of keys.
    x = A (high u bits) | B (low v bits); round i replaces (A, B) by (B, A + F_i(B) mod 2^m),
    m = u on even rounds and v on odd ones, so after an even number of rounds the halves
    are back to u and v bits. Each round is invertible given B, hence the whole is."""
    mask_u, mask_v = np.uint64((1 << u) - 1), np.uint64((1 << v) - 1)
    a, b = x >> np.uint64(v), x & mask_v
    for i in range(ROUNDS):
        c = (a + _mix64(b ^ keys[i])) & (mask_u if i % 2 == 0 else mask_v)
        a, b = b, c
    return (a << np.uint64(v)) | b


def permute(seed: int, epochs: np.ndarray, positions: np.ndarray, n: int) -> np.ndarray:
    """Order 2: the block at ``positions`` of each ``epochs``' permutation of [0, n) (int64)."""
    positions = np.asarray(positions, dtype=np.int64).ravel()
    if n == 1:
        return np.zeros(positions.shape, dtype=np.int64)
    bits = (n - 1).bit_length()  # 2^(bits-1) < n <= 2^bits: the domain is less than twice n
    u, v = bits // 2, bits - bits // 2
    keys = _round_keys(seed, np.asarray(epochs, dtype=np.int64).ravel())
    y = _feistel(positions.astype(np.uint64), keys, u, v)
    # Cycle-walking: a value that lands outside [0, n) is sent through the network again until
    # it lands inside. It follows its own cycle of the bijection, which passes back through
    # [0, n), so this ends, and restricted to [0, n) it is again a bijection.
    walk = np.flatnonzero(y >= np.uint64(n))
    while walk.size:
        y[walk] = _feistel(y[walk], keys[:, walk], u, v)
        walk = walk[y[walk] >= np.uint64(n)]
    return y.astype(np.int64)


@lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    # Order 1. PCG64 seeded by (seed, epoch): the same permutation on every machine and numpy>=1.17.
    return np.random.default_rng([seed, epoch]).permutation(n)


def sample_blocks(seed: int, samples: np.ndarray, n: int, order: int = CURRENT_ORDER) -> np.ndarray:
    """Block ids (int64) of the run's samples ``samples`` (global sample indices) over n blocks."""
    g = np.asarray(samples, dtype=np.int64)
    if order == ORDER_V2:
        return permute(seed, g // n, g % n, n)
    if order != ORDER_V1:
        raise ValueError(f"unknown sample order {order!r} (known: {ORDERS})")
    out = np.empty_like(g)
    for epoch in np.unique(g // n):
        sel = g // n == epoch
        out[sel] = _epoch_order(seed, int(epoch), n)[g[sel] % n]
    return out


def derived_seed(seed: int, name: str) -> int:
    """A seed of its own for a named stream (a mixture's source), from the run's seed: sources
    do not walk their blocks in lockstep, and reordering the mix list leaves each order alone."""
    digest = hashlib.blake2b(f"{seed}\0{name}".encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


__all__ = ["CURRENT_ORDER", "ORDERS", "ORDER_V1", "ORDER_V2", "derived_seed", "permute", "sample_blocks"]
