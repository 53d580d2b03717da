"""The prepare timeline (benchmarks/tools/prepare_timeline.py): its figures add up, it sees every task,
and wrapping the workers' entry point changes no byte of the output."""
import os
import sys
from pathlib import Path

# The lab's tools import as top-level modules, this checkout's distlm first. No conftest.py here:
# beside tests/conftest.py it would take the module name "conftest" that the product's tests import.
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks" / "tools")]
os.environ.setdefault("OMP_NUM_THREADS", "1")  # as in tests/conftest.py

import json  # noqa: E402

import pytest  # noqa: E402

import prepare_timeline as tl  # noqa: E402
from distlm.corpus import prepare as prep  # noqa: E402
from distlm.corpus import sources  # noqa: E402


def test_summary_of_a_known_timeline():
    """Two workers over a 10 s call: worker A busy 1-4 and 5-9, worker B busy 2-6 (then idle for good)."""
    run = {"workers": 2, "parent_pid": 1, "start": 100.0, "end": 110.0, "input_bytes": 5e6, "parent_cpu_s": 1.0,
           "parent_cpu": {"appending shards (copy + sha256)": 1.0},
           "tasks": [{"pid": 7, "unit": 0, "kind": "lines", "bytes": 1, "start": 101.0, "end": 104.0,
                      "process_start": 100.5},
                     {"pid": 8, "unit": 1, "kind": "lines", "bytes": 2, "start": 102.0, "end": 106.0,
                      "process_start": 100.8},
                     {"pid": 7, "unit": 2, "kind": "lines", "bytes": 3, "start": 105.0, "end": 109.0,
                      "process_start": 100.5}]}
    s = tl.summarize(run)
    assert s["wall_s"] == 10.0 and s["busy_s"] == 11.0 and s["utilisation"] == pytest.approx(0.55)
    assert s["workers_started_s"] == pytest.approx(0.8) and s["all_busy_s"] == 2.0
    assert (s["idle_before_first_task_s"], s["idle_between_tasks_s"], s["idle_after_last_task_s"]) == (3.0, 1.0, 5.0)
    assert s["tail_s"] == 3.0 and s["finish_s"] == 1.0
    assert s["tasks"] == 3 and s["task_bytes"] == 6 and s["kinds"]["lines"]["max_s"] == 4.0
    assert "utilisation 0.55" in tl.report("x", s)
    assert tl.chart(run, columns=10).splitlines()[:2] == ["  w0  | ### #### |", "  w1  |  ####    |"]


@pytest.fixture
def corpus(tmp_path):
    """A JSONL file and a one-document text file, both cut into many tasks."""
    folder = tmp_path / "in"
    folder.mkdir()
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    lines = [json.dumps({"text": " ".join(words[(i + j) % 10] for j in range(40 + i % 30))}) for i in range(600)]
    (folder / "a.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "b.txt").write_text(" ".join(words[i % 7] + str(i % 13) for i in range(8000)))
    return folder


def test_timeline_adds_up_and_changes_no_byte(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "TASK_CHARS", 8000)
    monkeypatch.setattr(prep, "TASK_MIN_CHARS", 8000)
    workers = 2
    run = tl.profile_prepare([str(corpus)], workers, tmp_path / "timed", tmp_path / "trace")
    plain = prep.prepare([str(corpus)], tmp_path / "plain", workers=workers, progress=False)
    assert run["shards"] == [s["sha256"] for split in ("train", "val") for s in plain["splits"][split]["shards"]]

    files = sources.input_files(sources.resolve_inputs([str(corpus)]))
    total = sum(p.stat().st_size for p in corpus.iterdir())
    units = sources.plan_units(files, None, prep.task_chars(total))
    assert len(units) > 2 * workers and {u.kind for u in units} >= {"lines", "piece", "hash"}
    assert sorted(t["unit"] for t in run["tasks"]) == list(range(len(units)))  # every task, once
    assert len({t["pid"] for t in run["tasks"]}) <= workers

    s = tl.summarize(run)
    n_wall = workers * s["wall_s"]
    assert all(run["start"] <= t["start"] <= t["end"] <= run["end"] for t in run["tasks"])
    assert 0 < s["busy_s"] <= n_wall
    idle = s["idle_before_first_task_s"] + s["idle_between_tasks_s"] + s["idle_after_last_task_s"]
    assert s["busy_s"] + idle == pytest.approx(n_wall)
    assert 0 <= s["all_busy_s"] and s["tail_s"] + s["finish_s"] <= s["wall_s"]
    assert sum(s["parent_cpu"].values()) == pytest.approx(s["parent_cpu_s"])
    assert s["parent_cpu"]["appending shards (copy + sha256)"] > 0
    assert s["parent_cpu"]["planning units"] > 0


def test_command_prints_the_profile(tmp_path, capsys):
    """The command as the results page gives it, scaled down: one row, a fresh process."""
    assert tl.main(["--rows", "huge-txt", "--workers", "2", "--mb-per-worker", "1.5", "--work", str(tmp_path / "w"),
                    "--json", str(tmp_path / "t.json"), "--chart"]) == 0
    out = capsys.readouterr().out
    assert "huge-txt:" in out and "utilisation" in out and "parent CPU" in out
    assert sum(line.startswith("  w") for line in out.splitlines()) == 2  # a chart line a worker
    s = json.loads((tmp_path / "t.json").read_text())["huge-txt"]
    assert s["kinds"]["hash"]["count"] == 1 and s["kinds"]["piece"]["count"] == 3
    assert not (tmp_path / "w").exists()


def test_a_split_that_exceeds_the_main_thread_is_not_printed():
    sane = {"appending shards (copy + sha256)": 0.4, "waiting for futures": 0.1, tl.REST: 0.05}
    assert tl.split_text(sane).startswith("appending shards (copy + sha256) 0.40, waiting for futures 0.10")
    # as measured on a 16-vCPU machine: parts in the hundreds of "seconds" against 2.2 s of main-thread CPU
    broken = {"waiting for futures": 178.08, "appending shards (copy + sha256)": 108.86, tl.REST: -292.71}
    text = tl.split_text(broken)
    assert "not given" in text and "292.71" in text and "178.08" not in text
