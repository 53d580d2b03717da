"""benchmarks/tools/optimizer_parts.py --before: another copy of distlm beside this one, each
in its own processes (on a CPU, a tiny model: the plumbing the GPU measurement runs through)."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "benchmarks" / "tools" / "optimizer_parts.py"


def test_before_and_after_run_each_code_and_print_the_table(tmp_path):
    old = tmp_path / "old"
    shutil.copytree(ROOT / "distlm", old / "distlm", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, str(TOOL), "--before", str(old), "--cpu", "--rounds", "1", "--out", str(out)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    r = json.loads((out / "optimizer-parts.json").read_text())
    # each measurement imported the code it names
    assert [s["distlm"] for s in r["steps"]["old"]] == [str(old / "distlm" / "__init__.py")]
    assert [s["distlm"] for s in r["steps"]["new"]] == [str(ROOT / "distlm" / "__init__.py")]
    assert all(len(r["benches"][k]) == 1 and r["benches"][k][0]["tokens_per_s"] > 0 for k in ("old", "new"))
    assert "| old (" in p.stdout and "| new (" in p.stdout and "whole step: " in p.stdout
    assert "optimizer.step: " in p.stdout and not r["failed"]


def test_a_before_folder_without_distlm_is_refused_in_one_line(tmp_path):
    p = subprocess.run([sys.executable, str(TOOL), "--before", str(tmp_path), "--cpu", "--out", str(tmp_path / "o")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and str(tmp_path) in p.stderr
    assert not (tmp_path / "o").exists()
