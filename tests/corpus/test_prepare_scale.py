"""prepare at scale: big files cut into ranges change nothing, FineWeb-style parquet trees,
resuming a killed prepare, and --shard I/N parts merged into what one prepare makes.

"Equal" below means byte-identical: the same shard files (names, bytes, so sha256) and the
same manifest.json apart from its one timing field, "created".
"""
import hashlib
import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from distlm.corpus import prepare as prep
from distlm.corpus import sources
from distlm.data import DataError, load_manifest, verify_shards
from distlm.data import tokenizer as tkz

ROOT = Path(__file__).resolve().parents[2]
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
         "under pale moonlight near an old stone bridge").split()


def text(rng: np.random.Generator, n_words: int) -> str:
    words = rng.choice(WORDS, n_words)
    return " ".join(w + ("." if rng.random() < 0.08 else "") + ("\n" if rng.random() < 0.03 else "") for w in words)


def make_docs(n: int, seed: int = 0, lo: int = 20, hi: int = 300) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"[{i}] " + text(rng, int(rng.integers(lo, hi))) for i in range(n)]


def run(inputs, out, **kw):
    kw.setdefault("workers", 1)
    kw.setdefault("progress", False)
    return prep.prepare([str(i) for i in inputs], out, **kw)


def without_created(manifest: dict) -> dict:
    return {k: v for k, v in manifest.items() if k != "created"}


def folder_bytes(out: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != "manifest.json"}


def assert_same(a: dict, out_a: Path, b: dict, out_b: Path) -> None:
    assert without_created(a) == without_created(b)
    assert folder_bytes(out_a) == folder_bytes(out_b)
    verify_shards(out_a, a)


def split_tokens(out: Path) -> dict:
    m = load_manifest(out)
    return {name: np.concatenate([np.fromfile(out / s["file"], "<u2") for s in split["shards"]] or [[]]).tolist()
            for name, split in m["splits"].items()}


def kinds(inputs, separator=None) -> set:
    found = sources.resolve_inputs([str(i) for i in inputs])
    return {u.kind for u in sources.plan_units(sources.input_files(found), separator, prep.TASK_CHARS)}


# ---- big files in ranges ------------------------------------------------------------------------
def _jsonl(folder: Path) -> tuple[list, dict]:
    lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(make_docs(120))]
    lines[7] = ""  # blank lines and null texts are skipped wherever the cuts fall
    lines[50] = json.dumps({"text": None})
    (folder / "big.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return [folder / "big.jsonl"], {}


def _separated(folder: Path) -> tuple[list, dict]:
    docs = make_docs(150, seed=1)
    raw = "\ufeff" + "<|sep|>".join(docs[:40]) + "<|sep|><|sep|>" + "<|sep|>".join(docs[40:])
    data = raw.replace("\n", "\r\n").encode("utf-8")
    data = data[:5000] + b"\xff\xfe" + data[5000:20000] + b"\xc3" + data[20000:]  # invalid UTF-8, twice
    (folder / "sep.txt").write_bytes(data)
    return [folder / "sep.txt"], {"separator": "<|sep|>"}


def _paragraphs(folder: Path) -> tuple[list, dict]:
    # "\n\n" overlaps itself, and CRLF files change it: cuts avoid both ('\n\n\n' runs, '\r' nearby)
    docs = make_docs(150, seed=2)
    ends = ["\n\n", "\r\n\n", "\n\r\n", "\r\n\r\n", "\n\n\n", "\n\n\n\n", "\r\n\n\n"]
    raw = "".join(d + ends[i % len(ends)] for i, d in enumerate(docs))
    data = raw[:30000].replace("\n", "\r\n") + raw[30000:]
    (folder / "paras.txt").write_bytes(data.encode("utf-8"))
    return [folder / "paras.txt"], {"separator": "\n\n"}


def _one_long_document(folder: Path) -> tuple[list, dict]:
    long = "\ufeff" + "\n".join(make_docs(200, seed=3)).replace("[1", "é[1").replace("\n", "\r\n")
    (folder / "book.txt").write_bytes(long.encode("utf-8") + b" caf\xe9 ")
    small = folder / "small"
    small.mkdir()
    for i, d in enumerate(make_docs(6, seed=4)):
        (small / f"{i}.txt").write_text(d)
    return [small, folder / "book.txt"], {}


def _parquet(folder: Path) -> tuple[list, dict]:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    docs = make_docs(160, seed=5)
    pq.write_table(pa.table({"id": list(range(160)), "text": docs[:100] + [None] + docs[101:]}),
                   folder / "web.parquet", row_group_size=10)
    return [folder / "web.parquet"], {}


@pytest.mark.parametrize("make, kind", [(_jsonl, "lines"), (_separated, "split"), (_paragraphs, "split"),
                                        (_one_long_document, "piece"), (_parquet, "rows")])
def test_ranges_of_big_files_give_the_same_data_as_whole_files(tmp_path, monkeypatch, make, kind):
    inputs, kw = make(tmp_path)
    whole = run(inputs, tmp_path / "whole", shard_tokens=3000, **kw)
    monkeypatch.setattr(prep, "TASK_CHARS", 4096)
    assert kind in kinds(inputs, kw.get("separator"))
    for workers in (1, 2):
        out = tmp_path / f"ranges{workers}"
        assert_same(run(inputs, out, shard_tokens=3000, workers=workers, **kw), out, whole, tmp_path / "whole")
    assert whole["splits"]["val"]["documents"] > 0 and whole["stats"]["documents"] > 1


def test_cut_places():
    sep = b"\n\n"
    assert sources._separator_cut(b"ab\n\n\ncd", 3, sep) is None  # reading the whole file matches at 2, not 3
    assert sources._separator_cut(b"ab\n\n\ncd\n\nef", 3, sep) == 7
    assert sources._separator_cut(b"ab\r\n\ncd", 3, sep) is None  # '\r\n' -> '\n' makes the text differ here
    assert sources._piece_cut(b"ab  cd", 0) == 2 and sources._piece_cut(b"a\r\nb c", 0) == 4
    assert sources._piece_cut("é é".encode(), 0) is None  # only after ASCII: both sides decode alone
    assert sources._line_cut(b'{"a": 1}\n{"b"', 3) == 9


def test_jsonl_error_in_a_later_range_names_the_files_line(tmp_path, monkeypatch):
    lines = [json.dumps({"text": d}) for d in make_docs(80)]
    lines[71] = '{"text": oops}'
    (tmp_path / "big.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(prep, "TASK_CHARS", 2048)
    assert kinds([tmp_path / "big.jsonl"]) == {"lines"}
    with pytest.raises(DataError, match=r"big\.jsonl:72: invalid JSON"):
        run([tmp_path / "big.jsonl"], tmp_path / "out", workers=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.jsonl"]


# ---- FineWeb-style inputs -------------------------------------------------------------------------
def test_two_hundred_parquet_files_in_nested_folders(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    docs = make_docs(600, seed=6, lo=5, hi=60)
    root = tmp_path / "fineweb" / "data"
    for f in range(200):  # CC-MAIN-2024-xx/yyy/000_00f.parquet: 3 levels of folders
        folder = root / f"CC-MAIN-2024-{f // 50:02d}" / f"{f // 10 % 5:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        rows = docs[3 * f:3 * f + 3]
        pq.write_table(pa.table({"text": rows, "url": [f"https://example.com/{f}/{i}" for i in range(3)],
                                 "token_count": [len(r) for r in rows]}), folder / f"000_{f:05d}.parquet")
    monkeypatch.setattr(prep, "TASK_CHARS", 16 << 10)  # ~ten files per task
    a = run([tmp_path / "fineweb"], tmp_path / "a", workers=2, shard_tokens=5000)
    assert a["stats"]["files"] == 200 and a["stats"]["documents"] == 600 and a["sources"][0]["files"] == 200
    m = load_manifest(tmp_path / "a")
    tok = tkz.gpt2()
    got = []
    for split in split_tokens(tmp_path / "a").values():
        ids = np.array(split)
        got += [tok.decode(part[:-1].tolist()) for part in np.split(ids, np.flatnonzero(ids == tok.eos_id) + 1)[:-1]]
    assert sorted(got) == sorted(docs) and m["splits"]["val"]["documents"] > 0
    b = run([tmp_path / "fineweb"], tmp_path / "b", workers=1, shard_tokens=5000)
    assert_same(a, tmp_path / "a", b, tmp_path / "b")


# ---- the fallbacks, against the rule written out here --------------------------------------------
def _key(doc: str, seed: int) -> float:
    digest = hashlib.blake2b(doc.encode(), digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "big") / 2.0 ** 64


def expected_splits(docs: list[str], val_fraction: float, seed: int = 0) -> dict:
    tok, keys = tkz.gpt2(), [_key(d, seed) for d in docs]
    ids = [tok.encode(d) + [tok.eos_id] for d in docs]
    if len(docs) == 1:
        n = len(ids[0])
        cut = n - min(max(1, round(n * val_fraction)), n - 1)
        return {"train": ids[0][:cut], "val": ids[0][cut:]}
    val = [k < val_fraction for k in keys]
    if val_fraction > 0 and not any(val):
        val[keys.index(min(keys))] = True
    if all(val):
        val[keys.index(max(keys))] = False
    return {"train": sum((i for i, v in zip(ids, val) if not v), []),
            "val": sum((i for i, v in zip(ids, val) if v), [])}


@pytest.mark.parametrize("val_fraction, seed", [(0.2, 0), (1e-6, 0), (0.97, 1)])
def test_fallbacks_rewrite_the_shards_as_the_rule_says(tmp_path, monkeypatch, val_fraction, seed):
    docs = make_docs(30, seed=7)
    val = [_key(d, seed) < val_fraction for d in docs]
    assert {0.2: 0 < sum(val) < 30, 1e-6: not any(val), 0.97: all(val)}[val_fraction]  # each case is what it says
    folder = tmp_path / "in"
    folder.mkdir()
    for i, d in enumerate(docs):
        (folder / f"{i:02d}.txt").write_text(d)
    monkeypatch.setattr(prep, "TASK_CHARS", 3000)
    m = run([folder], tmp_path / "out", val_fraction=val_fraction, seed=seed, shard_tokens=97, workers=2)
    assert split_tokens(tmp_path / "out") == expected_splits(docs, val_fraction, seed)
    for split in m["splits"].values():
        sizes = [s["tokens"] for s in split["shards"]]
        assert sizes == [97] * (len(sizes) - 1) + sizes[-1:] and 0 < sizes[-1] <= 97
    verify_shards(tmp_path / "out", m)


# ---- resume --------------------------------------------------------------------------------------
def write_corpus(folder: Path, n_files: int, docs_per_file: int, seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    docs = make_docs(n_files * docs_per_file, seed=seed, lo=200, hi=2000)
    for f in range(n_files):
        lines = [json.dumps({"text": d}) for d in docs[f * docs_per_file:(f + 1) * docs_per_file]]
        (folder / f"part-{f:03d}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_kill_9_then_resume_gives_the_bytes_of_an_uninterrupted_run(tmp_path, monkeypatch, capsys):
    src = write_corpus(tmp_path / "in", 24, 40)  # ~6 MB: about half a second of tokenizing per worker
    out = tmp_path / "out"
    code = ("import sys; import distlm.corpus.prepare as p; p.TASK_CHARS = 1 << 18; p.JOURNAL_SECONDS = 0; "
            "p.prepare([sys.argv[1]], sys.argv[2], workers=1, progress=False, shard_tokens=150_000)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(src), str(out)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    journal = tmp_path / f".out.tmp-{proc.pid}" / prep.JOURNAL
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if journal.is_file() and journal.read_bytes().count(b"\n") >= 3:  # header + two finished tasks
                break
            time.sleep(0.002)
    finally:
        if proc.poll() is None:
            proc.kill()  # SIGKILL: no handler, no cleanup
        rc = proc.wait(timeout=30)
        assert rc == -signal.SIGKILL, f"rc {rc}, finished before the kill? {proc.stderr.read().decode()[-2000:]}"
    records = [json.loads(line) for line in journal.read_text().split("\n")[1:-1]]
    assert records and not out.exists()
    assert records[-1]["inputs_done"] >= 1 and records[-1]["tokens"][0] > 0

    monkeypatch.setattr(prep, "TASK_CHARS", 1 << 18)
    resumed = run([src], out, workers=2, shard_tokens=150_000)
    said = capsys.readouterr().out
    done, total = map(int, said.split("resuming after ")[1].split(" tasks")[0].split(" of "))
    assert done == len(records) < total, said
    fresh = run([src], tmp_path / "fresh", shard_tokens=150_000)
    assert len(fresh["splits"]["train"]["shards"]) > 2
    assert_same(resumed, out, fresh, tmp_path / "fresh")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "in", "out"]


def test_interrupted_mid_shard_resumes_exactly(tmp_path, monkeypatch, capsys):
    """Ctrl-C after the shard file got bytes the journal never recorded: they are cut off."""
    src = write_corpus(tmp_path / "in", 12, 6)
    monkeypatch.setattr(prep, "TASK_CHARS", 20_000)
    monkeypatch.setattr(prep, "JOURNAL_SECONDS", 0)  # a line after every task
    fresh = run([src], tmp_path / "fresh", shard_tokens=7000)
    calls = []
    write = prep._ShardWriter.write

    def interrupted(self, data):
        write(self, data)
        calls.append(1)
        if len(calls) == 9:
            self.sync()  # as a kill leaves them: the bytes reached the file, the journal line did not
            raise KeyboardInterrupt

    monkeypatch.setattr(prep._ShardWriter, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run([src], tmp_path / "out", shard_tokens=7000)
    monkeypatch.setattr(prep._ShardWriter, "write", write)
    (kept,) = [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]
    records = [json.loads(line) for line in (kept / prep.JOURNAL).read_text().splitlines()[1:]]
    journaled = sum(s["tokens"] for r in records for split in r["shards_closed"] for s in split)
    journaled += sum(o[1] for o in records[-1]["open"] if o)
    assert 2 * journaled < sum(p.stat().st_size for p in kept.glob("*.bin"))  # unjournaled bytes are there
    # Another process's folder, as after a kill: rename it to a pid that does not exist.
    os.replace(kept, tmp_path / f".out.tmp-{2 ** 22 + 7}")
    resumed = run([src], tmp_path / "out", shard_tokens=7000, workers=2)
    assert "resuming after" in capsys.readouterr().out
    assert_same(resumed, tmp_path / "out", fresh, tmp_path / "fresh")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "in", "out"]


def test_a_journal_of_other_inputs_or_options_is_not_resumed(tmp_path, monkeypatch, capsys):
    src = write_corpus(tmp_path / "in", 6, 4)
    monkeypatch.setattr(prep, "TASK_CHARS", 8000)
    monkeypatch.setattr(prep, "JOURNAL_SECONDS", 0)
    monkeypatch.setattr(prep._Journal, "append", _interrupt_after(prep._Journal.append, 3))
    with pytest.raises(KeyboardInterrupt):
        run([src], tmp_path / "out")
    monkeypatch.undo()
    monkeypatch.setattr(prep, "TASK_CHARS", 8000)
    monkeypatch.setattr(prep, "JOURNAL_SECONDS", 0)
    (kept,) = [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]
    os.replace(kept, tmp_path / f".out.tmp-{2 ** 22 + 9}")
    m = run([src], tmp_path / "out", val_fraction=0.3)  # other options: starts over, removes the old folder
    assert "resuming" not in capsys.readouterr().out and m["val_fraction"] == 0.3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "out"]


def _interrupt_after(append, n):
    calls = []

    def wrapped(self, record):
        append(self, record)
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
    return wrapped


def test_killed_before_its_first_task_ended_resumes_from_the_start(tmp_path, monkeypatch, capsys):
    """A journal holding its header and no task (a kill in the first second) resumed: it was an
    IndexError naming no file."""
    src = write_corpus(tmp_path / "in", 6, 4)
    monkeypatch.setattr(prep, "TASK_CHARS", 8000)
    fresh = run([src], tmp_path / "fresh")

    def interrupted(self, record):
        raise KeyboardInterrupt  # before the first task's line: the journal is its header alone
    monkeypatch.setattr(prep._Journal, "append", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run([src], tmp_path / "out")
    monkeypatch.undo()
    monkeypatch.setattr(prep, "TASK_CHARS", 8000)
    (kept,) = [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]
    assert (kept / prep.JOURNAL).read_text().count("\n") == 1
    os.replace(kept, tmp_path / f".out.tmp-{2 ** 22 + 11}")  # as after a kill: a pid that does not exist
    resumed = run([src], tmp_path / "out")
    assert "resuming after 0 of" in capsys.readouterr().out
    assert_same(resumed, tmp_path / "out", fresh, tmp_path / "fresh")


# ---- --shard I/N and --merge --------------------------------------------------------------------
def mixed_corpus(root: Path) -> list[Path]:
    """Files of many sizes in nested folders, a JSONL big enough to be cut, and a second input."""
    docs = make_docs(90, seed=8)
    for i, d in enumerate(docs[:60]):
        sub = root / "a" / f"{i % 4}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"{i:03d}.txt").write_text(d * (1 + i % 5))
    (root / "b.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs[60:]) + "\n")
    return [root / "a", root / "b.jsonl"]


@pytest.mark.parametrize("val_fraction, parts", [(0.1, 3), (1e-9, 3), (0.1, 5)])
def test_parts_merged_equal_one_prepare(tmp_path, monkeypatch, val_fraction, parts):
    inputs = mixed_corpus(tmp_path / "in")
    monkeypatch.setattr(prep, "TASK_CHARS", 6000)
    kw = {"val_fraction": val_fraction, "shard_tokens": 2500}
    single = run(inputs, tmp_path / "single", **kw)
    dirs = [tmp_path / f"part{i}" for i in range(parts)]
    for i, d in enumerate(dirs):
        m = run(inputs, d, shard=f"{i}/{parts}", workers=1 + i % 2, **kw)
        assert m["part"]["index"] == i and m["stats"]["documents"] > 0  # every part has work
    merged = prep.merge([str(d) for d in reversed(dirs)], tmp_path / "merged", progress=False)
    assert_same(merged, tmp_path / "merged", single, tmp_path / "single")
    if val_fraction < 1e-6:
        assert single["splits"]["val"]["documents"] == 1  # the fallback, decided for the whole corpus
    assert run(inputs, tmp_path / "merged", **kw) == load_manifest(tmp_path / "merged")  # up to date


def test_a_lone_document_in_parts_is_split_by_tokens_as_in_one_prepare(tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "PART_MIN_CHARS", 1)  # two tiny files: a unit each, so a part each
    (tmp_path / "one.txt").write_text(make_docs(1, lo=400, hi=401)[0])
    (tmp_path / "empty.txt").write_text("   \n")
    inputs = [tmp_path / "one.txt", tmp_path / "empty.txt"]
    single = run(inputs, tmp_path / "single", val_fraction=0.1)
    for i in range(2):
        run(inputs, tmp_path / f"p{i}", shard=(i, 2), val_fraction=0.1)
    merged = prep.merge([str(tmp_path / "p0"), str(tmp_path / "p1")], tmp_path / "merged", progress=False)
    assert merged["split_method"] == "single-document-tail"
    assert_same(merged, tmp_path / "merged", single, tmp_path / "single")


def test_a_few_files_spread_evenly_over_the_parts(tmp_path, monkeypatch):
    """One big JSONL and two small files over 3 parts: the big file is cut, so each part gets
    about a third of the bytes (whole files went to part 0, leaving parts 1 and 2 empty), and
    the merge is still the one prepare's folder, byte for byte."""
    monkeypatch.setattr(prep, "PART_MIN_CHARS", 1 << 10)
    docs = make_docs(120, seed=3)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "big.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs[:110]) + "\n")
    (tmp_path / "in" / "b.txt").write_text(docs[110])
    (tmp_path / "in" / "c.txt").write_text(docs[111])
    inputs = [tmp_path / "in"]
    single = run(inputs, tmp_path / "single", shard_tokens=2000)
    total = single["stats"]["text_bytes"]
    parts = [run(inputs, tmp_path / f"p{i}", shard=f"{i}/3", shard_tokens=2000) for i in range(3)]
    shares = [m["stats"]["text_bytes"] / total for m in parts]
    assert all(0.2 < share < 0.47 for share in shares), shares
    merged = prep.merge([str(tmp_path / f"p{i}") for i in range(3)], tmp_path / "merged", progress=False)
    assert_same(merged, tmp_path / "merged", single, tmp_path / "single")


def test_a_part_that_would_be_empty_is_refused_in_one_line(tmp_path, capsys):
    """One compressed file is read whole: it cannot be spread over 2 parts. The part that
    would get nothing says so, exit 2, and writes nothing."""
    from distlm.cli import main
    docs = make_docs(20, seed=4)
    with gzip.open(tmp_path / "one.txt.gz", "wt") as f:
        f.write("\n\n".join(docs))
    said = []
    for i in range(2):
        code = main(["prepare", str(tmp_path / "one.txt.gz"), "--out", str(tmp_path / f"p{i}"), "--shard", f"{i}/2",
                     "--quiet", "--separator", "\n\n"])
        said.append((code, capsys.readouterr().err))
    empty = [(i, err) for i, (code, err) in enumerate(said) if code != 0]
    assert len(empty) == 1 and said[1 - empty[0][0]][0] == 0, said
    i, err = empty[0]
    assert said[i][0] == 2 and err.count("\n") == 1, err
    assert f"--shard {i}/2: part {i} would be empty" in err and err.rstrip().endswith("use at most 1 part"), err
    assert not (tmp_path / f"p{i}").exists() and not list(tmp_path.glob(f".p{i}*"))


def test_merge_refuses_parts_that_do_not_belong_together(tmp_path):
    inputs = mixed_corpus(tmp_path / "in")
    for i in range(2):
        run(inputs, tmp_path / f"p{i}", shard=f"{i}/2")
    run(inputs, tmp_path / "other", shard="1/2", val_fraction=0.2)
    run(inputs, tmp_path / "whole")
    cases = [(["p0", "other"], r"other: prepared with val_fraction=0\.2, .*p0 with val_fraction=0\.05"),
             (["p0"], r"missing part\(s\) 1/2"),
             (["p0", "p1", "p1"], r"p1: part 1/2 given twice"),
             (["p0", "whole"], r"whole: not a part"),
             (["p0", "nowhere"], r"nowhere/manifest\.json: not found")]
    for names, message in cases:
        with pytest.raises(DataError, match=message) as e:
            prep.merge([str(tmp_path / n) for n in names], tmp_path / "merged", progress=False)
        assert "\n" not in str(e.value)
    with pytest.raises(DataError, match=r"p1/manifest\.json: part 1/2 of a sharded prepare; join all the parts"):
        load_manifest(tmp_path / "p1")  # what training on a part says
    tokens = load_manifest(tmp_path / "p1", part_ok=True)["splits"]["train"]["shards"][0]["tokens"]
    (tmp_path / "p1" / "train_000000.bin").write_bytes(b"\0\0" * tokens)
    with pytest.raises(DataError, match=r"p1/train_000000\.bin: sha256 .* does not match"):
        prep.merge([str(tmp_path / "p0"), str(tmp_path / "p1")], tmp_path / "merged", progress=False)
    assert not (tmp_path / "merged").exists() and not list(tmp_path.glob(".merged.*"))
    with pytest.raises(DataError, match="--shard needs the gpt2 tokenizer"):
        run(inputs, tmp_path / "x", shard="0/2", tokenizer="bpe:300")
    with pytest.raises(DataError, match=r"--shard '2/2'|--shard 2/2: I must be from 0 to N-1"):
        run(inputs, tmp_path / "x", shard="2/2")


def test_cli_shard_and_merge(tmp_path, capsys):
    from distlm.cli import main
    inputs = [str(p) for p in mixed_corpus(tmp_path / "in")]
    for i in range(2):
        assert main(["prepare", *inputs, "--out", str(tmp_path / f"p{i}"), "--shard", f"{i}/2", "--quiet",
                     "--workers", "1"]) == 0
    assert "join the parts with --merge" in capsys.readouterr().out
    assert main(["prepare", "--merge", str(tmp_path / "p0"), str(tmp_path / "p1"), "--out", str(tmp_path / "m"),
                 "--quiet"]) == 0
    assert main(["prepare", *inputs, "--out", str(tmp_path / "single"), "--quiet", "--workers", "1"]) == 0
    assert_same(load_manifest(tmp_path / "m"), tmp_path / "m", load_manifest(tmp_path / "single"),
                tmp_path / "single")
    capsys.readouterr()
    assert main(["prepare", "--merge", str(tmp_path / "p0"), "--out", str(tmp_path / "m2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing part(s) 1/2" in err[0], err
