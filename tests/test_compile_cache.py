"""train.compile_cache: torch's compile caches in a folder of the user's, reused by a second
run; a folder that cannot be used is a one-line warning, not a failed run."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from distlm.config import ConfigError, load_config
from distlm.train.compile_cache import INDUCTOR_ENV, CompileCache, cache_root
from distlm.host import usable_cores
from distlm.train.compile_workers import ENV as WORKERS_ENV, CompileWorkers, share

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["model.n_layer=2", "model.n_head=2", "model.d_model=32", "model.d_ff=64", "model.block_size=16",
         "model.vocab_size=64", "data.source=synthetic", "train.device=cpu", "train.global_batch_size=2",
         "train.micro_batch_size=2", "train.max_steps=2", "train.eval_every=0", "log.progress=false",
         "log.tensorboard=false", "train.compile=true", "train.compile_scope=model", "model.loss_chunk=0"]


def test_auto_follows_the_user_cache_conventions(tmp_path):
    assert cache_root("auto", {"HOME": "/h"}) == Path("/h/.cache/distlm/compile")
    assert cache_root("auto", {"HOME": "/h", "XDG_CACHE_HOME": "/x"}) == Path("/x/distlm/compile")
    assert cache_root("auto", {"HOME": "/h", "XDG_CACHE_HOME": "/x", "DISTLM_CACHE_DIR": "/d"}) == Path("/d/compile")
    assert cache_root("off", {"HOME": "/h"}) is None
    assert cache_root(str(tmp_path / "c"), {"HOME": "/h"}) == tmp_path / "c"


def test_open_points_inductor_at_the_folder_and_torch_env_wins(tmp_path):
    env = {"HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    cache = CompileCache.open("auto", env)
    assert cache.folder == tmp_path / "xdg" / "distlm" / "compile" and cache.folder.is_dir()
    assert env[INDUCTOR_ENV] == str(cache.folder) and not cache.warm and cache.warning is None
    assert oct(cache.folder.stat().st_mode & 0o777) == "0o700"  # other users cannot plant compiled code
    # torch's own variable, set by the user, is kept under auto
    kept = {"HOME": str(tmp_path), INDUCTOR_ENV: str(tmp_path / "mine")}
    assert CompileCache.open("auto", kept).folder == tmp_path / "mine" and kept[INDUCTOR_ENV] == str(tmp_path / "mine")
    # ... but not torch's own default, which inductor itself writes there once it has run
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    set_by_torch = {"HOME": str(tmp_path), INDUCTOR_ENV: default_cache_dir()}
    assert CompileCache.open("auto", set_by_torch).folder == tmp_path / ".cache" / "distlm" / "compile"
    assert set_by_torch[INDUCTOR_ENV] == str(tmp_path / ".cache" / "distlm" / "compile")
    off = {"HOME": str(tmp_path)}
    assert CompileCache.open("off", off).folder is None and INDUCTOR_ENV not in off


def test_an_unusable_folder_is_a_one_line_warning(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    env = {"HOME": str(tmp_path)}
    cache = CompileCache.open(str(blocker / "cache"), env)
    assert cache.folder is None and INDUCTOR_ENV not in env  # torch keeps its default folder
    assert cache.warning.startswith("warning: train.compile_cache: ") and str(blocker / "cache") in cache.warning
    assert "\n" not in cache.warning


def test_an_empty_setting_is_refused():
    with pytest.raises(ConfigError, match="train.compile_cache: empty"):
        load_config("tiny", ["train.compile_cache="])


def _train(folder: Path, runs: Path, name: str, **extra_env: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (INDUCTOR_ENV, WORKERS_ENV, "LOCAL_WORLD_SIZE")}
    env.update(extra_env, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "distlm", "train", "--config", "tiny", *SMALL,
                           f"train.compile_cache={folder}", f"log.root={runs}", f"log.name={name}"],
                          env=env, capture_output=True, text=True, timeout=900, check=True)


def test_a_second_run_loads_what_the_first_compiled(tmp_path):
    """Two processes, one folder: the first compiles (cache misses) and says cold; the second
    compiles nothing, loads every graph from the folder and says warm (inductor's counters).
    The second reads a copy of the folder at another path, the first's removed: a cache carried
    to another machine is as warm."""
    folder = tmp_path / "cache"
    first = _train(folder, tmp_path / "runs", "a")
    assert f"compile cache: {folder} (cold, empty; train.compile_cache)" in first.stdout, first.stdout
    assert f"compile workers: {share(usable_cores(), 1)} a rank (torch's default)" in first.stdout, first.stdout
    cold = re.search(r"compile cache (\w+): (\d+) graphs loaded, (\d+) compiled", first.stdout)
    assert cold and cold.group(1) == "cold" and cold.group(2) == "0" and int(cold.group(3)) > 0, first.stdout
    assert any((folder / "fxgraph").rglob("*")), "nothing written to the cache folder"
    moved = tmp_path / "carried" / "cache"
    shutil.copytree(folder, moved)
    shutil.rmtree(folder)
    folder = moved
    # as one of 2 ranks on this host (LOCAL_WORLD_SIZE, as torchrun sets it): half the workers
    second = _train(folder, tmp_path / "runs", "b", LOCAL_WORLD_SIZE="2")
    cores = usable_cores()
    assert (f"compile workers: {share(cores, 2)} a rank ({cores} cores shared by 2 ranks on this host)"
            in second.stdout), second.stdout
    assert re.search(rf"compile cache: {re.escape(str(folder))} \(warm, \d+ files", second.stdout), second.stdout
    warm = re.search(r"compile cache (\w+): (\d+) graphs loaded, (\d+) compiled", second.stdout)
    assert warm and warm.group(1) == "warm" and warm.group(2) == cold.group(3) and warm.group(3) == "0", second.stdout
    # torch's own timers split the first step: cold it compiled, warm it only traced and loaded
    split = re.compile(r"in the compiler ([0-9.]+) s \(tracing ([0-9.]+), loading from the cache ([0-9.]+), "
                       r"compiling ([0-9.]+)\), the rest ([0-9.]+) s")
    cold_split, warm_split = split.search(first.stdout), split.search(second.stdout)
    assert cold_split and float(cold_split.group(4)) > 0, first.stdout
    assert warm_split and float(warm_split.group(4)) == 0 and float(warm_split.group(3)) > 0, second.stdout
    # the same losses: what was loaded is what was compiled
    loss = re.compile(r"step +2/2 .*?loss ([0-9.]+)")
    assert loss.search(first.stdout).group(1) == loss.search(second.stdout).group(1)


# ---- compile workers: each rank of a host its share of the cores ------------------------------
def test_each_rank_of_a_host_gets_its_share_of_the_cores():
    assert [share(64, n) for n in (1, 2, 4, 8)] == [32, 32, 16, 8]  # torch's cap of 32 stays
    assert share(16, 1) == 16 and share(2, 4) == 1 and share(1, 1) == 1
    alone = {}
    workers = CompileWorkers.set(alone, cores=64)
    assert workers.count == 32 and WORKERS_ENV not in alone  # one process: torch's own choice, untouched
    four = {"LOCAL_WORLD_SIZE": "4"}
    workers = CompileWorkers.set(four, cores=64)
    assert workers.count == 16 and four[WORKERS_ENV] == "16"
    assert workers.describe() == "compile workers: 16 a rank (64 cores shared by 4 ranks on this host)"
    horovod = {"HOROVOD_LOCAL_SIZE": "8"}
    assert CompileWorkers.set(horovod, cores=64).count == 8 and horovod[WORKERS_ENV] == "8"
    mine = {"LOCAL_WORLD_SIZE": "4", WORKERS_ENV: "3"}  # the user's own setting wins
    assert CompileWorkers.set(mine, cores=64).count == 3 and mine[WORKERS_ENV] == "3"
    for bad in ("0", "four", "-2"):
        with pytest.raises(ConfigError, match=f"{WORKERS_ENV}='{bad}'"):
            CompileWorkers.set({WORKERS_ENV: bad}, cores=64)


def test_inductor_takes_the_count_from_the_variable():
    """The variable is where inductor reads its count when it is imported (and its workers
    inherit it): a torch that stopped reading it would fail here."""
    env = dict(os.environ, LOCAL_WORLD_SIZE="4")
    env.pop(WORKERS_ENV, None)
    CompileWorkers.set(env, cores=12)
    out = subprocess.run([sys.executable, "-c", "import torch._inductor.config as c; print(c.compile_threads)"],
                         env=env, capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split()[-1] == "3"
