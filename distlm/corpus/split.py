"""Which split a document goes to: the hash rule and the fallbacks of ``prepare``.

One module because three places must agree on it exactly: the workers that hash each
document, ``bpe:N`` training (which reads only the train documents), and the parent and
``merge``, which apply the fallbacks to the whole corpus.
"""
from __future__ import annotations

import hashlib

TRAIN, VAL = 0, 1
SPLITS = ("train", "val")


def seed_key(seed: int) -> bytes:
    return str(seed).encode()[:64]


def split_key(data: bytes, key: bytes) -> float:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, key=key).digest(), "big") / 2.0 ** 64


def fallback(docs: list[int], tokens: list[int], min_train, max_val, val_fraction: float):
    """(split_method, the split to rewrite or None, its moved token ranges as (begin, end,
    destination), the documents per split afterwards) for the corpus totals."""
    total = docs[TRAIN] + docs[VAL]
    if total == 1 and val_fraction > 0:  # a lone document: its last val_fraction of tokens to val
        home = TRAIN if docs[TRAIN] else VAL
        n = tokens[home]
        cut = n - min(max(1, round(n * val_fraction)), n - 1)
        return "single-document-tail", home, [(0, cut, TRAIN), (cut, n, VAL)], [1, 1]
    if total and val_fraction > 0 and docs[VAL] == 0:
        _, first, n = min_train
        return "document-hash", TRAIN, [(first, first + n, VAL)], [docs[TRAIN] - 1, 1]
    if total and docs[TRAIN] == 0:
        _, first, n = max_val
        return "document-hash", VAL, [(first, first + n, TRAIN)], [1, docs[VAL] - 1]
    return "document-hash", None, [], list(docs)
