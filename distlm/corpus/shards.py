"""Token shards of a prepared folder: writing them, and routing token streams between splits.

Shared by every way a folder is made (text, pre-tokenized .bin inputs, ``merge``), so that
all of them cut and checksum shards alike.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

COPY_BLOCK = 1 << 23


class ShardWriter:
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


def reroute(writers: list[ShardWriter], home: int, moves: list, aside: Path) -> None:
    """Rewrite split ``home`` from the first token that leaves it on, sending the moved ranges
    to their split (empty until now, in every fallback).

    The tokens before that one stay where they are: the shard that holds it is cut there in
    place (its checksum recomputed by reading what is kept) and only what follows is routed.
    A lone document's range that stays home, (0, cut, home), is no move: rewriting it would copy
    and fsync the whole corpus's tokens again, one process, after every worker has finished."""
    w = writers[home]
    leaving = [b for b, e, d in moves if d != home and e > b]
    if not leaving:  # a lone document of one token: it stays whole where it is
        return
    first, s, pos = min(leaving), 0, 0
    while s < len(w.shards) and pos + w.shards[s]["tokens"] <= first:
        pos += w.shards[s]["tokens"]
        s += 1
    aside.mkdir()
    keep = first - pos  # tokens of shard s that stay
    old = w.truncate(s + (keep > 0))
    for shard in old:
        os.replace(w.dir / shard["file"], aside / shard["file"])
    tails = [aside / shard["file"] for shard in old]
    if keep > 0:
        kept = w.shards.pop()
        tail = aside / f"{kept['file']}.tail"
        with open(w.dir / kept["file"], "rb") as src, open(tail, "wb") as dst:
            src.seek(keep * w.itemsize)
            while block := src.read(COPY_BLOCK):
                dst.write(block)
        w.restore(w.shards, [kept["file"], keep])
        tails.insert(0, tail)
    router = Router(writers, home, first, moves)
    for path in tails:
        with open(path, "rb") as fh:
            while block := fh.read(COPY_BLOCK):
                router.feed(block)
    for writer in writers:
        writer.close()
    shutil.rmtree(aside)


class Router:
    """Writes one split's token stream, from token ``pos`` on, to the shard writers: tokens in
    a (begin, end, destination) range of ``moves`` to that split, the others to ``home``."""

    def __init__(self, writers: list[ShardWriter], home: int, pos: int, moves: list) -> None:
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
