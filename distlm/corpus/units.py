"""Cutting the input files into work units, and reading one unit.

A unit is what one worker process of ``prepare`` reads and tokenizes on its own: a run
of small files, or a range of a big one (JSONL at line ends, Parquet at row groups,
text at separators or, for one long document, at spaces). Ranges are cut only where
reading the parts gives exactly the documents and text of reading the whole file, so
the output does not depend on how the work was spread. Workers import these functions
by name: they stay top-level.
"""
from __future__ import annotations

import codecs
import io
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from distlm.corpus.formats import (BINARY_PROBE, TAR_SUFFIXES, SourceStats, _file_docs, _hf_arrow_docs, _jsonl_docs,
                                 _parquet_docs, decode_text, split_documents)
from distlm.data import DataError

RANGE_KINDS = ("lines", "split", "rows", "piece")  # a part of one file
_PROBE_STEP = 1 << 16  # bytes read at a time when looking for a place to cut a file
_PIECE_CUT = re.compile(rb"[\x21-\x7e](?=[ \n])")  # a printable ASCII character, then a space or newline


@dataclass(frozen=True)
class Unit:
    """One task of ``prepare``, read and tokenized by one worker process on its own.

    ``kind``: "files" (each of ``paths`` read whole), or a part of the one file in ``paths``:
    "lines" (JSONL bytes [start, end), cut after newlines), "split" (text bytes [start, end)
    that, but for the first range, begin with the separator), "rows" (Parquet row groups
    [start, end)), "piece" (bytes [start, end) of a file that is one document) or "hash"
    (that whole document's split key, for its pieces).
    """

    kind: str
    paths: tuple[tuple[str, str, bool], ...]  # (label, path, is an Arrow file of an HF save_to_disk folder)
    start: int = 0
    end: int = 0
    first: int = 0  # index of its first file in the list of all input files
    last: bool = True  # it ends its (last) file; for pieces: the document
    size: int = 0  # input bytes, for the progress bar and for balancing

    def files_done(self) -> int:
        """Input files finished once this unit is."""
        if self.kind == "files":
            return self.first + len(self.paths)
        return self.first + self.last

    def as_list(self) -> list:
        return [self.kind, [list(p) for p in self.paths], self.start, self.end, self.first, self.last, self.size]


def plan_units(files: list[tuple[str, str, bool]], separator: str | None, target: int) -> list[Unit]:
    """Cut the input files into units of about ``target`` bytes: runs of consecutive small
    files, and ranges of big files where a range boundary changes nothing (see the module
    docstring). Reads only a few KB around each boundary (Parquet: the footer)."""
    units: list[Unit] = []
    group: list[tuple[str, str, bool]] = []
    size = first = 0

    def flush() -> None:
        nonlocal group, size
        if group:
            units.append(Unit("files", tuple(group), first=first, size=size))
        group, size = [], 0

    for i, (label, path, arrow) in enumerate(files):
        try:
            n = os.stat(path).st_size
        except OSError as e:
            raise DataError(f"{label}: cannot read ({e.strerror})") from None
        ranges = None if arrow or _pieces(n, target) == 1 else _file_ranges(label, path, n, separator, target)
        if ranges is None:
            if not group:
                first = i
            group.append((label, path, arrow))
            size += n
            if size >= target:
                flush()
            continue
        flush()
        units += [Unit(u.kind, u.paths, u.start, u.end, i, u.last, u.size) for u in ranges]
    flush()
    return units


def _file_ranges(label: str, path: str, size: int, separator: str | None, target: int) -> list[Unit] | None:
    name = os.path.basename(path).lower()
    entry = ((label, path, False),)
    if name.endswith(TAR_SUFFIXES + (".gz", ".arrow")):
        return None  # compressed streams and Arrow files are read whole
    if name.endswith(".parquet"):
        return _row_group_units(entry, path, size, target)
    with open(path, "rb") as fh:
        if name.endswith((".jsonl", ".ndjson")):
            kind, cuts = "lines", _cuts(fh, size, target, 1, 0, _line_cut)
        elif b"\0" in fh.read(BINARY_PROBE):
            return None  # skipped as binary, whole
        elif separator:
            sep = separator.encode("utf-8")
            margin = 2 * len(sep) + 2
            kind, cuts = "split", _cuts(fh, size, target, margin, margin, lambda w, i: _separator_cut(w, i, sep))
        else:
            kind, cuts = "piece", _cuts(fh, size, target, 1, 1, _piece_cut)
    if not cuts:
        return None
    bounds = [0, *cuts, size]
    units = [Unit(kind, entry, a, b, last=b == size, size=b - a) for a, b in zip(bounds, bounds[1:])]
    if kind == "piece":
        units.insert(0, Unit("hash", entry, 0, size, last=False))
    return units


def _pieces(size: int, target: int) -> int:
    """How many ranges a file of ``size`` bytes is cut into: ``size / target`` rounded, at least 1.
    Rounded, not rounded up: a file a little over ``target`` stays one task instead of a full one
    and a sliver (and, for one long document, a third task hashing it), and the ranges of a big
    file are of one size, with no short last one."""
    return max(1, (2 * size + target) // (2 * target))


def _cuts(fh: BinaryIO, size: int, target: int, back: int, ahead: int, find) -> list[int]:
    """Cut positions near every ``size / _pieces(size, target)`` bytes: for each, the first place
    at or after it that ``find(window, i)`` accepts, looking at most ``target // 2`` bytes further on."""
    cuts: list[int] = []
    pieces = _pieces(size, target)
    for goal in (size * i // pieces for i in range(1, pieces)):
        pos, limit = max(goal, cuts[-1] + 1 if cuts else 0), min(size, goal + max(target // 2, 1))
        while pos < limit:
            base = max(0, pos - back)
            fh.seek(base)
            window = fh.read(pos - base + _PROBE_STEP + ahead)
            j = find(window, pos - base)
            if j is not None and j < pos - base + _PROBE_STEP and 0 < base + j < size:
                cuts.append(base + j)
                break
            pos += _PROBE_STEP
    return cuts


def _line_cut(window: bytes, i: int) -> int | None:
    """The first line start at or after i (just past a newline)."""
    j = window.find(b"\n", i - 1)
    return j + 1 if j >= 0 else None


def _piece_cut(window: bytes, i: int) -> int | None:
    """The first space or newline at or after i that follows a printable ASCII character.
    Both parts then decode alone (the cut is between ASCII bytes), keep their '\\r\\n'
    pairs, and tokenize as the whole does (see tokenizer.split_for_encoding)."""
    m = _PIECE_CUT.search(window, max(i - 1, 0))
    return m.end() if m else None


def _separator_cut(window: bytes, i: int, sep: bytes) -> int | None:
    """The first occurrence of ``sep`` at or after i where the whole file's left-to-right
    search finds it too (none overlaps it from the left) and no '\\r' nearby could change the
    text once '\\r\\n' becomes '\\n'."""
    n = len(sep)
    j = window.find(sep, i)
    while j >= 0:
        overlapped = window.find(sep, max(j - n + 1, 0), j + n - 1) >= 0
        if not overlapped and b"\r" not in window[max(j - 2 * n - 2, 0):j + 2 * n + 2]:
            return j
        j = window.find(sep, j + 1)
    return None


def _row_group_units(entry, path: str, size: int, target: int) -> list[Unit] | None:
    try:
        import pyarrow.parquet as pq
        meta = pq.ParquetFile(path).metadata
        groups = [meta.row_group(g).total_byte_size for g in range(meta.num_row_groups)]
    except Exception:  # noqa: BLE001 - no pyarrow, or a damaged file: read whole, where the error is reported
        return None
    total, bounds, run = max(sum(groups), 1), [0], 0
    for g, nbytes in enumerate(groups[:-1]):
        run += nbytes
        if run >= target:
            bounds.append(g + 1)
            run = 0
    if len(bounds) == 1:
        return None
    bounds.append(len(groups))
    return [Unit("rows", entry, a, b, last=b == len(groups), size=size * sum(groups[a:b]) // total)
            for a, b in zip(bounds, bounds[1:])]


def unit_documents(unit: Unit, text_field: str, separator: str | None,
                   stats: SourceStats) -> Iterator[tuple[str, str]]:
    """The documents of a "files", "lines", "split" or "rows" unit, as ``iter_documents``
    yields them from the whole files (without its no-documents error)."""
    label, path, _ = unit.paths[0]
    if unit.kind == "files":
        for label, path, arrow in unit.paths:
            docs = (_hf_arrow_docs(Path(path), text_field, stats) if arrow
                    else _file_docs(label, Path(path), text_field, stats))
            yield from split_documents(docs, separator, stats)
    elif unit.kind == "lines":
        yield from split_documents(_jsonl_range(unit, text_field, stats), separator, stats)
    elif unit.kind == "rows":
        stats.files += unit.start == 0
        try:
            with open(path, "rb") as fh:
                docs = _parquet_docs(label, fh, text_field, (unit.start, unit.end))
                yield from split_documents(docs, separator, stats)
        except OSError as e:
            raise DataError(f"{label}: cannot read ({e})") from None
    elif unit.kind == "split":
        text = read_range(unit, stats)
        if text is not None:
            yield from split_documents([(label, text)], separator, stats, skip_first=unit.start > 0)
    else:
        raise ValueError(f"unit_documents: a {unit.kind!r} unit has no documents of its own")


def _jsonl_range(unit: Unit, text_field: str, stats: SourceStats) -> Iterator[tuple[str, str]]:
    label, path, _ = unit.paths[0]
    stats.files += unit.start == 0
    data = _read_bytes(label, path, unit.start, unit.end)
    try:
        yield from _jsonl_docs(label, io.BytesIO(data), text_field, stats)
    except DataError:
        if unit.start == 0:
            raise
        # Only now count the lines before this range, so that the message names the file's line.
        with open(path, "rb") as fh:
            before = sum(block.count(b"\n") for block in iter(lambda: fh.read(min(1 << 24, unit.start - fh.tell())),
                                                              b""))
        for _ in _jsonl_docs(label, io.BytesIO(data), text_field, SourceStats(), before + 1):
            pass
        raise


def read_range(unit: Unit, stats: SourceStats) -> str | None:
    """The text of a "split" or "piece" unit, decoded and normalised as the whole file would be."""
    label, path, _ = unit.paths[0]
    stats.files += unit.start == 0
    return decode_text(label, _read_bytes(label, path, unit.start, unit.end), stats, head=unit.start == 0)


def _read_bytes(label: str, path: str, start: int, end: int) -> bytes:
    try:
        with open(path, "rb") as fh:
            fh.seek(start)
            return fh.read(end - start)
    except OSError as e:
        raise DataError(f"{label}: cannot read ({e})") from None


def text_blocks(label: str, path: str, block: int = 1 << 23) -> Iterator[str]:
    """A plain text file's text, as ``decode_text`` gives it whole, in blocks (for hashing a
    document too big to hold)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    held, first = "", True
    try:
        with open(path, "rb") as fh:
            while True:
                data = fh.read(block)
                text = held + decoder.decode(data, final=not data)
                if first and text:
                    text, first = (text[1:] if text.startswith("\ufeff") else text), False
                # A '\r' at the end may pair with a '\n' in the next block: keep it for then.
                held = "\r" if data and text.endswith("\r") else ""
                text = (text[:-1] if held else text).replace("\r\n", "\n")
                if text:
                    yield text
                if not data:
                    return
    except OSError as e:
        raise DataError(f"{label}: cannot read ({e})") from None



def hash_text_file(label: str, path: str, new_digest, block: int = 1 << 23) -> bytes:
    """The digest (``new_digest()``, e.g. a keyed blake2b) of the UTF-8 bytes of a plain text
    file's text as ``decode_text`` gives it whole (no BOM, '\\r\\n' as '\\n'), read a block at a time.

    Valid UTF-8 (nearly every file) is hashed as bytes: the text's UTF-8 is then the file's
    bytes with those two changes, and skipping the decode-replace-encode round trip makes the
    hash, which one worker computes alone while the others wait for it, about 1.5x faster.
    A file that turns out not to be valid UTF-8 is hashed anew through ``text_blocks``."""
    digest, decoder = new_digest(), codecs.getincrementaldecoder("utf-8")("strict")
    held, first = b"", True
    try:
        with open(path, "rb") as fh:
            while True:
                data = fh.read(block)
                try:
                    decoder.decode(data, final=not data)  # only to check; the text is not kept
                except UnicodeDecodeError:
                    break
                buf = held + data
                if first and data and len(buf) < len(codecs.BOM_UTF8):
                    held = buf  # too short yet to tell whether the file starts with a BOM
                    continue
                if first and buf:
                    buf, first = (buf[3:] if buf.startswith(codecs.BOM_UTF8) else buf), False
                # A '\r' at the end may pair with a '\n' in the next block: keep it for then.
                held = b"\r" if data and buf.endswith(b"\r") else b""
                buf = buf[:-1] if held else buf
                digest.update(buf.replace(b"\r\n", b"\n") if b"\r" in buf else buf)  # memchr, then the pair search
                if not data:
                    return digest.digest()
    except OSError as e:
        raise DataError(f"{label}: cannot read ({e})") from None
    digest = new_digest()
    for text in text_blocks(label, path, block):
        digest.update(text.encode("utf-8"))
    return digest.digest()
