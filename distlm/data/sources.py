"""Where documents come from.

Inputs are files, folders (walked recursively in sorted order, hidden entries
skipped), glob patterns, ``.jsonl``, ``.parquet``, Hugging Face ``save_to_disk``
folders (their Arrow files are read with pyarrow alone, no ``datasets``), gzip of
any of these, and tar archives (one document per member). A plain file is one
document, or several when a separator is given. The order is the inputs' order,
each folder or glob expanded in sorted order, so the same inputs always give the
same documents in the same order.

``plan_units`` cuts the same documents into tasks that worker processes read on their
own (``unit_documents``): runs of small files, and ranges of big ones (JSONL at line
ends, Parquet at row groups, text at separators or, for one long document, at spaces),
cut only where reading the parts gives exactly the documents and text of reading the
whole file.

Pre-tokenized nanoGPT/llm.c ``.bin`` files are not documents: ``read_token_file``.
"""
from __future__ import annotations

import codecs
import glob
import gzip
import io
import json
import lzma
import os
import re
import tarfile
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO

from distlm.data import DataError, read_json

DEFAULT_CORPUS = Path(__file__).resolve().parent.parent / "assets" / "gutenberg" / "gutenberg.tar.xz"
BINARY_PROBE = 8192  # a NUL byte in the first 8 KB marks a file as binary
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.xz", ".txz", ".tar.bz2", ".tbz2")
LLMC_MAGIC, LLMC_VERSION, LLMC_HEADER_BYTES = 20240520, 1, 256 * 4
_BIN_SPLIT = re.compile(r"(?:^|[_.-])(train|val)(?:[_.-]|$)")


@dataclass
class SourceStats:
    """What reading the inputs found; stored in the manifest."""

    files: int = 0
    documents: int = 0
    empty_documents: int = 0
    skipped_binary: int = 0
    binary_examples: list[str] = field(default_factory=list)  # the first few, for messages
    files_with_invalid_utf8: int = 0
    replaced_chars: int = 0

    def skip_binary(self, label: str) -> None:
        self.skipped_binary += 1
        if len(self.binary_examples) < 5:
            self.binary_examples.append(label)

    def as_dict(self) -> dict:
        return asdict(self)

    def add(self, other: dict) -> None:
        """Add another reader's counts (``as_dict()``), which came after these in input order."""
        for name, value in other.items():
            if name == "binary_examples":
                self.binary_examples = (self.binary_examples + list(value))[:5]
            else:
                setattr(self, name, getattr(self, name) + value)

    def summary(self) -> str:
        return (f"{self.files} file(s), {self.skipped_binary} binary skipped, "
                f"{self.empty_documents} empty document(s)")


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
        elif entry.is_file():
            out.append(Source(entry.path, Path(entry.path), "file"))
    return out


def _is_hf_dataset(folder: Path) -> bool:
    return (folder / "state.json").is_file() and any(folder.glob("*.arrow"))


def hf_arrow_files(folder: Path) -> list[Path]:
    """A save_to_disk folder's Arrow files, in the order its state.json lists them."""
    state = folder / "state.json"
    listed = (read_json(state) or {}).get("_data_files") or []
    if not isinstance(listed, list) or not all(isinstance(d, dict) and isinstance(d.get("filename"), str)
                                               for d in listed):
        raise DataError(f"{state}: '_data_files' is not a list of {{\"filename\": ...}} entries")
    paths = [folder / d["filename"] for d in listed] or sorted(folder.glob("*.arrow"))
    for path in paths:
        if not path.is_file():
            raise DataError(f"{path}: listed in {state} but missing")
    return paths


def source_files(source: Source) -> list[Path]:
    """The files behind a source, for fingerprints and sizes."""
    if source.kind == "hf":
        return [source.path / "state.json", *hf_arrow_files(source.path)]
    return [source.path]


def iter_documents(inputs: list[str], *, separator: str | None = None, text_field: str = "text",
                   stats: SourceStats | None = None, exclude: Path | None = None) -> Iterator[tuple[str, str]]:
    """Yield ``(source_id, text)`` for every non-empty document of ``inputs``, in order.

    ``source_id`` is the file, ``archive:member``, ``file.jsonl:line`` or ``file:row``.

    Binary files are skipped and invalid UTF-8 replaced by U+FFFD, both counted in
    ``stats``. Raises DataError if nothing at all is left.
    """
    stats = stats if stats is not None else SourceStats()
    for src in resolve_inputs(inputs, exclude):
        docs = _hf_docs(src, text_field, stats) if src.kind == "hf" else _file_docs(src, text_field, stats)
        yield from split_documents(docs, separator, stats)
    if stats.documents == 0:
        raise DataError(f"no documents in {', '.join(inputs)} ({stats.summary()})")


def split_documents(docs: Iterable[tuple[str, str]], separator: str | None, stats: SourceStats,
                    skip_first: bool = False) -> Iterator[tuple[str, str]]:
    """Cut each text on ``separator`` and drop (and count) the empty documents.
    ``skip_first``: the first text's first part is what precedes a range's opening separator
    (nothing), not a document."""
    for source_id, text in docs:
        parts = _split(text, separator)
        if skip_first:
            next(parts)
            skip_first = False
        for doc in parts:
            if not doc or doc.isspace():
                stats.empty_documents += 1
                continue
            stats.documents += 1
            yield source_id, doc


def _split(text: str, separator: str | None) -> Iterator[str]:
    if not separator:
        yield text
        return
    start = 0
    while (end := text.find(separator, start)) >= 0:
        yield text[start:end]
        start = end + len(separator)
    yield text[start:]


def _file_docs(src: Source, text_field: str, stats: SourceStats) -> Iterator[tuple[str, str]]:
    try:
        with open(src.path, "rb") as fh:
            yield from _stream_docs(src.label, src.path.name.lower(), fh, text_field, stats)
    except (OSError, EOFError, tarfile.TarError, lzma.LZMAError, zlib.error) as e:
        raise DataError(f"{src.label}: cannot read ({e})") from None


def _stream_docs(label: str, name: str, fh: BinaryIO, text_field: str,
                 stats: SourceStats) -> Iterator[tuple[str, str]]:
    """Documents of one file (or archive member), chosen by its name's suffix."""
    if name.endswith(TAR_SUFFIXES):
        yield from _tar_docs(label, fh, text_field, stats)
    elif name.endswith(".gz"):
        with gzip.GzipFile(fileobj=fh, mode="rb") as inner:
            yield from _stream_docs(label, name[:-3], inner, text_field, stats)
    elif name.endswith((".jsonl", ".ndjson")):
        stats.files += 1
        yield from _jsonl_docs(label, fh, text_field, stats)
    elif name.endswith(".parquet"):
        stats.files += 1
        yield from _parquet_docs(label, fh, text_field)
    elif name.endswith(".arrow"):
        stats.files += 1
        yield from _arrow_docs(label, fh, text_field)
    else:
        stats.files += 1
        text = decode_text(label, fh.read(), stats)
        if text is not None:
            yield label, text


def _tar_docs(label: str, fh: BinaryIO, text_field: str, stats: SourceStats) -> Iterator[tuple[str, str]]:
    # Streaming mode ("r|*"): members in archive order, no seeking in compressed data.
    with tarfile.open(fileobj=fh, mode="r|*", bufsize=1 << 20) as tar:  # default 10 KB reads are slow
        for member in tar:
            base = member.name.rsplit("/", 1)[-1]
            if not member.isfile() or base.startswith("."):
                continue
            inner = tar.extractfile(member)
            yield from _stream_docs(f"{label}:{member.name}", base.lower(), inner, text_field, stats)


def decode_text(label: str, data: bytes, stats: SourceStats, head: bool = True) -> str | None:
    """UTF-8 text of ``data``, or None (counted) when it looks binary.
    ``head=False``: ``data`` is a later range of a file, whose head was checked for binary."""
    if head and b"\0" in data[:BINARY_PROBE]:
        stats.skip_binary(label)
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("utf-8", "replace")
        # U+FFFD already present in the file is not a replacement: "ignore" keeps only those.
        stats.replaced_chars += text.count("\ufffd") - data.decode("utf-8", "ignore").count("\ufffd")
        stats.files_with_invalid_utf8 += 1
    text = text[1:] if head and text.startswith("\ufeff") else text
    # Windows line ends (the Gutenberg files have them) would otherwise cost a token per
    # line and come back as stray '\r' in generated text.
    return text.replace("\r\n", "\n")


def _jsonl_docs(label: str, fh: BinaryIO, field_name: str, stats: SourceStats,
                first_line: int = 1) -> Iterator[tuple[str, str]]:
    bad_utf8 = False
    for lineno, raw in enumerate(fh, first_line):
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            line = raw.decode("utf-8", "replace")
            stats.replaced_chars += line.count("\ufffd") - raw.decode("utf-8", "ignore").count("\ufffd")
            bad_utf8 = True
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as e:  # RecursionError: nested thousands deep
            raise DataError(f"{label}:{lineno}: invalid JSON ({type(e).__name__}: {e})") from None
        if not isinstance(record, dict) or field_name not in record:
            keys = ", ".join(list(map(str, record))[:10]) if isinstance(record, dict) else type(record).__name__
            raise DataError(f"{label}:{lineno}: no {field_name!r} field (found: {keys}); see --text-field")
        text = record[field_name]
        if text is None:
            continue
        if not isinstance(text, str):
            raise DataError(f"{label}:{lineno}: field {field_name!r} is a {type(text).__name__}, not a string")
        if "\\u" in line:  # JSON escapes can spell lone surrogates, which cannot be encoded
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                fixed = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
                stats.replaced_chars += fixed.count("\ufffd") - text.count("\ufffd")
                text, bad_utf8 = fixed, True
        yield f"{label}:{lineno}", text
    stats.files_with_invalid_utf8 += bad_utf8


def _pyarrow(label: str):
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise DataError(f"{label}: reading Parquet/Arrow needs pyarrow (pip install 'distlm[parquet]')") from None
    return pyarrow


def _column(label: str, schema, field_name: str) -> int:
    idx = schema.get_field_index(field_name)
    if idx < 0:
        raise DataError(f"{label}: no column {field_name!r} (columns: {', '.join(schema.names)}); see --text-field")
    kind = str(schema.field(idx).type)
    if kind not in ("string", "large_string", "string_view"):
        raise DataError(f"{label}: column {field_name!r} holds {kind}, not text")
    return idx


def _batches_docs(label: str, batches, idx: int, row: int = 0) -> Iterator[tuple[str, str]]:
    for batch in batches:
        for text in batch.column(idx).to_pylist():
            row += 1
            if text is not None:
                yield f"{label}:{row}", text


def _parquet_docs(label: str, fh: BinaryIO, field_name: str,
                  row_groups: tuple[int, int] | None = None) -> Iterator[tuple[str, str]]:
    pa = _pyarrow(label)
    source = fh if getattr(fh, "seekable", lambda: False)() else pa.BufferReader(fh.read())
    try:
        pf = pa.parquet.ParquetFile(source)
        _column(label, pf.schema_arrow, field_name)
        if row_groups is None:
            yield from _batches_docs(label, pf.iter_batches(batch_size=1024, columns=[field_name]), 0)
            return
        first = sum(pf.metadata.row_group(g).num_rows for g in range(row_groups[0]))
        batches = pf.iter_batches(batch_size=1024, columns=[field_name], row_groups=list(range(*row_groups)))
        yield from _batches_docs(label, batches, 0, first)
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:  # damage shows as any of these
        raise DataError(f"{label}: not a readable Parquet file ({e})") from None


def _arrow_docs(label: str, fh, field_name: str) -> Iterator[tuple[str, str]]:
    pa = _pyarrow(label)
    try:
        if not isinstance(fh, pa.NativeFile):  # an archive member or gzip stream: read it whole
            fh = pa.BufferReader(fh.read())
        try:
            reader = pa.ipc.open_stream(fh)  # what save_to_disk writes
            batches = iter(reader)
        except pa.ArrowInvalid:
            fh.seek(0)
            reader = pa.ipc.open_file(fh)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        yield from _batches_docs(label, batches, _column(label, reader.schema, field_name))
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
        raise DataError(f"{label}: not a readable Arrow file ({e})") from None


def _hf_docs(src: Source, field_name: str, stats: SourceStats) -> Iterator[tuple[str, str]]:
    _pyarrow(str(src.path))
    for path in hf_arrow_files(src.path):
        yield from _hf_arrow_docs(path, field_name, stats)


def _hf_arrow_docs(path: Path, field_name: str, stats: SourceStats) -> Iterator[tuple[str, str]]:
    pa = _pyarrow(str(path.parent))
    stats.files += 1
    with pa.memory_map(str(path)) as mapped:  # shards of big datasets: map, do not read
        yield from _arrow_docs(str(path), mapped, field_name)


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


# ---- tasks for worker processes ---------------------------------------------------------------
UNIT_KINDS = ("files", "lines", "split", "rows", "piece", "hash")
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


def input_files(sources: list[Source]) -> list[tuple[str, str, bool]]:
    """The files that hold documents, in reading order, as (label, path, is an HF Arrow file)."""
    out: list[tuple[str, str, bool]] = []
    for src in sources:
        if src.kind == "hf":
            out += [(str(p), str(p), True) for p in hf_arrow_files(src.path)]
        else:
            out.append((src.label, str(src.path), False))
    return out


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
        ranges = None if arrow or n <= target else _file_ranges(label, path, n, separator, target)
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


def _cuts(fh: BinaryIO, size: int, target: int, back: int, ahead: int, find) -> list[int]:
    """Cut positions near every ``target`` bytes: for each, the first place at or after it
    that ``find(window, i)`` accepts, looking at most ``target // 2`` bytes further on."""
    cuts: list[int] = []
    for goal in range(target, size, target):
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
                    else _file_docs(Source(label, Path(path), "file"), text_field, stats))
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
