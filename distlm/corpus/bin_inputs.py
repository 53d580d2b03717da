"""``prepare`` of pre-tokenized GPT-2 ``.bin`` inputs: copied into shards, not tokenized.

A path of its own: no split rule, journal or workers apply; the files given for train and
val are copied whole and only checked to be GPT-2 tokens.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from distlm.corpus.folder import inputs_fingerprint, swap_in, tokenizer_info, write_manifest
from distlm.corpus.shards import ShardWriter
from distlm.corpus.sources import read_token_file
from distlm.corpus.split import SPLITS
from distlm.data import MANIFEST, DataError, read_json, shards_present
from distlm.data import tokenizer as tkz


def prepare_bin_folder(pretok: tuple[list[Path], list[Path]], out_dir: Path, options: dict) -> dict:
    per_input = [(str(p), [p]) for p in pretok[0] + pretok[1]]
    fingerprint = inputs_fingerprint([f for _, fs in per_input for f in fs], options)
    old = read_json(out_dir / MANIFEST)
    if old and old.get("inputs_fingerprint") == fingerprint and shards_present(out_dir, old):
        print(f"{out_dir}: up to date")
        return old
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        body = _prepare_pretokenized(*pretok, tmp, options["shard_tokens"])
        sources = [{"path": raw, "files": len(fs), "bytes": sum(f.stat().st_size for f in fs)}
                   for raw, fs in per_input]
        manifest = write_manifest(tmp, body, sources=sources, fingerprint=fingerprint, options=options,
                                  seed=options["seed"], val_fraction=options["val_fraction"])
        swap_in(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def _prepare_pretokenized(train: list[Path], val: list[Path], tmp: Path, shard_tokens: int) -> dict:
    import numpy as np
    tok, splits, block = tkz.gpt2(), {}, 1 << 24
    for name, files in zip(SPLITS, (train, val)):
        writer, documents = ShardWriter(tmp, name, "uint16", shard_tokens), 0
        for path in files:
            tokens = read_token_file(path)
            for start in range(0, len(tokens), block):
                part = np.asarray(tokens[start:start + block])
                if int(part.max()) >= tok.vocab_size:
                    raise DataError(f"{path}: token {int(part.max())} is outside GPT-2's {tok.vocab_size}; "
                                    f"not a GPT-2 token file")
                documents += int(np.count_nonzero(part == tok.eos_id))
                writer.write(part.tobytes())
        splits[name] = writer.finish(documents)  # documents: EOS tokens seen
    return {"tokenizer": tokenizer_info(tok), "dtype": "uint16", "split_method": "pretokenized",
            "splits": splits, "stats": {"files": len(train) + len(val)}}
