"""The parts of prepare that make it fast without changing a byte: hashing a huge one-document
text file as bytes, the task size, and handing out a huge document's pieces while its hash runs."""
import hashlib
import json

import pytest

from distlm.corpus import prepare as prep
from distlm.corpus import units

TRICKY = [b"", b"\r", b"\r\n", b"\xef\xbb\xbf", b"\xef\xbb\xbfa\r\nb", b"a\r", b"a\r\r\n\r\nb\r",
          "caf\u00e9 \u4e2d\u6587 \U0001f600\r\n".encode() * 7, b"ok \xff bad \xc3", b"\xed\xa0\x80 surrogate",
          b"\r\n".join(f"line {i} \u00e9".encode() for i in range(50))]


def text_digest(label: str, path: str, block: int) -> bytes:
    digest = hashlib.blake2b(digest_size=8, key=b"7")
    for text in units.text_blocks(label, path, block):
        digest.update(text.encode("utf-8"))
    return digest.digest()


@pytest.mark.parametrize("data", TRICKY)
def test_bytes_hash_equals_the_text_hash(data, tmp_path):
    """Every block size, so that BOMs, '\\r\\n' pairs and multi-byte characters fall across block
    ends; invalid UTF-8 falls back to the text path."""
    path = tmp_path / "doc.txt"
    path.write_bytes(data)
    want = text_digest("doc", str(path), 1 << 20)
    for block in range(1, len(data) + 2):
        got = units.hash_text_file("doc", str(path), lambda: hashlib.blake2b(digest_size=8, key=b"7"), block)
        assert got == want, block


def test_task_size_follows_the_corpus_not_the_workers():
    assert prep.task_chars(10 << 30) == prep.TASK_CHARS  # big corpora: the largest tasks
    assert prep.task_chars(600 << 20) == (600 << 20) // prep.TASKS_PER_CORPUS  # 600 MB: ~1.2 MB, 512 tasks
    assert prep.task_chars(5 << 20) == prep.TASK_MIN_CHARS


def test_small_files_make_many_tasks_on_a_mid_size_corpus(tmp_path, monkeypatch):
    """600 files of 1 KB, scaled down from 600 files of 1 MB: one task per file, not 8 per task."""
    monkeypatch.setattr(prep, "TASK_MIN_CHARS", 1000)
    monkeypatch.setattr(prep, "TASKS_PER_CORPUS", 512)
    for i in range(600):
        (tmp_path / "in").mkdir(exist_ok=True)
        (tmp_path / "in" / f"{i:04d}.txt").write_text(f"document {i} " + "word " * 200)
    seen = []
    real = prep.plan_units

    def spy(files, separator, target):
        seen.append(target)
        return real(files, separator, target)

    monkeypatch.setattr(prep, "plan_units", spy)
    prep.prepare([str(tmp_path / "in")], tmp_path / "out", workers=1, progress=False)
    assert seen and seen[0] <= 1300


def test_pieces_are_handed_out_while_their_hash_runs(tmp_path, monkeypatch):
    """A one-document file in ~75 pieces, two workers, room for 5 tasks ahead. While the document's
    hash is still being computed, every piece is handed out (no worker waits for the one hashing the
    whole file); once it is done, or when it is computed in this process, the bound holds again (the
    pieces' token files do not pile up on disk). The output is the same as with one worker."""
    import contextlib
    from concurrent.futures import Future

    from distlm.corpus import build, pool
    monkeypatch.setattr(prep, "TASK_CHARS", 2000)
    doc = tmp_path / "book.txt"
    doc.write_text(" ".join(f"word{i}" for i in range(16000)))
    submitted, at_hash = [], []

    class Later(Future):
        """A worker's future that finishes only when waited for: the hash is still running."""

        def __init__(self, compute):
            super().__init__()
            self.compute = compute

        def result(self, timeout=None):
            if not self.done():
                self.set_result(self.compute())
            return super().result()

    class Recording(pool._Inline):
        hash_later = True

        def run(self, fn, *args):
            submitted.append(args[1].kind)
            if args[1].kind == "hash" and self.hash_later:
                return Later(lambda: fn(self.tok, *args))
            return super().run(fn, *args)

    @contextlib.contextmanager
    def executor(workers, tok):
        yield Recording(tok)

    real_result = build._result

    def result(future):
        got = real_result(future)
        if "key" in got:
            at_hash.append(len(submitted))
        return got

    monkeypatch.setattr(build.workers_pool, "open_executor", executor)
    monkeypatch.setattr(build, "_result", result)
    two = prep.prepare([str(doc)], tmp_path / "two", workers=2, progress=False)
    pieces = submitted.count("piece")
    assert pieces >= 70 and at_hash == [pieces + 1]

    submitted.clear(), at_hash.clear()
    Recording.hash_later = False  # a hash already done: the bound of (2 * 2 + 1) * 2000 bytes holds
    prep.prepare([str(doc)], tmp_path / "done", workers=2, progress=False)
    assert at_hash and at_hash[0] <= 1 + 5 + 1

    monkeypatch.undo()
    monkeypatch.setattr(prep, "TASK_CHARS", 2000)
    one = prep.prepare([str(doc)], tmp_path / "one", workers=1, progress=False)
    for name in ("train", "val"):
        assert [s["sha256"] for s in two["splits"][name]["shards"]] == \
               [s["sha256"] for s in one["splits"][name]["shards"]]


# JSONL lines where a fast parser could differ from json: duplicate keys, escapes, surrogates (paired
# and lone), invalid UTF-8, NaN, huge integers, null and non-string texts, other fields, a BOM, blanks.
JSONL_LINES = [b'{"text": "plain"}', b'{"text": "a", "text": "b", "id": 3}', b'{"t\\u0065xt": "escaped key"}',
               b'{"text": "caf\\u00e9 \\ud83d\\ude00 \\u0000 tab\\t"}', b'{"text": "lone \\ud800 high"}',
               b'{"text": "bad \xff byte"}', b'{"text": "caf\xc3\xa9 raw"}', b'{"text": null}', b'   ',
               b'{"meta": {"a": [1, 2.5, NaN, 1e400]}, "text": "with NaN"}', b'{"n": 123456789012345678901234567890, "text": "big"}',
               b'{"text": "ok"} \r', b'{"text": "\\ud800\\udc00 pair"}', b'\xef\xbb\xbf{"text": "bom"}']
JSONL_BAD = [b'{"text": 123456789012345678901234567890}', b'{"text": 5}', b'{"body": "x"}', b'[1, 2]', b'{"text": "x"} junk',
             b'{"text": "a\tb"}', b'\xef\xbb\xbf{"text": "bom"}']


def jsonl_read(lines: list[bytes], loads) -> tuple:
    """The documents, statistics and error of reading ``lines`` as one JSONL file with ``loads``
    as the fast parser (None: json alone)."""
    import io

    from distlm.corpus import formats
    saved, formats._FAST_LOADS = formats._FAST_LOADS, loads
    stats = formats.SourceStats()
    docs, error = [], None
    try:
        docs = list(formats._jsonl_docs("f.jsonl", io.BytesIO(b"\n".join(lines) + b"\n"), "text", stats))
    except formats.DataError as e:
        error = str(e)
    finally:
        formats._FAST_LOADS = saved
    return docs, stats.as_dict(), error


def _loaders():
    import json
    counted = []

    def json_on_bytes(raw):  # the fast path's contract (bytes in, ValueError out), run by json
        counted.append(raw)
        return json.loads(raw.decode("utf-8"))  # strict: UnicodeDecodeError is a ValueError

    out = [pytest.param((json_on_bytes, counted), id="json-as-fast-parser")]
    try:
        import orjson
        out.append(pytest.param((orjson.loads, None), id="orjson"))
    except ImportError:
        out.append(pytest.param(None, id="orjson", marks=pytest.mark.skip(reason="orjson not installed")))
    return out


@pytest.mark.parametrize("loader", _loaders())
def test_a_fast_json_parser_reads_jsonl_as_json_does(loader):
    """With a fast parser (orjson where installed) every line gives what json alone gives: the
    same documents, replacement counts and error messages; the fast parser reads the lines it can."""
    loads, counted = loader
    good = [line for line in JSONL_LINES if not line.startswith(b"\xef")]
    assert jsonl_read(good, loads) == jsonl_read(good, None)
    assert jsonl_read(good, None)[0][2] == ("f.jsonl:3", "escaped key")
    if counted is not None:
        assert len(counted) == len([line for line in good if line.strip()])
    for bad in JSONL_BAD:
        lines = [b'{"text": "first"}', bad]
        want = jsonl_read(lines, None)
        assert want[2] is not None and want[2].startswith("f.jsonl:2: ")
        assert jsonl_read(lines, loads) == want


@pytest.mark.skipif(__import__("sys").platform != "linux", reason="workers are forked on Linux only")
def test_forked_workers_inherit_what_encoding_imports():
    """numpy (encoding to shard bytes imports it on first use) is loaded in the parent before the
    fork, so no worker pays for importing it again; in a fresh process, where nothing loaded it."""
    import subprocess
    import sys
    code = ("import sys\n"
            "from distlm.corpus import pool\n"
            "from distlm.data.tokenizer import gpt2\n"
            "def loaded(tok):\n"
            "    return 'numpy' in sys.modules\n"
            "with pool.open_executor(2, gpt2()) as ex:\n"
            "    print('before-first-task', ex.run(loaded).result())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "before-first-task True" in out.stdout


def _one_file_units(tmp_path, name: str, data: str, target: int) -> list:
    path = tmp_path / name
    path.write_text(data)
    return units.plan_units([(name, str(path), False)], None, target)


@pytest.mark.parametrize("name, line", [("doc.txt", "word{} "), ("docs.jsonl", '{{"text": "document {}"}}\n')])
def test_a_file_a_little_over_the_task_size_stays_one_task(tmp_path, name, line):
    """1.3 x the task size: one task, not a full one and a sliver (and, for one document, a hash task)."""
    data, i = "", 0
    while len(data) < 13_000:
        data, i = data + line.format(i), i + 1
    assert [u.kind for u in _one_file_units(tmp_path, name, data, 10_000)] == ["files"]


@pytest.mark.parametrize("name, line", [("doc.txt", "word{} "), ("docs.jsonl", '{{"text": "document {}"}}\n')])
def test_a_big_file_is_cut_into_ranges_of_one_size(tmp_path, name, line):
    """10.3 x the task size: 10 ranges within a few percent of each other, no short last one."""
    data, i = "", 0
    while len(data) < 103_000:
        data, i = data + line.format(i), i + 1
    sizes = [u.size for u in _one_file_units(tmp_path, name, data, 10_000) if u.kind != "hash"]
    assert len(sizes) == 10 and sum(sizes) == len(data)
    assert max(sizes) / min(sizes) < 1.01


def _tokens(out, manifest, split: str) -> list:
    import numpy as np
    return np.concatenate([np.fromfile(out / s["file"], "<u2") for s in manifest["splits"][split]["shards"]]
                          or [np.zeros(0, "<u2")]).tolist()


@pytest.fixture
def fed(monkeypatch):
    """The token bytes the fallback routes anew (what it rereads, rewrites and syncs)."""
    from distlm.corpus import shards
    seen, real = [], shards.Router.feed

    def spy(self, data):
        seen.append(memoryview(data).nbytes)
        return real(self, data)

    monkeypatch.setattr(shards.Router, "feed", spy)
    return seen


def test_a_lone_document_moves_only_its_tail(tmp_path, fed):
    """The lone document's last tenth goes to val; the rest stays where it was written (the shard
    holding the cut is cut in place), instead of every token being copied anew."""
    from distlm.data import tokenizer as tkz
    from distlm.data import verify_shards
    text = " ".join(f"word{i % 97}x{i % 13}" for i in range(3000))
    (tmp_path / "doc.txt").write_text(text)
    out = tmp_path / "out"
    m = prep.prepare([str(tmp_path / "doc.txt")], out, workers=1, progress=False, val_fraction=0.1, shard_tokens=700)
    assert m["split_method"] == "single-document-tail"
    verify_shards(out, m)
    want = tkz.gpt2().encode(text) + [tkz.gpt2().eos_id]
    train, val = _tokens(out, m, "train"), _tokens(out, m, "val")
    assert train + val == want and len(val) == round(len(want) * 0.1)
    assert [s["tokens"] for s in m["splits"]["train"]["shards"][:-1]] == [700] * (len(train) // 700)
    assert sum(fed) == 2 * len(val)


def test_a_document_moved_to_val_leaves_the_tokens_before_it(tmp_path, fed):
    """No document hashes to val: the lowest-key one moves there, from the middle of a split
    written in many shards; only the tokens from it on are routed anew, and the tokens are where
    rewriting the whole split put them."""
    from distlm.corpus.split import seed_key, split_key
    from distlm.data import tokenizer as tkz
    from distlm.data import verify_shards
    docs = [" ".join(f"w{(i * 7 + j) % 50}" for j in range(30 + i % 40)) for i in range(80)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "out"
    m = prep.prepare([str(tmp_path / "docs.jsonl")], out, workers=1, progress=False, val_fraction=1e-12,
                     shard_tokens=500)
    verify_shards(out, m)
    tok = tkz.gpt2()
    encoded = [tok.encode(d) + [tok.eos_id] for d in docs]
    moved = min(range(len(docs)), key=lambda i: split_key(docs[i].encode(), seed_key(0)))
    assert _tokens(out, m, "val") == encoded[moved]
    assert _tokens(out, m, "train") == [t for i, e in enumerate(encoded) if i != moved for t in e]
    after = sum(len(e) for e in encoded[moved:])
    assert 0 < moved and sum(fed) == 2 * after
