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

How the work is spread: ``sources.plan_units`` cuts the inputs into units of about
``TASK_CHARS`` bytes (runs of small files, ranges of big ones). A worker process reads,
splits, hashes and tokenizes a whole unit by itself and writes its tokens to files in the
temporary folder; the parent only appends those files to the shards, in unit order. So
the parent does a constant amount of work per unit whatever the documents, no text goes
through a pipe, at most ``2 * workers + 1`` units are in flight (memory does not grow with
the corpus), shards are written as units finish, and the output is the same for any
number of workers. The two fallbacks above need the whole corpus: they are applied at
the end, by rewriting the shards from the one holding the moved tokens on.

Resuming: the temporary folder keeps ``journal.jsonl``, a line after a finished unit about
every second (input files done, shards closed, the open shard's length, counts, the
candidates for the fallbacks). A run killed outright leaves the folder behind; the next run with the same
inputs, options and plan adopts it, truncates the open shard to the journaled length and
goes on from the next unit, giving the same bytes as an uninterrupted run.

Parts: ``shard=(I, N)`` prepares only the I-th of N contiguous runs of the inputs
(balanced by size) and skips the fallbacks; ``merge`` streams the N parts, in order, into
the folder that one ``prepare`` of all the inputs makes, byte for byte.

Re-running with the same inputs (paths, sizes, mtimes) and options is a no-op.
Anything else is built in a temporary folder beside ``out_dir`` and swapped in
with renames, so ``out_dir`` is always either the old complete data or the new; a
folder that has files but no manifest.json is never replaced.
"""
from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections import deque
from datetime import datetime, timezone
from pathlib import Path

from distlm.data import (FORMAT_VERSION, MANIFEST, DataError, load_manifest, read_json,  # noqa: F401 (re-exported)
                         same_tokenizer, shards_present, verify_shards)
from distlm.data import tokenizer as tkz
from distlm.data.sources import (RANGE_KINDS, SourceStats, Unit, input_files, iter_documents, plan_units,
                                 pretokenized_inputs, read_range, read_token_file, resolve_inputs, source_files,
                                 text_blocks, unit_documents)

TRAIN, VAL = 0, 1
SPLITS = ("train", "val")
CACHE_CHARS = 256 << 20  # bpe:N: corpora up to this size are read once to train it; bigger ones twice
POOL_MIN_BYTES = 1 << 20  # smaller inputs: starting worker processes costs more than it saves
# Input bytes per worker task. Big enough that the parent's per-task work (a journal line, two
# fsyncs, opening files) is noise; small enough that all cores stay busy to the end and a
# task's text and tokens are a few tens of MB in a worker.
TASK_CHARS = 8 << 20
# A journal line (and the fsyncs before it) at most this often: a kill loses at most this much work,
# and on a network file system, where an fsync can take tens of ms, syncing stays a small cost.
JOURNAL_SECONDS = 1.0
JOURNAL = "journal.jsonl"
UNITS = "units"
COPY_BLOCK = 1 << 23


def prepare(inputs: list[str], out_dir: Path, *, tokenizer: str = "gpt2", val_fraction: float = 0.05,
            seed: int = 0, workers: int | None = None, separator: str | None = None, text_field: str = "text",
            shard_tokens: int = 100_000_000, progress: bool = True, shard: str | tuple[int, int] | None = None) -> dict:
    """Tokenize ``inputs`` (see ``distlm.data.sources``) into ``out_dir``; returns the manifest.

    ``tokenizer``: "gpt2" or "bpe:N" (trained here on the train documents).
    ``workers``: tokenizer processes; default all cores, or 1 below 1 MB of input.
    ``separator``: split each file into documents on this string.
    ``text_field``: the text column of JSONL / Parquet / Arrow inputs.
    ``shard``: "I/N" (or (I, N)): prepare only part I (from 0) of N, for ``merge``.
    Raises DataError, naming the file, line or value, for anything wrong with them.
    """
    inputs, out_dir = [str(i) for i in inputs], Path(out_dir)
    _check_options(tokenizer, val_fraction, seed, workers, shard_tokens)
    part = _parse_shard(shard)
    _recover_stale(out_dir)
    _check_out_dir(out_dir)
    val_fraction = float(val_fraction)  # so 0 and 0.0 fingerprint alike
    options = {"tokenizer": tokenizer, "val_fraction": val_fraction, "seed": seed, "separator": separator,
               "text_field": text_field, "shard_tokens": shard_tokens}
    if not inputs:
        raise DataError("no inputs given")
    pretok = pretokenized_inputs(inputs, tokenizer)
    if pretok and part:
        raise DataError("--shard splits text inputs; pre-tokenized .bin files are copied whole, without parts")
    if part and tokenizer != "gpt2":
        raise DataError(f"--shard needs the gpt2 tokenizer: {tokenizer} is trained on all the documents, "
                        f"so each part would train its own")
    if pretok:
        return _prepare_bin_folder(pretok, out_dir, options)

    resolved = [(k, src) for k, raw in enumerate(inputs) for src in resolve_inputs([raw], out_dir)]
    per_source = [[(f, f.stat().st_size) for f in source_files(src)] for _, src in resolved]
    fingerprint = _inputs_fingerprint([f for fs in per_source for f, _ in fs], options)
    chosen = (list(range(len(resolved))) if part is None
              else _part_members([sum(n for _, n in fs) for fs in per_source], *part))
    sources = [{"path": raw, "files": 0, "bytes": 0} for raw in inputs]
    for j in chosen:
        sources[resolved[j][0]]["files"] += len(per_source[j])
        sources[resolved[j][0]]["bytes"] += sum(n for _, n in per_source[j])
    own = fingerprint if part is None else _inputs_fingerprint(
        [f for j in chosen for f, _ in per_source[j]], {**options, "shard": list(part)})
    old = read_json(out_dir / MANIFEST)
    if old and old.get("inputs_fingerprint") == own and shards_present(out_dir, old):
        print(f"{out_dir}: up to date")
        return old
    files = input_files([resolved[j][1] for j in chosen])
    units = plan_units(files, separator, TASK_CHARS)
    plan = hashlib.sha256(json.dumps([u.as_list() for u in units]).encode()).hexdigest()
    header = {"journal": 1, "inputs": own, "plan": plan, "units": len(units)}
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    keep = False
    try:
        resumed = _adopt(out_dir, tmp, header)
        if resumed is None:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        workers = workers or _default_workers(sum(n for j in chosen for _, n in per_source[j]))
        body = _prepare_text(inputs, out_dir, tmp, options, units, len(files), header, resumed, workers, progress,
                             part)
        if part is not None:
            body["part"] = {"index": part[0], "count": part[1], "corpus_fingerprint": fingerprint,
                            **body.pop("candidates")}
        manifest = {"format_version": FORMAT_VERSION, **body, "sources": sources, "inputs_fingerprint": own,
                    "options": options, "seed": seed, "val_fraction": val_fraction,
                    "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        (tmp / JOURNAL).unlink()
        _swap_in(tmp, out_dir)
    except KeyboardInterrupt:
        keep = (tmp / JOURNAL).is_file()  # Ctrl-C: the next run goes on from here
        raise
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def merge(parts: list[str], out_dir: Path, *, progress: bool = True) -> dict:
    """Join the part folders of ``prepare(..., shard="I/N")``, I = 0..N-1, into ``out_dir``.

    The result is the folder that one ``prepare`` of all the inputs makes: the same shard
    files (each split's tokens in input order, cut anew every ``shard_tokens``), the same
    manifest but for ``created``. Each part shard's sha256 is checked as it is read. The
    fallbacks (a split left empty by the hash, a lone document) are decided here, for the
    whole corpus. DataError when the parts come from different runs, are missing or damaged.
    """
    from tqdm import tqdm
    out_dir = Path(out_dir)
    if not parts:
        raise DataError("--merge needs the part folders (made with --shard I/N)")
    _recover_stale(out_dir)
    _check_out_dir(out_dir)
    loaded = _load_parts([Path(p) for p in parts])
    ref = loaded[0][1]
    fingerprint, options = ref["part"]["corpus_fingerprint"], ref["options"]
    old = read_json(out_dir / MANIFEST)
    if old and "part" not in old and old.get("inputs_fingerprint") == fingerprint and shards_present(out_dir, old):
        print(f"{out_dir}: up to date")
        return old
    totals = _part_totals(loaded)
    if sum(totals["docs"]) == 0:
        raise DataError(f"no documents in {', '.join(s['path'] for s in totals['sources'])} "
                        f"({totals['stats'].summary()})")
    method, home, moves, docs = _fallback(totals["docs"], totals["tokens"], totals["min_train"], totals["max_val"],
                                          options["val_fraction"])
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    itemsize = 2 if ref["dtype"] == "uint16" else 4
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        tok_file = ref["tokenizer"].get("file")
        if tok_file:
            shutil.copyfile(loaded[0][0] / tok_file, tmp / tok_file)
        writers = [_ShardWriter(tmp, s, ref["dtype"], options["shard_tokens"]) for s in SPLITS]
        with tqdm(total=sum(totals["tokens"]) * itemsize, unit="B", unit_scale=True, desc="merging",
                  disable=None if progress else True) as bar:
            for split in (TRAIN, VAL):
                router = _Router(writers, split, 0, moves if home == split else [])
                for path, m in loaded:
                    for shard in m["splits"][SPLITS[split]]["shards"]:
                        _feed_checked(path / shard["file"], shard["sha256"], router, bar)
        splits = {name: w.finish(docs[i]) for i, (name, w) in enumerate(zip(SPLITS, writers))}
        manifest = {"format_version": FORMAT_VERSION, "tokenizer": ref["tokenizer"], "dtype": ref["dtype"],
                    "split_method": method, "splits": splits,
                    "stats": {**totals["stats"].as_dict(), "chars": totals["chars"], "text_bytes": totals["bytes"]},
                    "sources": totals["sources"], "inputs_fingerprint": fingerprint, "options": options,
                    "seed": ref["seed"], "val_fraction": ref["val_fraction"],
                    "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
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


def _parse_shard(shard) -> tuple[int, int] | None:
    if shard is None:
        return None
    if isinstance(shard, str):
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", shard)
        if not m:
            raise DataError(f"--shard {shard!r}: write I/N, e.g. 0/8 for the first of 8 parts")
        shard = (int(m.group(1)), int(m.group(2)))
    index, count = shard
    if not 0 <= index < count:
        raise DataError(f"--shard {index}/{count}: I must be from 0 to N-1 (parts are numbered from 0)")
    return index, count


def _part_members(sizes: list[int], index: int, count: int) -> list[int]:
    """The sources of part ``index``: each goes to the part in which its first byte falls when
    all inputs' bytes, in order, are cut into ``count`` equal runs. Contiguous runs, so the
    parts one after another are the inputs in order, as ``merge`` needs."""
    total, pos, members = sum(sizes), 0, []
    for j, size in enumerate(sizes):
        if (pos * count // total if total else j * count // len(sizes)) == index:
            members.append(j)
        pos += size
    return members


def _check_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"{out_dir}: exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / MANIFEST).is_file():
        raise DataError(f"{out_dir}: not empty and has no {MANIFEST}; refusing to replace it (choose another --out)")


def _stale(out_dir: Path) -> list[tuple[str, Path]]:
    """(tag, path) of the temporary folders beside ``out_dir`` whose process is gone."""
    prefix = f".{out_dir.name}."
    if os.name != "posix" or not out_dir.parent.is_dir():
        return []
    found = []
    for path in sorted(out_dir.parent.glob(glob.escape(prefix) + "*-*")):
        tag, _, pid = path.name[len(prefix):].partition("-")
        if tag in ("tmp", "old") and pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            found.append((tag, path))
    return found


def _recover_stale(out_dir: Path) -> None:
    """Clean up after a run that was killed outright (SIGKILL, power cut) mid-way; a
    temporary folder with a journal is left for ``_adopt`` to resume from."""
    for tag, path in _stale(out_dir):
        if tag == "old" and not out_dir.exists():  # killed between the two renames of _swap_in
            os.replace(path, out_dir)
        elif tag == "old" or not (path / JOURNAL).is_file():
            shutil.rmtree(path, ignore_errors=True)


def _adopt(out_dir: Path, tmp: Path, header: dict) -> tuple[list[dict], int] | None:
    """Take over the temporary folder of a killed run of the same job, as ``tmp``: its
    journal's records and valid length. Other leftovers are removed."""
    found = None
    for tag, path in sorted(_stale(out_dir), key=lambda tp: -_mtime(tp[1] / JOURNAL)):
        got = _Journal.read(path / JOURNAL, header) if tag == "tmp" and found is None else None
        if got is not None and _Build.files_match(path, got[0]):
            try:
                os.replace(path, tmp)
                found = got
                continue
            except OSError:  # another run took it first
                pass
        shutil.rmtree(path, ignore_errors=True)
    return found


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


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


def _seed_key(seed: int) -> bytes:
    return str(seed).encode()[:64]


def _doc_key(data: bytes, key: bytes) -> float:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, key=key).digest(), "big") / 2.0 ** 64


# ---- text: the parent --------------------------------------------------------------------------
def _prepare_text(inputs: list[str], out_dir: Path, tmp: Path, options: dict, units: list[Unit], n_files: int,
                  header: dict, resumed: tuple[list[dict], int] | None, workers: int, progress: bool,
                  part: tuple[int, int] | None) -> dict:
    from tqdm import tqdm
    name = options["tokenizer"]
    if name == "gpt2":
        tok = tkz.gpt2()
    elif resumed is not None and (tmp / "tokenizer.json").is_file():
        tok = tkz.load_tokenizer(name, tmp)  # trained before the kill, on the same documents
    else:
        tok = _train_bpe(inputs, out_dir, options, progress)
        tok.save(tmp)
    build = _Build(tmp, tok.dtype, options)
    start = 0
    if resumed is not None:
        start = build.restore(resumed[0])
        print(f"{out_dir}: resuming after {start} of {len(units)} tasks "
              f"({resumed[0][-1]['inputs_done']} of {n_files} input files done)")
    journal = _Journal(tmp / JOURNAL, header, None if resumed is None else resumed[1])
    try:
        (tmp / UNITS).mkdir(exist_ok=True)
        with tqdm(total=sum(u.size for u in units[start:]), unit="B", unit_scale=True,
                  desc=f"tokenizing ({name})", disable=None if progress else True) as bar, \
                tkz.open_executor(workers, tok) as pool:
            _run_units(pool, units, start, build, journal, tmp / UNITS, options, workers, bar)
        shutil.rmtree(tmp / UNITS)
        if part is None and sum(build.docs) == 0:
            raise DataError(f"no documents in {', '.join(inputs)} ({build.stats.summary()})")
        if part is None:
            journal.append({"fixup": True})  # the shards change from here: a run killed now starts over
        body = build.finish(part is not None)
    finally:
        journal.close()
    return {"tokenizer": _tokenizer_info(tok), "dtype": tok.dtype, **body}


def _run_units(pool, units: list[Unit], start: int, build: _Build, journal: _Journal, folder: Path,
               options: dict, workers: int, bar) -> None:
    """Hand units to the workers, at most ``2 * workers + 1`` ahead of the one being written,
    and append each finished unit's tokens to the shards in unit order."""
    window = 2 * workers + 1
    pending: deque = deque()
    k, journaled = start, time.monotonic()
    while k < len(units) or pending:
        while k < len(units) and len(pending) < window:
            pending.append((k, pool.run(_encode_unit, k, units[k], options, str(folder))))
            k += 1
        i, future = pending.popleft()
        build.add(i, units[i], _result(future), folder)
        if time.monotonic() - journaled >= JOURNAL_SECONDS:
            journal.append(build.record(i, units[i]))
            journaled = time.monotonic()
        bar.update(units[i].size)


def _result(future):
    from concurrent.futures.process import BrokenProcessPool
    try:
        return future.result()
    except BrokenProcessPool:
        raise DataError("a tokenizer worker process died (out of memory? or prepare() called from a script "
                        "without `if __name__ == '__main__':`, which spawned workers need)") from None


class _Build:
    """The parent's side of a text prepare: appends each finished unit's token files to the
    shards, in unit order, and keeps the counts and the candidates for the fallbacks.
    ``record`` is its state after a unit, as a journal line; ``restore`` rebuilds it."""

    def __init__(self, tmp: Path, dtype: str, options: dict) -> None:
        self.tmp, self.val_fraction = tmp, options["val_fraction"]
        self.writers = [_ShardWriter(tmp, s, dtype, options["shard_tokens"]) for s in SPLITS]
        self.docs, self.chars, self.bytes, self.stats = [0, 0], 0, 0, SourceStats()
        self.min_train = self.max_val = None  # [key, first token in its split, tokens]: earliest on ties
        self.pending = None  # [key, split, first token, tokens so far] of a document arriving in pieces
        self.bad_file = -1  # the file last counted in files_with_invalid_utf8: its other ranges don't count

    def add(self, k: int, unit: Unit, result: dict, folder: Path) -> None:
        if unit.kind == "hash":
            split = VAL if result["key"] < self.val_fraction else TRAIN
            self.pending = [result["key"], split, self.writers[split].tokens, 0]
            return
        stats = result["stats"]
        if unit.kind in RANGE_KINDS and stats["files_with_invalid_utf8"]:
            if self.bad_file == unit.first:
                stats["files_with_invalid_utf8"] = 0
            self.bad_file = unit.first
        self.stats.add(stats)
        self.chars, self.bytes = self.chars + result["chars"], self.bytes + result["bytes"]
        if unit.kind == "piece":
            key, split, first, _ = self.pending
            self.pending[3] += self._append(folder / f"{k:08d}.doc", split)
            if unit.last:
                self.docs[split] += 1
                self._candidate(split, key, first, self.pending[3])
                self.pending = None
            return
        starts = [w.tokens for w in self.writers]
        for split in (TRAIN, VAL):
            self._append(folder / f"{k:08d}.{SPLITS[split]}", split)
            self.docs[split] += result["docs"][split]
        for split, best in ((TRAIN, result["min_train"]), (VAL, result["max_val"])):
            if best is not None:
                self._candidate(split, best[0], starts[split] + best[1], best[2])

    def _candidate(self, split: int, key: float, first: int, tokens: int) -> None:
        if split == TRAIN and (self.min_train is None or key < self.min_train[0]):
            self.min_train = [key, first, tokens]
        if split == VAL and (self.max_val is None or key > self.max_val[0]):
            self.max_val = [key, first, tokens]

    def _append(self, path: Path, split: int) -> int:
        """Copy a worker's token file to the split's shards, delete it; its token count."""
        if not path.is_file():
            return 0
        before = self.writers[split].tokens
        with open(path, "rb") as fh:
            while block := fh.read(COPY_BLOCK):
                self.writers[split].write(block)
        path.unlink()
        return self.writers[split].tokens - before

    def record(self, k: int, unit: Unit) -> dict:
        for w in self.writers:
            w.sync()  # the journal must never promise tokens that are not on disk
        return {"unit": k, "inputs_done": unit.files_done(), "tokens": [w.tokens for w in self.writers],
                "shards_closed": [w.take_closed() for w in self.writers],
                "open": [w.open_shard() for w in self.writers], "dtype": self.writers[0].dtype,
                "state": {"docs": self.docs, "chars": self.chars, "bytes": self.bytes, "stats": self.stats.as_dict(),
                          "min_train": self.min_train, "max_val": self.max_val, "pending": self.pending,
                          "bad_file": self.bad_file}}

    @staticmethod
    def files_match(folder: Path, records: list[dict]) -> bool:
        """The shard files a journal describes are there (closed: exact size; open: at least
        the journaled length)."""
        if not records:
            return True
        itemsize = 2 if records[-1]["dtype"] == "uint16" else 4
        try:
            for split in (TRAIN, VAL):
                for shard in (s for r in records for s in r["shards_closed"][split]):
                    if (folder / shard["file"]).stat().st_size != shard["tokens"] * itemsize:
                        return False
                open_shard = records[-1]["open"][split]
                if open_shard and (folder / open_shard[0]).stat().st_size < open_shard[1] * itemsize:
                    return False
        except (OSError, KeyError, TypeError, IndexError):
            return False
        return True

    def restore(self, records: list[dict]) -> int:
        """The state after the journal's last unit; returns the next unit's index."""
        if not records:
            return 0
        last = records[-1]
        keep = set()
        for split, w in enumerate(self.writers):
            closed = [s for r in records for s in r["shards_closed"][split]]
            w.restore(closed, last["open"][split])
            keep.update(s["file"] for s in w.shards)
        for path in self.tmp.glob("*.bin"):  # shards begun after the last journal line
            if path.name not in keep:
                path.unlink()
        shutil.rmtree(self.tmp / UNITS, ignore_errors=True)
        state = last["state"]
        self.docs, self.chars, self.bytes = state["docs"], state["chars"], state["bytes"]
        self.stats = SourceStats(**state["stats"])
        self.min_train, self.max_val = state["min_train"], state["max_val"]
        self.pending, self.bad_file = state["pending"], state["bad_file"]
        return last["unit"] + 1

    def finish(self, is_part: bool) -> dict:
        for w in self.writers:
            w.close()
        body = {"split_method": "part"}
        if is_part:  # the fallbacks need the whole corpus: merge applies them
            body["candidates"] = {"min_train": self.min_train, "max_val": self.max_val}
        else:
            method, home, moves, self.docs = _fallback(self.docs, [w.tokens for w in self.writers], self.min_train,
                                                       self.max_val, self.val_fraction)
            if moves:
                _reroute(self.writers, home, moves, self.tmp / "reroute")
            body["split_method"] = method
        body["splits"] = {name: w.finish(d) for name, w, d in zip(SPLITS, self.writers, self.docs)}
        body["stats"] = {**self.stats.as_dict(), "chars": self.chars, "text_bytes": self.bytes}
        return body


def _fallback(docs: list[int], tokens: list[int], min_train, max_val, val_fraction: float):
    """(split_method, the split to rewrite or None, its moved token ranges as (begin, end,
    destination), the documents per split afterwards) for the corpus totals."""
    total = docs[TRAIN] + docs[VAL]
    if total == 1 and val_fraction > 0:  # a lone document: its last val_fraction of tokens to val
        home = TRAIN if docs[TRAIN] else VAL
        n = tokens[home]
        cut = n - min(max(1, round(n * val_fraction)), n - 1)
        return "single-document-tail", home, [(0, cut, TRAIN), (cut, n, VAL)], [1, 1]
    if total and val_fraction > 0 and docs[VAL] == 0:
        _, first, n = min_train
        return "document-hash", TRAIN, [(first, first + n, VAL)], [docs[TRAIN] - 1, 1]
    if total and docs[TRAIN] == 0:
        _, first, n = max_val
        return "document-hash", VAL, [(first, first + n, TRAIN)], [1, docs[VAL] - 1]
    return "document-hash", None, [], list(docs)


def _reroute(writers: list[_ShardWriter], home: int, moves: list, aside: Path) -> None:
    """Rewrite split ``home`` from the shard that holds the first moved token on, sending the
    moved ranges to their split (empty until now, in every fallback)."""
    w = writers[home]
    first, s, pos = min(b for b, _, _ in moves), 0, 0
    while s < len(w.shards) and pos + w.shards[s]["tokens"] <= first:
        pos += w.shards[s]["tokens"]
        s += 1
    aside.mkdir()
    old = w.truncate(s)
    for shard in old:
        os.replace(w.dir / shard["file"], aside / shard["file"])
    router = _Router(writers, home, pos, moves)
    for shard in old:
        with open(aside / shard["file"], "rb") as fh:
            while block := fh.read(COPY_BLOCK):
                router.feed(block)
    for writer in writers:
        writer.close()
    shutil.rmtree(aside)


class _Router:
    """Writes one split's token stream, from token ``pos`` on, to the shard writers: tokens in
    a (begin, end, destination) range of ``moves`` to that split, the others to ``home``."""

    def __init__(self, writers: list[_ShardWriter], home: int, pos: int, moves: list) -> None:
        self.writers, self.home, self.pos = writers, home, pos
        self.moves = sorted((b, e, d) for b, e, d in moves if e > b)
        self.itemsize = writers[home].itemsize

    def feed(self, data) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            dest, stop = self.home, None
            for begin, end, to in self.moves:
                if begin <= self.pos < end:
                    dest, stop = to, end
                    break
                if self.pos < begin:
                    stop = begin
                    break
            n = len(view) // self.itemsize
            take = n if stop is None else min(n, stop - self.pos)
            self.writers[dest].write(view[:take * self.itemsize])
            view, self.pos = view[take * self.itemsize:], self.pos + take


class _Journal:
    """``journal.jsonl`` in the temporary folder: a header line (inputs, options and plan),
    then a line after a finished unit (``_Build.record``) every JOURNAL_SECONDS or so, each
    describing everything up to that unit. A line goes out in one write, after
    the shard bytes it describes were synced, and is synced itself: a kill at any moment
    leaves a valid prefix, and a torn last line is dropped when the journal is read."""

    def __init__(self, path: Path, header: dict, valid_bytes: int | None) -> None:
        if valid_bytes is None:
            path.write_bytes(json.dumps(header).encode() + b"\n")
        else:
            os.truncate(path, valid_bytes)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.fsync(self.fd)

    def append(self, record: dict) -> None:
        data = memoryview((json.dumps(record, separators=(",", ":")) + "\n").encode())
        while len(data):
            data = data[os.write(self.fd, data):]
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    @staticmethod
    def read(path: Path, header: dict) -> tuple[list[dict], int] | None:
        """(the unit records, the length of the valid prefix) if ``path`` is a journal of
        this job that can be resumed; None otherwise."""
        try:
            lines = path.read_bytes().split(b"\n")
            if json.loads(lines[0]) != header:
                return None
        except (OSError, ValueError):
            return None
        records, size = [], len(lines[0]) + 1
        for line in lines[1:-1]:  # the last item follows the last newline: empty, or a torn line
            try:
                record = json.loads(line)
            except ValueError:
                break
            if not isinstance(record, dict) or record.get("fixup"):
                return None  # killed while rewriting shards for the fallbacks: start over
            if not isinstance(record.get("unit"), int) or record["unit"] <= (records[-1]["unit"] if records else -1):
                break
            records.append(record)
            size += len(line) + 1
        return records, size


# ---- text: a worker -----------------------------------------------------------------------------
def _encode_unit(tok: tkz.Tokenizer, k: int, unit: Unit, options: dict, folder: str) -> dict:
    """Read, split, hash and tokenize one unit; tokens go to ``folder/{k}.train|.val|.doc``.
    Returns the counts and, for the fallbacks, this unit's lowest-key train document and
    highest-key val document as [key, first token, tokens] within the unit's own files."""
    key = _seed_key(options["seed"])
    label, path, _ = unit.paths[0]
    if unit.kind == "hash":
        digest = hashlib.blake2b(digest_size=8, key=key)
        for text in text_blocks(label, path):
            digest.update(text.encode("utf-8"))
        return {"key": int.from_bytes(digest.digest(), "big") / 2.0 ** 64}
    stats, out = SourceStats(), _UnitFiles(os.path.join(folder, f"{k:08d}"))
    code = "<u2" if tok.dtype == "uint16" else "<u4"
    eos = tok.eos_id.to_bytes(2 if code == "<u2" else 4, "little")
    itemsize = len(eos)
    result = {"docs": [0, 0], "chars": 0, "bytes": 0, "min_train": None, "max_val": None}
    try:
        if unit.kind == "piece":
            text = read_range(unit, stats) or ""
            stats.documents += unit.start == 0
            out.write("doc", _encode(tok, text) + (eos if unit.last else b""))
            result.update(chars=len(text), bytes=len(text.encode("utf-8")))
        else:
            vf, written = options["val_fraction"], [0, 0]
            for _, text in unit_documents(unit, options["text_field"], options["separator"], stats):
                data = text.encode("utf-8")
                doc_key = _doc_key(data, key)
                split = VAL if doc_key < vf else TRAIN
                tokens = _encode(tok, text) + eos
                n = len(tokens) // itemsize
                if split == TRAIN and (result["min_train"] is None or doc_key < result["min_train"][0]):
                    result["min_train"] = [doc_key, written[TRAIN], n]
                if split == VAL and (result["max_val"] is None or doc_key > result["max_val"][0]):
                    result["max_val"] = [doc_key, written[VAL], n]
                out.write(SPLITS[split], tokens)
                written[split] += n
                result["docs"][split] += 1
                result["chars"] += len(text)
                result["bytes"] += len(data)
    finally:
        out.close()
    result["stats"] = stats.as_dict()
    return result


def _encode(tok: tkz.Tokenizer, text: str) -> bytes:
    # Long documents go in pieces that tokenize exactly as the whole (tokenizer.split_for_encoding).
    return b"".join(tok.encode_packed(list(tkz.split_for_encoding(text, tok.chunk_chars))))


class _UnitFiles:
    """A worker's token files for one unit, opened on first use."""

    def __init__(self, base: str) -> None:
        self.base, self.files = base, {}

    def write(self, name: str, data: bytes) -> None:
        if name not in self.files:
            self.files[name] = open(f"{self.base}.{name}", "wb", buffering=1 << 20)
        self.files[name].write(data)

    def close(self) -> None:
        for fh in self.files.values():
            fh.close()


# ---- bpe:N: training on the train documents ---------------------------------------------------
def _train_bpe(inputs: list[str], out_dir: Path, options: dict, progress: bool) -> tkz.BPETokenizer:
    """Train bpe:N on the documents that end up in train, reading the inputs here: once to
    find the split (with the fallbacks), then again unless they fit in CACHE_CHARS."""
    from tqdm import tqdm
    name, vf, key = options["tokenizer"], options["val_fraction"], _seed_key(options["seed"])
    read = functools.partial(iter_documents, inputs, separator=options["separator"],
                             text_field=options["text_field"], exclude=out_dir)
    count = n_val = chars = 0
    lowest = highest = (-1, 0.0)  # (document, key): the earliest on ties
    cache: list[str] | None = []
    with tqdm(unit="char", unit_scale=True, desc=f"reading ({name})", disable=None if progress else True) as bar:
        for i, (_, text) in enumerate(read()):
            doc_key = _doc_key(text.encode("utf-8"), key)
            if count == 0 or doc_key < lowest[1]:
                lowest = (i, doc_key)
            if count == 0 or doc_key > highest[1]:
                highest = (i, doc_key)
            count, n_val, chars = count + 1, n_val + (doc_key < vf), chars + len(text)
            bar.update(len(text))
            if cache is not None:
                cache.append(text)
                if chars > CACHE_CHARS:
                    cache = None
    whole = count == 1 and vf > 0
    to_val = lowest[0] if vf > 0 and n_val == 0 else -1
    to_train = highest[0] if n_val == count else -1
    texts = cache if cache is not None else (text for _, text in read(stats=SourceStats()))

    def train_texts():  # in pieces: the trainer spreads pieces over cores, not one whole book
        for i, text in enumerate(texts):
            if whole:
                text = text[:max(1, int(len(text) * (1 - vf)))]
            elif i == to_val or (i != to_train and _doc_key(text.encode("utf-8"), key) < vf):
                continue
            yield from tkz.split_for_encoding(text, 1 << 16)

    return tkz.train_bpe(train_texts(), tkz.parse_bpe_size(name), progress=progress and sys.stderr.isatty())


# ---- shards ----------------------------------------------------------------------------------
class _ShardWriter:
    """Appends token bytes to ``{split}_NNNNNN.bin`` files of at most ``limit`` tokens each."""

    def __init__(self, directory: Path, split: str, dtype: str, limit: int) -> None:
        self.dir, self.split, self.limit, self.dtype = directory, split, limit, dtype
        self.itemsize = 2 if dtype == "uint16" else 4
        self.shards: list[dict] = []
        self.tokens = 0
        self.reported = 0  # closed shards already in a journal line
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
                self.close()

    def close(self) -> None:
        if self._fh is not None:
            self.sync()
            self._fh.close()
            self.shards[-1].update(tokens=self._n, sha256=self._sha.hexdigest())
            self._fh = None

    def sync(self) -> None:
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())

    def take_closed(self) -> list[dict]:
        """The shards closed since the last call (for the journal)."""
        closed = len(self.shards) - (self._fh is not None)
        new, self.reported = self.shards[self.reported:closed], closed
        return [dict(s) for s in new]

    def open_shard(self) -> list | None:
        return None if self._fh is None else [self.shards[-1]["file"], self._n]

    def restore(self, closed: list[dict], open_shard: list | None) -> None:
        """Continue after a journaled state: the open shard is cut back to its journaled
        length (what came after was never journaled) and its checksum recomputed."""
        self.shards = [dict(s) for s in closed]
        self.reported = len(self.shards)
        self.tokens = sum(s["tokens"] for s in closed)
        if open_shard:
            name, n = open_shard
            path = self.dir / name
            os.truncate(path, n * self.itemsize)
            self._sha = hashlib.sha256()
            with open(path, "rb") as fh:
                while block := fh.read(COPY_BLOCK):
                    self._sha.update(block)
            self._fh, self._n = open(path, "ab"), n
            self.shards.append({"file": name, "tokens": 0, "sha256": ""})
            self.tokens += n

    def truncate(self, keep: int) -> list[dict]:
        """Forget the (closed) shards from index ``keep`` on; returns them."""
        self.close()
        dropped, self.shards = self.shards[keep:], self.shards[:keep]
        self.tokens = sum(s["tokens"] for s in self.shards)
        return dropped

    def finish(self, documents: int) -> dict:
        self.close()
        return {"tokens": self.tokens, "documents": documents, "shards": self.shards}


def _tokenizer_info(tok: tkz.Tokenizer) -> dict:
    return {"name": tok.name, "fingerprint": tok.fingerprint(), "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id, "file": None if tok.name == "gpt2" else "tokenizer.json"}


# ---- merge -------------------------------------------------------------------------------------
def _load_parts(paths: list[Path]) -> list[tuple[Path, dict]]:
    """The parts' manifests in part order; DataError unless they are parts 0..N-1 of one run."""
    loaded = []
    for path in paths:
        m = load_manifest(path, part_ok=True)
        if not isinstance(m.get("part"), dict):
            raise DataError(f"{path}: not a part (made by `distlm prepare --shard I/N`); nothing to merge")
        loaded.append((path, m))
    ref_path, ref = loaded[0]
    hint = "merge only the parts of one job (same inputs and options)"
    for path, m in loaded[1:]:
        if not same_tokenizer(m["tokenizer"], ref["tokenizer"]) or m["tokenizer"]["name"] != ref["tokenizer"]["name"]:
            raise DataError(f"{path}: tokenizer {m['tokenizer']['name']} differs from {ref_path}'s "
                            f"{ref['tokenizer']['name']}; {hint}")
        for opt in sorted(set(ref["options"]) | set(m["options"])):
            if m["options"].get(opt) != ref["options"].get(opt):
                raise DataError(f"{path}: prepared with {opt}={m['options'].get(opt)!r}, {ref_path} with "
                                f"{opt}={ref['options'].get(opt)!r}; {hint}")
        if m["part"]["count"] != ref["part"]["count"]:
            raise DataError(f"{path}: part {m['part']['index']}/{m['part']['count']}, but {ref_path} is part "
                            f"{ref['part']['index']}/{ref['part']['count']}; {hint}")
        if m["part"]["corpus_fingerprint"] != ref["part"]["corpus_fingerprint"]:
            raise DataError(f"{path}: prepared from other inputs than {ref_path} (the input files or their "
                            f"sizes or dates differ); {hint}")
    count, seen = ref["part"]["count"], {}
    for path, m in loaded:
        if m["part"]["index"] in seen:
            raise DataError(f"{path}: part {m['part']['index']}/{count} given twice (also {seen[m['part']['index']]})")
        seen[m["part"]["index"]] = path
        if not shards_present(path, m):
            raise DataError(f"{path}: shards missing or of the wrong size; prepare this part again")
    missing = [f"{i}/{count}" for i in range(count) if i not in seen]
    if missing:
        raise DataError(f"missing part(s) {', '.join(missing)}: merge needs all {count} parts")
    return sorted(loaded, key=lambda pm: pm[1]["part"]["index"])


def _part_totals(loaded: list[tuple[Path, dict]]) -> dict:
    """Documents, tokens, statistics and sources summed over the parts in order, and the
    fallback candidates of the whole corpus (positions counted from its start)."""
    docs, tokens, stats, chars, n_bytes = [0, 0], [0, 0], SourceStats(), 0, 0
    best: dict = {"min_train": None, "max_val": None}
    sources = [dict(s, files=0, bytes=0) for s in loaded[0][1]["sources"]]
    for path, m in loaded:
        for name, split, better in (("min_train", TRAIN, lambda a, b: a < b), ("max_val", VAL, lambda a, b: a > b)):
            cand = m["part"].get(name)
            if cand is not None and (best[name] is None or better(cand[0], best[name][0])):
                best[name] = [cand[0], tokens[split] + cand[1], cand[2]]
        for split, name in enumerate(SPLITS):
            tokens[split] += m["splits"][name]["tokens"]
            docs[split] += m["splits"][name]["documents"]
        stats.add({k: v for k, v in m["stats"].items() if k not in ("chars", "text_bytes")})
        chars, n_bytes = chars + m["stats"]["chars"], n_bytes + m["stats"]["text_bytes"]
        if [s["path"] for s in m["sources"]] != [s["path"] for s in sources]:
            raise DataError(f"{path}: lists other inputs than {loaded[0][0]}; merge only the parts of one job")
        for total, s in zip(sources, m["sources"]):
            total["files"] += s["files"]
            total["bytes"] += s["bytes"]
    return {"docs": docs, "tokens": tokens, "stats": stats, "chars": chars, "bytes": n_bytes, "sources": sources,
            **best}


def _feed_checked(path: Path, sha256: str, router: _Router, bar) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(COPY_BLOCK):
            digest.update(block)
            router.feed(block)
            bar.update(len(block))
    if digest.hexdigest() != sha256:
        raise DataError(f"{path}: sha256 {digest.hexdigest()} does not match its manifest's {sha256}; "
                        f"prepare this part again")


# ---- pre-tokenized .bin inputs ----------------------------------------------------------------
def _prepare_bin_folder(pretok: tuple[list[Path], list[Path]], out_dir: Path, options: dict) -> dict:
    per_input = [(str(p), [p]) for p in pretok[0] + pretok[1]]
    fingerprint = _inputs_fingerprint([f for _, fs in per_input for f in fs], options)
    old = read_json(out_dir / MANIFEST)
    if old and old.get("inputs_fingerprint") == fingerprint and shards_present(out_dir, old):
        print(f"{out_dir}: up to date")
        return old
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        body = _prepare_pretokenized(*pretok, tmp, options["shard_tokens"])
        sources = [{"path": raw, "files": len(fs), "bytes": sum(f.stat().st_size for f in fs)}
                   for raw, fs in per_input]
        manifest = {"format_version": FORMAT_VERSION, **body, "sources": sources,
                    "inputs_fingerprint": fingerprint, "options": options, "seed": options["seed"],
                    "val_fraction": options["val_fraction"],
                    "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        _swap_in(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


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
