"""Start-up: the compiler imported on a thread of its own beside the set-up, joined before the
model is built, and the set-up line saying what ran beside its phases."""
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from distlm.config import load_config
from distlm.parallel import ParallelDims
from distlm.tasks import build_task
from distlm.train.metrics import SetupClock
from distlm.train.setup import COMPILER_MODULES, BackgroundImport, build_model

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.n_layer=2", "model.n_head=2", "model.d_model=32", "model.d_ff=64", "model.block_size=16",
        "model.vocab_size=64", "data.source=synthetic", "train.device=cpu", "train.global_batch_size=2",
        "train.micro_batch_size=2", "train.compile=true", "train.compile_scope=block", "model.loss_chunk=0"]


def _module(tmp_path, monkeypatch, name: str, body: str) -> None:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))


def test_the_import_runs_on_another_thread_and_join_waits_for_it(tmp_path, monkeypatch):
    # the module blocks until the test lets it finish: join() must wait for the whole import
    _module(tmp_path, monkeypatch, "startup_slow_mod", """
        import threading
        import startup_gate
        ran_on = threading.current_thread().name
        startup_gate.release.wait()
        done = True
        """)
    gate = type(sys)("startup_gate")
    gate.release = threading.Event()
    monkeypatch.setitem(sys.modules, "startup_gate", gate)
    monkeypatch.delitem(sys.modules, "startup_slow_mod", raising=False)
    bg = BackgroundImport(["startup_slow_mod"], name="slow import").start()
    waiter = threading.Thread(target=bg.join)
    waiter.start()
    waiter.join(timeout=0.5)
    assert waiter.is_alive(), "join() returned before the import had finished"
    gate.release.set()
    waiter.join()
    assert bg.join() >= 0 and bg.seconds is not None and bg.waited is not None
    mod = sys.modules["startup_slow_mod"]
    assert mod.done and mod.ran_on != threading.main_thread().name
    assert re.fullmatch(r"slow import \d+\.\d s in the background, waited \d+\.\d s", bg.describe())


def test_a_failed_import_is_raised_by_join_in_the_caller(tmp_path, monkeypatch):
    _module(tmp_path, monkeypatch, "startup_broken_mod", "raise ImportError('no such compiler here')\n")
    monkeypatch.delitem(sys.modules, "startup_broken_mod", raising=False)
    bg = BackgroundImport(["startup_broken_mod"]).start()
    with pytest.raises(ImportError, match="no such compiler here"):
        bg.join()
    with pytest.raises(ImportError):  # every join says so, not only the first
        bg.join()


def test_build_model_joins_the_background_import_and_builds_the_same_model():
    cfg = load_config("tiny", TINY)
    task = build_task(cfg)
    plain = build_model(cfg, ParallelDims(), torch.device("cpu"), task)
    clock = SetupClock()
    bg = BackgroundImport(COMPILER_MODULES).start()
    overlapped = build_model(cfg, ParallelDims(), torch.device("cpu"), task, clock, bg)
    assert all(m in sys.modules for m in COMPILER_MODULES) and bg.waited is not None
    names = [n for n, _ in clock.phases]
    assert names[0] == "compiler import wait" and "compiler import" not in names
    a, b = plain.module.state_dict(), overlapped.module.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_setup_line_says_what_ran_beside_its_phases_and_the_reports_still_read_it():
    sys.path.insert(0, str(ROOT / "benchmarks" / "tools"))
    try:
        import speedrun_report
        import startup
    finally:
        sys.path.remove(str(ROOT / "benchmarks" / "tools"))
    clock = SetupClock()
    clock.phases = [("device and process group", 0.4), ("compiler import wait", 1.2), ("weights", 1.0)]
    line = clock.line(background=("cuda driver start 0.5 s in the background from the imports on (done)",
                                  "compiler import 3.7 s in the background, waited 1.2 s"))
    assert line.startswith("set-up 2.6 s (device and process group 0.4, compiler import wait 1.2, weights 1.0; "
                           "beside them: cuda driver start 0.5 s in the background from the imports on (done), "
                           "compiler import 3.7 s in the background, waited 1.2 s)"), line
    age = re.search(r"; ([0-9.]+) s since the process started$", line).group(1)  # Linux's /proc
    row = startup.parse(line + "\n")
    assert row["phases"] == {"device and process group": 0.4, "compiler import wait": 1.2, "weights": 1.0}
    assert row["background"] == {"cuda driver start": 0.5, "compiler import": 3.7}
    assert speedrun_report.SETUP.search(line).group(1) == age and row["since_start_s"] == float(age)


def test_the_trainer_starts_the_import_before_its_set_up_and_reports_it(tmp_path, monkeypatch):
    """The Trainer's own path, on a CPU made to take the GPU's rule: the import starts before
    the process group, build_model waits for it, and the set-up line says both."""
    import distlm.train.trainer as trainer_module
    started = []

    def anywhere(compiles, device):
        started.append(compiles)
        return BackgroundImport(COMPILER_MODULES).start() if compiles else None
    monkeypatch.setattr(trainer_module, "start_compiler_import", anywhere)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    cfg = load_config("tiny", [*TINY, f"log.root={tmp_path}", "log.name=a", "train.max_steps=1",
                               f"train.compile_cache={tmp_path / 'cache'}"])
    t = trainer_module.Trainer(cfg)
    assert started == [True]
    assert re.search(r"compiler import wait \d+\.\d, model plan", t.setup_line), t.setup_line
    assert re.search(r"; beside them: compiler import \d+\.\d s in the background, waited \d+\.\d s\)", t.setup_line)
    # the cache folder was set before the import began, and is the one the run reports
    assert t.compile_cache is not None and t.compile_cache.folder == tmp_path / "cache"


def test_the_rule_starts_the_import_only_for_a_compiled_run_on_a_gpu():
    from distlm.train.setup import start_compiler_import
    assert start_compiler_import(True, torch.device("cpu")) is None
    assert start_compiler_import(False, torch.device("cuda", 0)) is None
    bg = start_compiler_import(True, torch.device("cuda", 0))  # imports only: no GPU needed
    assert isinstance(bg, BackgroundImport) and bg.modules == COMPILER_MODULES
    bg.join()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_a_compiled_run_imports_the_compiler_beside_its_set_up(tmp_path):
    """`pytest -m gpu`: a fresh process on one GPU, as a user starts it; its set-up line says the
    compiler was imported beside the phases, and the run trains."""
    import os
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-m", "distlm", "train", "--config", "tiny", "data.source=synthetic",
                          "model.vocab_size=1000", "train.max_steps=2", "train.compile=true", "train.eval_every=0",
                          "log.progress=false", f"log.root={tmp_path}", "log.name=g",
                          f"train.compile_cache={tmp_path / 'cache'}"],
                         env=env, capture_output=True, text=True, timeout=600, check=True)
    assert re.search(r"compiler import wait \d+\.\d.*; beside them: cuda driver start \d+\.\d s in the background "
                     r"from the imports on \(done\), compiler import \d+\.\d s in the background", out.stdout), out.stdout
    assert "done: step 2" in out.stdout


def test_two_ranks_set_up_with_the_import_beside_their_process_group(tmp_path):
    """Two gloo ranks (one launch), each importing the compiler on its thread while the main
    thread joins the process group, claims the run folder and checks memory: both finish the
    set-up, each with the same model (DDP broadcast rank 0's weights; the wait is reported)."""
    import os
    script = tmp_path / "set_up.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, sys
        import torch
        import distlm.train.trainer as trainer_module
        from distlm.config import load_config
        from distlm.train.setup import COMPILER_MODULES, BackgroundImport
        trainer_module.start_compiler_import = lambda compiles, device: (
            BackgroundImport(COMPILER_MODULES).start() if compiles else None)
        cfg = load_config("tiny", {TINY!r} + ["log.root={tmp_path}", "log.name=ddp", "train.max_steps=1",
                                              "parallel.dp_replicate=2", "train.global_batch_size=4", "train.compile_cache={tmp_path / 'cache'}"])
        t = trainer_module.Trainer(cfg)
        total = float(sum(p.detach().double().sum() for p in t.gpt.parameters()))
        with open(os.path.join("{tmp_path}", f"rank{{t.dims.rank}}.json"), "w") as f:
            json.dump({{"line": t.setup_line, "total": total}}, f)
        """))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    import json
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert "; beside them: compiler import" in r["line"] and "compiler import wait" in r["line"], r["line"]
    assert ranks[0]["total"] == ranks[1]["total"]
