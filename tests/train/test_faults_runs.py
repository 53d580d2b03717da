"""Run-level faults, each as a real process or a real run: two trainers on one run
folder, signals at start-up and after the last step, an evaluation that fails after the last
step, a finished run resumed, absurd numbers in the config, a broken manifest, and a killed
`prepare` leaving its tokenizer workers behind."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

import fault_harness as fh

LONG = ["train.max_steps=100000", "train.checkpoint_every=0"]


def one_line_error(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def run_together(*cmds) -> list[subprocess.CompletedProcess]:
    procs = [subprocess.Popen(c, cwd=str(fh.ROOT), env=fh.child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for c in cmds]
    outs = [p.communicate(timeout=fh.WAIT_S) for p in procs]
    return [subprocess.CompletedProcess(c, p.returncode, *out) for c, p, out in zip(cmds, procs, outs)]


def test_a_second_trainer_on_the_same_run_is_refused_and_the_lock_dies_with_its_holder(tmp_path):
    first = fh.launch(fh.train_cmd(tmp_path, "x", *LONG), tmp_path / "first.log")
    try:
        assert fh.wait_for(lambda: fh.last_logged_step(tmp_path / "x") >= 2, first), \
            (tmp_path / "first.log").read_text()
        # The same name started fresh is refused as an existing run; with resume=auto (which
        # would truncate the live run's metrics.csv) the lock refuses it, naming the holder.
        # Both start together: the first trainer trains (and costs CPU) until they are done.
        fresh, err = (one_line_error(p) for p in run_together(fh.train_cmd(tmp_path, "x"),
                                                              fh.train_cmd(tmp_path, "x", "train.resume=auto")))
        assert "already exists" in fresh, fresh
        assert "in use by another trainer" in err and f"PID {first.pid}" in err, err
        rows_before = fh.metric_rows(tmp_path / "x")
        assert rows_before, "the first trainer's metrics were lost"
    finally:
        fh.kill_tree(first)
    # kill -9 leaves no stale lock: the run resumes.
    third = fh.run(fh.train_cmd(tmp_path, "x", "train.max_steps=4", "train.resume=auto"))
    assert third.returncode == 0, third.stderr


SIGNAL_AT_FINISH = """
import os, signal, sys
from distlm.config import load_config
from distlm.train.trainer import Trainer
cfg = load_config(None, sys.argv[1:])
trainer = Trainer(cfg)
finish = trainer._finish
def signalled_finish(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)  # the window between the last step and the final save
    return finish(*args, **kwargs)
trainer._finish = signalled_finish
print("RESULT", trainer.train()["checkpoint"])
"""


def test_a_signal_after_the_last_step_still_leaves_the_final_checkpoint(tmp_path):
    script = tmp_path / "signal_at_finish.py"
    script.write_text(textwrap.dedent(SIGNAL_AT_FINISH))
    overrides = [o for o in fh.CLI_TINY if not o.startswith(("train.checkpoint_every", "train.max_steps"))]
    proc = fh.run([sys.executable, str(script), *overrides, "train.max_steps=3", "train.checkpoint_every=0",
                   f"log.root={tmp_path}", "log.name=s"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    complete, _ = fh.checkpoints(tmp_path / "s")
    assert [fh.step_of(c) for c in complete] == [3]


def start_up_moments(run_dir, log) -> dict:
    """Moments of start-up, each an event the process shows (not a time after the launch,
    which a loaded machine stretches): before the interpreter has imported anything of
    ours, once the run folder is claimed, once config.yaml is written, once the run banner
    is printed (the first step about to start)."""
    return {"launch": lambda: True,
            "lock": lambda: (run_dir / ".lock").exists(),
            "config.yaml": lambda: (run_dir / "config.yaml").exists(),
            "banner": lambda: re.search(r"^run \S+ \|", log.read_text(errors="replace"), re.M) is not None}


def test_a_signal_during_start_up_leaves_nothing_or_a_resumable_run(tmp_path):
    outcomes = set()
    for i, moment in enumerate(("launch", "lock", "config.yaml", "banner")):
        name = f"r{i}"
        run_dir, log = tmp_path / name, tmp_path / f"{name}.log"
        proc = fh.launch(fh.train_cmd(tmp_path, name, *LONG), log)
        assert fh.wait_for(start_up_moments(run_dir, log)[moment], proc), f"{moment} never came:\n{log.read_text()}"
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=fh.WAIT_S)
        if not run_dir.exists() or not any(p for p in run_dir.iterdir() if p.name != ".lock"):
            outcomes.add("nothing")
            continue
        assert (run_dir / "config.yaml").is_file(), list(run_dir.iterdir())
        again = fh.run(fh.train_cmd(tmp_path, name, "train.max_steps=2", "train.resume=auto"))
        assert again.returncode == 0, again.stderr[-2000:]
        outcomes.add("resumable")
    assert outcomes  # each outcome above was checked


def test_a_failing_final_evaluation_keeps_the_final_checkpoint(tmp_path, tiny_data):
    from distlm.config import load_config
    from distlm.train.trainer import Trainer
    cfg = load_config(None, ["model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.d_ff=64",
                             "model.block_size=16", f"data.dir={tiny_data}", "train.max_steps=3",
                             "train.eval_every=0", "log.progress=false", "log.tensorboard=false",
                             f"log.root={tmp_path}", "log.name=e", "train.device=cpu"])
    trainer = Trainer(cfg)

    def broken_eval():
        raise RuntimeError("evaluation failed")

    trainer.evaluate = broken_eval
    with pytest.raises(RuntimeError, match="evaluation failed"):
        trainer.train()
    complete, _ = fh.checkpoints(tmp_path / "e")
    assert [fh.step_of(c) for c in complete] == [3]


def test_resuming_a_finished_run_adds_no_row(tmp_path):
    done = fh.run(fh.train_cmd(tmp_path, "f", "train.max_steps=4", "train.eval_every=2"))
    assert done.returncode == 0, done.stderr
    before = (tmp_path / "f" / "metrics.csv").read_text()
    again = fh.run(fh.train_cmd(tmp_path, "f", "train.max_steps=4", "train.eval_every=2", "train.resume=auto"))
    assert again.returncode == 0, again.stderr
    after = (tmp_path / "f" / "metrics.csv").read_text()
    assert after == before


@pytest.mark.parametrize("override,needle", [
    ("optim.adamw.lr=nan", "optim.adamw.lr must be a finite number"), ("optim.adamw.lr=inf", "optim.adamw.lr must be a finite number"),
    ("optim.adamw.beta1=2", "optim.adamw.beta1 must be in [0, 1)"), ("train.grad_clip=nan", "train.grad_clip must be a finite"),
    ("train.warmup_steps=-1", "train.warmup_steps must be >= 0"),
    ("optim.adamw.weight_decay=-0.1", "optim.adamw.weight_decay must be >= 0"), ("train.keep_last=-1", "train.keep_last must be"),
    ("optim.adamw.eps=0", "optim.adamw.eps must be > 0"),
])
def test_absurd_optimizer_numbers_are_refused_in_one_line(override, needle, capsys):
    from distlm.cli import main
    assert main(["train", "data.source=synthetic", override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


@pytest.mark.parametrize("value", ["'50257'", "0", "true"])
def test_a_manifest_vocab_that_is_not_a_positive_integer_is_named(value, tiny_data, tmp_path, capsys):
    import shutil
    from distlm.cli import main
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    text = (data / "manifest.json").read_text()
    manifest = json.loads(text)
    manifest["tokenizer"]["vocab_size"] = json.loads(value.replace("'", '"'))
    (data / "manifest.json").write_text(json.dumps(manifest))
    rc = main(["train", f"data.dir={data}", "train.max_steps=1", f"log.root={tmp_path}", "log.progress=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "tokenizer.vocab_size must be a positive integer" in err[0], err


def test_a_manifest_vocab_above_the_tokenizers_is_refused(tiny_data, tmp_path, capsys):
    import shutil
    from distlm.cli import main
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["tokenizer"]["vocab_size"] = 50304
    (data / "manifest.json").write_text(json.dumps(manifest))
    rc = main(["train", f"data.dir={data}", "train.max_steps=1", f"log.root={tmp_path}", "log.progress=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "50304" in err[0] and "50257" in err[0], err


def test_kill_9_of_prepare_takes_its_tokenizer_workers_with_it(tmp_path):
    text = tmp_path / "text"
    text.mkdir()
    para = "It was the best of times, it was the worst of times, it was the age of wisdom. " * 40 + "\n\n"
    for i in range(16):
        (text / f"doc{i}.txt").write_text(para * 2500)  # ~8 MB each: the workers live for seconds
    proc = subprocess.Popen([sys.executable, "-m", "distlm", "prepare", str(text), "--out", str(tmp_path / "out"),
                             "--workers", "2", "--quiet"], cwd=str(fh.ROOT), env=fh.child_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert fh.wait_for(lambda: len(fh.descendants(proc.pid)) >= 2, proc), "no workers started"
        workers = fh.descendants(proc.pid)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=fh.WAIT_S)
    # They go when they notice; a loaded machine may take its time to schedule them.
    fh.wait_until(lambda: not any(fh._alive(p) for p in workers), timeout=120)
    survivors = [p for p in workers if fh._alive(p)]
    for p in survivors:  # don't leave them running on a failure
        os.kill(p, signal.SIGKILL)
    assert not survivors, f"tokenizer workers {survivors} outlived their parent"


def test_eval_on_data_from_another_tokenizer_is_refused(tmp_path, tiny_data, text_dir, capsys):
    """A smaller vocabulary fits the model, so only the tokenizer's fingerprint tells them apart."""
    from distlm.cli import main
    from distlm.corpus.prepare import prepare
    other = tmp_path / "bpe"
    prepare([str(text_dir)], other, tokenizer="bpe:300", val_fraction=0.2, seed=0, workers=1, progress=False)
    assert main(["train", "model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.d_ff=64",
                 "model.block_size=16", f"data.dir={tiny_data}", "train.max_steps=1", "log.progress=false",
                 "log.tensorboard=false", f"log.root={tmp_path}", "log.name=g"]) == 0
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path / "g"), "--data", str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "prepared with tokenizer bpe:300" in err[0] and "trained with gpt2" in err[0], err
    assert main(["eval", "--checkpoint", str(tmp_path / "g"), "--data", str(tiny_data)]) == 0


def test_two_runs_started_in_the_same_second_get_their_own_folders(tmp_path, monkeypatch):
    """Two benches launched side by side on one machine took the same timestamped folder and
    the second died "in use by another trainer" (2 x 2 H100s, 2026-11-27). The folder is
    now claimed by creating it: the later run gets -2."""
    import distlm.train.runlock as runlock
    from distlm.config import load_config
    from distlm.train.trainer import Trainer
    monkeypatch.setattr(runlock.time, "strftime", lambda fmt: fmt.replace("%Y%m%d-%H%M%S", "20261127-010148"))
    args = ["data.source=synthetic", "model.n_layer=1", "train.max_steps=1", f"log.root={tmp_path}",
            "log.tensorboard=false"]
    first, second = Trainer(load_config("tiny", args)), Trainer(load_config("tiny", args), name_prefix="bench")
    third = Trainer(load_config("tiny", args))
    assert [t.run_dir.name for t in (first, second, third)] == \
        ["run-20261127-010148", "bench-20261127-010148", "run-20261127-010148-2"]
    assert all(t.run_dir.is_dir() for t in (first, second, third))
