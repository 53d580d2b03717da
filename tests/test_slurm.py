"""SLURM launch glue with fake SLURM variables and stub srun/scontrol/squeue commands.

No SLURM is needed: the rendezvous is a pure function of the environment, and the batch
script is run under bash with stubs first on PATH (one real 1-node training included).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distlm.launch.slurm import (LaunchError, expand_hostlist, gpus_per_node, parse_slurm_duration, run_finished,
                                    seconds_left, slurm_env_lines, slurm_rendezvous)

ROOT = Path(__file__).resolve().parent.parent
SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"
TINY = ["model.n_layer=2", "model.d_model=64", "model.d_ff=256", "model.block_size=32", "model.vocab_size=256",
        "data.source=synthetic", "train.global_batch_size=4", "train.micro_batch_size=4", "train.eval_every=0",
        "log.progress=false", "log.tensorboard=false", "parallel.timeout_s=60"]
JOB = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "gpt", "SLURM_JOB_NODELIST": "gpu[07-08]",
       "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1", "SLURM_GPUS_ON_NODE": "8"}


@pytest.mark.parametrize("spec,hosts", [
    ("node1", ["node1"]),
    ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
    ("a[8-10]", ["a8", "a9", "a10"]),
    ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
    ("x-[1,3]-ib", ["x-1-ib", "x-3-ib"]),
])
def test_expand_hostlist(spec, hosts):
    assert expand_hostlist(spec) == hosts


@pytest.mark.parametrize("bad", ["gpu[01-03", "gpu[a-b]"])
def test_expand_hostlist_rejects_garbage(bad):
    with pytest.raises(LaunchError):
        expand_hostlist(bad)


@pytest.mark.parametrize("env,n", [({"SLURM_GPUS_ON_NODE": "4"}, 4), ({"SLURM_GPUS_PER_NODE": "h100:8"}, 8),
                                   ({"SLURM_GPUS_PER_NODE": "gpu:h100:2(IDX:0-1)"}, 2),
                                   ({"CUDA_VISIBLE_DEVICES": "0,1,2"}, 3), ({}, 1),
                                   ({"DISTLM_NPROC_PER_NODE": "3", "SLURM_GPUS_ON_NODE": "8"}, 3)])
def test_gpus_per_node(env, n):
    assert gpus_per_node(env) == n


def test_rendezvous_from_fake_slurm_job():
    r = slurm_rendezvous(JOB)
    assert r == {"MASTER_ADDR": "gpu07", "MASTER_PORT": 20000 + 4242, "NNODES": 2, "NODE_RANK": 1,
                 "NPROC_PER_NODE": 8, "RDZV_ID": "distlm-4242", "NODES": "gpu07 gpu08"}
    # a requeued attempt (same id) meets at the same place; another job elsewhere
    assert slurm_rendezvous({**JOB, "SLURM_RESTART_COUNT": "3"})["MASTER_PORT"] == r["MASTER_PORT"]
    assert slurm_rendezvous({**JOB, "SLURM_JOB_ID": "4243"})["MASTER_PORT"] != r["MASTER_PORT"]
    assert 20000 <= slurm_rendezvous({**JOB, "SLURM_JOB_ID": "987654321"})["MASTER_PORT"] < 40000
    assert slurm_rendezvous({**JOB, "DISTLM_MASTER_PORT": "29500"})["MASTER_PORT"] == 29500


def test_rendezvous_errors_name_the_variable():
    with pytest.raises(LaunchError, match="SLURM_JOB_ID"):
        slurm_rendezvous({})
    with pytest.raises(LaunchError, match="SLURM_JOB_NUM_NODES=3"):
        slurm_rendezvous({**JOB, "SLURM_JOB_NUM_NODES": "3"})


@pytest.mark.parametrize("text,secs", [("1-02:03:04", 93784), ("2:03:04", 7384), ("3:04", 184), ("45", 45),
                                       ("UNLIMITED", None), ("", None)])
def test_parse_slurm_duration(text, secs):
    assert parse_slurm_duration(text) == secs


def test_time_limit_for_the_trainer():
    env = {**JOB, "SLURM_JOB_END_TIME": str(int(time.time()) + 3600)}
    assert 3590 < seconds_left(env) <= 3600
    lines = slurm_env_lines(env, margin_s=600)
    assert "export MASTER_ADDR=gpu07" in lines and "export NODES='gpu07 gpu08'" in lines
    limit = int(next(x for x in lines if x.startswith("export TIME_LIMIT_S=")).split("=")[1])
    assert 2990 <= limit <= 3000


def test_run_finished_reads_the_newest_checkpoint(tmp_path):
    assert not run_finished(tmp_path)
    for step in (50, 100):
        d = tmp_path / "checkpoints" / f"step_{step:07d}"
        d.mkdir(parents=True)
        (d / "distlm.json").write_text(json.dumps({"step": step, "config": {"train": {"max_steps": 100}}}))
        assert run_finished(tmp_path) == (step == 100)


def test_sbatch_script_parses():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    text = SBATCH.read_text()
    assert "#SBATCH --requeue" in text and "#SBATCH --signal=B:USR1@" in text


# ---- the batch script under stub SLURM commands ---------------------------------------
STUBS = {
    # srun: record, drop its own options, run the command as node 0 (or sleep / do nothing)
    "srun": """#!/bin/bash
echo "$@" > "$FAKE_LOG/srun.args"
echo $$ > "$FAKE_LOG/srun.pid"
while [[ "$1" == --* ]]; do shift; done
case "$FAKE_SRUN" in
  noop) exit 0 ;;
  *) SLURM_NODEID=0 SLURM_PROCID=0 SLURM_LOCALID=0 exec "$@" ;;
esac
""",
    # scontrol requeue: record it and end the job's step, as SLURM would
    "scontrol": """#!/bin/bash
echo "$@" >> "$FAKE_LOG/scontrol.log"
[ -f "$FAKE_LOG/srun.pid" ] && kill "$(cat "$FAKE_LOG/srun.pid")" 2>/dev/null
exit 0
""",
    "squeue": """#!/bin/bash
echo "${FAKE_TIME_LEFT:-1:00:00}"
""",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def batch(tmp_path: Path, mode: str, *args: str) -> tuple[subprocess.Popen, Path, Path]:
    stubs, log = tmp_path / "bin", tmp_path / "log"
    stubs.mkdir(exist_ok=True)
    log.mkdir(exist_ok=True)
    for name, text in STUBS.items():
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_"))}
    env.update(JOB, SLURM_JOB_NODELIST="localhost", SLURM_JOB_NUM_NODES="1", SLURM_NODEID="0",
               SLURM_GPUS_ON_NODE="1", SLURM_SUBMIT_DIR=str(ROOT), PATH=f"{stubs}:{env['PATH']}",
               PYTHON=sys.executable, FAKE_LOG=str(log), FAKE_SRUN=mode, DISTLM_RUN_ROOT=str(tmp_path / "runs"),
               DISTLM_MASTER_PORT=str(free_port()))
    proc = subprocess.Popen(["bash", str(SBATCH), *args], env=env, cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return proc, log, tmp_path / "runs" / "gpt-4242"


@pytest.mark.dist
def test_sbatch_trains_logs_the_job_and_does_not_requeue_a_finished_run(tmp_path):
    proc, log, run = batch(tmp_path, "run", "tiny", *TINY, "train.max_steps=2")
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    srun = (log / "srun.args").read_text()
    for part in ("--ntasks-per-node=1", "log.name=gpt-4242", "train.resume=auto", "train.time_limit_s=3000"):
        assert part in srun
    meta = json.loads((run / "slurm" / "job_4242_attempt_0.json").read_text())
    assert meta["SLURM_JOB_ID"] == "4242" and meta["rendezvous"]["MASTER_ADDR"] == "localhost"
    assert (run / "checkpoints" / "step_0000002" / "distlm.json").is_file()
    assert not (log / "scontrol.log").exists() and "run finished" in out


def test_sbatch_requeues_an_unfinished_run(tmp_path):
    proc, log, run = batch(tmp_path, "noop", "tiny")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert (log / "scontrol.log").read_text().split() == ["requeue", "4242"]


@pytest.mark.dist
def test_sbatch_usr1_checkpoints_then_requeues(tmp_path):
    """SLURM's early warning reaches the trainer as SIGTERM (srun -> torchrun -> worker):
    it saves at the step it is on and exits, and the script requeues the unfinished run."""
    proc, log, run = batch(tmp_path, "run", "tiny", *TINY, "train.max_steps=100000", "log.every=1")
    deadline = time.time() + 120
    while not (run / "metrics.csv").is_file() or len((run / "metrics.csv").read_text().splitlines()) < 3:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0]
        time.sleep(0.2)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "SIGTERM received" in out and (log / "scontrol.log").read_text().split() == ["requeue", "4242"]
    step = json.loads(next((run / "checkpoints").glob("step_*/distlm.json")).read_text())["step"]
    assert 2 <= step < 100000


def test_env_verb_single_process(capsys):
    from distlm.cli import main
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["world_size"] == 1 and report["torch"] and report["backend"] in ("gloo", "nccl")


@pytest.mark.dist
def test_env_verb_under_torchrun_all_reduces():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "-m", "distlm", "env", "--json"], cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    reports = json.loads(out.stdout)
    assert [r["rank"] for r in reports] == [0, 1] and all(r["all_reduce"]["ok"] for r in reports)
