"""`prepare` speed on three corpus shapes, as a ratio to the tokenizer's own speed.

    python -m distlm.bench.prepare_speed --shapes small-files,jsonl,huge --size-mb 200 \
        --workers 1,4,8,16 --out /tmp/prepare-speed [--work /tmp/prepare-corpora]

``--out`` receives only the tables (prepare_speed.md, .csv); the corpora go to ``--work``.

An absolute MB/s says little about a machine we do not control; the ratio to what one
process doing nothing but ``encode_ordinary`` reaches on the same documents, on the same
machine, in the same run, does. For each shape this builds a corpus of ``--size-mb`` MB
from the bundled Gutenberg texts (and the ``*.txt`` files under each ``--source`` folder),
measures that reference rate, then runs ``prepare`` once per worker count, each in a fresh
process (so each run's peak RSS is its own), and reports:

- MB/s: input bytes on disk / wall time of the ``prepare()`` call (from the first read to the
  renamed output folder; imports excluded, starting the worker processes included);
- ratio: (UTF-8 text bytes / wall) / (N x reference text bytes/s), N the worker count;
- ratio to the N-process reference: the same rate over what N processes doing nothing but
  ``encode_ordinary`` reach together (measured once per N, for 4 s): what the machine's cores
  give at once, where logical CPUs share physical cores or clocks drop under load;
- CPU ratio: the reference's CPU seconds per text byte over ``prepare``'s (parent and workers
  together): the work ``prepare`` adds to tokenizing, whatever else the machine runs;
- parent CPU s/MB: the ``prepare`` process's own user+system time per input MB;
- peak RSS of the parent (VmHWM) and of its largest worker (getrusage); both count the pages
  a forked worker shares with its parent.

Every run's output folder is checked to be byte-identical across worker counts (the sha256 of
each shard, as the manifest lists them).

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
import hashlib
import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "gutenberg" / "gutenberg.tar.xz"
SHAPES = ("small-files", "jsonl", "huge")
SMALL_FILE_BYTES = 1 << 20
JSONL_FILE_BYTES = 16 << 20
DOC_PARAGRAPHS = 20
POOL_DOCS = 4096
REFERENCE_SAMPLE = 16 << 20  # text bytes encoded for the reference rate (or the whole corpus if smaller)
CEILING_SECONDS = 4.0  # how long the N processes of the N-process reference encode
COLUMNS = ("shape", "workers", "input_mb", "wall_s", "mb_s", "ratio", "ceiling_ratio", "cpu_ratio",
           "parent_cpu_s_per_mb",
           "parent_rss_mb", "worker_rss_mb", "reference_mb_s", "identical")


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


def sample_pieces(path: str, sample: int = REFERENCE_SAMPLE) -> list[str]:
    """The first ``sample`` text bytes of ``path``'s documents, in the pieces ``prepare`` feeds
    the tokenizer (tokenizer.split_for_encoding)."""
    from distlm.data import tokenizer as tkz
    from distlm.corpus.sources import iter_documents
    tok, pieces, n = tkz.gpt2(), [], 0
    for _, text in iter_documents([path]):
        for piece in tkz.split_for_encoding(text, tok.chunk_chars):
            pieces.append(piece)
            n += len(piece.encode("utf-8"))
            if n >= sample:
                return pieces
    return pieces


def reference_rate(pieces: list[str], repeats: int = 2) -> tuple[float, float]:
    """Text bytes per second of this one process doing nothing but ``encode_ordinary`` (GPT-2)
    on ``pieces``, already in memory: per wall second and per CPU second, each the best of
    ``repeats`` passes (the machine may be shared)."""
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


def measure_one(path: str, workers: int, out: str) -> dict:
    """One ``prepare`` run in this (fresh) process: wall, CPU, peak RSS, output digest."""
    from distlm.corpus.prepare import prepare
    shutil.rmtree(out, ignore_errors=True)
    self0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    manifest = prepare([path], Path(out), workers=workers, progress=False)
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


def _run_in_fresh_process(path: str, workers: int, out: Path) -> dict:
    code = ("import json, sys; from distlm.bench.prepare_speed import measure_one; "
            "print('RESULT ' + json.dumps(measure_one(sys.argv[1], int(sys.argv[2]), sys.argv[3])))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                        *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-c", code, path, str(workers), str(out)], env=env,
                          capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"prepare of {path} with {workers} workers failed:\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def markdown(rows: list[dict]) -> str:
    head = ("| shape | workers | input MB | wall s | MB/s | ratio to N x ref | ratio to N-process ref | CPU ratio | "
            "parent CPU s/MB | parent RSS MB | worker RSS MB | ref MB/s (1 process) | same bytes |")
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['workers']} | {r['input_mb']:.0f} | {r['wall_s']:.1f} | {r['mb_s']:.1f} | "
                     f"{r['ratio']:.2f} | {r['ceiling_ratio']:.2f} | {r['cpu_ratio']:.2f} | "
                     f"{r['parent_cpu_s_per_mb']:.4f} | {r['parent_rss_mb']:.0f} | {r['worker_rss_mb']:.0f} | "
                     f"{r['reference_mb_s']:.1f} | {r['identical']} |")
    return "\n".join(lines) + "\n"


def machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?") \
        if os.path.exists("/proc/cpuinfo") else "?"
    import tiktoken
    cores = {(open(f"{d}/physical_package_id").read().strip(), open(f"{d}/core_id").read().strip())
             for d in map(str, Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology"))
             if os.path.exists(f"{d}/core_id")}
    return (f"{os.cpu_count()} logical CPUs on {len(cores) or '?'} physical cores ({cpu}), "
            f"python {sys.version.split()[0]}, tiktoken {tiktoken.__version__}, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m distlm.bench.prepare_speed", description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {', '.join(SHAPES)}")
    ap.add_argument("--size-mb", type=float, default=200,
                    help="MiB of input per corpus (2^20 bytes; the table counts MB of 10^6)")
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
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    counts = sorted({min(int(w), cores) for w in args.workers.split(",")})
    args.out.mkdir(parents=True, exist_ok=True)
    print(machine(), flush=True)
    t0 = time.perf_counter()
    work = args.work
    corpora = build_corpora(shapes, args.size_mb, work / "corpora", args.source, args.seed)
    print(f"corpora built in {time.perf_counter() - t0:.0f} s: {', '.join(corpora)}", flush=True)
    rows, ceilings = [], {}
    for name, path in corpora.items():
        pieces = sample_pieces(path)
        ref, ref_cpu = reference_rate(pieces)
        if not ceilings:  # the shapes share their paragraphs: the first one's documents stand for all
            ceilings = {w: parallel_reference(pieces, w) for w in counts}
            print("tokenizer alone, N processes at once (MB/s): "
                  + ", ".join(f"{w}: {c / 1e6:.1f} ({c / (w * ref):.2f} x N x 1 process)" for w, c in ceilings.items()),
                  flush=True)
        digests = set()
        for w in counts:
            r = _run_in_fresh_process(path, w, work / "prepared")
            digests.add(r["digest"])
            mb = r["input_bytes"] / 1e6
            rows.append({"shape": name, "workers": w, "input_mb": mb, "wall_s": r["wall_s"],
                         "mb_s": mb / r["wall_s"], "ratio": r["text_bytes"] / r["wall_s"] / (w * ref),
                         "ceiling_ratio": r["text_bytes"] / r["wall_s"] / ceilings[w],
                         "cpu_ratio": r["text_bytes"] / ref_cpu / (r["parent_cpu_s"] + r["workers_cpu_s"]),
                         "parent_cpu_s_per_mb": r["parent_cpu_s"] / mb, "parent_rss_mb": r["parent_rss_mb"],
                         "worker_rss_mb": r["worker_rss_mb"], "reference_mb_s": ref / 1e6,
                         "identical": "yes" if len(digests) == 1 else "NO"})
            print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    table = markdown(rows)
    print("\n" + table)
    (args.out / "prepare_speed.md").write_text(f"{machine()}\n\n{table}")
    with open(args.out / "prepare_speed.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({k: r[k] for k in COLUMNS} for r in rows)
    return 0 if all(r["identical"] == "yes" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
