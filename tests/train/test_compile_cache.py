"""The line after the first step: whether torch's compile cache was cold or warm, the graphs
loaded and compiled, the compiler's split, and the folder inductor used (TORCHINDUCTOR_CACHE_DIR,
else torch's default); a second run in the same folder loads what the first compiled."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from distlm.train.compile_cache import INDUCTOR_ENV, inductor_folder

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["model.n_layer=2", "model.n_head=2", "model.d_model=32", "model.d_ff=64", "model.block_size=16",
         "model.vocab_size=64", "data.source=synthetic", "train.device=cpu", "train.global_batch_size=2",
         "train.micro_batch_size=2", "train.max_steps=2", "train.eval_every=0", "log.progress=false",
         "log.tensorboard=false", "train.compile=true", "train.compile_scope=model", "model.loss_chunk=0"]
REPORT = re.compile(r"compile cache (\w+): (\d+) graphs loaded, (\d+) compiled \((.*?)\)")


def test_the_folder_is_torchs_variable_else_torchs_default(tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    assert inductor_folder({INDUCTOR_ENV: str(tmp_path)}) == str(tmp_path)
    assert inductor_folder({}) == default_cache_dir()


def _train(folder: Path, runs: Path, name: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != INDUCTOR_ENV}
    env.update({INDUCTOR_ENV: str(folder), "PYTHONPATH": str(ROOT)})
    return subprocess.run([sys.executable, "-m", "distlm", "train", "--config", "tiny", *SMALL,
                           f"log.root={runs}", f"log.name={name}"],
                          env=env, capture_output=True, text=True, timeout=900, check=True)


def test_a_second_run_loads_what_the_first_compiled(tmp_path):
    """Two processes, one folder: the first compiles (cache misses) and says cold; the second
    compiles nothing, loads every graph from the folder and says warm (inductor's counters).
    The second reads a copy of the folder at another path, the first's removed: a cache carried
    to another machine is as warm."""
    folder = tmp_path / "cache"
    first = _train(folder, tmp_path / "runs", "a")
    cold = REPORT.search(first.stdout)
    assert cold and cold.group(1) == "cold" and cold.group(2) == "0" and int(cold.group(3)) > 0, first.stdout
    assert cold.group(4) == str(folder), first.stdout
    assert any((folder / "fxgraph").rglob("*")), "nothing written to the cache folder"
    moved = tmp_path / "carried" / "cache"
    shutil.copytree(folder, moved)
    shutil.rmtree(folder)
    second = _train(moved, tmp_path / "runs", "b")
    warm = REPORT.search(second.stdout)
    assert warm and warm.group(1) == "warm" and warm.group(2) == cold.group(3) and warm.group(3) == "0", second.stdout
    assert warm.group(4) == str(moved), second.stdout
    # torch's own timers split the first step: cold it compiled, warm it only traced and loaded
    split = re.compile(r"in the compiler ([0-9.]+) s \(tracing ([0-9.]+), loading from the cache ([0-9.]+), "
                       r"compiling ([0-9.]+)\), the rest ([0-9.]+) s")
    cold_split, warm_split = split.search(first.stdout), split.search(second.stdout)
    assert cold_split and float(cold_split.group(4)) > 0, first.stdout
    assert warm_split and float(warm_split.group(4)) == 0 and float(warm_split.group(3)) > 0, second.stdout
    # the same losses: what was loaded is what was compiled
    loss = re.compile(r"step +2/2 .*?loss ([0-9.]+)")
    assert loss.search(first.stdout).group(1) == loss.search(second.stdout).group(1)
