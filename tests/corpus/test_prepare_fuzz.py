"""Fuzzing `distlm prepare` (hypothesis): whatever the inputs, it either writes a valid
data folder or raises DataError with one line, and never leaves a half-written folder.

Inputs are folders of 1-4 files drawn from: text, random bytes, invalid UTF-8, empty and
whitespace-only files, huge single lines, JSONL (valid, broken, wrong types, lone
surrogates), random bytes named .parquet / .arrow / .gz / .tar, truncated gzip and tar
archives, pre-tokenized train.bin/val.bin of random bytes, and Hugging Face
save_to_disk folders with broken state.json; with valid and invalid options. Sometimes
the output folder already holds an older prepared data set, which must survive a failure.

Property, per example:
- success: load_manifest(out) is the returned manifest, verify_shards passes, every
  token id is below the vocabulary size, and the split counts add up;
- DataError: its message is one non-empty line, and the output folder is exactly what
  it was before (absent, or the older data set, byte for byte);
- anything else is a bug (hypothesis shrinks it and the test fails);
- either way, nothing else is left beside the output folder (no .out.tmp-*/.out.old-*).
Runs derandomized (a fixed sequence of examples), so `make test` is reproducible;
DISTLM_FUZZ_EXAMPLES and DISTLM_FUZZ_RANDOM=1 run more, and different, examples.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from distlm.corpus import prepare as prep  # noqa: E402
from distlm.data import DataError, load_manifest, verify_shards  # noqa: E402

# `make test` runs a fixed sequence; DISTLM_FUZZ_EXAMPLES=20000 DISTLM_FUZZ_RANDOM=1 explores further.
MAX_EXAMPLES = int(os.environ.get("DISTLM_FUZZ_EXAMPLES", "1500"))
DERANDOMIZE = os.environ.get("DISTLM_FUZZ_RANDOM", "") in ("", "0")
try:  # with pyarrow, valid and damaged Parquet/Arrow files are fuzzed too; without, only "needs pyarrow"
    import pyarrow as pa
    import pyarrow.parquet as pq
except ImportError:
    pa = pq = None

text = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=200)
words = st.text(alphabet="abc xyz\n\t.é中🙂", max_size=120)


def _jsonl_line():
    good = st.builds(lambda t: json.dumps({"text": t}), text)
    raw_unicode = st.builds(lambda t: json.dumps({"text": t}, ensure_ascii=False), text)
    other = st.sampled_from([
        '{"text": null}', '{"text": 5}', '{"text": ["a"]}', '{"other": "x"}', '[1, 2]', '"just a string"',
        '{"text": "lone \\ud800 surrogate"}', '{"text": "pair \\ud83d\\ude42 ok"}', '{"text": "\\udfff"}',
        '{"text": "a"', '{text: "a"}', 'null', '{"text": "x", "text": 7}', '   ', '\x00\x01',
        '{"text": "' + "y" * 5000 + '"}', '[' * 50 + ']' * 50, '{"text": 1e999}', 'NaN'])
    return st.one_of(good, raw_unicode, other, words)


@st.composite
def jsonl_bytes(draw) -> bytes:
    lines = [draw(_jsonl_line()).encode("utf-8", "surrogatepass") for _ in range(draw(st.integers(0, 6)))]
    if draw(st.booleans()):
        lines.insert(draw(st.integers(0, len(lines))), draw(st.binary(max_size=40)))  # invalid UTF-8, stray bytes
    return b"\n".join(lines) + draw(st.sampled_from([b"", b"\n", b"\r\n"]))


@st.composite
def bad_utf8(draw) -> bytes:
    parts = [draw(words).encode() for _ in range(draw(st.integers(1, 4)))]
    junk = st.sampled_from([b"\xff", b"\xfe\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80\x80",
                            b"\xef\xbb\xbf"])
    return b"".join(p + draw(junk) for p in parts)


def _tar(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _arrow_bytes(table, kind: str) -> bytes:
    sink = pa.BufferOutputStream()
    if kind == "parquet":
        pq.write_table(table, sink)
    else:
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
    return sink.getvalue().to_pybytes()


@st.composite
def columnar(draw, kind: str) -> bytes:
    """A valid Parquet file / Arrow stream (text column, or a wrong one), maybe damaged."""
    rows = draw(st.lists(st.one_of(st.none(), text), max_size=8))
    column = draw(st.sampled_from(["text", "text", "text", "body"]))
    values = pa.array(rows, type=pa.string()) if draw(st.integers(0, 5)) else pa.array(range(len(rows)))
    data = _arrow_bytes(pa.table({column: values}), kind)
    damage = draw(st.sampled_from(["none", "none", "truncate", "flip"]))
    if damage == "truncate":
        return data[:draw(st.integers(0, len(data)))]
    if damage == "flip" and data:
        i = draw(st.integers(0, len(data) - 1))
        return data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1:]
    return data


@st.composite
def one_file(draw, huge: int = 200_000) -> tuple[str, bytes]:
    kind = draw(st.sampled_from(["text"] * 4 + ["bytes", "bad_utf8", "bad_utf8", "empty", "huge_line"] +
                                ["jsonl"] * 4 + ["parquet", "arrow", "gz", "gz_truncated", "tar", "tar_truncated",
                                                 "nul"]))
    if kind == "text":
        return draw(st.sampled_from(["a.txt", "b.md", "c", "d.json"])), draw(text).encode("utf-8")
    if kind == "bytes":
        return draw(st.sampled_from(["r.txt", "r.dat", "r"])), draw(st.binary(max_size=3000))
    if kind == "bad_utf8":
        return "bad.txt", draw(bad_utf8())
    if kind == "empty":
        return "empty.txt", draw(st.sampled_from([b"", b" ", b"\n\n\n", b"\t \r\n", b"\xef\xbb\xbf"]))
    if kind == "huge_line":
        n = draw(st.integers(min(20_000, huge), huge))
        return "huge.txt", (draw(st.sampled_from(["a", "ab ", "é", "🙂", " ", "x\u0301"])) * n)[:n].encode()
    if kind == "jsonl":
        return draw(st.sampled_from(["d.jsonl", "d.ndjson"])), draw(jsonl_bytes())
    if kind in ("parquet", "arrow"):
        if pa is not None and draw(st.booleans()):
            return f"t.{kind}", draw(columnar(kind))
        return f"t.{kind}", draw(st.binary(max_size=2000))
    if kind == "gz":
        inner = draw(st.sampled_from(["x.txt.gz", "x.jsonl.gz", "x.gz"]))
        return inner, draw(st.one_of(st.binary(max_size=500), st.builds(gzip.compress, text.map(str.encode))))
    if kind == "gz_truncated":
        data = gzip.compress(draw(text).encode() * 20)
        return "cut.txt.gz", data[:draw(st.integers(0, max(0, len(data) - 1)))]
    if kind == "tar":
        return draw(st.sampled_from(["a.tar", "a.tar.gz", "a.tgz", "a.tar.xz"])), draw(st.binary(max_size=2000))
    if kind == "tar_truncated":
        data = _tar({"m/one.txt": draw(text).encode(), "m/two.jsonl": draw(jsonl_bytes()), ".hidden": b"x"})
        return "cut.tar", data[:draw(st.integers(0, len(data)))]
    return "nul.txt", draw(words).encode() + b"\x00" + draw(st.binary(max_size=100))


@st.composite
def hf_folder(draw) -> dict[str, bytes]:
    """A save_to_disk look-alike: state.json (valid, broken, of the wrong types, listing a
    missing file) and an .arrow file: empty, random bytes, or (with pyarrow) a valid
    stream, maybe cut short."""
    state = draw(st.sampled_from([
        {"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}, {"_data_files": []}, {},
        {"_data_files": "abc"}, {"_data_files": [{}]}, {"_data_files": 5}, {"_data_files": [{"filename": 5}]},
        {"_data_files": [{"filename": "missing.arrow"}]}]))
    arrow = draw(st.sampled_from([b"", b"\x00\x00\x00\x80", b"\xff\xff\xff\xff"])) + draw(st.binary(max_size=300))
    if pa is not None and draw(st.booleans()):
        rows = draw(st.lists(st.one_of(st.none(), text), max_size=6))
        arrow = _arrow_bytes(pa.table({"text": pa.array(rows, type=pa.string())}), "arrow")
        arrow = arrow[:draw(st.integers(0, len(arrow)))] if draw(st.booleans()) else arrow
    files = {"state.json": json.dumps(state).encode(), "data-00000-of-00001.arrow": arrow}
    if draw(st.integers(0, 5)) == 0:  # a DatasetDict around it, maybe a broken one
        splits = draw(st.sampled_from([["."], 5, [5], "x", ["nope"]]))
        files["../dataset_dict.json"] = json.dumps({"splits": splits}).encode()
    return files


@st.composite
def pretokenized(draw) -> dict[str, bytes]:
    names = draw(st.sampled_from([("train.bin", "val.bin"), ("x_train_000.bin", "x_val_000.bin"), ("train.bin",)]))
    out = {}
    for n in names:
        if draw(st.booleans()):  # plausible GPT-2 tokens
            ids = draw(st.lists(st.integers(0, 50256), max_size=200))
            out[n] = np.asarray(ids, dtype="<u2").tobytes()
        else:
            out[n] = draw(st.binary(max_size=600))
    return out


@st.composite
def case(draw) -> dict:
    # BPE training on one long run without whitespace is slow (a 367 KB line of one emoji: ~40 s
    # with bpe:300, ~2 s with gpt2), so huge lines stay small when a BPE is trained.
    tokenizer = draw(st.sampled_from(["gpt2"] * 12 + ["bpe:300"] * 3 + ["bpe:abc", "bpe:1"]))
    layout = draw(st.sampled_from(["files", "files", "files", "hf", "pretokenized", "mixed_bin"]))
    files: dict[str, bytes] = {}
    if layout in ("files", "mixed_bin"):
        for i in range(draw(st.integers(1, 4))):
            name, data = draw(one_file(200_000 if tokenizer == "gpt2" else 12_000))
            files[f"{i}_{name}"] = data
        if layout == "mixed_bin":
            files["train.bin"] = b"\x01\x00" * 10
    elif layout == "hf":
        files = {f"ds/{k}": v for k, v in draw(hf_folder()).items()}
    else:
        files = draw(pretokenized())
    how = draw(st.sampled_from(["folder"] * 4 + ["paths"] * 2 + ["glob"] * 2 + ["missing"]))
    return {"files": files, "how": how, "tokenizer": tokenizer,
            "val_fraction": draw(st.sampled_from([0.0, 0.05, 0.05, 0.2, 0.2, 0.5, 0.99] * 3 + [1.0, -0.1])),
            "separator": draw(st.sampled_from([None, None, "\n", "\n\n", "é", "<|endoftext|>"])),
            "text_field": draw(st.sampled_from(["text"] * 5 + ["content"])),
            "shard_tokens": draw(st.sampled_from([100_000_000] * 3 + [50_000, 997])),  # many shards, not 10^5 files
            "old_data": draw(st.booleans())}


def _inputs(folder: Path, how: str) -> list[str]:
    files = sorted(str(p) for p in folder.rglob("*") if p.is_file())
    if how == "folder":
        return [str(folder)]
    if how == "paths":
        top = sorted(str(p) for p in folder.iterdir())
        return top
    if how == "glob":
        return [str(folder / "*")]
    return [str(folder / "does-not-exist.txt")] + files[:1]


def _snapshot(folder: Path) -> dict[str, str]:
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _check_data(out: Path, m: dict) -> None:
    assert load_manifest(out) == m
    verify_shards(out, m)
    vocab = int(m["tokenizer"]["vocab_size"])
    for name, split in m["splits"].items():
        assert split["tokens"] == sum(s["tokens"] for s in split["shards"]), name
        for s in split["shards"]:
            ids = np.fromfile(out / s["file"], dtype=m["dtype"])
            assert len(ids) == s["tokens"] and (len(ids) == 0 or int(ids.max()) < vocab), s["file"]
    assert m["splits"]["train"]["tokens"] > 0


@pytest.fixture(scope="module")
def old_data(tmp_path_factory) -> Path:
    """An earlier prepared data set, put in the output folder before some examples."""
    src = tmp_path_factory.mktemp("old_src")
    for i in range(3):
        (src / f"{i}.txt").write_text(f"an older document number {i}, long enough to be a document. " * 3)
    out = tmp_path_factory.mktemp("old") / "data"
    prep.prepare([str(src)], out, workers=1, progress=False, val_fraction=0.3)
    return out


def test_fuzz_prepare(old_data):
    counts: Counter = Counter()
    errors: Counter = Counter()
    slowest: list = [0.0]

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=DERANDOMIZE,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.large_base_example])
    @given(c=case())
    def check(c):
        counts["examples"] += 1
        with tempfile.TemporaryDirectory(prefix="fuzzprep-") as tmp:
            tmp = Path(tmp)
            src = tmp / "in"
            for name, data in c["files"].items():
                (src / name).parent.mkdir(parents=True, exist_ok=True)
                (src / name).write_bytes(data)
            counts["files"] += len(c["files"])
            out = tmp / "out"
            if c["old_data"]:
                shutil.copytree(old_data, out)
            before = _snapshot(out)
            t0 = time.perf_counter()
            try:
                m = prep.prepare(_inputs(src, c["how"]), out, tokenizer=c["tokenizer"],
                                 val_fraction=c["val_fraction"], seed=0, workers=1, separator=c["separator"],
                                 text_field=c["text_field"], shard_tokens=c["shard_tokens"], progress=False)
            except DataError as e:
                msg = str(e)
                assert msg.strip() and "\n" not in msg and "\r" not in msg, f"not one line: {msg!r}"
                assert _snapshot(out) == before, "a failed prepare changed the output folder"
                counts["DataError"] += 1
                errors[msg.split(":")[-1].strip()[:40]] += 1
            else:
                _check_data(out, m)
                counts["prepared"] += 1
            took = time.perf_counter() - t0
            if took > slowest[0]:
                slowest[:] = [took, {k: len(v) for k, v in c["files"].items()}, c["tokenizer"], c["how"]]
            left = sorted(p.name for p in tmp.iterdir())
            assert left == sorted(["in"] + (["out"] if out.exists() else [])), f"left behind: {left}"

    check()
    print(f"\nfuzzed prepare: {counts['examples']} inputs ({counts['files']} files): "
          f"{counts['prepared']} prepared, {counts['DataError']} DataError; no other exception; "
          f"pyarrow {'present' if pa is not None else 'absent'}")
    print("  DataError kinds:", dict(errors.most_common(12)))
    print(f"  slowest example {slowest[0]:.2f} s: {slowest[1:]}")
    assert counts["examples"] >= MAX_EXAMPLES and counts["prepared"] > 10 and counts["DataError"] > 10


# ---- what the fuzzer found (fixed since; kept as regression tests) -------------------------
def test_deeply_nested_jsonl_line_is_a_data_error(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "d.jsonl").write_text('{"text": "ok"}\n' + "[" * 100_000 + "\n")
    with pytest.raises(DataError, match=r"d.jsonl:2"):
        prep.prepare([str(tmp_path / "in")], tmp_path / "out", workers=1, progress=False)
    assert not (tmp_path / "out").exists()


def test_hf_state_listing_a_missing_file_is_a_data_error(tmp_path):
    ds = tmp_path / "in" / "ds"
    ds.mkdir(parents=True)
    (ds / "state.json").write_text(json.dumps({"_data_files": [{"filename": "missing.arrow"}]}))
    (ds / "data-00000-of-00001.arrow").write_bytes(b"")
    with pytest.raises(DataError, match="missing.arrow"):
        prep.prepare([str(tmp_path / "in")], tmp_path / "out", workers=1, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


@pytest.mark.parametrize("files", [
    {"dataset_dict.json": b'{"splits": 5}', "a.txt": b"hello"},
    {"dataset_dict.json": b'{"splits": [5]}', "a.txt": b"hello"},
    {"ds/state.json": b'{"_data_files": 5}', "ds/x.arrow": b"zz"},
    {"ds/state.json": b'{"_data_files": [{"filename": 5}]}', "ds/x.arrow": b"zz"},
], ids=["splits-int", "splits-list-of-int", "data-files-int", "filename-int"])
def test_hf_metadata_of_the_wrong_type_is_a_data_error(tmp_path, files):
    for name, data in files.items():
        (tmp_path / "in" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "in" / name).write_bytes(data)
    with pytest.raises(DataError):
        prep.prepare([str(tmp_path / "in")], tmp_path / "out", workers=1, progress=False)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_damaged_arrow_in_hf_folder_is_a_data_error(tmp_path, damage):
    pytest.importorskip("pyarrow")
    ds = tmp_path / "in" / "ds"
    ds.mkdir(parents=True)
    (ds / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data.arrow"}]}))
    if damage == "garbage":
        data = b"\x00\x00\x00\x80"
    else:  # a shard cut short after a record batch's header (its body missing), as a killed copy leaves it
        full = _arrow_bytes(pa.table({"text": pa.array(["a document", "another"], type=pa.string())}), "arrow")
        data = full[:len(full) - 8 - 24]  # no end-of-stream marker, body of the last batch cut
    (ds / "data.arrow").write_bytes(data)
    with pytest.raises(DataError, match="data.arrow"):
        prep.prepare([str(tmp_path / "in")], tmp_path / "out", workers=1, progress=False)


def test_damaged_parquet_errors_are_one_line(tmp_path):
    """Every one-byte change of a small Parquet file: prepared, or DataError on one line
    (pyarrow's own messages span lines; DataError flattens them)."""
    pytest.importorskip("pyarrow")
    data = _arrow_bytes(pa.table({"text": pa.array(["a document", None], type=pa.string())}), "parquet")
    outcomes = Counter()
    for i in range(len(data)):
        src, out = tmp_path / f"in{i}", tmp_path / f"out{i}"
        src.mkdir()
        (src / "t.parquet").write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:])
        try:
            prep.prepare([str(src)], out, workers=1, progress=False)
            outcomes["prepared"] += 1
        except DataError as e:
            assert "\n" not in str(e) and str(src) in str(e), repr(str(e))
            assert not out.exists()
            outcomes["DataError"] += 1
    assert outcomes["DataError"] > len(data) // 4, outcomes
