"""End to end through the CLI, as a user types it, plus every bad input named in one line.

Prepare and train run as processes, and so does what a test reads through a pipe; the verbs
after them (eval, generate, plot) and the refusals run through the CLI's entry point in this
process (each `python -m distlm` pays seconds of imports), their exit codes the ones it returns.
The exit status and lines of a refusal as a process: tests/cli/test_user_errors.py."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["model.n_layer=2", "model.n_head=2", "model.d_model=32", "model.d_ff=64", "model.block_size=16",
         "train.global_batch_size=8", "train.micro_batch_size=4", "train.eval_every=10", "train.eval_batches=2",
         "log.every=5", "log.progress=false"]


def distlm(*args, cwd=None, check=True, stdin=None):
    return distlm_all(args, cwd=cwd, check=check, stdins=[stdin])[0]


def distlm_all(*commands, cwd=None, check=True, stdins=None) -> list[subprocess.CompletedProcess]:
    """Several `python -m distlm ...` at once (each pays seconds of imports), results in order;
    ``stdins``: the text each one reads on stdin (None: it inherits ours, as before)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    stdins = stdins or [None] * len(commands)
    procs = [subprocess.Popen([sys.executable, "-m", "distlm", *map(str, args)], cwd=cwd, env=env, text=True,
                              stdin=subprocess.PIPE if text is not None else None,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for args, text in zip(commands, stdins)]
    out = []
    for args, text, proc in zip(commands, stdins, procs):
        stdout, stderr = proc.communicate(text, timeout=600)
        p = subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)
        if check and p.returncode != 0:
            raise AssertionError(f"distlm {' '.join(map(str, args))} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
        out.append(p)
    return out


@pytest.fixture(scope="module")
def e2e(tmp_path_factory, text_dir):
    tmp = tmp_path_factory.mktemp("e2e")
    distlm("prepare", text_dir, "--out", tmp / "data", "--tokenizer", "bpe:300", "--val-fraction", "0.2",
           "--workers", "2", "--quiet")
    p = distlm("train", "--config", "tiny", *SMALL, f"data.dir={tmp / 'data'}", "train.max_steps=20",
               f"log.root={tmp / 'runs'}", "log.name=r")
    return tmp, p


def test_an_error_every_rank_agreed_on_is_said_by_rank_0_alone(monkeypatch, capsys):
    """A rank's own error (its files, its GPU) is said by every rank that has it, with its rank;
    one decided on values agreed over the ranks (the memory check's least free memory) is the
    same everywhere, and rank 0 says it for all."""
    import distlm.cli as cli
    monkeypatch.setattr(cli, "_process_group_up", lambda: True)
    monkeypatch.setenv("RANK", "1")
    cli.print_error("its own", agreed=False)
    cli.print_error("everyone's", agreed=True)
    assert capsys.readouterr().err == "error (rank 1): its own\n"
    monkeypatch.setenv("RANK", "0")
    cli.print_error("everyone's", agreed=True)
    assert capsys.readouterr().err == "error: everyone's\n"


def test_eval_through_a_pipe_says_how_far_it_is(e2e):
    """No bar in a pipe (its redraws would flood a log): a line at each tenth of the batches,
    on stderr, as they are done; the result alone on stdout."""
    tmp, _ = e2e
    p = distlm("eval", "--checkpoint", tmp / "runs" / "r", "--batches", "20", "--device", "cpu")
    lines = p.stderr.splitlines()
    assert lines == [f"eval: {n}/20 batches" for n in range(2, 20, 2)], p.stderr
    assert p.stdout.count("\n") == 1 and "val loss" in p.stdout, p.stdout


def in_process(capsys, monkeypatch, *commands, stdins=None) -> list[subprocess.CompletedProcess]:
    """`distlm ...` commands through the CLI's entry point, one after the other, in this process."""
    import io
    from distlm.cli import main
    out = []
    for args, text in zip(commands, stdins or [None] * len(commands)):
        if text is not None:
            monkeypatch.setattr("sys.stdin", io.StringIO(text))
        capsys.readouterr()
        rc = main([str(a) for a in args])
        o, e = capsys.readouterr()
        out.append(subprocess.CompletedProcess(args, rc, o, e))
    return out


def test_prepare_train_eval_generate(e2e, capsys, monkeypatch):
    tmp, train = e2e
    assert "done: step 20" in train.stdout
    assert "tok/s" in train.stdout and "mfu n/a" in train.stdout  # no peak is known for a CPU
    prompts = tmp / "prompts.txt"
    prompts.write_text("The king\nAlice was\n")
    seeded = ["generate", "--checkpoint", tmp / "runs" / "r", "--prompt", "Call me", "--max-new-tokens", "12",
              "--seed", "1", "--num-samples", "2"]
    results = in_process(
        capsys, monkeypatch, ["eval", "--checkpoint", tmp / "runs" / "r", "--json"], seeded, seeded,
        ["generate", "--checkpoint", tmp / "runs" / "r", "--prompts-file", prompts, "--out", tmp / "o.jsonl",
         "--max-new-tokens", "5", "--seed", "0"],
        ["generate", "--checkpoint", tmp / "runs" / "r", "--interactive", "--max-new-tokens", "4"],
        ["plot", tmp / "runs" / "r", "--out", tmp / "cmp.png"], stdins=[None, None, None, None, "Hello\n\n", None])
    assert [p.returncode for p in results] == [0] * 6, [(p.args, p.stderr) for p in results if p.returncode]
    ev, gen, again, _, repl, plot = results
    ev = json.loads(ev.stdout)
    assert ev["split"] == "val" and 0 < ev["loss"] < 10 and ev["perplexity"] > 1
    assert gen.stdout.count("--- sample") == 2
    assert gen.stdout == again.stdout  # seeded
    lines = [json.loads(x) for x in (tmp / "o.jsonl").read_text().splitlines()]
    assert [x["prompt"] for x in lines] == ["The king", "Alice was"] and len(lines[0]["completions"]) == 1
    assert "interactive" in repl.stdout
    assert (tmp / "cmp.png").stat().st_size > 1000 and "wrote" in plot.stdout


def _fails(p, *needles):
    """Exit status 2 and one line on stderr, naming what was wrong."""
    assert p.returncode == 2, (p.stdout, p.stderr)
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), p.stderr
    for n in needles:
        assert n in err[0], err[0]


def test_bad_inputs_are_one_clear_line(e2e, tmp_path, capsys, monkeypatch):
    tmp, _ = e2e
    data, run = tmp / "data", tmp / "runs" / "r"
    nope, typo, preset, vocab, block, exists, cuda, shape, empty = in_process(capsys, monkeypatch,
        ["prepare", tmp_path / "nope.txt", "--out", tmp_path / "o"],
        ["train", "train.max_stpes=3"],
        ["train", "--config", "tiy"],
        ["train", "--config", "tiny", f"data.dir={data}", "model.vocab_size=100"],
        ["train", "--config", "tiny", *SMALL, f"data.dir={data}", "model.block_size=100000", f"log.root={tmp_path}"],
        ["train", "--config", "tiny", *SMALL, f"data.dir={data}", f"log.root={tmp / 'runs'}", "log.name=r"],
        ["train", "--config", "tiny", *SMALL, f"data.dir={data}", "train.device=cuda", f"log.root={tmp_path}"],
        ["train", "--config", "tiny", *SMALL, "model.d_model=64", f"data.dir={data}", f"train.resume={run}",
         f"log.root={tmp_path}", "log.name=x"],
        ["eval", "--checkpoint", tmp_path / "empty"])
    _fails(nope, "nope.txt")
    assert not (tmp_path / "o").exists()
    _fails(typo, "did you mean 'max_steps'")
    _fails(preset, "unknown preset 'tiy'", "did you mean 'tiny'")
    _fails(vocab, "model.vocab_size=100", "manifest.json")
    _fails(block, "block_size=100000", "longer than the data")
    _fails(exists, "already exists", "resume=auto")
    _fails(cuda, "train.device=cuda", "CUDA is not available")
    _fails(shape, "shape")
    _fails(empty, "no complete checkpoint")


def test_overrides_may_come_after_flags(capsys):
    from distlm.cli import main
    assert main(["plan", "model.n_layer=4", "--config", "gpt2-124m-1024", "--gpus", "2",
                 "train.micro_batch_size=4", "--gpu-mem-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "4 layers x 768" in out and "micro-batch 4" in out
    with pytest.raises(SystemExit):
        main(["plan", "--config", "gpt2-124m-1024", "model.n_layer=4", "--gpus", "2", "stray"])


def test_setup_and_done_lines_read_through_a_pipe(tmp_path):
    """Synthetic tokens have no val split: the last line says so instead of 'val loss nan'
    (a GPU log of the two-node run read as if the model had diverged). The set-up line names
    each phase of the start-up, in order, and they add up to its total."""
    p = distlm("train", "--config", "tiny", *SMALL, "data.source=synthetic", "train.max_steps=2",
               f"log.root={tmp_path}", "log.name=s")
    done = p.stdout.strip().splitlines()[-1]
    assert done.startswith("done: step 2, no validation") and "nan" not in done, done
    # The set-up line splits building the model into its three parts (the GPU logs showed 4-9 s
    # under one "model" label) and its phases add up to the total it prints.
    setup = next(line for line in p.stdout.splitlines() if line.startswith("set-up "))
    phases = re.findall(r"([a-z][a-z -]+?) (\d+\.\d)(?=[,)])", setup.split("(", 1)[1])
    assert [name for name, _ in phases] == ["device and process group", "device mesh", "config and data check", "memory check",
                                             "run folder", "compiler import", "model plan", "weights",
                                             "data-parallel wrap", "optimizer and data loader",
                                             "resume and run files"], setup
    total = float(re.match(r"set-up (\d+\.\d) s", setup).group(1))
    assert abs(sum(float(v) for _, v in phases) - total) <= 0.05 * len(phases), setup


def test_a_finished_train_process_ends_without_the_interpreters_teardown(tmp_path):
    """Once the run is on disk the process ends at once: an exit handler registered before the
    run does not run, and nothing printed is lost on the way (read through a pipe)."""
    code = ("import atexit, sys; atexit.register(lambda: print('teardown ran', flush=True)); "
            "from distlm.cli import run; sys.argv = ['distlm', *sys.argv[1:]]; sys.exit(run())")
    proc = subprocess.run([sys.executable, "-c", code, "train", "--config", "tiny", "data.source=synthetic",
                           "train.max_steps=2", "train.device=cpu", "train.compile=false", "log.samples=0",
                           f"log.root={tmp_path}", "log.name=quick"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1].startswith("done: step 2") and any(x.startswith("end of run ") for x in lines), proc.stdout
    assert "teardown ran" not in proc.stdout
    assert (tmp_path / "quick" / "checkpoints" / "step_0000002" / "distlm.json").is_file()
