"""Error paths of the command line that were tracebacks or raw bytes: a log.root that cannot
hold a run folder, a held .lock whose content is not a PID, generate's --out and prompts that
are not UTF-8. Each is one line on stderr, exit 2."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fault_harness import CLI_TINY  # noqa: E402

from distlm.cli import main  # noqa: E402


def one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize("where", ["a-file", "under-a-file", "proc"])
@pytest.mark.parametrize("named", [True, False])
def test_a_log_root_that_cannot_hold_a_run_folder_is_one_line(where, named, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    root = {"a-file": afile, "under-a-file": afile / "runs", "proc": Path("/proc/self/no-such")}[where]
    extra = ["log.name=r"] if named else []
    assert main(["train", *CLI_TINY, "train.max_steps=1", f"log.root={root}", *extra]) == 2
    msg = one_error(capsys)
    assert str(root) in msg and "Traceback" not in msg, msg
    assert afile.read_text() == "x"


def test_a_held_lock_with_escape_codes_is_not_echoed(tmp_path, capsys):
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    lock = run / ".lock"
    lock.write_bytes(b"\x1b[2J\x1b]0;owned\x07")
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               f"fd = os.open({str(lock)!r}, os.O_RDWR)\n"
                               "fcntl.lockf(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        code = main(["train", *CLI_TINY, "train.max_steps=1", f"log.root={run.parent}", "log.name=r",
                     "train.resume=auto"])
    finally:
        holder.kill()
        holder.wait()
    msg = one_error(capsys)
    assert code == 2 and "\x1b" not in msg and "\x07" not in msg and "PID unknown" in msg, repr(msg)


def generate(*args: str) -> list[str]:
    return ["generate", "--checkpoint", "/nonexistent/run", *args]


def test_generate_refuses_an_out_in_a_missing_folder_before_loading(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    out = tmp_path / "no-such-folder" / "out.jsonl"
    assert main(generate("--prompts-file", str(prompts), "--out", str(out))) == 2
    assert "no folder" in one_error(capsys)


def test_generate_refuses_an_out_that_is_a_folder(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    assert main(generate("--prompts-file", str(prompts), "--out", str(tmp_path))) == 2
    assert "is a folder" in one_error(capsys)


@pytest.mark.parametrize("data, words", [(b"caf\xe9\n", "UTF-8"), (None, "a FIFO"), ("folder", "a folder")])
def test_generate_refuses_a_prompts_file_it_cannot_read_as_text(data, words, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    if data is None:
        os.mkfifo(prompts)
    elif data == "folder":
        prompts.mkdir()
    else:
        prompts.write_bytes(data)
    t = time.perf_counter()
    assert main(generate("--prompts-file", str(prompts), "--out", str(tmp_path / "o.jsonl"))) == 2
    assert words in one_error(capsys) and time.perf_counter() - t < 30


def test_generate_refuses_a_prompt_of_bytes_that_are_not_utf8(capsys):
    prompt = b"caf\xe9".decode("utf-8", errors="surrogateescape")  # what Python makes of such argv bytes
    assert main(generate("--prompt", prompt)) == 2
    assert "UTF-8" in one_error(capsys)


def test_eval_on_shards_with_ids_past_the_vocabulary_is_one_line(tiny_data, tmp_path, capsys):
    import json
    import shutil

    import numpy as np
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    root = tmp_path / "runs"
    assert main(["train", f"data.dir={data}", "model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.d_ff=64",
                 "model.block_size=16", "train.global_batch_size=2", "train.micro_batch_size=2", "train.max_steps=1",
                 "train.device=cpu", f"log.root={root}", "log.name=r", "log.progress=false", "log.tensorboard=false",
                 "train.eval_every=0", "log.samples=0"]) == 0
    manifest = json.loads((data / "manifest.json").read_text())
    shard = data / manifest["splits"]["val"]["shards"][0]["file"]
    ids = np.fromfile(shard, dtype=manifest["dtype"])
    ids[3] = 60_000  # inside uint16, past GPT-2's 50,257
    ids.tofile(shard)
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(root / "r"), "--data", str(data), "--device", "cpu"]) == 2
    msg = one_error(capsys)
    assert "60000" in msg and "vocabulary" in msg, msg


def test_repeated_interrupts_at_exit_leave_no_traceback(monkeypatch, capsys):
    """Ctrl-C during the final save, and again while the process group closes: "interrupted",
    exit 130, and any further Ctrl-C ends the process by the default action, silently."""
    import signal

    import distlm.cli as cli

    def interrupted(fn, args):
        raise KeyboardInterrupt

    def shutdown_interrupted():
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "call", interrupted)
    monkeypatch.setattr(cli, "_shutdown", shutdown_interrupted)
    old = signal.getsignal(signal.SIGINT)
    try:
        assert cli.main(["env"]) == 130
        assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, old)
    assert capsys.readouterr().err.strip() == "interrupted"
