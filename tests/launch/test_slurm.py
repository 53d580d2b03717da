"""SLURM launch glue with fake SLURM variables and stub srun/scontrol/squeue commands.

No SLURM is needed: the rendezvous is a pure function of the environment, and the batch
script is run under bash with stubs first on PATH (one real 1-node training included).
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distlm.launch.slurm import (LaunchError, dry_run_env, expand_hostlist, gpus_per_node, launch_env, node_command,
                                    parse_slurm_duration, run_finished, seconds_left, slurm_env_lines, slurm_rendezvous)

ROOT = Path(__file__).resolve().parents[2]
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


def test_compile_cache_is_shared_by_the_nodes_and_kept_by_a_user_setting():
    """A requeued job may land on other nodes: the compile cache goes to the user's cache
    folder (on a cluster, the shared home), not the node's /tmp; a value the user set stays."""
    env = {**JOB, "HOME": "/home/ada"}
    assert launch_env(env, None)["TORCHINDUCTOR_CACHE_DIR"] == "/home/ada/.cache/distlm/torchinductor"
    assert launch_env({**env, "XDG_CACHE_HOME": "/scratch/ada"}, None)["TORCHINDUCTOR_CACHE_DIR"] == \
        "/scratch/ada/distlm/torchinductor"
    assert launch_env({**env, "TORCHINDUCTOR_CACHE_DIR": "/fast/ic"}, None)["TORCHINDUCTOR_CACHE_DIR"] == "/fast/ic"


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
  *) SLURM_NODEID=${FAKE_NODEID:-0} SLURM_PROCID=0 SLURM_LOCALID=0 exec "$@" ;;
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
    out, _ = proc.communicate(timeout=600)  # bounds a hang only: a loaded box takes minutes
    assert proc.returncode == 0, out
    srun = (log / "srun.args").read_text()
    assert "--ntasks-per-node=1" in srun and "exec-node" in srun
    node0 = next(line for line in out.splitlines() if line.startswith("node 0 ("))  # what srun's task ran
    for part in ("--node_rank 0", "log.name=gpt-4242", "train.resume=auto", "train.time_limit_s=3000"):
        assert part in node0
    meta = json.loads((run / "slurm" / "job_4242_attempt_0.json").read_text())
    assert meta["SLURM_JOB_ID"] == "4242" and meta["rendezvous"]["MASTER_ADDR"] == "localhost"
    assert (run / "checkpoints" / "step_0000002" / "distlm.json").is_file()
    assert not (log / "scontrol.log").exists() and "run finished" in out


def test_sbatch_requeues_an_unfinished_run(tmp_path):
    proc, log, run = batch(tmp_path, "noop", "tiny")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    assert (log / "scontrol.log").read_text().split() == ["requeue", "4242"]


@pytest.mark.dist
def test_sbatch_usr1_checkpoints_then_requeues(tmp_path):
    """SLURM's early warning reaches the trainer as SIGTERM (srun -> torchrun -> worker):
    it saves at the step it is on and exits, and the script requeues the unfinished run."""
    proc, log, run = batch(tmp_path, "run", "tiny", *TINY, "train.max_steps=100000", "log.every=1")
    deadline = time.monotonic() + 600  # bounds a hang only: the metrics rows are the event
    while not (run / "metrics.csv").is_file() or len((run / "metrics.csv").read_text().splitlines()) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=600)
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
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    reports = json.loads(out.stdout)
    assert [r["rank"] for r in reports] == [0, 1] and all(r["all_reduce"]["ok"] for r in reports)


# ---- what each node runs, and the dry run that prints it -------------------------------
TWO_NODES = {**JOB, "SLURM_GPUS_ON_NODE": "4"}  # gpu[07-08], 4 GPUs each
TRAIN = ["parallel.dp_shard=8", "train.global_batch_size=64", "train.micro_batch_size=8"]


def test_node_command_is_torchrun_around_distlm_train():
    env = {**TWO_NODES, **launch_env(TWO_NODES, left_s=3600, margin_s=600)}
    assert node_command(env, 1, "py", "gpt2-124m", ["a.b=1"]) == [
        "py", "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "4", "--node_rank", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "gpu07:24242", "--rdzv-id", "distlm-4242", "-m", "distlm",
        "train", "--config", "gpt2-124m", "log.root=runs", "log.name=gpt-4242", "train.resume=auto",
        "train.time_limit_s=3000", "a.b=1"]
    with pytest.raises(LaunchError, match="node rank 2 is outside 0..1"):
        node_command(env, 2, "py", "gpt2-124m")
    with pytest.raises(LaunchError, match="TIME_LIMIT_S"):
        node_command({k: v for k, v in env.items() if k != "TIME_LIMIT_S"}, 0, "py", "gpt2-124m")


def test_dry_run_env_stands_in_for_an_allocation():
    env = dry_run_env({}, nodes=3, gpus=2)
    r = slurm_rendezvous(env)
    assert r["NNODES"] == 3 and r["NPROC_PER_NODE"] == 2 and r["NODES"] == "dryrun-node0 dryrun-node1 dryrun-node2"
    with pytest.raises(LaunchError, match="--nodes 3, but SLURM_JOB_NODELIST='gpu\\[07-08\\]' names 2"):
        dry_run_env(TWO_NODES, nodes=3)
    with pytest.raises(LaunchError, match="--gpus-per-node"):
        dry_run_env({}, nodes=2)
    with pytest.raises(LaunchError, match="--nodes N"):
        dry_run_env({}, gpus=2)


def script(tmp_path: Path, args: list[str], slurm: dict, mode: str = "run") -> subprocess.CompletedProcess:
    """The batch script under stub srun/scontrol/squeue, read through pipes as a user would;
    PYTHON is a wrapper that records a torchrun command line instead of starting it."""
    stubs, log = tmp_path / "bin", tmp_path / "log"
    for folder in (stubs, log):
        folder.mkdir(exist_ok=True)
    for name, text in STUBS.items():
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    python = tmp_path / "python"
    python.write_text(f"""#!/bin/bash
if [ "$1 $2" = "-m torch.distributed.run" ]; then printf '%s\\n' "$@" > "$FAKE_LOG/torchrun.argv"; exit 0; fi
exec {sys.executable} "$@"
""")
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_",
                                                                       "DISTLM_"))}
    env.update(slurm, SLURM_SUBMIT_DIR=str(ROOT), PATH=f"{stubs}:{env['PATH']}", PYTHON=str(python),
               FAKE_LOG=str(log), FAKE_SRUN=mode, DISTLM_RUN_ROOT=str(tmp_path / "runs"))
    return subprocess.run(["bash", str(SBATCH), *args], env=env, cwd=tmp_path, text=True, capture_output=True,
                          timeout=600)


def commands(out: str) -> list[list[str]]:
    return [shlex.split(line) for line in out.splitlines() if line and not line.startswith(("#", "export "))]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("how", ["--dry-run", "DISTLM_DRY_RUN=1"])
def test_dry_run_prints_each_nodes_command_and_runs_nothing(tmp_path, how):
    slurm = dict(TWO_NODES, **({"DISTLM_DRY_RUN": "1"} if how != "--dry-run" else {}))
    out = script(tmp_path, [*(["--dry-run"] if how == "--dry-run" else []), "gpt2-124m", *TRAIN], slurm)
    assert out.returncode == 0, out.stderr
    argvs = commands(out.stdout)
    assert [flag(a, "--node_rank") for a in argvs] == ["0", "1"]
    for a in argvs:
        assert a[1:4] == ["-m", "torch.distributed.run", "--nnodes"] and flag(a, "--nnodes") == "2"
        assert flag(a, "--nproc_per_node") == "4" and flag(a, "--rdzv-endpoint") == "gpu07:24242"
        assert a[a.index("train"):] == ["train", "--config", "gpt2-124m", f"log.root={tmp_path / 'runs'}",
                                        "log.name=gpt-4242", "train.resume=auto", "train.time_limit_s=3000", *TRAIN]
    assert len({flag(a, "--rdzv-id") for a in argvs}) == 1
    assert "export MASTER_ADDR=gpu07" in out.stdout and "export OMP_NUM_THREADS=1" in out.stdout
    log = tmp_path / "log"
    assert not (log / "srun.args").exists() and not (log / "scontrol.log").exists()
    assert not (log / "torchrun.argv").exists() and not (tmp_path / "runs").exists()


def test_dry_run_without_slurm_takes_nodes_and_gpus(tmp_path):
    out = script(tmp_path, ["--dry-run", "--nodes", "3", "--gpus-per-node=2", "gpt2-124m", "parallel.dp_shard=6",
                            "train.global_batch_size=48", "train.micro_batch_size=8"], {})
    assert out.returncode == 0, out.stderr
    argvs = commands(out.stdout)
    assert [flag(a, "--node_rank") for a in argvs] == ["0", "1", "2"]
    assert {flag(a, "--rdzv-endpoint") for a in argvs} == {"dryrun-node0:20000"}
    assert all(flag(a, "--nproc_per_node") == "2" and "train.time_limit_s=0" in a for a in argvs)


@pytest.mark.parametrize("args,slurm,message", [
    (["--dry-run", "--nodes", "0", "--gpus-per-node", "4", "gpt2-124m"], {}, "--nodes 0"),
    (["--dry-run", "--nodes", "2", "--gpus-per-node", "4"], {}, "usage:"),
    (["--dry-run", "--nodes", "2", "--gpus-per-node", "4", "no-such-config.yaml"], {}, "no-such-config.yaml"),
    (["--dry-run", "--nodes", "2", "--gpus-per-node", "4", "gpt2-124m"], {}, "= 1, but the job has 8 GPUs"),
    (["--dry-run", "--nodes", "3", "gpt2-124m", *TRAIN], TWO_NODES, "--nodes 3, but SLURM_JOB_NODELIST"),
    (["--dry-run", "--nodes", "two", "gpt2-124m"], {}, "--nodes 'two'"),
    (["--nodes", "2", "gpt2-124m"], TWO_NODES, "add --dry-run"),
    (["--dry-run", "--frobnicate", "gpt2-124m"], TWO_NODES, "unknown option --frobnicate"),
    (["gpt2-124m"], {**TWO_NODES, "DISTLM_DRY_RUN": "yes"}, "DISTLM_DRY_RUN=yes"),
])
def test_dry_run_rejects_bad_input_in_one_line(tmp_path, args, slurm, message):
    out = script(tmp_path, args, slurm)
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and message in out.stderr, out.stderr
    assert not (tmp_path / "log" / "srun.args").exists()


@pytest.mark.parametrize("node", ["0", "1"])
def test_the_launch_runs_what_the_dry_run_prints(tmp_path, node):
    """The real path (srun -> exec-node on each node) execs node_command's argv: the stub
    srun plays node ``node`` and the recorded torchrun argv equals the dry run's line."""
    dry = script(tmp_path, ["--dry-run", "gpt2-124m", *TRAIN], TWO_NODES)
    assert dry.returncode == 0, dry.stderr
    expected = commands(dry.stdout)[int(node)]
    real = script(tmp_path, ["gpt2-124m", *TRAIN], {**TWO_NODES, "FAKE_NODEID": node})
    assert real.returncode == 0, real.stdout + real.stderr
    ran = (tmp_path / "log" / "torchrun.argv").read_text().splitlines()
    assert [str(tmp_path / "python"), *ran] == expected
    assert f"node {node} (" in real.stderr  # each node logs its command before starting it
    assert (tmp_path / "log" / "scontrol.log").read_text().split() == ["requeue", "4242"]  # unfinished: requeued


@pytest.mark.dist
def test_sbatch_a_users_error_is_one_line_and_exit_2(tmp_path):
    """A config the rank refuses, under the batch script: the rank's one line is all that is
    said of it (no torchrun traceback, no summary of the rank that exited), and the job's
    status is 2, not 1."""
    proc, log, run = batch(tmp_path, "run", "tiny", *TINY, "model.n_head=5")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 2, out
    # besides the script's line on the job and the node's command line
    said = [line for line in out.splitlines() if line.strip() and " job 4242 attempt 0: " not in line
            and not line.startswith("node 0 (")]
    assert said == ["error: model.d_model=64 is not divisible by model.n_head=5"], out
