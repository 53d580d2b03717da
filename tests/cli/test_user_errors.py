"""What a new user sees: each command run as `python -m distlm ...` through pipes,
its exit code, its stderr (one line, no traceback), the files it leaves and their modes.

Each process pays about 3 s of imports, so the commands of a test start together."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from distlm.config import ConfigError
from distlm.model.generate import SamplingConfig
from helpers.runs import tiny_run

ROOT = Path(__file__).resolve().parents[2]


def distlm_all(*commands, cwd=None, umask=None) -> list[subprocess.CompletedProcess]:
    """Run several `python -m distlm ...` at once; their results in order. A command whose
    first item is a dict runs with those environment variables added."""
    procs = []
    for c in commands:
        env = {**os.environ, "PYTHONPATH": str(ROOT), **(c[0] if isinstance(c[0], dict) else {})}
        args = c[1:] if isinstance(c[0], dict) else c
        procs.append(subprocess.Popen([sys.executable, "-m", "distlm", *map(str, args)], cwd=cwd, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      preexec_fn=(lambda: os.umask(umask)) if umask is not None else None))
    out = []
    for c, p in zip(commands, procs):
        stdout, stderr = p.communicate(timeout=300)
        out.append(subprocess.CompletedProcess(c, p.returncode, stdout, stderr))
    return out


def one_line_error(p: subprocess.CompletedProcess, *needles: str) -> str:
    assert p.returncode == 2, (p.args, p.stdout, p.stderr)
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in p.stderr, p.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_data) -> Path:
    """A 4-step run of a 2-layer model on the GPT-2 tokenizer, block_size 16."""
    return tiny_run(tmp_path_factory.mktemp("runs"), tiny_data, 4)


def test_sampling_arguments_and_missing_runs_are_one_line_errors(run, tmp_path):
    """Item 2: IndexError, NaN and silent reinterpretations become one line, exit 2."""
    gen = ["generate", "--checkpoint", run, "--prompt", "Call me"]
    samples0, nan, negative, above_one, plot = distlm_all(
        [*gen, "--num-samples", "0"], [*gen, "--top-k", "0", "--top-p", "0"], [*gen, "--temperature", "-1"],
        [*gen, "--top-p", "1.5"], ["plot", run, tmp_path / "other", "--out", tmp_path / "compare.png"])
    one_line_error(samples0, "--num-samples", "got 0")
    one_line_error(nan, "--top-p", "(0, 1]", "got 0.0", "temperature 0")
    one_line_error(negative, "--temperature", ">= 0", "got -1.0")
    one_line_error(above_one, "--top-p", "got 1.5")
    one_line_error(plot, f"{tmp_path / 'other'}: no such folder")
    assert not (tmp_path / "compare.png").exists()  # every run is read before anything is drawn
    # The library checks the same, naming the field and the flag.
    for bad, flag in [({"max_new_tokens": 0}, "--max-new-tokens"), ({"temperature": float("nan")}, "--temperature"),
                      ({"top_k": -1}, "--top-k"), ({"top_p": 0.0}, "--top-p"), ({"seed": 1.5}, "--seed")]:
        with pytest.raises(ConfigError, match=flag):
            SamplingConfig(**bad)
    SamplingConfig(temperature=0, top_k=0, top_p=1.0, seed=-3)  # greedy, no top-k, top-p 1: all allowed


def test_long_prompt_notice_prompts_file_seeds_and_eval_in_a_pipe(run, tmp_path):
    """Item 2: a prompt cut to the context says so. Item 10: --prompts-file seeds prompt i
    with seed + i and records it. Item 3: eval draws no progress bar into a pipe."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The king\nThe king\nAlice was\n")
    long_prompt = " ".join(["It is a truth universally acknowledged"] * 8)
    cut, batch, ev = distlm_all(
        ["generate", "--checkpoint", run, "--prompt", long_prompt, "--max-new-tokens", "3", "--seed", "0"],
        ["generate", "--checkpoint", run, "--prompts-file", prompts, "--out", tmp_path / "o.jsonl",
         "--max-new-tokens", "6", "--seed", "7", "--num-samples", "2"],
        ["eval", "--checkpoint", run, "--batches", "2"])
    assert cut.returncode == 0 and cut.stdout.startswith(long_prompt), cut.stderr
    note = cut.stderr.splitlines()
    assert len(note) == 1 and note[0].startswith("note: ") and "cut to its last 16 tokens" in note[0], cut.stderr

    assert batch.returncode == 0 and batch.stderr == "", batch.stderr
    lines = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [x["seed"] for x in lines] == [7, 8, 9] and [x["index"] for x in lines] == [0, 1, 2]
    assert lines[0]["completions"] != lines[1]["completions"]  # same prompt, its own seed
    from distlm.model.generate import generate_text
    from distlm.model.load import load_model, load_run_tokenizer
    model, cfg, folder = load_model(run)
    again = generate_text(model, load_run_tokenizer(folder, cfg), "The king",
                          SamplingConfig(max_new_tokens=6, seed=8), 2)
    assert again == lines[1]["completions"]  # the recorded seed reproduces the line

    assert ev.returncode == 0 and "\r" not in ev.stderr and ev.stderr == "", ev.stderr
    assert "val loss" in ev.stdout and "blocks" in ev.stdout and "tokens" in ev.stdout


def test_export_is_readable_by_other_users(run, tmp_path):
    """Item 10: model.safetensors gets the mode of the other files (0644 under umask 022);
    `export --help` says it is the way to one weights file."""
    export, help_ = distlm_all(["export", run, tmp_path / "hf"], ["export", "--help"], umask=0o022)
    assert export.returncode == 0 and "GPT2LMHeadModel" in export.stdout, export.stderr
    files = sorted((tmp_path / "hf").iterdir())
    assert "model.safetensors" in [f.name for f in files] and len(files) > 3
    for f in files:
        assert oct(os.stat(f).st_mode & 0o777) == oct(0o644), f
    from safetensors.torch import load_file
    assert "transformer.wte.weight" in load_file(tmp_path / "hf" / "model.safetensors")
    assert help_.returncode == 0 and "DCP" in help_.stdout and "one file" in help_.stdout


def test_cli_conventions(tmp_path):
    """Item 9: --version, --print-config, a repeated --config, a config field given as a flag,
    and one copy of a config error under torchrun."""
    version, printed, twice, flag, rank0, rank1 = distlm_all(
        ["--version"], ["train", "--config", "tiny", "train.max_steps=7", "--print-config"],
        ["train", "--config", "tiny", "--config", "gpt2-124m"], ["train", "--config", "tiny", "--max-steps", "5"],
        [{"RANK": "0", "WORLD_SIZE": "2"}, "train", "--config", "tyni"],
        [{"RANK": "1", "WORLD_SIZE": "2"}, "train", "--config", "tyni"], cwd=tmp_path)
    assert version.returncode == 0 and version.stdout == "distlm 0.1.0\n"
    assert printed.returncode == 0 and printed.stderr == ""
    assert yaml.safe_load(printed.stdout)["train"]["max_steps"] == 7
    assert yaml.safe_load(printed.stdout)["model"]["n_layer"] == 4  # the tiny preset, resolved
    assert not (tmp_path / "runs").exists()  # nothing trained
    one_line_error(twice, "--config given twice", "tiny", "gpt2-124m")
    one_line_error(flag, "--max-steps", "train.max_steps=5")
    one_line_error(rank0, "unknown preset 'tyni'")
    assert rank1.returncode == 2 and rank1.stderr == "" and rank1.stdout == ""  # rank 0 says it once


def test_bench_on_cpu(tmp_path):
    """Items 5 and 6: a GPU-sized bench on CPU is refused with a hint; a small one prints a
    line per step, numbers in CPU units, the run folder it used, and writes no Markdown."""
    small = ["--config", "tiny", "data.source=synthetic", "model.vocab_size=256", "model.n_layer=1",
             "model.block_size=32", "train.global_batch_size=4", "train.micro_batch_size=4"]
    big, ok, ceilings = distlm_all(
        ["bench", "--config", "gpt2-124m-1024", "data.source=synthetic", "train.compile=true"],
        ["bench", *small, "--warmup", "1", "--steps", "2", "--json", "r.json"],
        ["bench", "--ceilings", "--device", "cpu"], cwd=tmp_path)
    one_line_error(big, "GPU-sized run (124M params", "--config tiny", "--allow-cpu")
    assert ok.returncode == 0, ok.stderr
    assert ok.stderr.splitlines() == [line for line in ok.stderr.splitlines() if line.startswith("bench: ")]
    assert "warm-up step 1/1" in ok.stderr and "timed step 2/2" in ok.stderr and "\r" not in ok.stderr
    assert "/device)" in ok.stdout and "GFLOP/s per device" in ok.stdout and "peak n/a" in ok.stdout
    assert "None" not in ok.stdout and "/GPU" not in ok.stdout
    run_dir = ok.stdout.split("run folder: ")[1].strip()
    assert (tmp_path / run_dir / "config.yaml").is_file() and run_dir.startswith("runs/bench/bench-")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "runs"]  # no bench-results.md
    assert json.loads((tmp_path / "r.json").read_text())["mfu"] is None
    assert ceilings.returncode == 0 and "GFLOP/s" in ceilings.stdout and "0.0 TFLOP/s" not in ceilings.stdout


def test_plan_numbers_for_small_and_unsplittable_models():
    """Item 6: a tiny model's step time is not printed as 0, and dropped TP layouts say why."""
    tiny, big = distlm_all(["plan", "--config", "tiny", "--gpus", "1"],
                           ["plan", "--config", "gpt2-1.5b", "--gpus", "4"])
    assert tiny.returncode == 0 and big.returncode == 0
    row = next(line for line in tiny.stdout.splitlines() if line.startswith("| single |"))
    # est. ms/step: the planner's fixed 20 ms a step plus a fraction of a millisecond of compute,
    # printed to three significant digits rather than rounded to a whole number
    assert 20 < float(row.split("|")[-3]) < 25 and "." in row.split("|")[-3]
    assert "tp=2, tp=4 skipped: 25 heads do not split by 2, 4 (model.n_head=20 would)" in big.stdout


def test_rank_0_s_words_in_the_store_keep_the_other_ranks_from_repeating_them(monkeypatch, capsys):
    """Rank 0 leaves its error in the launch's store; a rank that finds the same error says
    nothing, one with other words (its own) says them with its rank, and so does one whose rank 0
    said nothing within the wait; an agreed error is rank 0's to say once rank 0 has spoken."""
    import torch.distributed as dist
    import distlm.cli as cli
    store = dist.HashStore()
    monkeypatch.setattr(cli, "_error_store", lambda: store)
    monkeypatch.setattr(cli, "RANK_0_WAIT_S", 0.2)
    monkeypatch.setenv("RANK", "1")
    cli.print_error("data/x/manifest.json: not found")  # rank 0 has said nothing yet
    assert capsys.readouterr().err == "error (rank 1): data/x/manifest.json: not found\n"
    monkeypatch.setenv("RANK", "0")
    cli.print_error("data/x/manifest.json: not found")
    assert capsys.readouterr().err == "error: data/x/manifest.json: not found\n"
    monkeypatch.setenv("RANK", "1")
    cli.print_error("data/x/manifest.json: not found")
    assert capsys.readouterr().err == ""
    cli.print_error("/scratch/x: no space left")
    assert capsys.readouterr().err == "error (rank 1): /scratch/x: no space left\n"
    cli.print_error("needs about 9 GiB but cuda:1 has 4 GiB free", agreed=True)  # rank 0 has spoken
    assert capsys.readouterr().err == ""


def test_a_rank_s_own_error_is_not_swallowed(monkeypatch, capsys):
    """Rank 0 alone reports a config error (every rank parsed the same command line), but an
    error raised once the process group is up may be one rank's own: that rank says it too."""
    import torch.distributed as dist
    from distlm.cli import print_error
    monkeypatch.setenv("RANK", "1")
    print_error("config says no")
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    print_error("train.micro_batch_size=16 does not fit on this GPU")
    assert capsys.readouterr().err == "error (rank 1): train.micro_batch_size=16 does not fit on this GPU\n"
    monkeypatch.setenv("RANK", "0")
    print_error("config says no")
    assert capsys.readouterr().err == "error: config says no\n"
