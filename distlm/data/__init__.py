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
import os
import stat
from pathlib import Path

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# A manifest lists a few thousand shards at most: kilobytes to a few MB.
MANIFEST_LIMIT = 64 << 20
MAX_SHARDS = 1_000_000
DTYPES = ("uint16", "uint32")


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
        data = json.loads(read_regular_text(path, MANIFEST_LIMIT, "the JSON file"))
    except (OSError, ValueError):  # DataError is a ValueError
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
    try:
        st = os.stat(path)
    except FileNotFoundError:
        from distlm.folders import NAMES, kind_of
        kind = kind_of(data_dir)
        if kind in ("run", "checkpoint", "runs", "hf"):  # a folder of another kind: no prepare into it
            raise DataError(f"{path}: not found; {data_dir} is {NAMES[kind]}, not prepared data"
                            + (", for init.from_hf" if kind == "hf" else _trained_on(Path(data_dir), kind))) from None
        raise DataError(f"{path}: not found; create it with `distlm prepare INPUT... --out {data_dir}`") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise DataError(f"{path}: is {file_kind(st.st_mode)}, not a manifest file")
    if st.st_size > MANIFEST_LIMIT:
        raise DataError(f"{path}: {st.st_size:,} bytes, over the {MANIFEST_LIMIT >> 20} MB limit of a manifest")
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
    problem = _manifest_problem(manifest)
    if problem:
        raise DataError(f"{path}: {problem} (not written by `distlm prepare`, or edited); run `distlm prepare` again")
    part = manifest.get("part")
    if part is not None and not part_ok:
        where = f"{part.get('index')}/{part.get('count')}" if isinstance(part, dict) else "?"
        raise DataError(f"{path}: part {where} of a sharded prepare; join all the parts first with "
                        f"`distlm prepare --merge PART_DIR... --out DIR`")
    return manifest


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def file_kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def read_regular_text(path: str | Path, limit: int, what: str, error: type = DataError) -> str:
    """The UTF-8 text of ``path``, which must be a regular file (a link to one is followed)
    of at most ``limit`` bytes. Opened without blocking, so a FIFO is named, not waited on;
    a folder, FIFO, socket or device is refused for what it is (never "not found"), a
    missing file is FileNotFoundError, everything else one line of ``error``."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise error(f"{path}: {what} cannot be read ({e.strerror or e.__class__.__name__})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path}: {what} is {file_kind(st.st_mode)}, not a regular file; refused")
        if st.st_size > limit:
            raise error(f"{path}: {what} is {st.st_size:,} bytes, over the {limit:,}-byte limit distlm reads")
        os.set_blocking(fd, True)
        data = b""
        while len(data) <= limit and (block := os.read(fd, 1 << 20)):
            data += block
    finally:
        os.close(fd)
    if len(data) > limit:
        raise error(f"{path}: {what} is over the {limit:,}-byte limit distlm reads")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: {what} is not UTF-8 text (byte {e.start})") from None


def file_name_problem(name, what: str) -> str | None:
    """Why ``name`` is not the name of a file in the folder itself, or None: a shard or the
    tokenizer is joined to the folder's path, so ``../x``, ``/etc/passwd`` or ``a/b`` would
    read a file elsewhere."""
    if not isinstance(name, str):
        return f"{what} is a {type(name).__name__}, not a file name"
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name or len(name) > 255:
        return f"{what} {json.dumps(name[:80])} is not the name of a file in the folder itself"
    return None


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62


def _manifest_problem(manifest: dict) -> str | None:
    """The first field of a manifest that is not of the type and range prepare writes."""
    if manifest["dtype"] not in DTYPES:
        return f"dtype {json.dumps(manifest['dtype'])[:40]} is not one of {', '.join(DTYPES)}"
    tok_file = manifest["tokenizer"].get("file")
    if tok_file is not None and file_name_problem(tok_file, "tokenizer.file"):
        return file_name_problem(tok_file, "tokenizer.file")
    splits = manifest["splits"]
    if not isinstance(splits, dict):
        return "splits is not an object"
    count = 0
    for name, split in splits.items():
        where = f"splits.{str(name)[:40]}"
        if not isinstance(split, dict) or not isinstance(split.get("shards"), list):
            return f"{where} is not an object with a list of shards"
        if "tokens" in split and not _is_count(split["tokens"]):
            return f"{where}.tokens is not a token count"
        count += len(split["shards"])
        if count > MAX_SHARDS:
            return f"more than {MAX_SHARDS:,} shards"
        for i, shard in enumerate(split["shards"]):
            if not isinstance(shard, dict):
                return f"{where}.shards[{i}] is not an object"
            problem = file_name_problem(shard.get("file"), f"{where}.shards[{i}].file")
            if problem:
                return problem
            if not _is_count(shard.get("tokens")):
                return f"{where}.shards[{i}].tokens is not a token count"
            if "sha256" in shard and not isinstance(shard["sha256"], str):
                return f"{where}.shards[{i}].sha256 is not a string"
    return None


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
