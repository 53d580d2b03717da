"""``bpe:N``: training the tokenizer on the documents that will land in train.

In the parent, before any worker starts: the workers need the finished tokenizer.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

from distlm.corpus.sources import SourceStats, iter_documents
from distlm.corpus.split import seed_key, split_key
from distlm.data import tokenizer as tkz


def train_bpe(inputs: list[str], out_dir: Path, options: dict, progress: bool, cache_chars: int) -> tkz.BPETokenizer:
    """Train bpe:N on the documents that end up in train, reading the inputs here: once to
    find the split (with the fallbacks), then again unless they fit in ``cache_chars``."""
    from tqdm import tqdm
    name, vf, key = options["tokenizer"], options["val_fraction"], seed_key(options["seed"])
    read = functools.partial(iter_documents, inputs, separator=options["separator"],
                             text_field=options["text_field"], exclude=out_dir)
    count = n_val = chars = 0
    lowest = highest = (-1, 0.0)  # (document, key): the earliest on ties
    cache: list[str] | None = []
    with tqdm(unit="char", unit_scale=True, desc=f"reading ({name})", disable=None if progress else True) as bar:
        for i, (_, text) in enumerate(read()):
            doc_key = split_key(text.encode("utf-8"), key)
            if count == 0 or doc_key < lowest[1]:
                lowest = (i, doc_key)
            if count == 0 or doc_key > highest[1]:
                highest = (i, doc_key)
            count, n_val, chars = count + 1, n_val + (doc_key < vf), chars + len(text)
            bar.update(len(text))
            if cache is not None:
                cache.append(text)
                if chars > cache_chars:
                    cache = None
    whole = count == 1 and vf > 0
    to_val = lowest[0] if vf > 0 and n_val == 0 else -1
    to_train = highest[0] if n_val == count else -1
    texts = cache if cache is not None else (text for _, text in read(stats=SourceStats()))

    def train_texts():  # in pieces: the trainer spreads pieces over cores, not one whole book
        for i, text in enumerate(texts):
            if whole:
                text = text[:max(1, int(len(text) * (1 - vf)))]
            elif i == to_val or (i != to_train and split_key(text.encode("utf-8"), key) < vf):
                continue
            yield from tkz.split_for_encoding(text, 1 << 16)

    return tkz.train_bpe(train_texts(), tkz.parse_bpe_size(name), progress=progress and sys.stderr.isatty())
