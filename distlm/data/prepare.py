"""``prepare``: documents in, train/val token shards and ``manifest.json`` out.

A prepared folder holds ``train_000000.bin``..., ``val_000000.bin``... (raw
little-endian uint16 tokens, uint32 above 65536 tokens of vocabulary; each
document's tokens followed by ``eos_id``), ``tokenizer.json`` for ``bpe:N``, and
``manifest.json`` describing all of it.

Split: a document goes to val when blake2b(seed, its text), read as a number in
[0, 1), is below ``val_fraction``. Hashing the text rather than its position means
copies of one document always land on the same side, and adding files leaves the
other documents where they were. When the hash sends no document to val (or all of
them), the one with the smallest (largest) value is moved, so with two or more
documents both splits are non-empty. A lone document is split by tokens instead:
its last ``val_fraction`` goes to val.

Re-running with the same inputs (paths, sizes, mtimes) and options is a no-op.
Anything else is built in a temporary folder beside ``out_dir`` and swapped in
with renames, so ``out_dir`` is always either the old complete data or the new; a
folder that has files but no manifest.json is never replaced.
"""
from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import json
import os
import shutil
import sys
from array import array
from collections import deque
from datetime import datetime, timezone
from pathlib import Path

from distlm.data import (FORMAT_VERSION, MANIFEST, DataError, load_manifest, read_json,  # noqa: F401 (re-exported)
                         shards_present, verify_shards)
from distlm.data import tokenizer as tkz
from distlm.data.sources import (SourceStats, iter_documents, pretokenized_inputs, read_token_file, resolve_inputs,
                                 source_files)

TRAIN, VAL, WHOLE = 0, 1, 2  # WHOLE: the lone document, cut by tokens at the end
SPLITS = ("train", "val")
CACHE_CHARS = 256 << 20  # corpora up to this size are read once; bigger ones twice
POOL_MIN_BYTES = 1 << 20  # smaller inputs: starting worker processes costs more than it saves
TASK_CHARS = 1 << 19  # text per pool task: small enough to balance, big enough to amortise


def prepare(inputs: list[str], out_dir: Path, *, tokenizer: str = "gpt2", val_fraction: float = 0.05,
            seed: int = 0, workers: int | None = None, separator: str | None = None, text_field: str = "text",
            shard_tokens: int = 100_000_000, progress: bool = True) -> dict:
    """Tokenize ``inputs`` (see ``distlm.data.sources``) into ``out_dir``; returns the manifest.

    ``tokenizer``: "gpt2" or "bpe:N" (trained here on the train documents).
    ``workers``: tokenizer processes; default all cores, or 1 below 1 MB of input.
    ``separator``: split each file into documents on this string.
    ``text_field``: the text column of JSONL / Parquet / Arrow inputs.
    Raises DataError, naming the file, line or value, for anything wrong with them.
    """
    inputs, out_dir = [str(i) for i in inputs], Path(out_dir)
    _check_options(tokenizer, val_fraction, seed, workers, shard_tokens)
    _recover_stale(out_dir)
    _check_out_dir(out_dir)
    val_fraction = float(val_fraction)  # so 0 and 0.0 fingerprint alike
    options = {"tokenizer": tokenizer, "val_fraction": val_fraction, "seed": seed, "separator": separator,
               "text_field": text_field, "shard_tokens": shard_tokens}
    pretok = pretokenized_inputs(inputs, tokenizer)
    if pretok:
        per_input = [(str(p), [p]) for p in pretok[0] + pretok[1]]
    else:
        per_input = [(raw, [f for s in resolve_inputs([raw], out_dir) for f in source_files(s)]) for raw in inputs]
    files = [f for _, fs in per_input for f in fs]
    fingerprint = _inputs_fingerprint(files, options)
    old = read_json(out_dir / MANIFEST)
    if old and old.get("inputs_fingerprint") == fingerprint and shards_present(out_dir, old):
        print(f"{out_dir}: up to date")
        return old
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        if pretok:
            body = _prepare_pretokenized(*pretok, tmp, shard_tokens)
        else:
            workers = workers or _default_workers(sum(f.stat().st_size for f in files))
            body = _prepare_text(inputs, out_dir, tmp, options, workers, progress)
        sources = [{"path": raw, "files": len(fs), "bytes": sum(f.stat().st_size for f in fs)}
                   for raw, fs in per_input]
        manifest = {"format_version": FORMAT_VERSION, **body, "sources": sources,
                    "inputs_fingerprint": fingerprint, "options": options, "seed": seed,
                    "val_fraction": val_fraction, "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        _swap_in(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def _check_options(tokenizer: str, val_fraction: float, seed: int, workers: int | None, shard_tokens: int) -> None:
    if tokenizer != "gpt2":
        tkz.parse_bpe_size(tokenizer)
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
        raise DataError(f"val_fraction {val_fraction!r} must be at least 0 and below 1")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise DataError(f"seed {seed!r} must be an integer")
    for name, value in (("workers", 1 if workers is None else workers), ("shard_tokens", shard_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DataError(f"{name} {value!r} must be a positive integer")


def _check_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"{out_dir}: exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / MANIFEST).is_file():
        raise DataError(f"{out_dir}: not empty and has no {MANIFEST}; refusing to replace it (choose another --out)")


def _recover_stale(out_dir: Path) -> None:
    """Clean up after a run that was killed outright (SIGKILL, power cut) mid-way."""
    prefix = f".{out_dir.name}."
    if os.name != "posix" or not out_dir.parent.is_dir():
        return
    for path in sorted(out_dir.parent.glob(glob.escape(prefix) + "*-*")):
        tag, _, pid = path.name[len(prefix):].partition("-")
        if tag not in ("tmp", "old") or not pid.isdigit() or _alive(int(pid)):
            continue
        if tag == "old" and not out_dir.exists():  # killed between the two renames of _swap_in
            os.replace(path, out_dir)
        else:
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _default_workers(disk_bytes: int) -> int:
    if disk_bytes < POOL_MIN_BYTES:
        return 1
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _inputs_fingerprint(files: list[Path], options: dict) -> str:
    stamp = [(str(f.resolve()), st.st_size, st.st_mtime_ns) for f in files for st in [f.stat()]]
    tok = tkz.gpt2().fingerprint() if options["tokenizer"] == "gpt2" else None
    blob = json.dumps([FORMAT_VERSION, options, tok, stamp], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _prepare_text(inputs: list[str], out_dir: Path, tmp: Path, options: dict, workers: int, progress: bool) -> dict:
    from tqdm import tqdm
    read = functools.partial(iter_documents, inputs, separator=options["separator"],
                             text_field=options["text_field"], exclude=out_dir)
    name, val_fraction, stats = options["tokenizer"], options["val_fraction"], SourceStats()
    with contextlib.ExitStack() as stack:
        bar = stack.enter_context(tqdm(unit="char", unit_scale=True, desc=f"reading ({name})",
                                       disable=None if progress else True))
        # gpt2 encodes while the documents are first read; bpe:N must read them all to train first.
        tok = tkz.gpt2() if name == "gpt2" else None
        batcher = _Batcher(stack, workers, tok) if tok is not None else None
        scan = _scan(read(stats=stats), options["seed"], batcher, bar)
        flags, method = _assign_splits(scan["keys"], val_fraction)
        if scan["cache"] is None and scan["streamed"] < len(flags):
            scan["cache"] = (text for _, text in read(stats=SourceStats()))  # too big to keep: read again
        if tok is None:
            tok = tkz.train_bpe(_train_texts(scan["cache"], flags, val_fraction), tkz.parse_bpe_size(name),
                                progress=progress and sys.stderr.isatty())
            tok.save(tmp)
            batcher = _Batcher(stack, workers, tok)
            if not isinstance(scan["cache"], list):
                scan["cache"] = (text for _, text in read(stats=SourceStats()))
        sink = _Sink(tmp, flags, tok.dtype, options["shard_tokens"])
        _encode_rest(batcher, sink, scan, bar, tok.name)
    return {"tokenizer": _tokenizer_info(tok), "dtype": tok.dtype, "split_method": method,
            "splits": sink.finish(val_fraction),
            "stats": {**stats.as_dict(), "chars": scan["chars"], "text_bytes": scan["bytes"]}}


def _scan(docs, seed: int, batcher: _Batcher | None, bar) -> dict:
    """The first read: every document's split key and the totals.

    Up to CACHE_CHARS of text, documents are also handed to ``batcher`` (when the
    tokenizer is already known) or kept in memory, so small corpora are read once.
    """
    keys, chars, n_bytes, streamed, cache = array("d"), 0, 0, 0, []
    key = str(seed).encode()[:64]
    for i, (_, text) in enumerate(docs):
        data = text.encode("utf-8")
        keys.append(int.from_bytes(hashlib.blake2b(data, digest_size=8, key=key).digest(), "big") / 2.0 ** 64)
        chars, n_bytes = chars + len(text), n_bytes + len(data)
        bar.update(len(text))
        if cache is None:
            continue
        if batcher is not None:
            batcher.add(i, text)
            streamed = i + 1
        else:
            cache.append(text)
        if chars > CACHE_CHARS:
            cache = None
    if batcher is not None:
        batcher.flush()
    return {"keys": keys, "chars": chars, "bytes": n_bytes, "streamed": streamed,
            "cache": cache if batcher is None else None}


def _assign_splits(keys: array, val_fraction: float) -> tuple[bytearray, str]:
    if len(keys) == 1 and val_fraction > 0:
        return bytearray([WHOLE]), "single-document-tail"
    flags = bytearray(VAL if k < val_fraction else TRAIN for k in keys)
    if val_fraction > 0 and VAL not in flags:
        flags[min(range(len(keys)), key=keys.__getitem__)] = VAL
    if TRAIN not in flags:
        flags[max(range(len(keys)), key=keys.__getitem__)] = TRAIN
    return flags, "document-hash"


def _train_texts(texts, flags: bytearray, val_fraction: float):
    """The train documents, in pieces: the trainer spreads pieces over cores, not one whole book."""
    for i, text in enumerate(texts):
        if flags[i] == WHOLE:
            text = text[:max(1, int(len(text) * (1 - val_fraction)))]
        if flags[i] != VAL:
            yield from tkz.split_for_encoding(text, 1 << 16)


def _encode_rest(batcher: _Batcher, sink: _Sink, scan: dict, bar, name: str) -> None:
    """Write what the scan already submitted, then encode the documents it did not."""
    n = len(sink.flags)
    if scan["streamed"] < n:
        bar.reset(total=scan["chars"])
        bar.set_description(f"tokenizing ({name})")
        count = 0
        for i, text in enumerate(scan["cache"]):
            count = i + 1
            if i >= n:
                break
            if i >= scan["streamed"]:
                batcher.add(i, text)
                batcher.drain(sink, bar, batcher.window)
        if count != n:
            raise DataError("the inputs changed while prepare was reading them; run it again")
        batcher.flush()
    batcher.drain(sink, bar if scan["streamed"] < n else None, 0)


class _Batcher:
    """Cuts documents into pieces, sends tasks of about TASK_CHARS to the workers, and
    hands the tokens back in document order whatever the number of workers."""

    def __init__(self, stack: contextlib.ExitStack, workers: int, tok: tkz.Tokenizer):
        self.executor = stack.enter_context(tkz.open_executor(workers, tok))
        self.chunk_chars, self.window = tok.chunk_chars, 2 * workers
        self.task, self.size, self.pending = [], 0, deque()

    def add(self, index: int, text: str) -> None:
        pieces = list(tkz.split_for_encoding(text, self.chunk_chars))
        for k, piece in enumerate(pieces):
            self.task.append((index, piece, k == len(pieces) - 1))
            self.size += len(piece)
            if self.size >= TASK_CHARS:
                self.flush()

    def flush(self) -> None:
        if self.task:
            self.pending.append((self.executor.submit(tkz.pool_encode, self.task), self.size))
            self.task, self.size = [], 0
        if len(self.pending) > self.window:  # the scan outruns the workers: keep the text in flight bounded
            _result(self.pending[-self.window - 1][0])

    def drain(self, sink: _Sink, bar, keep: int) -> None:
        while len(self.pending) > keep:
            future, size = self.pending.popleft()
            for index, data in _result(future):
                sink.write(index, data)
            if bar is not None:
                bar.update(size)


def _result(future) -> list:
    from concurrent.futures.process import BrokenProcessPool
    try:
        return future.result()
    except BrokenProcessPool:
        raise DataError("a tokenizer worker process died (out of memory? or prepare() called from a script "
                        "without `if __name__ == '__main__':`, which spawned workers need)") from None


class _Sink:
    """Routes each document's tokens to the shards of its split."""

    def __init__(self, out: Path, flags: bytearray, dtype: str, shard_tokens: int) -> None:
        self.flags, self.whole = flags, []
        self.writers = [_ShardWriter(out, s, dtype, shard_tokens) for s in SPLITS]

    def write(self, index: int, data: bytes) -> None:
        flag = self.flags[index]
        if flag == WHOLE:
            self.whole.append(data)
        else:
            self.writers[flag].write(data)

    def finish(self, val_fraction: float) -> dict:
        if self.whole:
            data, itemsize = b"".join(self.whole), self.writers[TRAIN].itemsize
            n = len(data) // itemsize
            cut = (n - min(max(1, round(n * val_fraction)), n - 1)) * itemsize
            self.writers[TRAIN].write(data[:cut])
            self.writers[VAL].write(data[cut:])
        whole = self.flags.count(WHOLE)
        docs = (self.flags.count(TRAIN) + whole, self.flags.count(VAL) + whole)
        return {s: w.finish(d) for s, w, d in zip(SPLITS, self.writers, docs)}


class _ShardWriter:
    """Appends token bytes to ``{split}_NNNNNN.bin`` files of at most ``limit`` tokens each."""

    def __init__(self, directory: Path, split: str, dtype: str, limit: int) -> None:
        self.dir, self.split, self.limit = directory, split, limit
        self.itemsize = 2 if dtype == "uint16" else 4
        self.shards: list[dict] = []
        self.tokens = 0
        self._fh = None

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            if self._fh is None:
                name = f"{self.split}_{len(self.shards):06d}.bin"
                self._fh, self._sha, self._n = open(self.dir / name, "wb"), hashlib.sha256(), 0
                self.shards.append({"file": name, "tokens": 0, "sha256": ""})
            part = view[:(self.limit - self._n) * self.itemsize]
            self._fh.write(part)
            self._sha.update(part)
            self._n += len(part) // self.itemsize
            self.tokens += len(part) // self.itemsize
            view = view[len(part):]
            if self._n == self.limit:
                self._close()

    def _close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self.shards[-1].update(tokens=self._n, sha256=self._sha.hexdigest())
            self._fh = None

    def finish(self, documents: int) -> dict:
        self._close()
        return {"tokens": self.tokens, "documents": documents, "shards": self.shards}


def _tokenizer_info(tok: tkz.Tokenizer) -> dict:
    return {"name": tok.name, "fingerprint": tok.fingerprint(), "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id, "file": None if tok.name == "gpt2" else "tokenizer.json"}


def _prepare_pretokenized(train: list[Path], val: list[Path], tmp: Path, shard_tokens: int) -> dict:
    import numpy as np
    tok, splits, block = tkz.gpt2(), {}, 1 << 24
    for name, files in zip(SPLITS, (train, val)):
        writer, documents = _ShardWriter(tmp, name, "uint16", shard_tokens), 0
        for path in files:
            tokens = read_token_file(path)
            for start in range(0, len(tokens), block):
                part = np.asarray(tokens[start:start + block])
                if int(part.max()) >= tok.vocab_size:
                    raise DataError(f"{path}: token {int(part.max())} is outside GPT-2's {tok.vocab_size}; "
                                    f"not a GPT-2 token file")
                documents += int(np.count_nonzero(part == tok.eos_id))
                writer.write(part.tobytes())
        splits[name] = writer.finish(documents)  # documents: EOS tokens seen
    return {"tokenizer": _tokenizer_info(tok), "dtype": "uint16", "split_method": "pretokenized",
            "splits": splits, "stats": {"files": len(train) + len(val)}}


def _swap_in(tmp: Path, out_dir: Path) -> None:
    if not out_dir.exists():
        os.replace(tmp, out_dir)
        return
    old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
    shutil.rmtree(old, ignore_errors=True)
    os.replace(out_dir, old)
    try:
        os.replace(tmp, out_dir)
    except BaseException:
        os.replace(old, out_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)
