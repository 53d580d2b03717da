import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread, in this process (torch reads it when first imported, after this file)
# and in every process a test starts. The models here are tiny: a second thread buys nothing,
# and on a busy machine the two spin in OpenMP barriers. Measured side by side on the 2-core
# box at load 10-20 (2026-11-27): test_trainer.py took 705 s wall and 103 s CPU with two
# threads, 293 s and 19 s with one. Set OMP_NUM_THREADS to choose otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the helpers package, fault_harness, fixture_digest

@pytest.fixture(autouse=True)
def _tf32_flags_per_test():
    """A Trainer on CUDA turns on TF32 for the process (what a training run wants). Inside one
    pytest process that leaked into later fp32 comparisons: on an H100, the FlexAttention and
    model tests that run after a Trainer test compared TF32 results at fp32 tolerances and failed
    (0.0035 against 2e-3); alone they pass. Each test starts from the flags the test run began with."""
    import torch
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


SAMPLE_TEXT = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. " * 6,
    "Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse, "
    "and nothing particular to interest me on shore, I thought I would sail about a little. " * 6,
    "In the beginning God created the heaven and the earth. And the earth was without form, and void. " * 6,
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do. " * 6,
    "The quality of mercy is not strained; it droppeth as the gentle rain from heaven upon the place beneath. " * 6,
    "I celebrate myself, and sing myself, and what I assume you shall assume. " * 6,
]


# "package": no folder under tests/ is a package (no __init__.py), so these are made once for
# the whole run, whichever folders its tests are in.
@pytest.fixture(scope="package")
def text_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("text")
    for i, t in enumerate(SAMPLE_TEXT * 4):
        (d / f"doc{i:02d}.txt").write_text(t)
    return d


@pytest.fixture(scope="package")
def tiny_data(tmp_path_factory, text_dir) -> Path:
    """A small prepared data set (GPT-2 tokenizer), shared by the tests that train."""
    from distlm.corpus.prepare import prepare
    out = tmp_path_factory.mktemp("data") / "tiny"
    prepare([str(text_dir)], out, tokenizer="gpt2", val_fraction=0.2, seed=0, workers=1, progress=False)
    return out


# ---- the multi-process worlds (tests/helpers/worlds.py) -------------------------------
_COLLECTED: list = []  # the test items of this run, once collected


@pytest.fixture(scope="package")
def worlds(tmp_path_factory, tiny_data):
    """One gloo world per size for the scenarios of every collected module."""
    from helpers.worlds import Worlds, modules_with_scenarios
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # every worker of this run: one folder, above each worker's own (helpers/worlds.py)
        base = tmp_path_factory.getbasetemp().parent / "worlds"
        base.mkdir(exist_ok=True)
    else:
        base = tmp_path_factory.mktemp("worlds")
    return Worlds(base, modules_with_scenarios(_COLLECTED), tiny_data)


def pytest_collection_modifyitems(items):
    _COLLECTED[:] = items
    # The test that first asks for a world waits for its whole launch: minutes on a loaded box.
    for item in items:
        if "worlds" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(3600))


# ---- where the suite's time goes ------------------------------------------------------
# DISTLM_TEST_CPU=FILE writes, per test, its wall seconds and the CPU seconds it cost (this
# process plus the children it waited for), setup and teardown included. On a shared box the
# wall time says more about the neighbours than the test; CPU time is what a test costs.
_CPU: dict = {}


def _cpu_now() -> tuple[float, float, float]:
    import resource
    import time
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.monotonic(), me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not os.environ.get("DISTLM_TEST_CPU"):
        yield
        return
    t0 = _cpu_now()
    yield
    t1 = _cpu_now()
    _CPU[item.nodeid] = [round(b - a, 2) for a, b in zip(t0, t1)]


def pytest_sessionfinish():  # the hook may take none of its arguments
    path = os.environ.get("DISTLM_TEST_CPU")
    if path and _CPU:
        import json
        rows = {k: dict(zip(("wall_s", "cpu_s", "children_cpu_s"), v)) for k, v in _CPU.items()}
        worker = os.environ.get("PYTEST_XDIST_WORKER")  # each worker its own file: PATH.gw0, PATH.gw1
        Path(f"{path}.{worker}" if worker else path).write_text(json.dumps(rows, indent=1))
