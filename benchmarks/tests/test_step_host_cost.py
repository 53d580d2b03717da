"""benchmarks/tools/step_host_cost.py: the host's side of a step, run as a user runs it, on the CPU
(the plumbing and the tables; the figures it gives here are not the GPU host's)."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "benchmarks" / "tools" / "step_host_cost.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_the_phases_of_each_scope_and_each_region_against_its_eager_form(tmp_path):
    out = tmp_path / "host.md"
    done = run("--scopes", "eager,block", "--reps", "2", "--out", str(out), "--", "model.n_layer=2", "model.value_embeds=1")
    assert done.returncode == 0, done.stderr
    assert out.read_text() == done.stdout  # the file holds what the console showed
    phases = dict(re.findall(r"^\| (eager|block) \| ([0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+) \|$", done.stdout, re.M))
    assert set(phases) == {"eager", "block"}, done.stdout
    for scope, row in phases.items():
        forward, backward, optimizer, step = (float(v) for v in row.split(" | "))
        assert min(forward, backward, optimizer) > 0 and abs(forward + backward + optimizer - step) < 0.02, (scope, row)
    # two layers: one U-net skip (block 1 takes block 0's output) and the embeddings, once each
    regions = dict(re.findall(r"^\| `(\w+)` \| (\d+) \| [+-]\d+ µs \| [+-]\d+ µs \|$", done.stdout, re.M))
    assert regions == {"embed_tokens": "1", "add_skip": "1"}, done.stdout


def test_an_unknown_scope_is_refused_in_one_line():
    done = run("--scopes", "eager,blocks")
    assert done.returncode == 2 and "--scopes: 'blocks' is not eager, block or model" in done.stderr.strip().splitlines()[-1]
