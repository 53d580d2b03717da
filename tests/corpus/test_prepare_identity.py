"""prepare's output, byte for byte, on the three corpus shapes of the prepare speed benchmark.

The digests in fixtures/prepare_identity/digests.json were computed with prepare as of commit
5ec28ac (2026-11-27), before its worker pipeline was reworked for speed: every shard's name,
token count and sha256, the documents per split and the split method must stay exactly those,
at 1 and 4 workers and however the inputs are cut into tasks. The corpora are built here from
the bundled Gutenberg books (benchmarks/tools/prepare_speed.py's build_corpora, deterministic); their own
digests are in the fixture too, so that a change to the corpus builder is told apart from a
change to prepare.

To recompute (only when the output is meant to change): PYTHONPATH=. python tests/corpus/test_prepare_identity.py
"""
import hashlib
import json
import sys
from pathlib import Path

import pytest

from distlm.corpus import prepare as prep

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "tools"))
from prepare_speed import build_corpora  # noqa: E402  (the lab's corpus builder)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "prepare_identity" / "digests.json"
SHAPES = ["small-files", "jsonl", "huge"]
SIZE_MB = 2.0
FILES = {"small_file_bytes": 64 << 10, "jsonl_file_bytes": 256 << 10}  # many files at 2 MB a corpus
OPTIONS = {"seed": 7, "val_fraction": 0.05, "shard_tokens": 150_000}
TASK = 256 << 10  # input bytes per task: the 2 MB files are cut into ranges, the small ones batched


def corpus_digest(path: Path) -> str:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return digest.hexdigest()


def output_digest(manifest: dict) -> str:
    """What must not change: the shards (name, tokens, sha256), documents per split, the split
    method, the tokenizer and the reading statistics (not the paths, not the creation time)."""
    kept = {k: manifest[k] for k in ("splits", "split_method", "dtype", "tokenizer", "stats")}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


def prepared(path: str, out: Path, workers: int) -> str:
    manifest = prep.prepare([path], out, workers=workers, progress=False, **OPTIONS)
    return output_digest(manifest)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict:
    return build_corpora(SHAPES, SIZE_MB, tmp_path_factory.mktemp("corpora"), [], **FILES)


def test_corpora_are_the_recorded_ones(corpora):
    want = json.loads(FIXTURE.read_text())
    assert sorted(corpora) == sorted(want["corpora"])
    for name, path in corpora.items():
        assert corpus_digest(Path(path)) == want["corpora"][name], name


@pytest.mark.parametrize("workers", [1, 4])
def test_output_is_byte_identical_to_the_recorded_one(corpora, workers, tmp_path, monkeypatch):
    """Each shape at 1 and 4 workers, with tasks small enough that files are batched and the
    single big files are cut into ranges (pieces of the one .txt document)."""
    monkeypatch.setattr(prep, "TASK_CHARS", TASK)
    want = json.loads(FIXTURE.read_text())["outputs"]
    got = {name: prepared(path, tmp_path / name, workers) for name, path in corpora.items()}
    assert got == want


def _json_parsers():
    import json
    out = [pytest.param(None, id="json"),
           pytest.param(lambda raw: json.loads(raw.decode("utf-8")), id="json-as-fast-parser")]
    try:
        import orjson
        out.append(pytest.param(orjson.loads, id="orjson"))
    except ImportError:
        out.append(pytest.param(None, id="orjson", marks=pytest.mark.skip(reason="orjson not installed")))
    return out


@pytest.mark.parametrize("workers", [1, 4])
@pytest.mark.parametrize("loads", _json_parsers())
def test_jsonl_output_is_the_same_with_either_json_parser(corpora, workers, loads, tmp_path, monkeypatch):
    """The JSONL shapes with json alone and with a fast parser (orjson where installed; forked
    workers inherit the choice)."""
    from distlm.corpus import formats
    monkeypatch.setattr(formats, "_FAST_LOADS", loads)
    monkeypatch.setattr(prep, "TASK_CHARS", TASK)
    want = json.loads(FIXTURE.read_text())["outputs"]
    for name in ("jsonl", "huge-jsonl"):
        assert prepared(corpora[name], tmp_path / name, workers) == want[name], name


def test_default_task_size_gives_the_same_bytes(corpora, tmp_path):
    """The output does not depend on how the inputs are cut into tasks."""
    want = json.loads(FIXTURE.read_text())["outputs"]
    for name in ("small-files", "huge-txt"):
        assert prepared(corpora[name], tmp_path / name, 2) == want[name], name


def _write_fixture() -> None:
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        rows = build_corpora(SHAPES, SIZE_MB, Path(tmp) / "corpora", [], **FILES)
        prep.TASK_CHARS = TASK
        outputs = {name: prepared(path, Path(tmp) / "out" / name, 1) for name, path in rows.items()}
        FIXTURE.parent.mkdir(parents=True, exist_ok=True)
        FIXTURE.write_text(json.dumps({"corpora": {n: corpus_digest(Path(p)) for n, p in rows.items()},
                                       "outputs": outputs}, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    _write_fixture()
