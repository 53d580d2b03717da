"""Resuming a killed text ``prepare``: the journal, and adopting a dead run's temporary folder.

A run killed outright (SIGKILL, power cut) leaves its temporary folder beside ``out_dir``;
this module decides what of it to keep (a folder of the same job whose journal and shard
files agree) and removes the rest, so the next run goes on from its last journaled unit.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
from pathlib import Path

from distlm.corpus.split import TRAIN, VAL

JOURNAL = "journal.jsonl"


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


def recover_stale(out_dir: Path) -> None:
    """Clean up after a run that was killed outright (SIGKILL, power cut) mid-way; a
    temporary folder with a journal is left for ``adopt`` to resume from."""
    for tag, path in _stale(out_dir):
        if tag == "old" and not out_dir.exists():  # killed between the two renames of swap_in
            os.replace(path, out_dir)
        elif tag == "old" or not (path / JOURNAL).is_file():
            shutil.rmtree(path, ignore_errors=True)


def adopt(out_dir: Path, tmp: Path, header: dict) -> tuple[list[dict], int] | None:
    """Take over the temporary folder of a killed run of the same job, as ``tmp``: its
    journal's records and valid length. Other leftovers are removed."""
    found = None
    for tag, path in sorted(_stale(out_dir), key=lambda tp: -_mtime(tp[1] / JOURNAL)):
        got = Journal.read(path / JOURNAL, header) if tag == "tmp" and found is None else None
        if got is not None and _files_match(path, got[0]):
            try:
                os.replace(path, tmp)
                found = got
                continue
            except OSError:  # another run took it first
                pass
        shutil.rmtree(path, ignore_errors=True)
    return found


def _files_match(folder: Path, records: list[dict]) -> bool:
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


class Journal:
    """``journal.jsonl`` in the temporary folder: a header line (inputs, options and plan),
    then a line after a finished unit (``build._Build.record``) every ``prepare.JOURNAL_SECONDS`` or so, each
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
