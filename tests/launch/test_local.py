"""`distlm train --nproc-per-node N` (distlm/launch/local.py): N ranks started by torchrun's own
entry point from the distlm process. On the CPU with gloo: the ranks train as a torchrun launch
would, they read the bytecode folder the launching process chose, and a rank's error is the
command's exit status."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distlm.cli import main
from distlm.launch.local import torchrun_args

ROOT = Path(__file__).resolve().parents[2]
# The tiny preset as it ships (its micro-batch left to auto), so the same command runs on 2 ranks.
TINY = ["--config", "tiny", "train.max_steps=2", "train.device=cpu", "parallel.dp_replicate=2", "log.progress=false", "log.tensorboard=false", "log.samples=0",
        "train.eval_every=0", "train.checkpoint_every=0"]


def launch(args, env_extra, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "PYTHONPYCACHEPREFIX")}
    env.update(PYTHONPATH=str(ROOT), **env_extra)
    return subprocess.run([sys.executable, "-m", "distlm", "train", "--nproc-per-node", "2", *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)


def test_two_ranks_train_and_read_the_launchers_bytecode_folder(tmp_path):
    folder = tmp_path / "bytecode"
    proc = launch([*TINY, "data.source=synthetic", f"log.root={tmp_path}", "log.name=r"],
                  {"PYTHONDONTWRITEBYTECODE": "1", "DISTLM_BYTECODE_CACHE": str(folder),
                   "DISTLM_BYTECODE_PRECOMPILE": "off"}, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "device cpu x2" in proc.stdout and "done: step 2" in proc.stdout
    assert proc.stdout.count("done: step 2") == 1  # rank 0 reports, as under torchrun
    # Only the ranks import the Trainer (the launching process stops at the launch): its bytecode
    # in the folder means the ranks write there too, though they inherit the launcher's
    # PYTHONPYCACHEPREFIX and PYTHONDONTWRITEBYTECODE=1 (before, they only read).
    trainer = Path(os.path.abspath(ROOT / "distlm" / "train" / "trainer.py"))
    cached = folder / trainer.parent.relative_to(trainer.anchor) / f"trainer.{sys.implementation.cache_tag}.pyc"
    assert cached.is_file(), sorted(str(p) for p in folder.rglob("*trainer*"))[:5]
    assert (tmp_path / "r" / "metrics.csv").is_file()


def test_a_ranks_error_is_one_line_from_rank_0_and_the_commands_exit_status(tmp_path):
    """A config the ranks refuse (the launcher does not build the model): one line from rank 0,
    exit 2, and nothing else on stderr: neither torchrun's lines about the rank that exited nor
    its traceback."""
    proc = launch([*TINY, "data.source=synthetic", f"log.root={tmp_path}", "log.name=r", "train.fp8=tensorwise"], {},
                  tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: train.fp8=tensorwise needs a CUDA GPU"), \
        proc.stderr


@pytest.mark.parametrize("wrong, said", [
    (["parallel.dp_replicate=1"], "but the world size is 2; add parallel.dp_replicate=2"),
    (["data.dir=NOWHERE"], "NOWHERE/manifest.json: not found"),
    (["model.n_layer=64", "model.d_model=8192", "model.n_head=64", "model.d_ff=32768"],
     "needs about 1,617.6 GiB but this machine's RAM, shared by its 2 processes, has"),
], ids=["world-size", "data", "memory"])
def test_what_needs_no_gpu_is_refused_before_a_rank_starts(tmp_path, monkeypatch, capsys, wrong, said):
    import distlm.launch.local as local

    def no_launch(*a, **k):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(local, "run_torchrun", no_launch)
    wrong = [w.replace("NOWHERE", str(tmp_path / "nowhere")) for w in wrong]
    said = said.replace("NOWHERE", str(tmp_path / "nowhere"))
    data = [] if any(w.startswith("data.") for w in wrong) else ["data.source=synthetic"]
    assert main(["train", "--nproc-per-node", "2", *TINY, *data, *wrong, f"log.root={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err, err


LAYOUT_ERROR = (["parallel.dp_replicate=1", "data.source=synthetic"],
                "but the world size is 2; add parallel.dp_replicate=2")


@pytest.mark.parametrize("wrong, said, rank_0_late", [
    (*LAYOUT_ERROR, False),
    (*LAYOUT_ERROR, True),
    (["data.dir=NOWHERE"], "NOWHERE/manifest.json: not found", False),
    (["data.source=synthetic", "model.n_layer=64", "model.d_model=8192", "model.n_head=64", "model.d_ff=32768"],
     "needs about 1,617.6 GiB but this machine's RAM, shared by its 2 processes, has", False),
], ids=["layout", "layout-rank-0-late", "data", "memory"])
def test_under_a_bare_torchrun_a_ranks_error_is_one_line_from_rank_0(tmp_path, wrong, said, rank_0_late):
    """A bare torchrun (not --nproc-per-node) starts the ranks with nothing checked first: the
    world size is known only there, a data folder is read and the memory measured there (its
    least over the ranks, by gloo). Each rank finds the same error; stderr, read through a pipe,
    holds one distlm line, rank 0's, and then only torchrun's own report (its log lines, its
    traceback and summary), no rank's traceback; the ranks exit 2. rank_0_late: rank 0 starts 3 s
    after rank 1, which finds the error first and must not exit before rank 0 has said it
    (torchrun would stop rank 0 at once, and nothing would be said)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    if rank_0_late:
        site = tmp_path / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text("import os, time\nif os.environ.get('RANK') == '0':\n    time.sleep(3)\n")
        env["PYTHONPATH"] = f"{site}{os.pathsep}{ROOT}"
    wrong = [w.replace("NOWHERE", str(tmp_path / "nowhere")) for w in wrong]
    said = said.replace("NOWHERE", str(tmp_path / "nowhere"))
    args = [a for a in TINY if a != "parallel.dp_replicate=2"] if "parallel.dp_replicate=1" in wrong else TINY
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "distlm", "train", *args, *wrong, f"log.root={tmp_path}"], cwd=tmp_path, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
    lines = proc.stderr.splitlines()
    ours = [line for line in lines if line.startswith("error")]
    assert len(ours) == 1 and ours[0].startswith("error: ") and said in ours[0], proc.stderr
    assert lines[0] == ours[0], proc.stderr  # nothing of ours before it
    assert str(ROOT / "distlm") + os.sep not in proc.stderr, proc.stderr  # no traceback through distlm's files
    assert "ChildFailedError" in proc.stderr and "exitcode  : 2 (pid" in proc.stderr, proc.stderr
    assert proc.returncode != 0 and "error" not in proc.stdout, proc.stdout


def test_a_classifiers_data_and_memory_are_checked_before_a_rank_starts(tmp_path, monkeypatch, capsys):
    import distlm.launch.local as local
    from distlm.tasks.classify.data import prepare_classify

    def no_launch(*a, **k):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(local, "run_torchrun", no_launch)
    src = tmp_path / "posts.jsonl"
    src.write_text("".join(f'{{"text": "post number {i} about {t}", "label": "{t}"}}\n'
                           for i in range(40) for t in ("space", "sport")))
    prepare_classify([str(src)], tmp_path / "posts", max_len=16, quiet=True)
    common = ["train", "--nproc-per-node", "2", "--config", "classify", "train.device=cpu", "parallel.dp_replicate=2",
              f"log.root={tmp_path}"]
    big = ["model.n_layer=64", "model.d_model=8192", "model.n_head=64", "model.d_ff=32768"]
    assert main([*common, f"data.dir={tmp_path / 'posts'}", *big]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "this machine's RAM, shared by its 2 processes, has" in err, err
    assert main([*common, f"data.dir={tmp_path / 'nowhere'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path / 'nowhere'}/manifest.json" in err, err


def test_torchruns_own_lines_are_kept_only_where_no_rank_said_why(monkeypatch, capsys):
    """A rank that exited 2 or 3 has said why in one line: torchrun's lines about it would
    repeat it. After a crash (a traceback, exit 1) they say which rank failed: written."""
    import logging

    import torch.distributed.run as run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from distlm.launch.local import run_torchrun
    handler = logging.StreamHandler(sys.stderr)
    logging.getLogger("torch.distributed").addHandler(handler)
    try:
        for status, kept in ((2, False), (3, False), (1, True)):
            def fake(args, status=status):
                logging.getLogger("torch.distributed.elastic.multiprocessing.api").error("failed (exitcode: %d)",
                                                                                        status)
                failure = ProcessFailure(local_rank=0, pid=1, exitcode=status, error_file="")
                raise ChildFailedError("distlm", {0: failure})

            monkeypatch.setattr(run, "main", fake)
            assert run_torchrun(["x"]) == (status, None)
            err = capsys.readouterr().err
            assert (f"failed (exitcode: {status})" in err) is kept, (status, err)
    finally:
        logging.getLogger("torch.distributed").removeHandler(handler)


def test_it_is_refused_inside_a_launch_and_for_no_processes(monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert main(["train", "--nproc-per-node", "2", "--config", "tiny", "train.device=cpu"]) == 2
    assert "already one rank of a launch" in capsys.readouterr().err
    monkeypatch.delenv("LOCAL_RANK")
    assert main(["train", "--nproc-per-node", "0", "--config", "tiny", "train.device=cpu"]) == 2
    assert "--nproc-per-node 0: expected a number of processes" in capsys.readouterr().err


def test_the_ranks_get_the_command_without_the_flag():
    assert torchrun_args(4, ["train", "--config", "speedrun-124m", "parallel.dp_replicate=4"]) == [
        "--standalone", "--nproc_per_node=4", "-m", "distlm", "train", "--config", "speedrun-124m",
        "parallel.dp_replicate=4"]


def test_sigterm_to_the_launcher_reaches_the_ranks_which_save_and_stop(tmp_path):
    """A scheduler's preemption signals the process it started: here the launcher. torchrun's agent
    passes SIGTERM on to the ranks; the Trainer finishes its step, saves and stops, and the command
    exits with the shell's status for SIGTERM (143), not a traceback."""
    import signal
    import time
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=str(ROOT))
    args = [a for a in TINY if a != "train.max_steps=2"]
    proc = subprocess.Popen([sys.executable, "-m", "distlm", "train", "--nproc-per-node", "2", *args,
                             "train.max_steps=100000", "data.source=synthetic", "log.every=1",
                             f"log.root={tmp_path}", "log.name=r"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics = tmp_path / "r" / "metrics.csv"
        deadline = time.time() + 300
        while time.time() < deadline and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, out + err
    assert "stopped by signal SIGTERM" in err and "Traceback" not in err
    assert "stopped:" in out and "continue with: distlm train ... log.name=r train.resume=auto" in out
    assert list((tmp_path / "r" / "checkpoints").glob("step_*")), out
