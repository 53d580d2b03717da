"""What a user sees of a training run, read as a user reads
it: the console through pipes, metrics.csv with csv.DictReader, samples.txt, TensorBoard's
text tab through EventAccumulator, loss.png decoded.

    item 1  resume refuses a checkpoint of another architecture or data, in one line, before
            loading anything and without touching the run; resume=auto without log.name says
            that nothing was resumed
    item 4  log.samples: samples at each evaluation and at the end, on the console, in
            TensorBoard and RUN/samples.txt; `distlm generate --seed i` gives sample i back
    item 7  the training log, its last line and `distlm eval` say what the validation loss
            was measured on
    item 8  a short run logs about 20 points, one row per step, elapsed_s across resumes

Each `python -m distlm` pays about 3 s of imports: independent commands start together."""
import csv
import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from distlm.config import SECTIONS, ConfigError, load_config
from distlm.train.logger import log_interval

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.n_layer=2", "model.n_head=2", "model.d_model=32", "model.d_ff=64", "model.block_size=16",
        "train.global_batch_size=8", "train.micro_batch_size=4", "train.eval_batches=2", "train.warmup_steps=2",
        "log.progress=false", "train.device=cpu"]
PROMPT = "Call me"
# 8 steps: evaluations at 5 (every 5) and at the end (8, not a multiple of 5), checkpoints at 5 and 8.
RUN = TINY + ["train.max_steps=8", "train.eval_every=5", "train.checkpoint_every=5", "train.keep_last=5",
              "log.every=1", "log.samples=2", f"log.sample_prompt={PROMPT}"]


def distlm_all(*commands, cwd=None) -> list[subprocess.CompletedProcess]:
    """Run several `python -m distlm ...` at once, stdout and stderr through pipes."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    procs = [subprocess.Popen([sys.executable, "-m", "distlm", *map(str, c)], cwd=cwd, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for c in commands]
    out = []
    for c, p in zip(commands, procs):
        stdout, stderr = p.communicate(timeout=300)
        out.append(subprocess.CompletedProcess(c, p.returncode, stdout, stderr))
    return out


def ok(p: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert p.returncode == 0, (p.args, p.stdout[-3000:], p.stderr[-3000:])
    return p


def metrics(run: Path) -> list[dict]:
    with open(run / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def sample_blocks(run: Path) -> dict[int, list[str]]:
    """samples.txt -> {step: [sample 0, sample 1, ...]} (each with its prompt)."""
    out: dict[int, list[str]] = {}
    for block in re.split(r"^=== step ", (run / "samples.txt").read_text(), flags=re.M)[1:]:
        step = int(block.split(" ", 1)[0])
        texts = re.split(r"^--- sample \d+ \(seed \d+\) ---\n", block, flags=re.M)[1:]
        # each sample ends with a line break, and the block with one more
        out[step] = [t[:-1] for t in texts[:-1]] + [texts[-1][:-2]]
    return out


def tb_texts(run: Path) -> dict[int, str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0})
    ea.Reload()
    return {e.step: e.tensor_proto.string_val[0].decode() for e in ea.Tensors("samples/text_summary")}


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory, tiny_data):
    """One 8-step run through the CLI, its console captured through pipes."""
    root = tmp_path_factory.mktemp("runs")
    p = ok(distlm_all(["train", "--config", "tiny", *RUN, f"data.dir={tiny_data}", f"log.root={root}",
                       "log.name=s"])[0])
    return root / "s", p


# ---- item 4: samples ---------------------------------------------------------------------
def test_samples_at_each_evaluation_and_at_the_end(lm_run):
    run, p = lm_run
    lines = p.stdout.splitlines()
    heads = [i for i, ln in enumerate(lines) if ln.startswith("samples at step ")]
    assert [lines[i].split()[3] for i in heads] == ["5", "8"], p.stdout
    assert "seeds 0-1" in lines[heads[0]] and "temperature 0.8" in lines[heads[0]] and "top-k 50" in lines[heads[0]]
    for i in heads:
        assert [ln.startswith(f"  >> {PROMPT}") for ln in lines[i + 1:i + 4]] == [True, True, False]
    # At the end: after the final evaluation, before the end-of-run line and the last line.
    assert lines[heads[1] - 1].startswith("final val loss") and lines[heads[1] + 3].startswith("end of run ")
    assert lines[heads[1] + 4].startswith("done: step 8")

    blocks = sample_blocks(run)
    assert sorted(blocks) == [5, 8] and all(len(b) == 2 and b[0].startswith(PROMPT) for b in blocks.values())
    assert blocks[5] != blocks[8]  # the model learned something in between (same seeds)
    for step, console_at in zip((5, 8), heads):  # the console shows the same text, on one line each
        assert [" ".join(t.split()) for t in blocks[step]] == [ln[5:] for ln in lines[console_at + 1:console_at + 3]]

    tb = tb_texts(run)
    assert sorted(tb) == [5, 8]
    for step in (5, 8):
        assert "seeds 0-1" in tb[step]
        for t in blocks[step]:  # code blocks: each line of the sample, indented by 4 spaces
            assert "\n".join("    " + ln for ln in t.split("\n")) in tb[step]


def test_generate_gives_a_sample_back_and_eval_says_what_it_measured(lm_run):
    """Item 4: sample i is `distlm generate --seed i` of the checkpoint of its step.
    Item 7: the training log and `distlm eval` say what the validation loss was measured on."""
    run, p = lm_run
    gen, ev, ev_json = distlm_all(
        ["generate", "--checkpoint", run, "--prompt", PROMPT, "--seed", "1", "--max-new-tokens", "48",
         "--temperature", "0.8", "--top-k", "50", "--no-stream"],
        ["eval", "--checkpoint", run, "--batches", "2"], ["eval", "--checkpoint", run, "--batches", "2", "--json"])
    assert ok(gen).stdout == f"--- sample 1 ---\n{sample_blocks(run)[8][1]}\n"

    # 2 micro-batches of 4 blocks of 16 tokens: 8 blocks, 128 tokens, in every place.
    measured = re.compile(r" on (8 blocks \([^)]*\), 128 tokens)")
    at_eval = [ln for ln in p.stdout.splitlines() if ln.startswith("step      5/")]
    assert len(at_eval) == 1 and "val " in at_eval[0] and measured.search(at_eval[0]), p.stdout
    final = [ln for ln in p.stdout.splitlines() if ln.startswith("final val loss")]
    assert len(final) == 1 and measured.search(final[0]), p.stdout
    done = p.stdout.splitlines()[-1]
    assert done.startswith("done: step 8, val loss") and measured.search(done), done
    what = measured.search(final[0]).group(1)
    assert ok(ev).stdout.rstrip().endswith(f"over {what}"), ev.stdout
    import json
    result = json.loads(ok(ev_json).stdout)
    assert (result["blocks"], result["tokens"]) == (8, 128)


def test_no_samples_without_a_tokenizer_or_for_a_classifier(tmp_path):
    """Synthetic tokens have no tokenizer; a classifier has no text: neither writes samples."""
    from distlm.tasks.classify.task import ClassifyTask
    from distlm.train.trainer import Trainer
    assert ClassifyTask().samples(None) == []
    cfg = load_config(None, TINY + ["data.source=synthetic", "model.vocab_size=256", "train.max_steps=2",
                                    "log.tensorboard=false", f"log.root={tmp_path}", "log.name=syn"])
    Trainer(cfg).train()
    assert not (tmp_path / "syn" / "samples.txt").exists()


# ---- items 4 and 8 across a resume -------------------------------------------------------
def test_a_resumed_run_is_one_run(lm_run, tiny_data):
    """After a crash past the step-5 checkpoint, the resumed run's metrics.csv, samples.txt
    and TensorBoard samples are those of the run that never crashed: one row per step,
    elapsed_s counting on from the rows it keeps, the crashed attempt's samples dropped."""
    run, _ = lm_run
    crashed = run.parent / "crashed"
    shutil.copytree(run, crashed)
    shutil.rmtree(crashed / "checkpoints" / "step_0000008")
    rows_before = metrics(crashed)
    p = ok(distlm_all(["train", "--config", "tiny", *RUN, f"data.dir={tiny_data}", f"log.root={run.parent}",
                       "log.name=crashed", "train.resume=auto"])[0])
    assert "resumed from" in p.stdout and "step 5" in p.stdout

    rows = metrics(crashed)
    assert [r["step"] for r in rows] == [str(s) for s in range(1, 9)]  # one row per step
    for a, b in zip(metrics(run), rows):
        assert (a["loss"], a["grad_norm"], a["val_loss"]) == (b["loss"], b["grad_norm"], b["val_loss"]), a["step"]
    elapsed = [float(r["elapsed_s"]) for r in rows]
    assert elapsed[:5] == [float(r["elapsed_s"]) for r in rows_before[:5]]  # kept as they were
    assert all(b > a for a, b in zip(elapsed, elapsed[1:])), elapsed  # and counting on, not from 0
    assert elapsed[5] > elapsed[4] >= max(float(r["elapsed_s"]) for r in rows_before[:5])

    assert (crashed / "samples.txt").read_text() == (run / "samples.txt").read_text()
    assert sorted(tb_texts(crashed)) == [5, 8]


# ---- item 1: resume refuses another architecture or data ---------------------------------
def test_resume_refuses_another_model_or_data_and_leaves_the_run_alone(lm_run, tiny_data, tmp_path):
    run = tmp_path / "r"
    shutil.copytree(lm_run[0], run)
    other_data = tmp_path / "other-data"
    shutil.copytree(tiny_data, other_data)
    files = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".lock"}
    base = ["train", "--config", "tiny", *RUN, f"log.root={tmp_path}"]
    refused, no_name = distlm_all(
        [*base, "log.name=r", f"data.dir={other_data}", "model.n_layer=1", "model.d_model=64", "train.seed=8",
         "train.global_batch_size=16", "train.resume=auto"],
        [*base, f"data.dir={tiny_data}", "train.max_steps=1", "train.resume=auto"])

    # One line, exit 2, every differing field with both values; no shape error first.
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    err = refused.stderr.splitlines()
    assert len(err) == 1, refused.stderr
    assert err[0].startswith("error: train.resume=auto: the checkpoint was trained with "), err[0]
    was, now = err[0].split("the checkpoint was trained with ")[1].split(", this run has ")
    assert was == (f"data.dir={tiny_data}, model.d_model=32, model.n_layer=2, "
                   f"train.global_batch_size=8, train.seed=1337"), was
    assert now.startswith(f"data.dir={other_data}, model.d_model=64, model.n_layer=1, "
                          f"train.global_batch_size=16, train.seed=8;"), now
    assert "resumed" not in refused.stdout
    # Nothing in the run changed: config.yaml (written after a resume) included.
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".lock"} == files

    # resume=auto without log.name: said once, loudly, on stderr, with what to do.
    ok(no_name)
    warn = [ln for ln in no_name.stderr.splitlines() if "resumed nothing" in ln]
    assert len(warn) == 1 and warn[0].startswith("warning: train.resume=auto resumed nothing"), no_name.stderr
    assert "log.name=NAME" in warn[0] and warn[0].endswith(f"(runs with checkpoints under {tmp_path}/: r)"), warn

    # What may change does: length, schedule, micro-batch, logging, and the same data
    # folder spelled another way (relative to another working directory).
    resumed = ok(distlm_all(["train", "--config", "tiny", *RUN, f"log.root={tmp_path}", "log.name=r",
                             f"data.dir={tiny_data.name}", "train.max_steps=10", "optim.adamw.lr=1e-3",
                             "train.micro_batch_size=2", "train.eval_every=0", "log.samples=0", "log.every=3",
                             "train.keep_last=1", "train.resume=auto"], cwd=tiny_data.parent)[0])
    assert "resumed from" in resumed.stdout and resumed.stdout.splitlines()[-1].startswith("done: step 10")


def test_resume_from_a_path_is_refused_before_any_weight_is_loaded(lm_run, tiny_data, tmp_path):
    from distlm.train.trainer import Trainer
    ckpt = lm_run[0] / "checkpoints" / "step_0000005"
    cfg = load_config("tiny", RUN + [f"data.dir={tiny_data}", "model.d_ff=128", "model.position=rope",
                                     f"log.root={tmp_path}", "log.name=p", f"train.resume={ckpt}"])
    with pytest.raises(ConfigError) as e:
        Trainer(cfg)
    assert str(e.value).startswith(f"train.resume={ckpt}: the checkpoint was trained with model.d_ff=64, "
                                   f"model.position=sinusoidal, this run has model.d_ff=128, model.position=rope;")
    assert not (tmp_path / "p" / "config.yaml").exists()


def test_every_config_field_is_either_kept_or_free_on_resume():
    from distlm.train.resume_check import MAY_CHANGE, MUST_MATCH, _fields, differences, must_match_fields
    must = set(must_match_fields())
    may = {f"{s}.{n}" for s, spec in MAY_CHANGE.items() for n in _fields(s, spec)}
    every = {f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    # a nested field may be kept while the rest of its section is free (optim.muon.embed_lr's on/off)
    outer = {".".join(k.split(".")[:2]) for k in must}
    assert not must & may and outer | may == every, (must & may, every - outer - may)
    assert {"model.n_layer", "model.d_model", "model.vocab_size", "data.dir", "data.mix", "data.source",
            "train.seed", "train.global_batch_size"} <= must
    assert {"train.max_steps", "optim.adamw", "train.micro_batch_size", "parallel.dp_shard", "log.every",
            "train.device", "train.dtype", "train.compile", "model.loss_chunk"} <= may
    assert set(MUST_MATCH) | set(MAY_CHANGE) == set(SECTIONS)
    # A field an older checkpoint did not record counts as its default.
    cfg = load_config("tiny")
    saved = cfg.to_dict()
    del saved["model"]["qk_norm"]
    assert differences(saved, cfg) == []
    assert differences(saved, load_config("tiny", ["model.qk_norm=true"])) == [("model.qk_norm", False, True)]
    # optim.muon.embed_lr: another rate may follow, but on <-> off changes the optimizer's groups.
    muon = ["optim.name=muon", "model.tie_embeddings=false"]
    on = load_config("tiny", muon + ["optim.muon.embed_lr=0.3"]).to_dict()
    assert differences(on, load_config("tiny", muon + ["optim.muon.embed_lr=0.6", "optim.muon.lr=0.05"])) == []
    assert differences(on, load_config("tiny", muon)) == [("optim.muon.embed_lr", 0.3, 0.0)]


# ---- item 8: a short run draws a curve ---------------------------------------------------
def test_log_interval_adapts_only_when_auto():
    assert [log_interval(None, n) for n in (5, 30, 300, 700, 100_000)] == [1, 1, 10, 10, 10]
    assert [log_interval(50, n) for n in (5, 30, 300, 100_000)] == [50, 50, 50, 50]  # a number is kept


def test_a_short_run_logs_about_20_points_and_plots_them(tmp_path, tiny_data):
    """30 steps with log.every left to auto (the tiny preset's): a row per step, the final
    evaluation merged into the last row, and a curve across the plot."""
    from distlm.train.trainer import Trainer
    cfg = load_config("tiny", TINY + [f"data.dir={tiny_data}", "train.max_steps=30", "train.eval_every=0",
                                      "log.samples=0", "log.tensorboard=false", f"log.root={tmp_path}",
                                      "log.name=short"])
    assert cfg.log.every is None
    Trainer(cfg).train()
    rows = metrics(tmp_path / "short")
    assert [r["step"] for r in rows] == [str(s) for s in range(1, 31)]
    assert all(r["loss"] for r in rows) and [r["step"] for r in rows if r["val_loss"]] == ["30"]
    import matplotlib.image
    img = matplotlib.image.imread(tmp_path / "short" / "loss.png")[..., :3]
    c0 = np.array([0x1f, 0x77, 0xb4]) / 255  # matplotlib's first colour: the train curve
    ys, xs = np.nonzero(np.abs(img - c0).max(-1) < 0.08)
    assert len(xs) > 150 and xs.max() - xs.min() > 0.5 * img.shape[1], (len(xs), img.shape)
