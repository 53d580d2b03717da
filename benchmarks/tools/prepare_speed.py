"""`prepare` speed on three corpus shapes, as a ratio to the tokenizer's own speed.

    python benchmarks/tools/prepare_speed.py --shapes small-files,jsonl,huge --mb-per-worker 40 \
        --workers 1,4,8,16 --out /tmp/prepare-speed [--work /tmp/prepare-corpora]
    python benchmarks/tools/prepare_speed.py ... --size-mb 200    (one corpus size for every worker count)

``--out`` receives only the tables (prepare_speed.md, .csv); the corpora go to ``--work``.

An absolute MB/s says little about a machine we do not control; the ratio to what one
process doing nothing but ``encode_ordinary`` reaches on the same documents, on the same
machine, in the same run, does. For each shape this builds a corpus from the bundled
Gutenberg texts (and the ``*.txt`` files under each ``--source`` folder), then runs
``prepare`` once per worker count, each in a fresh process (so each run's peak RSS is its
own), and measures the reference rate again just before each run and once after the last.

Corpus size: ``--size-mb`` MB for every worker count, or ``--mb-per-worker`` M: N x M MB for
N workers (a prefix of the files; for the one-file shapes a file of that size), so that every
run lasts about as long and the runs with many workers are not too short to measure (starting
the workers and the last wave of tasks weigh at a few seconds). Rows of different sizes are
different corpora: "same bytes" then compares nothing and says "n/a".

The reference of a shape is the median of its passes (each ``REFERENCE_SAMPLE`` text bytes,
about a second): one process's speed moves by tens of percent within a run on a shared or
virtual machine (clock, neighbours), and a single pass taken at another moment than the runs
made the ratios move as much. "ref spread" gives (max - min) / median of the passes.

The table has:

- MB/s: input bytes on disk / wall time of the ``prepare()`` call (from the first read to the
  renamed output folder; imports excluded, starting the worker processes included);
- ratio: (UTF-8 text bytes / wall) / (N x reference text bytes/s), N the worker count;
- ratio to the N-process reference: the same rate over what N processes doing nothing but
  ``encode_ordinary`` reach together (measured for each N at the start and at the end, 3 s each,
  the mean): what the machine's cores give at once, where logical CPUs share physical cores or
  clocks drop under load;
- CPU ratio: the reference's CPU seconds per text byte over ``prepare``'s (parent and workers
  together): the work ``prepare`` adds to tokenizing, whatever else the machine runs;
- parent CPU s/MB: the ``prepare`` process's own user+system time per input MB;
- peak RSS of the parent (VmHWM) and of its largest worker (getrusage); both count the pages
  a forked worker shares with its parent.

With ``--size-mb``, every run's output folder is checked to be byte-identical across worker
counts (the sha256 of each shard, as the manifest lists them).

Shapes (each ``--size-mb`` MB):

- ``small-files``: plain-text files of about 1 MB, one document each;
- ``jsonl``: JSONL files of about 16 MB, documents of about 20 paragraphs; with pyarrow, the
  same documents as Parquet too (row ``parquet``);
- ``huge``: one ``.txt`` file (one document: no separator) and one ``.jsonl`` file.

Documents are drawn from a pool of 4096 documents of 20 random paragraphs each, so a big corpus
repeats documents (the tokenizer does not care; repeated documents land in the same split).

The corpus is written once per ``--out`` and size and reused; it is in the page cache when
``prepare`` reads it (on a machine with less free memory than the corpus it is not).
"""
from __future__ import annotations

import argparse
import csv
import functools
import hashlib
import json
import os
import random
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from distlm.host import usable_cores  # noqa: E402

ASSETS = ROOT / "distlm" / "assets" / "gutenberg" / "gutenberg.tar.xz"
SHAPES = ("small-files", "jsonl", "huge")
SMALL_FILE_BYTES = 1 << 20
JSONL_FILE_BYTES = 16 << 20
DOC_PARAGRAPHS = 20
POOL_DOCS = 4096
REFERENCE_SAMPLE = 8 << 20  # text bytes a reference pass encodes (or the whole corpus if smaller)
CEILING_SECONDS = 3.0  # how long the N processes of the N-process reference encode, each time
COLUMNS = ("shape", "workers", "input_mb", "wall_s", "mb_s", "ratio", "ceiling_ratio", "cpu_ratio",
           "parent_cpu_s_per_mb",
           "parent_rss_mb", "worker_rss_mb", "reference_mb_s", "reference_spread", "identical")


def paragraphs(sources: list[Path]) -> list[str]:
    """The paragraphs (over 20 characters) of the bundled Gutenberg books and of the ``*.txt``
    files under ``sources``, in a fixed order."""
    texts = []
    with tarfile.open(ASSETS) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if member.isfile() and not member.name.rsplit("/", 1)[-1].startswith("."):
                texts.append(tar.extractfile(member).read().decode("utf-8", "replace"))
    for folder in sources:
        texts += [p.read_text("utf-8", "replace") for p in sorted(Path(folder).rglob("*.txt"))]
    out = []
    for text in texts:
        out += [p.strip() for p in re.split(r"\n\s*\n", text.replace("\r\n", "\n")) if len(p.strip()) > 20]
    return out


class _Documents:
    """Documents drawn at random from a pool of ``POOL_DOCS`` documents of ``DOC_PARAGRAPHS``
    random paragraphs each (a pool, so that writing GBs is quick): the same sequence for the
    same paragraphs and seed. Each as (UTF-8 text, its JSONL line)."""

    def __init__(self, paras: list[str], seed: int) -> None:
        rng = random.Random(seed)
        self.pool = []
        for _ in range(POOL_DOCS):
            text = "\n\n".join(rng.choices(paras, k=DOC_PARAGRAPHS))
            self.pool.append((text.encode("utf-8"), (json.dumps({"text": text}) + "\n").encode("utf-8")))
        self.rng = rng

    def draw(self) -> tuple[bytes, bytes]:
        return self.pool[self.rng.randrange(len(self.pool))]


def build_corpora(shapes: list[str], size_mb: float, folder: Path, sources: list[Path], seed: int = 0, *,
                  small_file_bytes: int = SMALL_FILE_BYTES, jsonl_file_bytes: int = JSONL_FILE_BYTES) -> dict:
    """Write each shape's corpus (``size_mb`` MB each) under ``folder``; {row name: input path}.
    Deterministic: the same paragraphs, size, seed and file sizes give the same bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    stamp = folder / "corpora.json"
    key = {"shapes": shapes, "size_mb": size_mb, "sources": [str(s) for s in sources], "seed": seed,
           "files": [small_file_bytes, jsonl_file_bytes]}
    old = json.loads(stamp.read_text()) if stamp.is_file() else None
    if old and old["key"] == key:
        return old["rows"]
    stamp.unlink(missing_ok=True)
    paras, size, rows = paragraphs(sources), int(size_mb * (1 << 20)), {}
    for shape in shapes:
        docs = _Documents(paras, seed)
        if shape == "small-files":
            rows[shape] = _write_files(folder / shape, docs, size, small_file_bytes, ".txt")
        elif shape == "jsonl":
            rows["jsonl"] = _write_files(folder / "jsonl", docs, size, jsonl_file_bytes, ".jsonl")
            if _has_pyarrow():
                rows["parquet"] = _write_parquet(folder / "parquet", folder / "jsonl")
        elif shape == "huge":
            rows["huge-txt"] = _write_files(folder / "huge-txt", docs, size, size, ".txt") + "/00000.txt"
            rows["huge-jsonl"] = _write_files(folder / "huge-jsonl", docs, size, size, ".jsonl") + "/00000.jsonl"
        else:
            raise SystemExit(f"--shapes: unknown shape {shape!r} (choose from {', '.join(SHAPES)})")
    stamp.write_text(json.dumps({"key": key, "rows": rows}))
    return rows


def _write_files(folder: Path, docs: _Documents, size: int, file_bytes: int, suffix: str) -> str:
    """Files of about ``file_bytes`` each, ``size`` bytes in all: a .txt file is one document
    (drawn documents joined by blank lines), a .jsonl file one document a line."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    total = i = 0
    while total < size:
        with open(folder / f"{i:05d}{suffix}", "wb") as fh:
            n = 0
            while n < min(file_bytes, size - total):
                text, line = docs.draw()
                data = line if suffix == ".jsonl" else (b"\n\n" if n else b"") + text
                fh.write(data)
                n += len(data)
        total, i = total + n, i + 1
    return str(folder)


def _has_pyarrow() -> bool:
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        return False
    return True


def _write_parquet(folder: Path, jsonl: Path) -> str:
    """The JSONL files' documents as Parquet files, one for each, row groups of 128 rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for path in sorted(jsonl.glob("*.jsonl")):
        with open(path, "rb") as fh:
            texts = [json.loads(line)["text"] for line in fh]
        pq.write_table(pa.table({"text": texts}), folder / f"{path.stem}.parquet", row_group_size=128)
    return str(folder)


def sized_inputs(corpora: dict, sizes_mb: list[float], folder: Path, sources: list[Path], seed: int = 0) -> dict:
    """{row: {size: [input paths]}} for each size (MiB) of ``sizes_mb`` from ``build_corpora``'s
    rows at the largest size: the folders' first files up to that size (Parquet: as many files as
    the JSONL rows take, the same documents), and for the one-file rows a file of that size, written
    here once (the same documents as the largest file's beginning)."""
    out: dict = {}
    files = {name: sorted(Path(path).iterdir()) for name, path in corpora.items() if Path(path).is_dir()}
    for name, path in corpora.items():
        out[name] = {}
        for mb in sizes_mb:
            target = int(mb * (1 << 20))
            if name in files:
                base = "jsonl" if name == "parquet" and "jsonl" in files else name
                total, take = 0, 0
                for f in files[base]:
                    if total >= target:
                        break
                    total, take = total + f.stat().st_size, take + 1
                out[name][mb] = [str(f) for f in files[name][:take]]
            elif mb == max(sizes_mb):
                out[name][mb] = [path]
            else:
                out[name][mb] = [_sized_file(Path(path), target, folder / f"{name}-{mb:g}MiB", sources, seed)]
    return out


def _sized_file(big: Path, size: int, folder: Path, sources: list[Path], seed: int) -> str:
    """``big``'s first ``size`` bytes' worth of documents as a file of its own (kept for the next run)."""
    path, stamp = folder / big.name, json.dumps({"sources": [str(s) for s in sources], "seed": seed, "size": size})
    if path.is_file() and (folder / "key.json").is_file() and (folder / "key.json").read_text() == stamp:
        return str(path)
    shutil.rmtree(folder, ignore_errors=True)
    _write_files(folder, _Documents(_paragraphs_cached(tuple(sources)), seed), size, size, big.suffix)
    (folder / "key.json").write_text(stamp)
    return str(path)


@functools.lru_cache(maxsize=1)
def _paragraphs_cached(sources: tuple) -> list[str]:
    return paragraphs(list(sources))


def sample_pieces(inputs: str | list[str], sample: int = REFERENCE_SAMPLE) -> list[str]:
    """The first ``sample`` text bytes of the documents of ``inputs`` (a path or a list), in the
    pieces ``prepare`` feeds the tokenizer (tokenizer.split_for_encoding)."""
    from distlm.corpus.sources import iter_documents
    from distlm.data import tokenizer as tkz
    tok, pieces, n = tkz.gpt2(), [], 0
    for _, text in iter_documents([inputs] if isinstance(inputs, str) else list(inputs)):
        for piece in tkz.split_for_encoding(text, tok.chunk_chars):
            pieces.append(piece)
            n += len(piece.encode("utf-8"))
            if n >= sample:
                return pieces
    return pieces


def reference_rate(pieces: list[str], repeats: int = 1) -> tuple[float, float]:
    """Text bytes per second of this one process doing nothing but ``encode_ordinary`` (GPT-2)
    on ``pieces``, already in memory: per wall second and per CPU second, each the best of
    ``repeats`` passes."""
    from distlm.data import tokenizer as tkz
    enc, n = tkz.gpt2().encoding, sum(len(p.encode("utf-8")) for p in pieces)
    wall = cpu = float("inf")
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        for piece in pieces:
            enc.encode_ordinary(piece)
        wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
    return n / wall, n / cpu


def _encode_for(pieces: list[str], seconds: float, barrier, results) -> None:
    from distlm.data import tokenizer as tkz
    enc, n, i = tkz.gpt2().encoding, 0, 0
    barrier.wait()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        enc.encode_ordinary(pieces[i % len(pieces)])
        n, i = n + len(pieces[i % len(pieces)].encode("utf-8")), i + 1
    results.put(n / (time.perf_counter() - t0))


def parallel_reference(pieces: list[str], processes: int, seconds: float | None = None) -> float:
    """Text bytes/s of ``processes`` processes at once doing nothing but ``encode_ordinary``:
    what the machine's cores give together (shared cores, clocks that drop with load)."""
    import multiprocessing as mp
    from distlm.data import tokenizer as tkz
    tkz.gpt2().encoding  # noqa: B018 - built once, inherited by the forked processes
    seconds = CEILING_SECONDS if seconds is None else seconds
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_encode_for, args=(pieces, seconds, barrier, results)) for _ in range(processes)]
    for p in procs:
        p.start()
    total = sum(results.get() for _ in procs)
    for p in procs:
        p.join()
    return total


def measure_one(inputs: str | list[str], workers: int, out: str) -> dict:
    """One ``prepare`` run in this (fresh) process: wall, CPU, peak RSS, output digest."""
    from distlm.corpus.prepare import prepare
    shutil.rmtree(out, ignore_errors=True)
    self0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    manifest = prepare([inputs] if isinstance(inputs, str) else list(inputs), Path(out), workers=workers,
                       progress=False)
    wall = time.perf_counter() - t0
    self1 = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    shards = [s["sha256"] for split in ("train", "val") for s in manifest["splits"][split]["shards"]]
    shutil.rmtree(out, ignore_errors=True)
    return {"wall_s": wall, "text_bytes": manifest["stats"]["text_bytes"],
            "input_bytes": sum(s["bytes"] for s in manifest["sources"]),
            "parent_cpu_s": (self1.ru_utime + self1.ru_stime) - (self0.ru_utime + self0.ru_stime),
            "workers_cpu_s": kids.ru_utime + kids.ru_stime,
            "parent_rss_mb": _peak_rss_mb(self1), "worker_rss_mb": kids.ru_maxrss / 1024,
            "digest": hashlib.sha256("".join(shards).encode()).hexdigest()}


def _peak_rss_mb(usage) -> float:
    """This process's peak RSS. Linux's VmHWM, not getrusage, whose maximum carries over the
    RSS of the process that exec'd this one (the benchmark, holding its corpora)."""
    try:
        with open("/proc/self/status") as fh:
            return next(int(ln.split()[1]) for ln in fh if ln.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return usage.ru_maxrss / 1024


def in_fresh_process(target: str, *args) -> dict:
    """``target`` ("module:function") called with ``args`` (JSON values) in a fresh Python process,
    this checkout's distlm and these tools first on its path, so that each run's peak memory and
    imports are its own; its JSON result."""
    code = ("import importlib, json, sys; module, name = sys.argv[1].split(':'); "
            "print('RESULT ' + json.dumps(getattr(importlib.import_module(module), name)(*json.loads(sys.argv[2]))))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(Path(__file__).resolve().parent),
                                                        *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-c", code, target, json.dumps(args)], env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        inputs, workers = args[0], args[1]
        raise SystemExit(f"prepare of {inputs[0]}... with {workers} workers failed:\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def markdown(rows: list[dict]) -> str:
    head = ("| shape | workers | input MB | wall s | MB/s | ratio to N x ref | ratio to N-process ref | CPU ratio | "
            "parent CPU s/MB | parent RSS MB | worker RSS MB | ref MB/s (1 process) | ref spread | same bytes |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['workers']} | {r['input_mb']:.0f} | {r['wall_s']:.1f} | {r['mb_s']:.1f} | "
                     f"{r['ratio']:.2f} | {r['ceiling_ratio']:.2f} | {r['cpu_ratio']:.2f} | "
                     f"{r['parent_cpu_s_per_mb']:.4f} | {r['parent_rss_mb']:.0f} | {r['worker_rss_mb']:.0f} | "
                     f"{r['reference_mb_s']:.1f} | {r['reference_spread']:.0%} | {r['identical']} |")
    return "\n".join(lines) + "\n"


def machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?") \
        if os.path.exists("/proc/cpuinfo") else "?"
    import tiktoken
    cores = {(open(f"{d}/physical_package_id").read().strip(), open(f"{d}/core_id").read().strip())
             for d in map(str, Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology"))
             if os.path.exists(f"{d}/core_id")}
    try:
        import orjson
        json_parser = f"orjson {orjson.__version__}"
    except ImportError:
        json_parser = "no orjson (JSONL through json)"
    return (f"{os.cpu_count()} logical CPUs on {len(cores) or '?'} physical cores ({cpu}), "
            f"python {sys.version.split()[0]}, tiktoken {tiktoken.__version__}, {json_parser}, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/tools/prepare_speed.py", description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {', '.join(SHAPES)}")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--size-mb", type=float, default=None,
                      help="MiB of input per corpus (2^20 bytes; the table counts MB of 10^6), the same for every "
                           "worker count (default 200 unless --mb-per-worker)")
    size.add_argument("--mb-per-worker", type=float, default=None,
                      help="N x this many MiB of input for the run with N workers: each run lasts about as long")
    ap.add_argument("--workers", default="1,4,8,16", help="worker counts (capped to the cores)")
    ap.add_argument("--out", type=Path, required=True, help="folder for the tables")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "distlm-prepare-speed",
                    help="folder for the corpora (kept for the next run of the same size) and prepared outputs: "
                         "GBs, so not under --out (default: %(default)s)")
    ap.add_argument("--source", type=Path, action="append", default=[],
                    help="a folder whose *.txt files add paragraphs (repeatable); the bundled books always count")
    ap.add_argument("--seed", type=int, default=0, help="for drawing paragraphs into documents")
    args = ap.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    cores = usable_cores()
    counts = sorted({min(int(w), cores) for w in args.workers.split(",")})
    args.out.mkdir(parents=True, exist_ok=True)
    print(machine(), flush=True)
    t0 = time.perf_counter()
    work = args.work
    sizes = {w: (args.mb_per_worker * w if args.mb_per_worker else args.size_mb or 200.0) for w in counts}
    corpora = build_corpora(shapes, max(sizes.values()), work / "corpora", args.source, args.seed)
    inputs = sized_inputs(corpora, sorted(set(sizes.values())), work / "corpora", args.source, args.seed)
    print(f"corpora built in {time.perf_counter() - t0:.0f} s: {', '.join(corpora)}", flush=True)
    measured, ceilings, last_pieces = [], {}, None
    for name in corpora:
        pieces = last_pieces = sample_pieces(inputs[name][sizes[counts[0]]])
        if not ceilings:  # the shapes share their paragraphs: the first one's documents stand for all
            ceilings = {w: parallel_reference(pieces, w) for w in counts}
        refs, runs = [], []
        for w in counts:
            refs.append(reference_rate(pieces))  # just before the run: the machine as the run finds it
            runs.append((w, in_fresh_process("prepare_speed:measure_one", inputs[name][sizes[w]], w,
                                               str(work / "prepared"))))
            print(f"  {name}, {w} workers: {runs[-1][1]['input_bytes'] / 1e6:.0f} MB in {runs[-1][1]['wall_s']:.1f} s; "
                  f"the 1-process reference just before: {refs[-1][0] / 1e6:.2f} MB/s", flush=True)
        refs.append(reference_rate(pieces))
        measured.append((name, refs, runs))
    if last_pieces is not None:  # the N-process reference again at the end; the mean of both
        ceilings = {w: (c + parallel_reference(last_pieces, w)) / 2 for w, c in ceilings.items()}
    rows = []
    for name, refs, runs in measured:
        ref, ref_cpu = statistics.median(r[0] for r in refs), statistics.median(r[1] for r in refs)
        spread = (max(r[0] for r in refs) - min(r[0] for r in refs)) / ref
        digests = {r["digest"] for _, r in runs}
        same = "n/a" if len(set(sizes.values())) > 1 else "yes" if len(digests) == 1 else "NO"
        for w, r in runs:
            mb = r["input_bytes"] / 1e6
            rows.append({"shape": name, "workers": w, "input_mb": mb, "wall_s": r["wall_s"],
                         "mb_s": mb / r["wall_s"], "ratio": r["text_bytes"] / r["wall_s"] / (w * ref),
                         "ceiling_ratio": r["text_bytes"] / r["wall_s"] / ceilings[w],
                         "cpu_ratio": r["text_bytes"] / ref_cpu / (r["parent_cpu_s"] + r["workers_cpu_s"]),
                         "parent_cpu_s_per_mb": r["parent_cpu_s"] / mb, "parent_rss_mb": r["parent_rss_mb"],
                         "worker_rss_mb": r["worker_rss_mb"], "reference_mb_s": ref / 1e6,
                         "reference_spread": spread, "identical": same})
    print("tokenizer alone, N processes at once (MB/s, mean of the start and the end): "
          + ", ".join(f"{w}: {c / 1e6:.1f}" for w, c in ceilings.items()), flush=True)
    table = markdown(rows)
    print("\n" + table)
    command = "python benchmarks/tools/prepare_speed.py " + " ".join(sys.argv[1:] if argv is None else argv)
    (args.out / "prepare_speed.md").write_text(f"{machine()}\n\n`{command}`\n\n{table}")
    with open(args.out / "prepare_speed.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({k: r[k] for k in COLUMNS} for r in rows)
    return 0 if all(r["identical"] != "NO" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
