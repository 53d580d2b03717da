"""Where documents come from: finding the inputs, and the facade over reading them.

Inputs are files, folders (walked recursively in sorted order, hidden entries
skipped), glob patterns, ``.jsonl``, ``.parquet``, Hugging Face ``save_to_disk``
folders (their Arrow files are read with pyarrow alone, no ``datasets``), gzip of
any of these, and tar archives (one document per member). A plain file is one
document, or several when a separator is given. The order is the inputs' order,
each folder or glob expanded in sorted order, so the same inputs always give the
same documents in the same order.

This module finds the inputs (``resolve_inputs``, ``input_files``) and reads them in
order (``iter_documents``). The rest lives beside it, and its public names are
re-exported here so that callers need one import:

- ``formats``: reading the documents of one file in each format (``SourceStats``,
  ``split_documents``, ``decode_text``, ``hf_arrow_files``);
- ``units``: ``plan_units`` cuts the same documents into tasks that worker processes
  read on their own (``unit_documents``, ``read_range``, ``text_blocks``);
- ``pretokenized``: nanoGPT/llm.c ``.bin`` files, which are tokens, not documents
  (``pretokenized_inputs``, ``read_token_file``).
"""
from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from distlm.corpus.formats import SourceStats, _file_docs, _hf_docs, hf_arrow_files, split_documents
from distlm.corpus.formats import decode_text  # noqa: F401 (re-exported)
from distlm.corpus.pretokenized import pretokenized_inputs, read_token_file  # noqa: F401 (re-exported)
from distlm.corpus.units import RANGE_KINDS, Unit, plan_units  # noqa: F401 (re-exported)
from distlm.corpus.units import read_range, text_blocks, unit_documents  # noqa: F401 (re-exported)
from distlm.corpus.units import _line_cut, _piece_cut, _separator_cut  # noqa: F401 (tests use them here)
from distlm.data import DataError, read_json

DEFAULT_CORPUS = Path(__file__).resolve().parent.parent / "assets" / "gutenberg" / "gutenberg.tar.xz"


@dataclass(frozen=True)
class Source:
    label: str  # the path as the user would recognise it
    path: Path
    kind: str  # "file", or "hf" for a save_to_disk folder


def resolve_inputs(inputs: list[str], exclude: Path | None = None) -> list[Source]:
    """Expand inputs into concrete sources; DataError for a path that is not there."""
    if not inputs:
        raise DataError("no inputs given")
    skip = exclude.resolve() if exclude is not None else None
    found: list[Source] = []
    for raw in inputs:
        path = Path(raw).expanduser()
        if not raw.strip():
            raise DataError(f"empty input path {raw!r}")
        if path.is_dir() or path.is_file():
            matches = [str(path)]
        elif any(c in raw for c in "*?["):
            matches = sorted(glob.glob(os.path.expanduser(raw), recursive=True))
            if not matches:
                raise DataError(f"{raw}: no files match this pattern")
        elif path.is_symlink():
            raise DataError(f"{raw}: a symbolic link to nothing readable (missing, or a loop)")
        else:
            raise DataError(f"{raw}: no such file or directory")
        for m in matches:
            p = Path(m)
            found.extend(_walk(p, skip) if p.is_dir() else [Source(m, p, "file")] if p.is_file() else [])
    return found


def _walk(folder: Path, skip: Path | None) -> list[Source]:
    if skip is not None and folder.resolve() == skip:
        return []
    if _is_hf_dataset(folder):
        return [Source(str(folder), folder, "hf")]
    splits = folder / "dataset_dict.json"
    if splits.is_file():  # a DatasetDict: each split is a dataset folder
        names = (read_json(splits) or {}).get("splits", [])
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise DataError(f"{splits}: 'splits' is not a list of folder names")
        return [Source(str(folder / s), folder / s, "hf") for s in names if _is_hf_dataset(folder / s)]
    out: list[Source] = []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.name.startswith("."):
            continue
        if entry.is_dir(follow_symlinks=False):  # symlinked folders could loop
            out.extend(_walk(Path(entry.path), skip))
        elif _is_file(entry):
            out.append(Source(entry.path, Path(entry.path), "file"))
    return out


def _is_file(entry: os.DirEntry) -> bool:
    """A regular file, through links; a link that loops (ELOOP) is an error naming it, not
    a traceback, and one that leads nowhere is skipped like any other non-file."""
    try:
        return entry.is_file()
    except OSError as e:
        raise DataError(f"{entry.path}: {e.strerror} (a symbolic link that loops?); remove it or name "
                        f"the files to read") from None


def _is_hf_dataset(folder: Path) -> bool:
    return (folder / "state.json").is_file() and any(folder.glob("*.arrow"))


def source_files(source: Source) -> list[Path]:
    """The files behind a source, for fingerprints and sizes."""
    if source.kind == "hf":
        return [source.path / "state.json", *hf_arrow_files(source.path)]
    return [source.path]


def input_files(sources: list[Source]) -> list[tuple[str, str, bool]]:
    """The files that hold documents, in reading order, as (label, path, is an HF Arrow file)."""
    out: list[tuple[str, str, bool]] = []
    for src in sources:
        if src.kind == "hf":
            out += [(str(p), str(p), True) for p in hf_arrow_files(src.path)]
        else:
            out.append((src.label, str(src.path), False))
    return out


def iter_documents(inputs: list[str], *, separator: str | None = None, text_field: str = "text",
                   stats: SourceStats | None = None, exclude: Path | None = None) -> Iterator[tuple[str, str]]:
    """Yield ``(source_id, text)`` for every non-empty document of ``inputs``, in order.

    ``source_id`` is the file, ``archive:member``, ``file.jsonl:line`` or ``file:row``.

    Binary files are skipped and invalid UTF-8 replaced by U+FFFD, both counted in
    ``stats``. Raises DataError if nothing at all is left.
    """
    stats = stats if stats is not None else SourceStats()
    for src in resolve_inputs(inputs, exclude):
        docs = (_hf_docs(src.path, text_field, stats) if src.kind == "hf"
                else _file_docs(src.label, src.path, text_field, stats))
        yield from split_documents(docs, separator, stats)
    if stats.documents == 0:
        raise DataError(f"no documents in {', '.join(inputs)} ({stats.summary()})")


