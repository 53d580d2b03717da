"""The worker side of a text ``prepare``: one unit read, split, hashed and tokenized.

Runs in the tokenizer processes, which import this module by name to call ``encode_unit``:
it stays small and imports only what a worker needs.
"""
from __future__ import annotations

import hashlib
import os

from distlm.corpus.sources import SourceStats, Unit, read_range, unit_documents
from distlm.corpus.split import SPLITS, TRAIN, VAL, seed_key, split_key
from distlm.corpus.units import hash_text_file
from distlm.data import tokenizer as tkz


def encode_unit(tok: tkz.Tokenizer, k: int, unit: Unit, options: dict, folder: str) -> dict:
    """Read, split, hash and tokenize one unit; tokens go to ``folder/{k}.train|.val|.doc``.
    Returns the counts and, for the fallbacks, this unit's lowest-key train document and
    highest-key val document as [key, first token, tokens] within the unit's own files."""
    key = seed_key(options["seed"])
    label, path, _ = unit.paths[0]
    if unit.kind == "hash":
        digest = hash_text_file(label, path, lambda: hashlib.blake2b(digest_size=8, key=key))
        return {"key": int.from_bytes(digest, "big") / 2.0 ** 64}
    stats, out = SourceStats(), _UnitFiles(os.path.join(folder, f"{k:08d}"))
    code = "<u2" if tok.dtype == "uint16" else "<u4"
    eos = tok.eos_id.to_bytes(2 if code == "<u2" else 4, "little")
    itemsize = len(eos)
    result = {"docs": [0, 0], "chars": 0, "bytes": 0, "min_train": None, "max_val": None}
    try:
        if unit.kind == "piece":
            text = read_range(unit, stats) or ""
            stats.documents += unit.start == 0
            out.write("doc", _encode(tok, text) + (eos if unit.last else b""))
            result.update(chars=len(text), bytes=len(text.encode("utf-8")))
        else:
            vf, written = options["val_fraction"], [0, 0]
            for _, text in unit_documents(unit, options["text_field"], options["separator"], stats):
                data = text.encode("utf-8")
                doc_key = split_key(data, key)
                split = VAL if doc_key < vf else TRAIN
                tokens = _encode(tok, text) + eos
                n = len(tokens) // itemsize
                if split == TRAIN and (result["min_train"] is None or doc_key < result["min_train"][0]):
                    result["min_train"] = [doc_key, written[TRAIN], n]
                if split == VAL and (result["max_val"] is None or doc_key > result["max_val"][0]):
                    result["max_val"] = [doc_key, written[VAL], n]
                out.write(SPLITS[split], tokens)
                written[split] += n
                result["docs"][split] += 1
                result["chars"] += len(text)
                result["bytes"] += len(data)
    finally:
        out.close()
    result["stats"] = stats.as_dict()
    return result


def _encode(tok: tkz.Tokenizer, text: str) -> bytes:
    # Long documents go in pieces that tokenize exactly as the whole (tokenizer.split_for_encoding).
    return b"".join(tok.encode_packed(list(tkz.split_for_encoding(text, tok.chunk_chars))))


class _UnitFiles:
    """A worker's token files for one unit, opened on first use."""

    def __init__(self, base: str) -> None:
        self.base, self.files = base, {}

    def write(self, name: str, data: bytes) -> None:
        if name not in self.files:
            self.files[name] = open(f"{self.base}.{name}", "wb", buffering=1 << 20)
        self.files[name].write(data)

    def close(self) -> None:
        for fh in self.files.values():
            fh.close()
