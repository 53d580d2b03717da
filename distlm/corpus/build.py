"""The parent's side of a text ``prepare``: tokenizer, workers, and the shards in unit order.

The parent hands units to the worker processes (``worker``), appends their token
files to the shards in unit order, journals its state for resuming, and at the end applies
the fallbacks that need the whole corpus.
"""
from __future__ import annotations

import shutil
import time
from collections import deque
from pathlib import Path

from distlm.corpus import pool as workers_pool
from distlm.corpus.bpe import train_bpe
from distlm.corpus.folder import tokenizer_info
from distlm.corpus.journal import JOURNAL, Journal
from distlm.corpus.shards import COPY_BLOCK, ShardWriter, reroute
from distlm.corpus.sources import RANGE_KINDS, SourceStats, Unit
from distlm.corpus.split import SPLITS, TRAIN, VAL, fallback
from distlm.corpus.worker import encode_unit
from distlm.data import DataError
from distlm.data import tokenizer as tkz

UNITS = "units"


def prepare_text(inputs: list[str], out_dir: Path, tmp: Path, options: dict, units: list[Unit], n_files: int,
                 header: dict, resumed: tuple[list[dict], int] | None, workers: int, progress: bool,
                 part: tuple[int, int] | None, *, journal_seconds: float, cache_chars: int, ahead_bytes: int) -> dict:
    """Tokenize ``units`` into shards in ``tmp``, resuming from ``resumed`` (``adopt``); the
    manifest's body. ``journal_seconds``, ``cache_chars``: ``prepare.JOURNAL_SECONDS``, ``CACHE_CHARS``;
    ``ahead_bytes``: input bytes handed to the workers ahead of the unit being appended."""
    from tqdm import tqdm
    name = options["tokenizer"]
    if name == "gpt2":
        tok = tkz.gpt2()
    elif resumed is not None and (tmp / "tokenizer.json").is_file():
        tok = tkz.load_tokenizer(name, tmp)  # trained before the kill, on the same documents
    else:
        tok = train_bpe(inputs, out_dir, options, progress, cache_chars)
        tok.save(tmp)
    build = _Build(tmp, tok.dtype, options)
    start = 0
    if resumed is not None:
        start = build.restore(resumed[0])
        done = resumed[0][-1]["inputs_done"] if resumed[0] else 0  # killed before its first task ended
        print(f"{out_dir}: resuming after {start} of {len(units)} tasks ({done} of {n_files} input files done)")
    journal = Journal(tmp / JOURNAL, header, None if resumed is None else resumed[1])
    try:
        (tmp / UNITS).mkdir(exist_ok=True)
        with tqdm(total=sum(u.size for u in units[start:]), unit="B", unit_scale=True,
                  desc=f"tokenizing ({name})", disable=None if progress else True) as bar, \
                workers_pool.open_executor(workers, tok) as pool:
            _run_units(pool, units, start, build, journal, tmp / UNITS, options, ahead_bytes, bar, journal_seconds)
        shutil.rmtree(tmp / UNITS)
        if part is None and sum(build.docs) == 0:
            raise DataError(f"no documents in {', '.join(inputs)} ({build.stats.summary()})")
        if part is None:
            journal.append({"fixup": True})  # the shards change from here: a run killed now starts over
        body = build.finish(part is not None)
    finally:
        journal.close()
    return {"tokenizer": tokenizer_info(tok), "dtype": tok.dtype, **body}


def _run_units(pool, units: list[Unit], start: int, build: _Build, journal: Journal, folder: Path,
               options: dict, ahead_bytes: int, bar, journal_seconds: float) -> None:
    """Hand units to the workers, up to ``ahead_bytes`` of input ahead of the one being written,
    and append each finished unit's tokens to the shards in unit order.

    A bound in bytes, not units, so that small units keep as many bytes in flight as big ones.
    While the unit at the head is the hash of a document that comes in pieces and is still being
    computed, its pieces are handed out regardless: the hash reads the whole file on one worker (seconds for GBs) and
    would otherwise leave the other workers idle once the bound is reached; their token files
    wait on disk, no more than the document's own tokens."""
    pending: deque = deque()
    k, ahead, journaled = start, 0, time.monotonic()
    while k < len(units) or pending:
        while k < len(units) and (not pending or ahead < ahead_bytes or _behind_hash(pending[0], units[k])):
            pending.append((k, units[k], pool.run(encode_unit, k, units[k], options, str(folder))))
            ahead += units[k].size
            k += 1
        i, unit, future = pending.popleft()
        build.add(i, unit, _result(future), folder)
        ahead -= unit.size
        if time.monotonic() - journaled >= journal_seconds:
            journal.append(build.record(i, unit))
            journaled = time.monotonic()
        bar.update(unit.size)


def _behind_hash(head: tuple, unit: Unit) -> bool:
    """``unit`` is a piece of the document whose hash, ``head`` (index, unit, future), is still
    being computed (once it is done, or in this process, the bound holds again)."""
    _, first, future = head
    return first.kind == "hash" and not future.done() and unit.kind == "piece" and unit.paths == first.paths


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
        self.writers = [ShardWriter(tmp, s, dtype, options["shard_tokens"]) for s in SPLITS]
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
            method, home, moves, self.docs = fallback(self.docs, [w.tokens for w in self.writers], self.min_train,
                                                       self.max_val, self.val_fraction)
            if moves:
                reroute(self.writers, home, moves, self.tmp / "reroute")
            body["split_method"] = method
        body["splits"] = {name: w.finish(d) for name, w, d in zip(SPLITS, self.writers, self.docs)}
        body["stats"] = {**self.stats.as_dict(), "chars": self.chars, "text_bytes": self.bytes}
        return body
