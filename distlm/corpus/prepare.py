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

How the work is spread: ``units.plan_units`` cuts the inputs into units of about
``task_chars(corpus size)`` bytes (runs of small files, ranges of big ones). A worker process reads,
splits, hashes and tokenizes a whole unit by itself and writes its tokens to files in the
temporary folder; the parent only appends those files to the shards, in unit order. So
the parent does a constant amount of work per unit whatever the documents, no text goes
through a pipe, units of at most ``(2 * workers + 1) * TASK_CHARS`` input bytes are handed
out ahead of the one being appended (memory and temporary disk do not grow with the corpus;
the pieces of one huge document, whose split waits for its hash, are the exception: their
token files wait on disk), shards are written as units finish, and the output is the same
for any number of workers. The two fallbacks above need the whole corpus: they are applied at
the end, by rewriting the shards from the first moved token on (the tokens before it stay in place).

Resuming: the temporary folder keeps ``journal.jsonl``, a line after a finished unit about
every second (input files done, shards closed, the open shard's length, counts, the
candidates for the fallbacks). A run killed outright leaves the folder behind; the next run with the same
inputs, options and plan adopts it, truncates the open shard to the journaled length and
goes on from the next unit, giving the same bytes as an uninterrupted run.

Parts: ``shard=(I, N)`` prepares only the I-th of N contiguous runs of the inputs' units
(balanced by bytes; a big file is cut into several, so a few files still spread over N
parts) and skips the fallbacks; ``merge`` streams the N parts, in order, into
the folder that one ``prepare`` of all the inputs makes, byte for byte.

Re-running with the same inputs (paths, sizes, mtimes) and options is a no-op.
Anything else is built in a temporary folder beside ``out_dir`` and swapped in
with renames, so ``out_dir`` is always either the old complete data or the new; a
folder that has files but no manifest.json is never replaced.

This module holds the public entry points and their option checks; the rest is split by idea:
``split`` (the hash rule and fallbacks), ``shards`` (shard writing and rerouting),
``folder`` (fingerprint, manifest, swap-in), ``journal`` (resuming a killed run),
``build`` (the parent's text pipeline), ``pool`` (the tokenizer processes), ``worker`` (a worker's
unit), ``bpe`` (training bpe:N), ``merge`` (checking and summing parts) and ``bin_inputs``
(pre-tokenized .bin inputs).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from distlm.corpus.bin_inputs import prepare_bin_folder
from distlm.corpus.build import prepare_text
from distlm.corpus.folder import check_out_dir, inputs_fingerprint, swap_in, write_manifest
from distlm.corpus.journal import JOURNAL, adopt, recover_stale
from distlm.corpus.journal import Journal as _Journal  # noqa: F401 (tests patch it here)
from distlm.corpus.merge import feed_checked, load_parts, part_totals
from distlm.corpus.shards import Router, ShardWriter
from distlm.corpus.shards import ShardWriter as _ShardWriter  # noqa: F401 (tests patch it here)
from distlm.corpus.sources import input_files, plan_units, pretokenized_inputs, resolve_inputs, source_files
from distlm.corpus.split import SPLITS, TRAIN, VAL, fallback
from distlm.corpus.units import Unit
from distlm.data import MANIFEST, DataError, read_json, shards_present
from distlm.data import tokenizer as tkz
from distlm.host import usable_cores

# Settings read at call time from this module (tests and tools set them here).
CACHE_CHARS = 256 << 20  # bpe:N: corpora up to this size are read once to train it; bigger ones twice
POOL_MIN_BYTES = 1 << 20  # smaller inputs: starting worker processes costs more than it saves
# Input bytes per worker task: at most TASK_CHARS, at least TASK_MIN_CHARS, else the corpus over
# TASKS_PER_CORPUS. Small enough that all cores stay busy to the end: with one task per core at
# a time, the last wave leaves cores idle: at 16 workers, 8 MB tasks lost ~6% of a 600 MB corpus
# (75 tasks, 5 waves for 4.7 waves of work) and ~22% of a 200 MB one; 512 tasks make it ~2%. Big enough that the
# per-task costs (submitting it, opening and deleting its token files: ~1 ms) are noise next to
# tokenizing 1 MB (~100 ms), and a task's text and tokens stay a few tens of MB in a worker.
TASK_CHARS = 8 << 20
TASK_MIN_CHARS = 1 << 20
TASKS_PER_CORPUS = 512
PART_MIN_CHARS = 64 << 10  # --shard I/N: the smallest unit cut to spread a small corpus over the parts
# A journal line (and the fsyncs before it) at most this often: a kill loses at most this much work,
# and on a network file system, where an fsync can take tens of ms, syncing stays a small cost.
JOURNAL_SECONDS = 1.0


def prepare(inputs: list[str], out_dir: Path, *, tokenizer: str = "gpt2", val_fraction: float = 0.05,
            seed: int = 0, workers: int | None = None, separator: str | None = None, text_field: str = "text",
            shard_tokens: int = 100_000_000, progress: bool = True, shard: str | tuple[int, int] | None = None) -> dict:
    """Tokenize ``inputs`` (see ``distlm.corpus.sources``) into ``out_dir``; returns the manifest.

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
    recover_stale(out_dir)
    check_out_dir(out_dir)
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
        return prepare_bin_folder(pretok, out_dir, options)

    resolved = [(k, src) for k, raw in enumerate(inputs) for src in resolve_inputs([raw], out_dir)]
    per_source = [[(f, f.stat().st_size) for f in source_files(src)] for _, src in resolved]
    fingerprint = inputs_fingerprint([f for fs in per_source for f, _ in fs], options)
    total = sum(n for fs in per_source for _, n in fs)
    files = input_files([src for _, src in resolved])
    if part is None:
        units, owned, touched = plan_units(files, separator, task_chars(total)), range(len(resolved)), None
    else:
        units, owned, touched = _part_units(resolved, files, separator, total, *part)
    sources = [{"path": raw, "files": 0, "bytes": 0} for raw in inputs]
    for j in owned:
        sources[resolved[j][0]]["files"] += len(per_source[j])
        sources[resolved[j][0]]["bytes"] += sum(n for _, n in per_source[j])
    own = fingerprint if part is None else inputs_fingerprint(
        [f for j in touched for f, _ in per_source[j]], {**options, "shard": list(part)})
    old = read_json(out_dir / MANIFEST)
    if old and old.get("inputs_fingerprint") == own and shards_present(out_dir, old):
        print(f"{out_dir}: up to date")
        return old
    plan = hashlib.sha256(json.dumps([u.as_list() for u in units]).encode()).hexdigest()
    header = {"journal": 1, "inputs": own, "plan": plan, "units": len(units)}
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    keep = False
    try:
        resumed = adopt(out_dir, tmp, header)
        if resumed is None:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        workers = workers or _default_workers(sum(u.size for u in units))
        body = prepare_text(inputs, out_dir, tmp, options, units, len(files), header, resumed, workers, progress,
                            part, journal_seconds=JOURNAL_SECONDS, cache_chars=CACHE_CHARS,
                            ahead_bytes=(2 * workers + 1) * TASK_CHARS)
        if part is not None:
            body["part"] = {"index": part[0], "count": part[1], "corpus_fingerprint": fingerprint,
                            **body.pop("candidates")}
        manifest = write_manifest(tmp, body, sources=sources, fingerprint=own, options=options, seed=seed,
                                  val_fraction=val_fraction)
        (tmp / JOURNAL).unlink()
        swap_in(tmp, out_dir)
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
    recover_stale(out_dir)
    check_out_dir(out_dir)
    loaded = load_parts([Path(p) for p in parts])
    ref = loaded[0][1]
    fingerprint, options = ref["part"]["corpus_fingerprint"], ref["options"]
    old = read_json(out_dir / MANIFEST)
    if old and "part" not in old and old.get("inputs_fingerprint") == fingerprint and shards_present(out_dir, old):
        print(f"{out_dir}: up to date")
        return old
    totals = part_totals(loaded)
    if sum(totals["docs"]) == 0:
        raise DataError(f"no documents in {', '.join(s['path'] for s in totals['sources'])} "
                        f"({totals['stats'].summary()})")
    method, home, moves, docs = fallback(totals["docs"], totals["tokens"], totals["min_train"], totals["max_val"],
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
        writers = [ShardWriter(tmp, s, ref["dtype"], options["shard_tokens"]) for s in SPLITS]
        with tqdm(total=sum(totals["tokens"]) * itemsize, unit="B", unit_scale=True, desc="merging",
                  disable=None if progress else True) as bar:
            for split in (TRAIN, VAL):
                router = Router(writers, split, 0, moves if home == split else [])
                for path, m in loaded:
                    for shard in m["splits"][SPLITS[split]]["shards"]:
                        feed_checked(path / shard["file"], shard["sha256"], router, bar)
        splits = {name: w.finish(docs[i]) for i, (name, w) in enumerate(zip(SPLITS, writers))}
        body = {"tokenizer": ref["tokenizer"], "dtype": ref["dtype"], "split_method": method, "splits": splits,
                "stats": {**totals["stats"].as_dict(), "chars": totals["chars"], "text_bytes": totals["bytes"]}}
        manifest = write_manifest(tmp, body, sources=totals["sources"], fingerprint=fingerprint, options=options,
                                  seed=ref["seed"], val_fraction=ref["val_fraction"])
        swap_in(tmp, out_dir)
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


def _part_units(resolved: list, files: list, separator: str | None, total: int, index: int,
                count: int) -> tuple[list[Unit], list[int], list[int]]:
    """Part ``index`` of ``count``: (its units, the sources it accounts for, the sources it reads).

    The whole corpus is cut into units (whole small files, ranges of big ones: distlm/corpus/
    units.py), at least 8 a part where the files allow, so that the parts come out within
    about an eighth of each other; each unit goes to the part in which its middle byte falls
    when all the units' bytes, in order, are cut into ``count`` equal runs (the pieces of one
    long document go with it). Contiguous runs of units, so the parts one after another are
    the inputs in order, as ``merge`` needs, however few files there are. A source is
    accounted for by the part that finishes its last file. DataError naming the part where it
    would be empty (the inputs cut into fewer units than parts: one compressed file is one)."""
    target = min(task_chars(total), max(PART_MIN_CHARS, total // (8 * count)))
    units = plan_units(files, separator, target)
    blocks: list[list[Unit]] = []
    for u in units:
        if u.kind == "piece" and blocks:
            blocks[-1].append(u)
        else:
            blocks.append([u])
    mine, pos, whole = [], 0, sum(u.size for u in units)
    for block in blocks:
        size = sum(u.size for u in block)
        at = (2 * pos + size) * count // (2 * whole) if whole else len(mine) * count // len(blocks)
        if min(at, count - 1) == index:
            mine += block
        pos += size
    if not mine:
        biggest = max((sum(u.size for u in b) for b in blocks), default=0)
        raise DataError(f"--shard {index}/{count}: part {index} would be empty: the inputs ({total:,} bytes) make "
                        f"only {len(blocks)} unit(s) of work, the largest {biggest:,} bytes (small files are grouped "
                        f"up to {target:,} bytes; a compressed or Arrow file is read whole); use at most "
                        f"{len(blocks)} part{'s' if len(blocks) > 1 else ''}")
    counts = [len(input_files([src])) for _, src in resolved]  # each source's input files, in order
    starts = [sum(counts[:j]) for j in range(len(counts))]
    finished = {f for u in mine for f in range(u.first, u.files_done())}
    reads = {f for u in mine for f in range(u.first, u.first + len(u.paths))}
    # a source with no file to read (an empty HF folder) is part 0's to account for
    owned = [j for j, (a, n) in enumerate(zip(starts, counts)) if (a + n - 1 in finished if n else index == 0)]
    touched = [j for j, (a, n) in enumerate(zip(starts, counts)) if any(a <= f < a + n for f in reads)]
    return mine, owned, touched


def task_chars(total_bytes: int) -> int:
    """Input bytes per worker task for a corpus of ``total_bytes`` (see TASK_CHARS). Depends on
    the corpus alone, not on the worker count, so a killed run resumes with any number of workers."""
    return min(TASK_CHARS, max(TASK_MIN_CHARS, total_bytes // TASKS_PER_CORPUS))


def _default_workers(disk_bytes: int) -> int:
    if disk_bytes < POOL_MIN_BYTES:
        return 1
    return usable_cores()
