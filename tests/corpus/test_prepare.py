"""prepare: input formats, determinism, splits, atomic output, re-runs, and bad inputs."""
import gzip
import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest

from distlm.corpus import pool
from distlm.corpus import prepare as prep
from distlm.corpus.sources import read_token_file
from distlm.data import DataError, load_manifest, verify_shards
from distlm.data import tokenizer as tkz

DOCS = [f"Document number {i}: " + "the quick brown fox jumps over the lazy dog. " * (3 + i % 4) + f"End {i}."
        for i in range(24)]


def run(inputs, out, **kw):
    kw.setdefault("workers", 1)
    kw.setdefault("progress", False)
    return prep.prepare([str(i) for i in inputs], out, **kw)


def write_docs(folder: Path, docs=DOCS, suffix=".txt") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (folder / f"doc{i:03d}{suffix}").write_text(doc, encoding="utf-8")
    return folder


def split_docs(out: Path) -> dict:
    """Each split's documents, decoded from the shards."""
    m = load_manifest(out)
    tok = tkz.load_tokenizer(m["tokenizer"]["name"], out)
    result = {}
    for name, split in m["splits"].items():
        ids = np.concatenate([np.fromfile(out / s["file"], dtype=m["dtype"]) for s in split["shards"]] or [[]])
        cuts = np.flatnonzero(ids == tok.eos_id)
        assert len(cuts) == split["documents"] and (len(ids) == 0 or cuts[-1] == len(ids) - 1)
        result[name] = [tok.decode(part[:-1].tolist()) for part in np.split(ids, cuts + 1)[:-1]]
    return result


def assert_clean(out: Path, exists: bool = False):
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    assert leftovers == [] and out.exists() == exists


def shard_bytes(out: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.suffix in (".bin", ".json")
            and p.name != "manifest.json"}


def without_created(manifest: dict) -> dict:
    return {k: v for k, v in manifest.items() if k != "created"}


def test_text_folder_gpt2(tmp_path):
    out = tmp_path / "out"
    m = run([write_docs(tmp_path / "in")], out, val_fraction=0.2)
    assert m["format_version"] == 1 and m["dtype"] == "uint16" and m["split_method"] == "document-hash"
    assert m["tokenizer"] == {"name": "gpt2", "fingerprint": tkz.gpt2().fingerprint(), "vocab_size": 50257,
                              "eos_id": 50256, "file": None}
    assert m["sources"] == [{"path": str(tmp_path / "in"), "files": 24, "bytes": sum(len(d) for d in DOCS)}]
    assert m["stats"]["documents"] == 24 and m["stats"]["text_bytes"] == sum(len(d) for d in DOCS)
    docs = split_docs(out)
    assert docs["val"] and docs["train"] and not set(docs["val"]) & set(docs["train"])
    assert sorted(docs["train"] + docs["val"]) == sorted(DOCS)
    assert m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"] == sum(
        len(tkz.gpt2().encode(d)) + 1 for d in DOCS)
    verify_shards(out, m)
    assert load_manifest(out) == m
    assert_clean(out, exists=True)


def test_deterministic_across_runs_and_workers(tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "TASK_CHARS", 300)  # many small tasks, so order really is tested
    monkeypatch.setattr(tkz.GPT2Tokenizer, "chunk_chars", 100)
    src = write_docs(tmp_path / "in")
    a, b = run([src], tmp_path / "a", shard_tokens=500), run([src], tmp_path / "b", shard_tokens=500, workers=2)
    assert len(a["splits"]["train"]["shards"]) > 2
    assert without_created(a) == without_created(b)
    assert shard_bytes(tmp_path / "a") == shard_bytes(tmp_path / "b")
    assert all(s["tokens"] <= 500 for split in a["splits"].values() for s in split["shards"])


@pytest.mark.parametrize("tokenizer", ["gpt2", "bpe:300"])
def test_big_corpora_read_twice_give_the_same_shards(tmp_path, monkeypatch, tokenizer):
    src = write_docs(tmp_path / "in")
    a = run([src], tmp_path / "a", tokenizer=tokenizer)
    monkeypatch.setattr(prep, "CACHE_CHARS", 500)  # keeps only the first few documents in memory
    monkeypatch.setattr(prep, "TASK_CHARS", 300)
    b = run([src], tmp_path / "b", tokenizer=tokenizer, workers=2)
    assert without_created(a) == without_created(b)
    assert shard_bytes(tmp_path / "a") == shard_bytes(tmp_path / "b")


def test_spawned_workers_give_the_same_shards(tmp_path, monkeypatch):
    monkeypatch.setattr(pool, "START_METHOD", "spawn")
    monkeypatch.setattr(prep, "TASK_CHARS", 2000)
    src = write_docs(tmp_path / "in")
    a, b = run([src], tmp_path / "a"), run([src], tmp_path / "b", workers=2)
    assert without_created(a) == without_created(b)
    assert shard_bytes(tmp_path / "a") == shard_bytes(tmp_path / "b")


def test_rerun_is_a_noop_and_new_options_replace(tmp_path, capsys):
    src, out = write_docs(tmp_path / "in"), tmp_path / "out"
    first = run([src], out)
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert run([src], out) == first
    assert "up to date" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    second = run([src], out, val_fraction=0.5)
    assert second["val_fraction"] == 0.5 and second["inputs_fingerprint"] != first["inputs_fingerprint"]
    assert load_manifest(out) == second
    (src / "doc000.txt").write_text("changed text", encoding="utf-8")
    assert run([src], out, val_fraction=0.5)["inputs_fingerprint"] != second["inputs_fingerprint"]
    assert_clean(out, exists=True)


def test_refuses_to_replace_a_folder_that_is_not_prepared_data(tmp_path):
    out = tmp_path / "home"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(DataError, match="refusing"):
        run([write_docs(tmp_path / "in")], out)
    assert (out / "precious.txt").read_text() == "keep me"


def test_stale_temp_folders_are_recovered(tmp_path):
    src, out = write_docs(tmp_path / "in"), tmp_path / "out"
    run([src], out)
    dead = 2 ** 22 + 12345  # above Linux's default pid_max, so no such process
    os.replace(out, tmp_path / f".out.old-{dead}")  # as if killed between the two renames
    (tmp_path / f".out.tmp-{dead}").mkdir()
    run([src], out)
    assert_clean(out, exists=True)


def test_jsonl_gzip_tar_and_glob_inputs(tmp_path):
    lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(DOCS[:8])] + ["", json.dumps({"text": None})]
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as fh:
        fh.write("\n".join(json.dumps({"body": d}) for d in DOCS[8:12]))
    with gzip.open(tmp_path / "c.txt.gz", "wt", encoding="utf-8") as fh:
        fh.write(DOCS[12])
    with tarfile.open(tmp_path / "d.tar.xz", "w:xz") as tar:
        for i, doc in enumerate(DOCS[13:16]):
            info = tarfile.TarInfo(f"books/{i}.txt")
            info.size = len(doc.encode())
            tar.addfile(info, io.BytesIO(doc.encode()))
    write_docs(tmp_path / "globbed", DOCS[16:20])
    out = tmp_path / "out"
    m = run([tmp_path / "a.jsonl", tmp_path / "c.txt.gz", tmp_path / "d.tar.xz", tmp_path / "glob*/*.txt"], out)
    docs = split_docs(out)
    assert sorted(docs["train"] + docs["val"]) == sorted(DOCS[:8] + DOCS[12:20])
    assert m["stats"]["empty_documents"] == 0 and m["sources"][3]["files"] == 4
    run([tmp_path / "b.jsonl.gz"], tmp_path / "out2", text_field="body")
    assert sorted(sum(split_docs(tmp_path / "out2").values(), [])) == sorted(DOCS[8:12])


def test_separator_hidden_files_and_recursion(tmp_path):
    folder = tmp_path / "in"
    (folder / "sub" / "deeper").mkdir(parents=True)
    (folder / "sub" / "deeper" / "all.txt").write_text("<|sep|>".join(DOCS[:5]) + "<|sep|>\n<|sep|>")
    (folder / ".hidden.txt").write_text("should not appear")
    m = run([folder], tmp_path / "out", separator="<|sep|>")
    assert sorted(sum(split_docs(tmp_path / "out").values(), [])) == sorted(DOCS[:5])
    assert m["stats"]["empty_documents"] == 2


def test_parquet_and_hf_arrow_folder(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    table = pa.table({"text": DOCS[:6], "n": list(range(6))})
    pq.write_table(table, tmp_path / "a.parquet")
    hf = tmp_path / "hf_ds"
    hf.mkdir()
    for k, part in enumerate((table.slice(0, 3), table.slice(3, 3))):
        with pa.ipc.new_stream(hf / f"data-{k:05d}-of-00002.arrow", part.schema) as writer:
            writer.write_table(part)
    (hf / "dataset_info.json").write_text("{}")
    (hf / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00001-of-00002.arrow"},
                                                               {"filename": "data-00000-of-00002.arrow"}]}))
    with pa.ipc.new_file(tmp_path / "f.arrow", table.schema) as writer:  # the random-access format
        writer.write_table(table)
    for src in ("a.parquet", "hf_ds", "f.arrow"):
        out = tmp_path / f"out-{src}"
        run([tmp_path / src], out)
        assert sorted(sum(split_docs(out).values(), [])) == sorted(DOCS[:6])
    with pytest.raises(DataError, match="no column 'body'.*text, n"):
        run([tmp_path / "a.parquet"], tmp_path / "out3", text_field="body")
    assert_clean(tmp_path / "out3")


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    (tmp_path / "a.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"a\.parquet: reading Parquet/Arrow needs pyarrow"):
        run([tmp_path / "a.parquet"], tmp_path / "out")
    assert_clean(tmp_path / "out")


def test_bpe_trains_on_train_documents_only(tmp_path):
    rare = "zqj" * 400
    docs = [" ".join(DOCS), rare]
    seed = next(s for s in range(100)  # a seed whose hash puts the rare document in val
                if _key(rare, s) < _key(docs[0], s))
    for i, doc in enumerate(docs):
        (tmp_path / f"{i}.txt").write_text(doc)
    out = tmp_path / "out"
    m = run([tmp_path / "0.txt", tmp_path / "1.txt"], out, tokenizer="bpe:300", val_fraction=0.5, seed=seed)
    assert m["tokenizer"]["name"] == "bpe:300" and m["tokenizer"]["file"] == "tokenizer.json"
    assert m["tokenizer"]["vocab_size"] <= 300
    assert split_docs(out) == {"train": [docs[0]], "val": [rare]}
    tok = tkz.load_tokenizer("bpe:300", out)
    assert tok.fingerprint() == m["tokenizer"]["fingerprint"]
    assert len(tok.encode("zqjzqj")) >= 4  # never saw it: no merges for it
    verify_shards(out)


def _key(text: str, seed: int) -> float:
    digest = hashlib.blake2b(text.encode(), digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "big") / 2.0 ** 64


def test_single_document_is_split_by_tokens(tmp_path):
    (tmp_path / "input.txt").write_text(DOCS[5] * 20)
    m = run([tmp_path / "input.txt"], tmp_path / "out", val_fraction=0.1)
    assert m["split_method"] == "single-document-tail"
    train, val = m["splits"]["train"]["tokens"], m["splits"]["val"]["tokens"]
    assert val == round((train + val) * 0.1)
    ids = np.concatenate([np.fromfile(tmp_path / "out" / f"{s}_000000.bin", "<u2") for s in ("train", "val")])
    assert ids.tolist() == tkz.gpt2().encode(DOCS[5] * 20) + [50256]


def test_val_fraction_zero_leaves_val_empty(tmp_path):
    m = run([write_docs(tmp_path / "in")], tmp_path / "out", val_fraction=0)
    assert m["splits"]["val"] == {"tokens": 0, "documents": 0, "shards": []}


@pytest.mark.parametrize("header", [False, True])
def test_pretokenized_bin_files(tmp_path, header):
    rng = np.random.default_rng(0)
    data = {s: rng.integers(0, 50257, n).astype("<u2") for s, n in (("train", 3000), ("val", 500))}
    folder = tmp_path / "nanogpt"
    folder.mkdir()
    for split, tokens in data.items():
        with open(folder / f"{split}.bin", "wb") as fh:
            if header:
                fh.write(np.array([20240520, 1, len(tokens)] + [0] * 253, "<i4").tobytes())
            fh.write(tokens.tobytes())
    out = tmp_path / "out"
    m = run([folder], out, shard_tokens=1000)
    assert m["split_method"] == "pretokenized" and m["tokenizer"]["name"] == "gpt2"
    assert [len(s["shards"]) for s in m["splits"].values()] == [3, 1]
    for split, tokens in data.items():
        got = np.concatenate([np.fromfile(out / s["file"], "<u2") for s in m["splits"][split]["shards"]])
        assert np.array_equal(got, tokens)
        assert np.array_equal(read_token_file(folder / f"{split}.bin"), tokens)
    verify_shards(out, m)
    m2 = run([folder / "val.bin", folder / "train.bin"], tmp_path / "out2", shard_tokens=1000)
    assert m2["splits"] == m["splits"]


def test_bad_pretokenized_files(tmp_path):
    (tmp_path / "train.bin").write_bytes(np.array([20240520, 1, 100] + [0] * 253, "<i4").tobytes() + b"\0" * 10)
    (tmp_path / "val.bin").write_bytes(b"\1\0\2")
    with pytest.raises(DataError, match=r"train\.bin: header promises 100 tokens"):
        run([tmp_path], tmp_path / "out")
    (tmp_path / "train.bin").write_bytes(b"\1\0")
    with pytest.raises(DataError, match=r"val\.bin: odd size 3"):
        run([tmp_path / "train.bin", tmp_path / "val.bin"], tmp_path / "out")
    with pytest.raises(DataError, match="tokenizer 'bpe:300' cannot apply"):
        run([tmp_path], tmp_path / "out", tokenizer="bpe:300")
    (tmp_path / "meta.pkl").write_bytes(b"x")
    with pytest.raises(DataError, match="meta.pkl"):
        run([tmp_path], tmp_path / "out")
    assert_clean(tmp_path / "out")


def test_invalid_utf8_is_replaced_and_counted(tmp_path):
    write_docs(tmp_path / "in", DOCS[:3])
    (tmp_path / "in" / "latin1.txt").write_bytes(b"Caf\xe9 and na\xefve, already " + "\ufffd".encode())
    m = run([tmp_path / "in"], tmp_path / "out")
    assert m["stats"]["files_with_invalid_utf8"] == 1 and m["stats"]["replaced_chars"] == 2
    assert "Caf\ufffd and na\ufffdve, already \ufffd" in sum(split_docs(tmp_path / "out").values(), [])


@pytest.mark.parametrize("case, message", [
    ("missing", r"nope\.txt: no such file or directory"),
    ("empty", r"no documents in .*empty\.txt"),
    ("binary", r"no documents in .*1 binary skipped"),
    ("bad_json", r"bad\.jsonl:3: invalid JSON"),
    ("no_field", r"nofield\.jsonl:2: no 'text' field \(found: content\)"),
    ("glob", r"nothing\*\.txt: no files match"),
    ("tokenizer", r"unknown tokenizer 'gpt-5'"),
    ("val_fraction", r"val_fraction 1\.5"),
])
def test_bad_inputs_fail_cleanly(tmp_path, case, message):
    inputs = {"missing": "nope.txt", "empty": "empty.txt", "binary": "bin", "bad_json": "bad.jsonl",
              "no_field": "nofield.jsonl", "glob": "nothing*.txt", "tokenizer": "ok.txt", "val_fraction": "ok.txt"}
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "blob.dat").write_bytes(b"\x7fELF\0\0\1\2" * 100)
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{"text": oops}\n')
    (tmp_path / "nofield.jsonl").write_text('{"text": "a"}\n{"content": "b"}\n')
    (tmp_path / "ok.txt").write_text("fine")
    kw = {"tokenizer": "gpt-5"} if case == "tokenizer" else {"val_fraction": 1.5} if case == "val_fraction" else {}
    out = tmp_path / "out"
    with pytest.raises(DataError, match=message):
        run([tmp_path / inputs[case]], out, **kw)
    assert_clean(out)


def test_load_manifest_and_verify_errors(tmp_path):
    with pytest.raises(DataError, match=str(tmp_path / "manifest.json")):
        load_manifest(tmp_path)
    out = tmp_path / "out"
    m = run([write_docs(tmp_path / "in", DOCS[:4])], out)
    shard = out / m["splits"]["train"]["shards"][0]["file"]
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=f"{shard}: sha256"):
        verify_shards(out)
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(DataError, match=str(shard)):
        verify_shards(out, m)
    (out / "manifest.json").write_text("{")
    with pytest.raises(DataError, match="not a valid JSON manifest"):
        load_manifest(out)


def test_a_folder_with_only_train_bin_is_text(tmp_path):
    folder = write_docs(tmp_path / "in", DOCS[:3])
    (folder / "model_train.bin").write_bytes(np.arange(5000, dtype="<u2").tobytes())
    m = run([folder], tmp_path / "out")
    assert m["split_method"] == "document-hash" and m["stats"]["skipped_binary"] == 1
    assert m["stats"]["binary_examples"] == [str(folder / "model_train.bin")]


@pytest.mark.parametrize("files, message", [
    ({"d.jsonl": '{"text": "ok"}\n' + "[" * 100_000 + "\n"}, r"d\.jsonl:2: invalid JSON"),
    ({"ds/state.json": '{"_data_files": [{"filename": "gone.arrow"}]}', "ds/x.arrow": ""}, r"gone\.arrow: listed in"),
    ({"ds/state.json": '{"_data_files": [{"filename": 5}]}', "ds/x.arrow": ""}, r"state\.json: '_data_files'"),
    ({"dataset_dict.json": '{"splits": 5}', "a.txt": "hello"}, r"dataset_dict\.json: 'splits'"),
    ({"ds/state.json": "{}", "ds/x.arrow": "\0\0\0\x80"}, r"x\.arrow: not a readable Arrow file"),
])
def test_malformed_structured_inputs_fail_cleanly(tmp_path, files, message):
    for name, data in files.items():
        (tmp_path / "in" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "in" / name).write_text(data)
    if "arrow" in message:
        pytest.importorskip("pyarrow")
    with pytest.raises(DataError, match=message):
        run([tmp_path / "in"], tmp_path / "out")
    assert_clean(tmp_path / "out")


def test_data_error_messages_are_one_line():
    assert str(DataError("x.parquet: broken (pyarrow says:\nline two\r\n  three)")) == \
        "x.parquet: broken (pyarrow says: line two three)"
