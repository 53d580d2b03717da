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
import hashlib
import json
import os
import re
import shutil
import sys
from array import array
from collections import deque
from datetime import datetime, timezone
from pathlib import Path

from distlm.data import DataError
from distlm.data import tokenizer as tkz
from distlm.data.sources import SourceStats, iter_documents, read_token_file, resolve_inputs, source_files

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TRAIN, VAL, WHOLE = 0, 1, 2  # WHOLE: the lone document, cut by tokens at the end
SPLITS = ("train", "val")
CACHE_CHARS = 256 << 20  # documents up to this size stay in memory between the passes
POOL_MIN_BYTES = 1 << 20  # smaller inputs: starting worker processes costs more than it saves
TASK_CHARS = 1 << 19  # text per pool task: small enough to balance, big enough to amortise
START_METHOD = "fork" if sys.platform == "linux" else "spawn"  # see _pool
_BIN_SPLIT = re.compile(r"(?:^|[_.-])(train|val)(?:[_.-]|$)")


def prepare(inputs: list[str], out_dir: Path, *, tokenizer: str = "gpt2", val_fraction: float = 0.05,
            seed: int = 0, workers: int | None = None, separator: str | None = None, text_field: str = "text",
            shard_tokens: int = 100_000_000, progress: bool = True) -> dict:
    """Tokenize ``inputs`` into ``out_dir``; returns the manifest (see the module docstring)."""
    inputs, out_dir = [str(i) for i in inputs], Path(out_dir)
    _check_options(tokenizer, val_fraction, seed, workers, shard_tokens)
    _check_out_dir(out_dir)
    options = {"tokenizer": tokenizer, "val_fraction": val_fraction, "seed": seed, "separator": separator,
               "text_field": text_field, "shard_tokens": shard_tokens}
    pretok = _pretokenized(inputs, tokenizer)
    if pretok:
        per_input = [(str(p), [p]) for p in pretok[0] + pretok[1]]
    else:
        per_input = [(raw, [f for s in resolve_inputs([raw], out_dir) for f in source_files(s)]) for raw in inputs]
    files = [f for _, fs in per_input for f in fs]
    fingerprint = _inputs_fingerprint(files, options)
    old = _read_json(out_dir / MANIFEST)
    if old and old.get("inputs_fingerprint") == fingerprint and _shards_present(out_dir, old):
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
            disk_bytes = sum(f.stat().st_size for f in files)
            body = _prepare_text(inputs, out_dir, tmp, options, _n_workers(workers, disk_bytes), progress)
        manifest = {"format_version": FORMAT_VERSION, **body,
                    "sources": [{"path": raw, "files": len(fs), "bytes": sum(f.stat().st_size for f in fs)}
                                for raw, fs in per_input],
                    "inputs_fingerprint": fingerprint, "options": options, "seed": seed,
                    "val_fraction": val_fraction, "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        _swap_in(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def _check_options(tokenizer: str, val_fraction: float, seed: int, workers: int | None, shard_tokens: int) -> None:
    tkz.check_tokenizer_name(tokenizer)
    if not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
        raise DataError(f"val_fraction {val_fraction!r} must be at least 0 and below 1")
    if not isinstance(seed, int):
        raise DataError(f"seed {seed!r} must be an integer")
    if workers is not None and (not isinstance(workers, int) or workers < 1):
        raise DataError(f"workers {workers!r} must be a positive integer")
    if not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise DataError(f"shard_tokens {shard_tokens!r} must be a positive integer")


def _check_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"{out_dir}: exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / MANIFEST).is_file():
        raise DataError(f"{out_dir}: not empty and has no {MANIFEST}; refusing to replace it (choose another --out)")


def _n_workers(workers: int | None, disk_bytes: int) -> int:
    if workers is not None:
        return workers
    if disk_bytes < POOL_MIN_BYTES:
        return 1
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _inputs_fingerprint(files: list[Path], options: dict) -> str:
    stamp = [(str(f.resolve()), st.st_size, st.st_mtime_ns) for f in files for st in [f.stat()]]
    tok = tkz.gpt2().fingerprint() if options["tokenizer"] == "gpt2" else None
    blob = json.dumps([FORMAT_VERSION, options, tok, stamp], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _prepare_text(inputs: list[str], out_dir: Path, tmp: Path, options: dict, n_workers: int,
                  progress: bool) -> dict:
    def read(stats: SourceStats):
        return iter_documents(inputs, separator=options["separator"], text_field=options["text_field"],
                              stats=stats, exclude=out_dir)

    name, val_fraction = options["tokenizer"], options["val_fraction"]
    with contextlib.ExitStack() as stack:
        pool = None
        if name == "gpt2" and n_workers > 1:  # boots while the documents are scanned
            tok = tkz.gpt2()
            if START_METHOD == "fork":
                tok.encoding  # noqa: B018 - built once here, inherited by every worker
            pool = stack.enter_context(_pool(n_workers, tok, None))
        stats = SourceStats()
        cache, keys, n_chars, n_bytes = _scan(read(stats), options["seed"])
        flags, method = _assign_splits(keys, val_fraction)
        if name == "gpt2":
            tok = tkz.gpt2()
        else:
            docs = cache if cache is not None else read(SourceStats())
            tok = tkz.train_bpe(_train_texts(docs, flags, val_fraction), tkz.parse_bpe_size(name),
                                progress=progress and sys.stderr.isatty())
            tok.save(tmp)
            if n_workers > 1:
                pool = stack.enter_context(_pool(n_workers, tok, str(tmp)))
        docs = cache if cache is not None else read(SourceStats())
        splits = _tokenize(docs, flags, tok, pool, n_workers, tmp, options, progress, n_chars)
    return {"tokenizer": _tokenizer_info(tok), "dtype": tok.dtype, "split_method": method, "splits": splits,
            "stats": {**stats.as_dict(), "chars": n_chars, "text_bytes": n_bytes}}


@contextlib.contextmanager
def _pool(n: int, tok: tkz.Tokenizer, data_dir: str | None):
    """``n`` worker processes, each holding ``tok`` (built by pool_init, or inherited by fork).

    Linux forks: a spawned worker re-imports the caller's main module and its
    imports (torch: seconds each), longer than tokenizing a small corpus. Workers
    only run tokenizer code, so the parent's threads cannot trip them up; the code
    stays spawn-safe for the platforms where fork is not offered or not safe.
    An executor rather than multiprocessing.Pool: a dead worker fails the run
    instead of hanging it.
    """
    import multiprocessing
    import warnings
    from concurrent.futures import ProcessPoolExecutor
    ctx = multiprocessing.get_context(START_METHOD)
    pool = ProcessPoolExecutor(n, mp_context=ctx, initializer=tkz.pool_init, initargs=(tok.name, data_dir))
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # tells tokenizers the fork is deliberate
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
            for _ in range(n):  # start every worker now, so they boot while the parent reads
                pool.submit(int)
        if saved is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _scan(docs, seed: int):
    """First pass: each document's split key, the totals, and the documents if they are small."""
    cache: list | None = []
    keys, n_chars, n_bytes = array("d"), 0, 0
    key = str(seed).encode()[:64]
    for item in docs:
        data = item[1].encode("utf-8")
        digest = hashlib.blake2b(data, digest_size=8, key=key).digest()
        keys.append(int.from_bytes(digest, "big") / 2.0 ** 64)
        n_chars, n_bytes = n_chars + len(item[1]), n_bytes + len(data)
        if cache is not None:
            cache.append(item)
            if n_chars > CACHE_CHARS:
                cache = None
    return cache, keys, n_chars, n_bytes


def _assign_splits(keys: array, val_fraction: float) -> tuple[bytearray, str]:
    if len(keys) == 1 and val_fraction > 0:
        return bytearray([WHOLE]), "single-document-tail"
    flags = bytearray(VAL if k < val_fraction else TRAIN for k in keys)
    if val_fraction > 0 and VAL not in flags:
        flags[min(range(len(keys)), key=keys.__getitem__)] = VAL
    if TRAIN not in flags:
        flags[max(range(len(keys)), key=keys.__getitem__)] = TRAIN
    return flags, "document-hash"


def _train_texts(docs, flags: bytearray, val_fraction: float):
    for i, (_, text) in enumerate(docs):
        if flags[i] == TRAIN:
            yield text
        elif flags[i] == WHOLE:
            yield text[:max(1, int(len(text) * (1 - val_fraction)))]


def _tasks(docs, flags: bytearray, chunk_chars: int):
    """Pool tasks of about TASK_CHARS: (split, piece, is the document's last piece)."""
    task, size, count = [], 0, 0
    for _, text in docs:
        if count >= len(flags):
            break
        pieces = list(tkz.split_for_encoding(text, chunk_chars))
        for k, piece in enumerate(pieces):
            task.append((flags[count], piece, k == len(pieces) - 1))
            size += len(piece)
            if size >= TASK_CHARS:
                yield task, size
                task, size = [], 0
        count += 1
    else:
        if count == len(flags):
            if task:
                yield task, size
            return
    raise DataError("the inputs changed while prepare was reading them; run it again")


def _tokenize(docs, flags: bytearray, tok: tkz.Tokenizer, pool, n_workers: int, out: Path, options: dict,
              progress: bool, n_chars: int) -> dict:
    from tqdm import tqdm
    writers = [_ShardWriter(out, s, tok.dtype, options["shard_tokens"]) for s in SPLITS]
    whole: list[bytes] = []
    pending: deque = deque()
    bar = tqdm(total=n_chars, unit="char", unit_scale=True, desc=f"tokenizing ({tok.name})",
               disable=None if progress else True)

    def drain(limit: int) -> None:
        while len(pending) > limit:
            result, size = pending.popleft()
            for split, data in _result(result) if pool is not None else result:
                if split == WHOLE:
                    whole.append(data)
                else:
                    writers[split].write(data)
            bar.update(size)

    with bar:
        for task, size in _tasks(docs, flags, tok.chunk_chars):
            work = pool.submit(tkz.pool_encode, task) if pool is not None else tkz.encode_task(tok, task)
            pending.append((work, size))
            drain(2 * n_workers)  # a bounded window: memory stays flat on any corpus size
        drain(0)
    if whole:
        data, itemsize = b"".join(whole), writers[TRAIN].itemsize
        n = len(data) // itemsize
        cut = (n - min(max(1, round(n * options["val_fraction"])), n - 1)) * itemsize
        writers[TRAIN].write(data[:cut])
        writers[VAL].write(data[cut:])
    docs_per_split = [flags.count(TRAIN) + flags.count(WHOLE), flags.count(VAL) + flags.count(WHOLE)]
    return {s: w.finish(d) for s, w, d in zip(SPLITS, writers, docs_per_split)}


def _result(future) -> list:
    from concurrent.futures.process import BrokenProcessPool
    try:
        return future.result()
    except BrokenProcessPool:
        raise DataError("a tokenizer worker process died (out of memory? or prepare() called from a script "
                        "without `if __name__ == '__main__':`, which spawned workers need)") from None


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
            take = min(len(view), (self.limit - self._n) * self.itemsize)
            self._fh.write(view[:take])
            self._sha.update(view[:take])
            self._n += take // self.itemsize
            self.tokens += take // self.itemsize
            view = view[take:]
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


def _pretokenized(inputs: list[str], tokenizer: str) -> tuple[list[Path], list[Path]] | None:
    """nanoGPT/llm.c ``.bin`` inputs as (train files, val files); None for text inputs."""
    paths = [Path(i).expanduser() for i in inputs]
    if len(paths) == 1 and paths[0].is_dir():
        folder = paths[0]
        if (folder / "meta.pkl").is_file() and (folder / "train.bin").is_file():
            raise DataError(f"{folder / 'meta.pkl'}: character-level nanoGPT data is not GPT-2 tokens; "
                            f"prepare the text instead")
        paths = sorted(p for p in folder.glob("*.bin") if _BIN_SPLIT.search(p.stem))
        if not paths:
            return None
    elif not any(p.suffix == ".bin" for p in paths):
        return None
    elif not all(p.suffix == ".bin" for p in paths):
        raise DataError(f"cannot mix pre-tokenized .bin files with text inputs: {', '.join(inputs)}")
    for p in paths:
        if not p.is_file():
            raise DataError(f"{p}: no such file")
        if not _BIN_SPLIT.search(p.stem):
            raise DataError(f"{p}: cannot tell train from val; name it like train.bin / val.bin")
    split = {p: _BIN_SPLIT.search(p.stem).group(1) for p in paths}
    train, val = [p for p in paths if split[p] == "train"], [p for p in paths if split[p] == "val"]
    if not train or not val:
        raise DataError(f"pre-tokenized inputs need both a train and a val .bin file: {', '.join(map(str, paths))}")
    if tokenizer != "gpt2":
        raise DataError(f"pre-tokenized .bin files hold GPT-2 tokens; tokenizer {tokenizer!r} cannot apply")
    return train, val


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


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _shards_present(data_dir: Path, manifest: dict) -> bool:
    """Every listed file is there with the right size (cheap; verify_shards checks contents)."""
    try:
        itemsize = 2 if manifest["dtype"] == "uint16" else 4
        shards = [s for split in manifest["splits"].values() for s in split["shards"]]
        sized = all((data_dir / s["file"]).stat().st_size == s["tokens"] * itemsize for s in shards)
        tok_file = manifest["tokenizer"].get("file")
        return sized and (tok_file is None or (data_dir / tok_file).is_file())
    except (OSError, KeyError, TypeError, AttributeError):
        return False


def load_manifest(data_dir: str | Path) -> dict:
    """The manifest of a prepared folder; DataError naming the path if missing or invalid."""
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise DataError(f"{path}: not found; create it with `distlm prepare INPUT... --out {data_dir}`")
    manifest = _read_json(path)
    if manifest is None:
        raise DataError(f"{path}: not a valid JSON manifest; run `distlm prepare` again")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{path}: format_version {manifest.get('format_version')!r} is not {FORMAT_VERSION}; "
                        f"run `distlm prepare` again")
    for key in ("tokenizer", "dtype", "splits"):
        if key not in manifest:
            raise DataError(f"{path}: missing field {key!r}")
    return manifest


def verify_shards(data_dir: str | Path, manifest: dict | None = None) -> None:
    """Check each shard's size and sha256 against the manifest; DataError naming the first bad one."""
    data_dir = Path(data_dir)
    manifest = manifest if manifest is not None else load_manifest(data_dir)
    itemsize = 2 if manifest["dtype"] == "uint16" else 4
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            path = data_dir / shard["file"]
            if not path.is_file():
                raise DataError(f"{path}: shard missing")
            if path.stat().st_size != shard["tokens"] * itemsize:
                raise DataError(f"{path}: {path.stat().st_size} bytes, manifest says {shard['tokens']} tokens")
            digest = hashlib.sha256()
            with open(path, "rb") as fh:
                while block := fh.read(1 << 23):
                    digest.update(block)
            if digest.hexdigest() != shard["sha256"]:
                raise DataError(f"{path}: sha256 {digest.hexdigest()} does not match the manifest's {shard['sha256']}")
