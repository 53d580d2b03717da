"""The runnable examples stay runnable."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(script, *args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, str(ROOT / "examples" / script), *map(str, args)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_examples(tmp_path):
    assert "124,439,808 parameters" in run("01_model_from_preset.py")
    out = run("02_train_and_generate.py", tmp_path)
    assert "trained to step 30" in out and "The cat" in out
    out = run("03_load_checkpoint.py", tmp_path / "runs" / "example", "The sun")
    assert out.count("The sun") == 2
    out = run("04_plan_layouts.py", 4, 79)
    assert "recommended:" in out and out.count("| yes |") >= 1
