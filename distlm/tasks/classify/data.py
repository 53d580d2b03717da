"""Labelled text in (CSV, TSV, JSONL, parquet; .gz/.xz), padded token arrays and a label map out.

    distlm prepare --task classify train.csv --out data/news --text-field text --label-field label \
        [--val-input test.csv | --split-field split | --val-fraction 0.1] --max-len 128

A prepared folder holds ``manifest.json`` (task, tokenizer, max_len, pad id, labels,
per-split rows and class counts, sources with sha256), ``labels.json`` (the label map)
and ``train.npz`` / ``val.npz`` with ``tokens`` (N x max_len, right-padded with the
tokenizer's end-of-text id, which never occurs inside encoded text), ``lengths`` (real
tokens per row: the attention/pooling mask is ``arange(max_len) < length``) and
``labels`` (indices into the label map). Everything is written into a temporary folder
and renamed into place, so an error leaves nothing behind.

The split comes from ``--val-input`` (a second file), else from a split column in the
data (train vs val/valid/validation/dev/test), else from a deterministic hold-out: a row
goes to val when a hash of (seed, text) falls under ``--val-fraction``.
"""
from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import lzma
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from distlm.data import DataError

FORMAT_VERSION = 1
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "assets" / "20news4" / "20news4.jsonl.xz"
VAL_NAMES = {"val", "valid", "validation", "dev", "test"}
TEXT_SUFFIXES = (".csv", ".tsv", ".jsonl", ".json", ".parquet", ".txt")


@dataclass
class Row:
    text: str
    label: str | None
    split: str | None
    where: str  # "FILE row N", for error messages


def _base_suffix(path: Path) -> str:
    name = path.name.lower()
    for comp in (".gz", ".xz"):
        if name.endswith(comp):
            name = name[: -len(comp)]
    return Path(name).suffix


def _open_text(path: Path) -> io.TextIOBase:
    name = path.name.lower()
    opener = gzip.open if name.endswith(".gz") else lzma.open if name.endswith(".xz") else open
    return opener(path, "rt", encoding="utf-8", errors="replace", newline="")


def _records(path: Path, fields: list[str]):
    """(row number, {field: value}) for each record; checks the fields exist first."""
    suffix = _base_suffix(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    if suffix not in TEXT_SUFFIXES:
        raise DataError(f"{path}: unsupported format '{suffix}' (use {', '.join(TEXT_SUFFIXES)}, optionally .gz/.xz)")
    try:
        if suffix in (".csv", ".tsv"):
            with _open_text(path) as f:
                reader = csv.DictReader(f, delimiter="\t" if suffix == ".tsv" else ",")
                _need(path, fields, reader.fieldnames or [])
                for i, rec in enumerate(reader, start=2):  # row 1 is the header
                    yield i, rec
        elif suffix in (".jsonl", ".json"):
            with _open_text(path) as f:
                for i, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except ValueError as e:
                        raise DataError(f"{path}: line {i}: not JSON ({e.msg})") from None
                    if not isinstance(rec, dict):
                        raise DataError(f"{path}: line {i}: expected a JSON object, got {type(rec).__name__}")
                    _need(path, fields, list(rec), f"line {i}: ")
                    yield i, rec
        elif suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise DataError(f"{path}: reading parquet needs pyarrow (pip install 'distlm[parquet]')") from None
            table = pq.read_table(path)
            _need(path, fields, table.column_names)
            cols = {f: table.column(f).to_pylist() for f in fields if f in table.column_names}
            for i in range(table.num_rows):
                yield i + 1, {f: cols[f][i] for f in cols}
        else:  # .txt: one text per line, no labels (predict)
            with _open_text(path) as f:
                for i, line in enumerate(f, start=1):
                    yield i, {fields[0]: line.rstrip("\r\n")}
    except (OSError, EOFError, lzma.LZMAError, csv.Error, UnicodeError) as e:
        raise DataError(f"{path}: cannot read ({e.__class__.__name__}: {e})") from None
    except Exception as e:  # pyarrow's errors have no common base worth importing
        if isinstance(e, DataError):
            raise
        raise DataError(f"{path}: cannot read ({e.__class__.__name__}: {str(e).splitlines()[0][:200]})") from None


def _need(path: Path, fields: list[str], have: list[str], where: str = "") -> None:
    for f in fields:
        if f not in have:
            raise DataError(f"{path}: {where}no column '{f}' (columns: {', '.join(map(str, have)) or 'none'}); "
                            f"choose one with --text-field/--label-field")


def _has_column(path: Path, name: str) -> bool:
    suffix = _base_suffix(path)
    try:
        if suffix in (".csv", ".tsv"):
            with _open_text(path) as f:
                return name in (next(csv.reader(f, delimiter="\t" if suffix == ".tsv" else ","), []))
        if suffix in (".jsonl", ".json"):
            with _open_text(path) as f:
                for line in f:
                    if line.strip():
                        rec = json.loads(line)
                        return isinstance(rec, dict) and name in rec
        if suffix == ".parquet":
            import pyarrow.parquet as pq
            return name in pq.read_schema(path).names
    except Exception:
        return False  # the real read reports the problem with its file and line
    return False


def read_texts(path: Path, text_field: str = "text") -> list[Row]:
    """Unlabelled texts (predict): .txt lines or a text column. An empty text is an error."""
    rows = []
    for i, rec in _records(path, [text_field]):
        text = _text(path, i, rec, text_field)
        rows.append(Row(text, None, None, f"{path} row {i}"))
    if not rows:
        raise DataError(f"{path}: no texts in it")
    return rows


def _text(path: Path, i: int, rec: dict, field: str) -> str:
    value = rec.get(field)
    text = "" if value is None else str(value)
    if not text.strip():
        raise DataError(f"{path}: row {i}: empty text in field '{field}'")
    return text


def read_labelled(path: Path, text_field: str, label_field: str, split_field: str | None) -> list[Row]:
    fields = [text_field, label_field] + ([split_field] if split_field else [])
    rows = []
    for i, rec in _records(path, fields):
        text = _text(path, i, rec, text_field)
        label = rec.get(label_field)
        if label is None or not str(label).strip():
            raise DataError(f"{path}: row {i}: empty label in field '{label_field}'")
        split = None
        if split_field:
            split = str(rec.get(split_field)).strip().lower()
            if split != "train" and split not in VAL_NAMES:
                raise DataError(f"{path}: row {i}: split field '{split_field}' has {split!r}; "
                                f"expected train or one of {', '.join(sorted(VAL_NAMES))}")
            split = "train" if split == "train" else "val"
        rows.append(Row(text, str(label).strip(), split, f"{path} row {i}"))
    if not rows:
        raise DataError(f"{path}: no rows in it")
    return rows


def label_order(labels: set[str]) -> list[str]:
    """Numeric labels in numeric order (0, 1, ..., 10), others alphabetically."""
    try:
        return sorted(labels, key=lambda s: (float(s), s))
    except ValueError:
        return sorted(labels)


def _holdout(text: str, seed: int, fraction: float) -> bool:
    h = hashlib.sha1(f"{seed}\0{text}".encode("utf-8", "replace")).digest()
    return int.from_bytes(h[:8], "little") / 2**64 < fraction


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def assign_splits(train_rows: list[Row], val_rows: list[Row] | None, seed: int, val_fraction: float,
                  how: str) -> tuple[list[Row], list[Row], str]:
    if val_rows is not None:
        return train_rows, val_rows, how
    if all(r.split is not None for r in train_rows):
        return ([r for r in train_rows if r.split == "train"], [r for r in train_rows if r.split == "val"], how)
    val = [r for r in train_rows if _holdout(r.text, seed, val_fraction)]
    train = [r for r in train_rows if not _holdout(r.text, seed, val_fraction)]
    return train, val, f"hash hold-out of {val_fraction:g} (seed {seed})"


def encode_rows(rows: list[Row], labels: list[str], tok, max_len: int) -> dict[str, np.ndarray]:
    index = {name: i for i, name in enumerate(labels)}
    ids = tok.encode_batch([r.text for r in rows])
    tokens = np.full((len(rows), max_len), tok.eos_id, dtype=np.uint16 if tok.vocab_size <= 65536 else np.uint32)
    lengths = np.zeros(len(rows), dtype=np.int32)
    for i, seq in enumerate(ids):
        seq = seq[:max_len]  # truncate: the head of a post carries its topic
        tokens[i, :len(seq)] = seq
        lengths[i] = len(seq)
    out = {"tokens": tokens, "lengths": lengths,
           "labels": np.array([index[r.label] for r in rows], dtype=np.int64)}
    return out


def prepare_classify(inputs: list[str], out: Path, *, text_field: str = "text", label_field: str = "label",
                     max_len: int = 128, val_input: str | None = None, split_field: str | None = "split",
                     val_fraction: float = 0.1, seed: int = 0, tokenizer: str = "gpt2", quiet: bool = False) -> dict:
    """Read, split, label-map, tokenize, truncate, pad; write atomically. Returns the manifest."""
    if tokenizer != "gpt2":
        raise DataError(f"--tokenizer {tokenizer}: classification data is prepared with gpt2 only")
    if max_len <= 0:
        raise DataError(f"--max-len must be positive, got {max_len}")
    if not 0.0 < val_fraction < 1.0 and val_input is None:
        raise DataError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    paths = [Path(p) for p in (inputs or [str(DEFAULT_DATA)])]
    out = Path(out)
    sources = [{"file": str(p), "sha256": _sha256(p)} for p in paths + ([Path(val_input)] if val_input else [])
               if p.is_file()]
    options = {"text_field": text_field, "label_field": label_field, "max_len": max_len, "val_input": val_input,
               "split_field": split_field, "val_fraction": val_fraction, "seed": seed, "tokenizer": tokenizer}
    fingerprint = hashlib.sha256(json.dumps([sources, options], sort_keys=True).encode()).hexdigest()
    old = _read_manifest(out)
    if old is not None and old.get("fingerprint") == fingerprint:
        return old  # same inputs, same options: nothing to do
    # The split column is used when the (first) file has it; else the hold-out decides.
    use_split = split_field if (val_input is None and split_field and _has_column(paths[0], split_field)) else None
    rows = [r for p in paths for r in read_labelled(p, text_field, label_field, use_split)]
    val_rows = read_labelled(Path(val_input), text_field, label_field, None) if val_input else None
    how = f"--val-input {val_input}" if val_input else f"split column '{use_split}'"
    train, val, how = assign_splits(rows, val_rows, seed, val_fraction, how)
    if not train:
        raise DataError(f"{paths[0]}: no training rows after the split ({how})")
    labels = label_order({r.label for r in train})
    if len(labels) < 2:
        raise DataError(f"{paths[0]}: field '{label_field}' has a single label {labels[0]!r}; a classifier needs two")
    for r in val:
        if r.label not in labels:
            raise DataError(f"{r.where}: label {r.label!r} (field '{label_field}') appears only in the held-out "
                            f"split, never in training; training labels: {', '.join(labels)}")
    from distlm.data.tokenizer import load_tokenizer
    tok = load_tokenizer(tokenizer)
    arrays = {"train": encode_rows(train, labels, tok, max_len), "val": encode_rows(val, labels, tok, max_len)}
    manifest = {
        "task": "classify", "format_version": FORMAT_VERSION, "fingerprint": fingerprint,
        "tokenizer": {"name": tok.name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
                      "fingerprint": tok.fingerprint()},
        "max_len": max_len, "pad_id": tok.eos_id, "text_field": text_field, "label_field": label_field,
        "labels": labels, "split_from": how, "sources": sources, "options": options,
        "splits": {s: {"file": f"{s}.npz", "rows": int(len(a["labels"])),
                       "class_counts": np.bincount(a["labels"], minlength=len(labels)).tolist(),
                       "truncated": int((a["lengths"] == max_len).sum()),
                       "mean_length": float(a["lengths"].mean()) if len(a["lengths"]) else 0.0}
                   for s, a in arrays.items()},
    }
    _write_atomically(out, manifest, arrays)
    if not quiet:
        print(summary(out, manifest))
    return manifest


def summary(out: Path, m: dict) -> str:
    tr, va = m["splits"]["train"], m["splits"]["val"]
    return (f"prepared {out}: {len(m['labels'])} labels ({', '.join(m['labels'])}), train {tr['rows']:,} rows, "
            f"val {va['rows']:,} rows ({m['split_from']}); max_len {m['max_len']} "
            f"(train mean length {tr['mean_length']:.0f}, {tr['truncated']:,} truncated)")


def _read_manifest(out: Path) -> dict | None:
    from distlm.data import read_json
    m = read_json(out / "manifest.json")
    return m if m and m.get("task") == "classify" else None


def _write_atomically(out: Path, manifest: dict, arrays: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        for split, a in arrays.items():
            np.savez(tmp / f"{split}.npz", **a)
        labels = {"labels": manifest["labels"], "label_field": manifest["label_field"],
                  "pad_id": manifest["pad_id"], "max_len": manifest["max_len"], "tokenizer": manifest["tokenizer"]}
        (tmp / "labels.json").write_text(json.dumps(labels, indent=1))
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))  # last: marks the folder complete
        old = None
        if out.exists():
            old = out.parent / f".old-{out.name}-{os.getpid()}"
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_manifest(data_dir: Path) -> dict:
    m = _read_manifest(Path(data_dir))
    if m is None:
        from distlm.data import read_json
        other = read_json(Path(data_dir) / "manifest.json")
        if other is not None:
            raise DataError(f"{data_dir}: prepared for language modelling, not classification; "
                            f"run `distlm prepare --task classify INPUT --out DIR`")
        raise DataError(f"{data_dir}/manifest.json: missing; run `distlm prepare --task classify INPUT --out {data_dir}`")
    if int(m.get("format_version", 0)) != FORMAT_VERSION:
        raise DataError(f"{data_dir}/manifest.json: format_version {m.get('format_version')} is not {FORMAT_VERSION}")
    return m


def load_split(data_dir: Path, manifest: dict, split: str) -> dict[str, np.ndarray]:
    info = manifest["splits"].get(split)
    if info is None:
        raise DataError(f"{data_dir}/manifest.json: no '{split}' split")
    from distlm.data import file_name_problem
    problem = file_name_problem(info.get("file") if isinstance(info, dict) else None, f"splits.{split}.file")
    if problem:
        raise DataError(f"{data_dir}/manifest.json: {problem}; refused")
    path = Path(data_dir) / info["file"]
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in ("tokens", "lengths", "labels")}
    except (OSError, KeyError, ValueError) as e:
        raise DataError(f"{path}: cannot read ({e.__class__.__name__}: {e})") from None
    if len(arrays["labels"]) != info["rows"]:
        raise DataError(f"{path}: has {len(arrays['labels'])} rows, manifest says {info['rows']}")
    return arrays
