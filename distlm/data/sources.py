"""Where documents come from.

Inputs are files, folders (walked recursively in sorted order, hidden entries
skipped), glob patterns, ``.jsonl``, ``.parquet``, Hugging Face ``save_to_disk``
folders (their Arrow files are read with pyarrow alone, no ``datasets``), gzip of
any of these, and tar archives (one document per member). A plain file is one
document, or several when a separator is given. The order is the inputs' order,
each folder or glob expanded in sorted order, so the same inputs always give the
same documents in the same order.

Pre-tokenized nanoGPT/llm.c ``.bin`` files are not documents: ``read_token_file``.
"""
from __future__ import annotations

import glob
import gzip
import json
import lzma
import os
import re
import tarfile
import zlib
from collections.abc import Iterator
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
        for source_id, text in docs:
            for doc in _split(text, separator):
                if not doc or doc.isspace():
                    stats.empty_documents += 1
                    continue
                stats.documents += 1
                yield source_id, doc
    if stats.documents == 0:
        raise DataError(f"no documents in {', '.join(inputs)} ({stats.summary()})")


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


def decode_text(label: str, data: bytes, stats: SourceStats) -> str | None:
    """UTF-8 text of ``data``, or None (counted) when it looks binary."""
    if b"\0" in data[:BINARY_PROBE]:
        stats.skip_binary(label)
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("utf-8", "replace")
        # U+FFFD already present in the file is not a replacement: "ignore" keeps only those.
        stats.replaced_chars += text.count("\ufffd") - data.decode("utf-8", "ignore").count("\ufffd")
        stats.files_with_invalid_utf8 += 1
    text = text[1:] if text.startswith("\ufeff") else text
    # Windows line ends (the Gutenberg files have them) would otherwise cost a token per
    # line and come back as stray '\r' in generated text.
    return text.replace("\r\n", "\n")


def _jsonl_docs(label: str, fh: BinaryIO, field_name: str, stats: SourceStats) -> Iterator[tuple[str, str]]:
    bad_utf8 = False
    for lineno, raw in enumerate(fh, 1):
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


def _batches_docs(label: str, batches, idx: int) -> Iterator[tuple[str, str]]:
    row = 0
    for batch in batches:
        for text in batch.column(idx).to_pylist():
            row += 1
            if text is not None:
                yield f"{label}:{row}", text


def _parquet_docs(label: str, fh: BinaryIO, field_name: str) -> Iterator[tuple[str, str]]:
    pa = _pyarrow(label)
    source = fh if getattr(fh, "seekable", lambda: False)() else pa.BufferReader(fh.read())
    try:
        pf = pa.parquet.ParquetFile(source)
        _column(label, pf.schema_arrow, field_name)
        yield from _batches_docs(label, pf.iter_batches(batch_size=1024, columns=[field_name]), 0)
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
    pa = _pyarrow(str(src.path))
    for path in hf_arrow_files(src.path):
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
