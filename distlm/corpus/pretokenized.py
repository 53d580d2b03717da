"""Pre-tokenized nanoGPT/llm.c ``.bin`` inputs: already tokens, not documents.

Apart from ``sources`` and ``formats`` because nothing here is read as text: such
inputs skip tokenizing and are copied into shards as they are (``bin_inputs``).
"""
from __future__ import annotations

import re
from pathlib import Path

from distlm.data import DataError

LLMC_MAGIC, LLMC_VERSION, LLMC_HEADER_BYTES = 20240520, 1, 256 * 4
_BIN_SPLIT = re.compile(r"(?:^|[_.-])(train|val)(?:[_.-]|$)")


def pretokenized_inputs(inputs: list[str], tokenizer: str) -> tuple[list[Path], list[Path]] | None:
    """nanoGPT/llm.c ``.bin`` inputs as (train files, val files); None for text inputs.

    Either the files themselves, or one folder holding both ``train.bin`` and
    ``val.bin`` (or llm.c's ``*_train*.bin`` and ``*_val*.bin``). A folder with
    only one kind is text to prepare, its .bin files skipped as binary.
    """
    paths = [Path(i).expanduser() for i in inputs]
    split = {p: m.group(1) for p in paths if p.suffix == ".bin" and (m := _BIN_SPLIT.search(p.stem))}
    if len(paths) == 1 and paths[0].is_dir():
        folder = paths[0]
        split = {p: m.group(1) for p in sorted(folder.glob("*.bin")) if (m := _BIN_SPLIT.search(p.stem))}
        if set(split.values()) != {"train", "val"}:
            return None
        if (folder / "meta.pkl").is_file():
            raise DataError(f"{folder / 'meta.pkl'}: character-level nanoGPT data is not GPT-2 tokens; "
                            f"prepare the text instead")
    elif not any(p.suffix == ".bin" for p in paths):
        return None
    elif len(split) < len(paths):
        odd = next(p for p in paths if p not in split)
        if not split:  # no train/val .bin among the inputs: nothing was mixed, the name is what is wrong
            raise DataError(f"{odd}: a .bin input is read as pre-tokenized tokens (nanoGPT/llm.c), given as a train "
                            f"and a val file named like train.bin and val.bin; this name says neither")
        raise DataError(f"{odd}: cannot mix with pre-tokenized .bin files; name those like train.bin / val.bin")
    for p in split:
        if not p.is_file():
            raise DataError(f"{p}: no such file")
    train, val = [p for p in split if split[p] == "train"], [p for p in split if split[p] == "val"]
    if not train or not val:
        raise DataError(f"pre-tokenized inputs need both a train and a val .bin file: {', '.join(inputs)}")
    if tokenizer != "gpt2":
        raise DataError(f"pre-tokenized .bin files hold GPT-2 tokens; tokenizer {tokenizer!r} cannot apply")
    return train, val


def read_token_file(path: str | Path):
    """Tokens of a nanoGPT (raw uint16) or llm.c (1 KB header, then uint16) ``.bin`` file.

    The llm.c header is 256 int32: magic 20240520, version 1, token count. The file
    is memory-mapped; DataError names the file when it is truncated or malformed.
    """
    import numpy as np
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from None
    header = np.fromfile(path, dtype="<i4", count=3) if size >= LLMC_HEADER_BYTES else np.zeros(3, "<i4")
    if header[0] == LLMC_MAGIC:
        if header[1] != LLMC_VERSION:
            raise DataError(f"{path}: llm.c token file version {header[1]} is not supported (only 1: uint16)")
        count, offset = int(header[2]), LLMC_HEADER_BYTES
        if size != offset + 2 * count:
            raise DataError(f"{path}: header promises {count} tokens ({offset + 2 * count} bytes) "
                            f"but the file has {size} bytes (truncated or corrupt)")
    else:
        if size % 2:
            raise DataError(f"{path}: odd size {size}, not whole uint16 tokens (truncated?)")
        count, offset = size // 2, 0
    if count == 0:
        raise DataError(f"{path}: holds no tokens")
    return np.memmap(path, dtype="<u2", mode="r", offset=offset, shape=(count,))
