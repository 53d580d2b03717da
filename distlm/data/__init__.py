"""Data at run time: reading a prepared folder (token shards plus ``manifest.json``).

The folder's format is defined here (the manifest, its checks, the shards' checksums), the
tokenizers in ``tokenizer``, the batches in ``loader``, ``order`` and ``mixture``. Writing a
folder is the pipeline's (``distlm.corpus``), which imports this package, never the reverse.
This module itself is in the standard library alone: the trainer imports it, and so does
every tokenizer worker process; ``.tokenizer`` and ``.loader`` are imported on demand.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class DataError(ValueError):
    """A problem with the user's data or options, worded for the user.

    The message is one line naming the file, field or value at fault; the CLI
    prints it as ``error: <message>`` and exits with status 2.
    """

    def __init__(self, message: str) -> None:
        # Messages quote other libraries' errors (pyarrow's span lines): keep the promise of one line.
        super().__init__(" ".join(str(message).split()) if "\n" in str(message) or "\r" in str(message)
                         else message)


def read_json(path: Path) -> dict | None:
    """A JSON object from ``path``, or None if it is missing or not one."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _trained_on(folder: Path, kind: str) -> str:
    """'; the run trained on data.dir=D' from a run's (or its checkpoint's run's) config.yaml."""
    import yaml
    config = (folder if kind == "run" else folder.parent.parent) / "config.yaml"
    try:
        data_dir = (yaml.safe_load(config.read_text()) or {}).get("data", {}).get("dir")
    except (OSError, AttributeError, yaml.YAMLError):  # no readable config: no hint, the error stands
        return ""
    return f"; the run trained on data.dir={data_dir}" if isinstance(data_dir, str) and data_dir else ""


def load_manifest(data_dir: str | Path, *, part_ok: bool = False) -> dict:
    """The manifest of a prepared folder; DataError naming the path if missing or invalid.
    A part of a sharded prepare (``prepare --shard I/N``) holds only some inputs, its splits
    not yet balanced: refused unless ``part_ok`` (for ``prepare --merge``)."""
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        from distlm.folders import NAMES, kind_of
        kind = kind_of(data_dir)
        if kind in ("run", "checkpoint", "runs", "hf"):  # a folder of another kind: no prepare into it
            raise DataError(f"{path}: not found; {data_dir} is {NAMES[kind]}, not prepared data"
                            + _trained_on(Path(data_dir), kind))
        raise DataError(f"{path}: not found; create it with `distlm prepare INPUT... --out {data_dir}`")
    manifest = read_json(path)
    if manifest is None:
        raise DataError(f"{path}: not a valid JSON manifest; run `distlm prepare` again")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{path}: format_version {manifest.get('format_version')!r} is not {FORMAT_VERSION}; "
                        f"run `distlm prepare` again")
    for key in ("tokenizer", "dtype", "splits"):
        if key not in manifest:
            raise DataError(f"{path}: missing field {key!r}")
    tok = manifest["tokenizer"]
    if not isinstance(tok, dict) or not isinstance(tok.get("name"), str):
        raise DataError(f"{path}: field 'tokenizer' must hold the tokenizer's name")
    vocab = tok.get("vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab <= 0:
        raise DataError(f"{path}: tokenizer.vocab_size must be a positive integer, got {vocab!r}")
    part = manifest.get("part")
    if part is not None and not part_ok:
        where = f"{part.get('index')}/{part.get('count')}" if isinstance(part, dict) else "?"
        raise DataError(f"{path}: part {where} of a sharded prepare; join all the parts first with "
                        f"`distlm prepare --merge PART_DIR... --out DIR`")
    return manifest


def fit_vocab(model_vocab: int | None, manifest: dict, data_dir: str | Path) -> int:
    """model.vocab_size for this data: the tokenizer's when unset; refused when smaller."""
    vocab = int(manifest["tokenizer"]["vocab_size"])
    if model_vocab is None:
        return vocab
    if model_vocab < vocab:
        raise DataError(f"model.vocab_size={model_vocab} is smaller than the data's vocabulary "
                        f"({vocab}, tokenizer {manifest['tokenizer']['name']} in {data_dir}/manifest.json)")
    return model_vocab


def same_tokenizer(a: dict, b: dict) -> bool:
    """Two manifests' (or a run's and a manifest's) tokenizer records name the same token ids.
    Records written before fingerprints existed compare by name and size."""
    if a.get("fingerprint") and b.get("fingerprint"):
        return a["fingerprint"] == b["fingerprint"]
    return a.get("name") == b.get("name") and a.get("vocab_size") == b.get("vocab_size")


def _shards(manifest: dict) -> list[dict]:
    return [shard for split in manifest["splits"].values() for shard in split["shards"]]


def shards_present(data_dir: str | Path, manifest: dict) -> bool:
    """Every listed file is there with the right size (cheap; verify_shards reads contents)."""
    try:
        itemsize = 2 if manifest["dtype"] == "uint16" else 4
        sized = all((Path(data_dir) / s["file"]).stat().st_size == s["tokens"] * itemsize for s in _shards(manifest))
        tok_file = manifest["tokenizer"].get("file")
        return sized and (tok_file is None or (Path(data_dir) / tok_file).is_file())
    except (OSError, KeyError, TypeError, AttributeError):
        return False


def verify_shards(data_dir: str | Path, manifest: dict | None = None) -> None:
    """Check each shard's size, sha256 and token-id range against the manifest; DataError
    naming the first bad one. The range check catches a shard whose checksum was rewritten
    with it (an id past the vocabulary would crash the embedding, on CUDA as a device assert)."""
    import numpy as np  # only here: the rest of this module stays standard-library
    manifest = manifest if manifest is not None else load_manifest(data_dir)
    itemsize = 2 if manifest["dtype"] == "uint16" else 4
    vocab = int(manifest["tokenizer"]["vocab_size"])
    for shard in _shards(manifest):
        path = Path(data_dir) / shard["file"]
        if not path.is_file() or path.stat().st_size != shard["tokens"] * itemsize:
            raise DataError(f"{path}: missing or not {shard['tokens']} tokens long, as the manifest says")
        digest, top = hashlib.sha256(), -1
        with open(path, "rb") as fh:
            while block := fh.read(1 << 23):
                digest.update(block)
                top = max(top, int(np.frombuffer(block, dtype="<" + manifest["dtype"][0] + str(itemsize)).max()))
        if top >= vocab:
            raise DataError(f"{path}: holds token id {top}, outside the tokenizer's vocabulary of {vocab}")
        if digest.hexdigest() != shard["sha256"]:
            raise DataError(f"{path}: sha256 {digest.hexdigest()} does not match the manifest's {shard['sha256']}")


__all__ = ["DataError", "FORMAT_VERSION", "MANIFEST", "fit_vocab", "load_manifest", "same_tokenizer", "shards_present",
           "verify_shards"]
