"""benchmarks/tools/prepare_speed.py end to end at a tiny size."""
import os
import sys
from pathlib import Path

# The lab's tools import as top-level modules, this checkout's distlm first. No conftest.py here:
# beside tests/conftest.py it would take the module name "conftest" that the product's tests import.
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks" / "tools")]
os.environ.setdefault("OMP_NUM_THREADS", "1")  # as in tests/conftest.py


def test_benchmark_writes_its_table(tmp_path, monkeypatch):
    """The speed benchmark end to end at a tiny size: a row per worker count, the same bytes at
    each, and the table as markdown and CSV."""
    import csv

    import prepare_speed
    monkeypatch.setattr(prepare_speed, "CEILING_SECONDS", 0.3)
    monkeypatch.setattr(prepare_speed, "REFERENCE_SAMPLE", 1 << 18)
    rc = prepare_speed.main(["--shapes", "small-files", "--size-mb", "0.3", "--workers", "1,2,64",
                             "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")])
    assert rc == 0
    rows = list(csv.DictReader(open(tmp_path / "out" / "prepare_speed.csv")))
    cores = len(__import__("os").sched_getaffinity(0))
    assert [int(r["workers"]) for r in rows] == sorted({1, min(2, cores), min(64, cores)})
    assert all(r["identical"] == "yes" and float(r["mb_s"]) > 0 and float(r["ratio"]) > 0 for r in rows)
    assert "| small-files | 1 |" in (tmp_path / "out" / "prepare_speed.md").read_text()
    assert not (tmp_path / "out" / "corpora").exists()  # GBs of corpora stay in --work


def test_benchmark_sizes_each_run_by_its_workers(tmp_path, monkeypatch):
    """--mb-per-worker: the run with N workers reads N times as much (a prefix of the 1 MiB files,
    or a one-file corpus of that size), the reference is taken before every run and after the last,
    and "same bytes" compares nothing."""
    import csv

    import prepare_speed
    monkeypatch.setattr(prepare_speed, "CEILING_SECONDS", 0.3)
    monkeypatch.setattr(prepare_speed, "REFERENCE_SAMPLE", 1 << 17)
    passes = []
    real = prepare_speed.reference_rate
    monkeypatch.setattr(prepare_speed, "reference_rate", lambda pieces: passes.append(1) or real(pieces))
    work = tmp_path / "work"
    assert prepare_speed.main(["--shapes", "small-files,huge", "--mb-per-worker", "1", "--workers", "1,2",
                               "--out", str(tmp_path / "out"), "--work", str(work)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "out" / "prepare_speed.csv")))
    assert [(r["shape"], r["workers"]) for r in rows] == [(s, w) for s in ("small-files", "huge-txt", "huge-jsonl")
                                                          for w in ("1", "2")]
    size = {(r["shape"], r["workers"]): float(r["input_mb"]) for r in rows}
    for shape in ("small-files", "huge-txt", "huge-jsonl"):
        assert 1.8 < size[shape, "2"] / size[shape, "1"] < 2.2, (shape, size)
    assert all(r["identical"] == "n/a" and float(r["ratio"]) > 0 for r in rows)
    assert len(passes) == 3 * 3  # each shape: before each of its 2 runs, and once after
    assert (work / "corpora" / "huge-txt-1MiB" / "00000.txt").stat().st_size >= 1 << 20
    assert "--mb-per-worker 1" in (tmp_path / "out" / "prepare_speed.md").read_text()
