"""scripts/build_docs_corpus.py: a small technical-documentation corpus, the same bytes twice,
that `distlm prepare` takes; bad arguments are one line and exit 2, with nothing written."""
import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "build_docs_corpus.py"


def _tool():
    spec = importlib.util.spec_from_file_location("build_docs_corpus", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_module_document_reads_docstrings_without_running_the_module(tmp_path):
    src = tmp_path / "pkg" / "mod.py"
    src.parent.mkdir()
    src.write_text('"""What the module is for, at some length. ' + "x " * 120 + '"""\n'
                   'raise SystemExit("never run")\n'
                   'class Box(dict):\n    """A box."""\n    def open(self, lid: int = 1) -> bool:\n'
                   '        """Opens the lid."""\n    def _hidden(self):\n        """not documentation"""\n'
                   'def _private():\n    """not documentation either"""\n')
    text = _tool().module_document(src, "pkg.mod")
    assert text.startswith("pkg.mod\n=======\n\nWhat the module is for")
    assert "class Box(dict)\n\nA box." in text and "def Box.open(self, lid: int=1) -> bool\n\nOpens the lid." in text
    assert "not documentation" not in text
    assert _tool().module_document(tmp_path / "missing.py", "m") is None


def run(*args, cwd=None):
    return subprocess.run([sys.executable, str(SCRIPT), "--out", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=600)


def test_a_small_corpus_is_deterministic_licensed_and_prepares(tmp_path):
    args = ["--max-mb", "0.3", "--packages", "pyyaml,packaging"]
    a, b = run(tmp_path / "a" / "docs.jsonl", *args), run(tmp_path / "b" / "docs.jsonl", *args)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    data = (tmp_path / "a" / "docs.jsonl").read_bytes()
    assert hashlib.sha256(data).digest() == hashlib.sha256((tmp_path / "b" / "docs.jsonl").read_bytes()).digest()
    rows = [json.loads(line) for line in data.decode().splitlines()]
    assert rows and all(r["text"].strip() for r in rows)
    assert 0.3e6 <= len(data) < 0.3e6 + 400_000  # stops after the document that crosses the limit
    assert rows[0]["source"].startswith("stdlib:")  # the standard library first, in path order
    sources = json.loads((tmp_path / "a" / "docs.jsonl.sources.json").read_text())["sources"]
    assert sources[0]["source"] == "python-stdlib" and sources[0]["licence"] == "PSF-2.0"
    assert sorted({r["source"].split(":")[0] for r in rows}) == ["stdlib"]  # 0.3 MB: the stdlib fills it
    assert not list((tmp_path / "a").glob("*.tmp"))
    prep = subprocess.run([sys.executable, "-m", "distlm", "prepare", str(tmp_path / "a" / "docs.jsonl"), "--out",
                           str(tmp_path / "prepared"), "--tokenizer", "bpe:300", "--quiet"],
                          capture_output=True, text=True, timeout=600,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert prep.returncode == 0, prep.stderr
    manifest = json.loads((tmp_path / "prepared" / "manifest.json").read_text())
    assert manifest["stats"]["files"] == 1 and manifest["stats"]["documents"] == len(rows)  # not the licence list
    assert manifest["splits"]["train"]["tokens"] > 100_000


def test_packages_alone_carry_their_licence(tmp_path):
    r = run(tmp_path / "docs.jsonl", "--no-stdlib", "--packages", "pyyaml,packaging")
    assert r.returncode == 0, r.stderr
    sources = json.loads((tmp_path / "docs.jsonl.sources.json").read_text())["sources"]
    assert [(s["source"], s["licence"]) for s in sources] == [("pyyaml", "MIT"),
                                                              ("packaging", "Apache-2.0 OR BSD-2-Clause")]
    rows = [json.loads(line) for line in (tmp_path / "docs.jsonl").read_text().splitlines()]
    assert {r["source"].split(":")[0] for r in rows} == {"pyyaml", "packaging"}


def test_bad_arguments_are_one_line_and_write_nothing(tmp_path):
    r = run(tmp_path / "docs.jsonl", "--packages", "numpy,gplthing")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "gplthing" in r.stderr
    r = run(tmp_path, "--max-mb", "1")
    assert r.returncode == 2 and "is a folder" in r.stderr
    r = run(tmp_path / "docs.jsonl", "--max-mb", "0")
    assert r.returncode == 2 and "--max-mb" in r.stderr
    assert not list(tmp_path.iterdir())
