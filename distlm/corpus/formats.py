"""Reading the documents of one input file, whatever its format.

Kept apart from finding the inputs (``sources``) because worker processes read files
and ranges of files (``units``) with these same readers: a document must come out
identical whichever way its file is read. Plain text, gzip, tar (one document per
member), JSONL, Parquet and Arrow (Hugging Face ``save_to_disk`` folders, read with
pyarrow alone, no ``datasets``).
"""
from __future__ import annotations

import gzip
import json
import lzma
import os
import stat
import tarfile
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO

from distlm.data import DataError, file_kind, file_name_problem, read_json

BINARY_PROBE = 8192  # a NUL byte in the first 8 KB marks a file as binary
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.xz", ".txz", ".tar.bz2", ".tbz2")


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



def hf_arrow_files(folder: Path) -> list[Path]:
    """A save_to_disk folder's Arrow files, in the order its state.json lists them."""
    state = folder / "state.json"
    listed = (read_json(state) or {}).get("_data_files") or []
    if not isinstance(listed, list) or not all(isinstance(d, dict) and isinstance(d.get("filename"), str)
                                               for d in listed):
        raise DataError(f"{state}: '_data_files' is not a list of {{\"filename\": ...}} entries")
    for i, d in enumerate(listed):  # joined to the folder: never a path out of it
        problem = file_name_problem(d["filename"], f"_data_files[{i}].filename")
        if problem:
            raise DataError(f"{state}: {problem}; refused")
    paths = [folder / d["filename"] for d in listed] or sorted(folder.glob("*.arrow"))
    for path in paths:
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            raise DataError(f"{path}: listed in {state} but missing") from None
        if not stat.S_ISREG(mode):
            raise DataError(f"{path}: is {file_kind(mode)}, not an Arrow file (listed in {state})")
    return paths


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


def _file_docs(label: str, path: Path, text_field: str, stats: SourceStats) -> Iterator[tuple[str, str]]:
    try:
        with open(path, "rb") as fh:
            yield from _stream_docs(label, path.name.lower(), fh, text_field, stats)
    except (OSError, EOFError, tarfile.TarError, lzma.LZMAError, zlib.error) as e:
        raise DataError(f"{label}: cannot read ({e})") from None


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
    # line and come back as stray '\r' in generated text. Looking for a '\r' first is 5x cheaper
    # than replace's search for the pair, which costs ~2% of tokenizing where there is none.
    return text.replace("\r\n", "\n") if "\r" in text else text


def _fast_json_loads():
    """orjson's ``loads`` where it is installed (the ``fast`` extra), else None.

    It parses a line of JSONL two to three times faster than ``json`` (4.5 against 10.8 us for a
    5 KB document on a 2-core CPU: 2% of tokenizing it). It is used only where it
    cannot change the output: a line it parses into an object whose field is a string. orjson
    refuses whatever ``json`` refuses, and more besides (invalid UTF-8, lone surrogates, NaN,
    integers past 64 bits); those lines, and every one whose text is missing, null, not a string
    or not encodable, go through ``json`` as before, which keeps its replacements, counts and messages."""
    try:
        import orjson
    except ImportError:
        return None
    return orjson.loads


_FAST_LOADS = _fast_json_loads()


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _jsonl_docs(label: str, fh: BinaryIO, field_name: str, stats: SourceStats,
                first_line: int = 1) -> Iterator[tuple[str, str]]:
    bad_utf8, fast = False, _FAST_LOADS
    for lineno, raw in enumerate(fh, first_line):
        if not raw.strip():
            continue
        if fast is not None:
            try:
                record = fast(raw)
            except ValueError:  # orjson.JSONDecodeError; json below says what is wrong, or reads it
                record = None
            if type(record) is dict and type(text := record.get(field_name)) is str and (
                    b"\\u" not in raw or _encodable(text)):  # a lone surrogate: json's way below replaces it
                yield f"{label}:{lineno}", text
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


def _hf_docs(folder: Path, field_name: str, stats: SourceStats) -> Iterator[tuple[str, str]]:
    _pyarrow(str(folder))
    for path in hf_arrow_files(folder):
        yield from _hf_arrow_docs(path, field_name, stats)


def _hf_arrow_docs(path: Path, field_name: str, stats: SourceStats) -> Iterator[tuple[str, str]]:
    pa = _pyarrow(str(path.parent))
    stats.files += 1
    with pa.memory_map(str(path)) as mapped:  # shards of big datasets: map, do not read
        yield from _arrow_docs(str(path), mapped, field_name)

