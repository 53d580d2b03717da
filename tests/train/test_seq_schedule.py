"""Sequence-length warm-up: train.seq_warmup_steps / seq_warmup_start.

The loader serves the same blocks in the same order; only the rows they are cut into, and
so the attention context, change during the warm-up. Checked here: the schedule, a step
against the loss computed by hand on the rows, the tokens trained on, bit-exact resume
across a stage boundary, the document mask, the compile-graph budget, the config errors."""
import copy
import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distlm.config import DYNAMO_RECOMPILE_LIMIT, ConfigError, load_config, seq_warmup_lengths, updated
from distlm.train.seq_schedule import SeqSchedule

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.n_layer=2", "model.n_head=2", "model.d_model=32", "model.d_ff=64", "model.block_size=16",
        "train.global_batch_size=8", "train.micro_batch_size=4", "train.eval_every=4", "train.eval_batches=2",
        "train.warmup_steps=2", "log.every=1", "log.progress=false", "log.tensorboard=false", "log.samples=0",
        "train.seed=7", "train.device=cpu", "train.compile=false"]
# block_size 16 from rows of 4: stages of 4 (steps 0-1), 8 (steps 2-3), then 16 from step 4.
WARM = ["train.seq_warmup_steps=4", "train.seq_warmup_start=4"]


def schedule(overrides) -> SeqSchedule:
    return SeqSchedule.from_config(load_config("tiny", TINY + overrides))


def rows(run_dir):
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


# ---- the schedule ----------------------------------------------------------------------
def test_lengths_double_in_equal_stages_up_to_the_block():
    s = SeqSchedule.from_config(load_config("tiny", ["model.block_size=1024", "train.seq_warmup_steps=300",
                                                     "train.seq_warmup_start=256"]))
    assert [s.length(i) for i in (0, 149, 150, 299, 300, 10_000)] == [256, 256, 512, 512, 1024, 1024]

    s = schedule(["train.seq_warmup_steps=10", "train.seq_warmup_start=2"])
    lengths = [s.length(i) for i in range(14)]
    assert lengths == [2] * 4 + [4] * 3 + [8] * 3 + [16] * 4  # 3 stages share 10 steps: 4, 3, 3
    assert all(n & (n - 1) == 0 for n in lengths) and lengths == sorted(lengths)
    events = {i: s.events(i) for i in range(14)}
    assert {i: e for i, e in events.items() if e} == {
        0: ["seq warm-up: step 1 -> rows of 2 tokens (8 per block of 16)"],  # as logged: 1-based
        4: ["seq warm-up: step 5 -> rows of 4 tokens (4 per block of 16)"],
        7: ["seq warm-up: step 8 -> rows of 8 tokens (2 per block of 16)"],
        10: ["seq warm-up: step 11 -> rows of 16 tokens, the whole block (warm-up done)"]}

    x, y = torch.arange(64).reshape(4, 16), torch.arange(1, 65).reshape(4, 16)
    rx, ry = s.apply(5, x, y)
    assert rx.shape == ry.shape == (16, 4) and torch.equal(rx.flatten(), x.flatten())
    assert torch.equal(ry.flatten(), y.flatten())


def test_off_is_the_identity():
    s = schedule([])
    x, y = torch.zeros(4, 16, dtype=torch.long), torch.ones(4, 16, dtype=torch.long)
    assert all(s.length(i) == 16 and not s.events(i) for i in range(50))
    out = s.apply(0, x, y)
    assert out[0] is x and out[1] is y


# ---- a step by hand ----------------------------------------------------------------------
@pytest.mark.parametrize("extra", [["model.position=learned"], ["model.position=rope", "model.attn_mask=doc"]])
def test_a_warm_up_step_is_the_models_loss_on_the_rows(tmp_path, tiny_data, extra):
    from distlm.train.trainer import Trainer
    cfg = load_config("tiny", TINY + WARM + extra + [f"data.dir={tiny_data}", "train.max_steps=3",
                                                      f"log.root={tmp_path}", "log.name=h"])
    t = Trainer(cfg)
    t.step = t.loader.step = 2  # as a run resumed at step 2, which trains on rows of 8
    micro = t.loader.micro_batches(2)
    before = copy.deepcopy(t.module)
    loss, grad_norm = t.train_step()

    n_micro = len(micro)
    by_hand = torch.zeros(())
    full = torch.zeros(())
    for x, y in micro:
        rows_loss = before(x.reshape(-1, 8), targets=y.reshape(-1, 8)) / n_micro  # positions from 0 in each row
        rows_loss.backward()
        by_hand += rows_loss.detach()
        with torch.no_grad():
            full += before(x, targets=y) / n_micro
    norm = sum(p.grad.double().square().sum() for p in before.parameters() if p.grad is not None).sqrt().float()
    torch.testing.assert_close(loss, by_hand, rtol=0, atol=0)
    torch.testing.assert_close(grad_norm, norm, rtol=1e-6, atol=0)
    assert abs(float(full - by_hand)) > 1e-4  # the rows are not the blocks


def test_the_document_mask_is_cut_with_the_rows(tmp_path, tiny_data, capsys):
    """The mask is computed in the forward from the rows it is given: one row per (row of
    the reshaped micro-batch), each starting its own documents."""
    from distlm.train.trainer import Trainer
    cfg = load_config("tiny", TINY + WARM + ["model.attn_mask=doc", f"data.dir={tiny_data}", "train.max_steps=6",
                                             f"log.root={tmp_path}", "log.name=d"])
    t = Trainer(cfg)
    seen = []
    mask_of = t.module.attention_mask
    t.module.attention_mask = lambda idx, *a, **k: seen.append(mask_of(idx, *a, **k).shape) or mask_of(idx, *a, **k)
    out = t.train()
    said = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("seq warm-up")]
    assert said == ["seq warm-up: step 1 -> rows of 4 tokens (4 per block of 16)",
                    "seq warm-up: step 3 -> rows of 8 tokens (2 per block of 16)",
                    "seq warm-up: step 5 -> rows of 16 tokens, the whole block (warm-up done)"]
    assert out["step"] == 6 and all(float(r["loss"]) > 0 for r in rows(tmp_path / "d") if r["loss"])
    # 2 micro-batches of 4 blocks of 16 a step: 16 rows of 4, 8 rows of 8, then 4 blocks
    assert seen[:6] == [(16, 1, 4, 4)] * 4 + [(8, 1, 8, 8)] * 2 and seen[-1] == (4, 1, 16, 16)


# ---- the tokens and their order ----------------------------------------------------------
def trained_inputs(tmp_path, data, name, extra) -> tuple[list, object]:
    """What the model was given, step by step: [(x, y) of each micro-batch] per step."""
    from distlm.train.trainer import Trainer
    cfg = load_config("tiny", TINY + extra + [f"data.dir={data}", "train.max_steps=6", f"log.root={tmp_path}",
                                              f"log.name={name}"])
    t = Trainer(cfg)
    steps = []
    fb = t.stepper.forward_backward

    def record(micro, *a, **k):
        steps.append([(x.clone(), y.clone()) for x, y in micro])
        return fb(micro, *a, **k)

    t.stepper.forward_backward = record
    t.train()
    return steps, t


def test_the_same_tokens_in_the_same_order(tmp_path, tiny_data):
    plain, a = trained_inputs(tmp_path, tiny_data, "plain", [])
    warm, b = trained_inputs(tmp_path, tiny_data, "warm", WARM)
    assert len(plain) == len(warm) == 6
    shapes = [[tuple(x.shape) for x, _ in step] for step in warm]
    assert shapes == [[(16, 4)] * 2] * 2 + [[(8, 8)] * 2] * 2 + [[(4, 16)] * 2] * 2
    for p, w in zip(plain, warm):
        assert [(x.flatten().tolist(), y.flatten().tolist()) for x, y in p] == \
               [(x.flatten().tolist(), y.flatten().tolist()) for x, y in w]
    assert a.loader.state_dict() == b.loader.state_dict() and a.tokens_seen == b.tokens_seen
    # the warm-up changed what was learned, not what was read
    assert rows(tmp_path / "plain")[0]["loss"] != rows(tmp_path / "warm")[0]["loss"]


# ---- resume --------------------------------------------------------------------------------
def test_resume_across_a_stage_boundary_is_bit_exact(tmp_path, tiny_data):
    """8 steps, warm-up over 6 (rows of 4, then of 8 from step 3, whole blocks from 6);
    stopped after 4 and resumed: the same weights and metrics as the run that never stopped."""
    from distlm.train.trainer import Trainer
    base = TINY + [f"data.dir={tiny_data}", "train.max_steps=8", "train.checkpoint_every=4", "train.keep_last=5",
                   "train.seq_warmup_steps=6", "train.seq_warmup_start=4", f"log.root={tmp_path}"]
    full = Trainer(load_config("tiny", base + ["log.name=full"]))
    full.train()
    shutil.copytree(tmp_path / "full", tmp_path / "crashed")
    shutil.rmtree(tmp_path / "crashed" / "checkpoints" / "step_0000008")
    resumed = Trainer(load_config("tiny", base + ["log.name=crashed", "train.resume=auto"]))
    assert resumed.step == 4 and resumed.seq_schedule.length(4) == 8 and resumed.seq_schedule.length(6) == 16
    resumed.train()
    a, b = rows(tmp_path / "full"), rows(tmp_path / "crashed")
    assert [r["step"] for r in b] == [str(s) for s in range(1, 9)]
    for ra, rb in zip(a, b):
        assert (ra["loss"], ra["grad_norm"], ra["lr"], ra["val_loss"]) == \
               (rb["loss"], rb["grad_norm"], rb["lr"], rb["val_loss"]), ra["step"]
    sa, sb = full.module.state_dict(), resumed.module.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_resume_keeps_the_warm_up():
    from distlm.train.resume_check import differences, must_match_fields
    assert {"train.seq_warmup_steps", "train.seq_warmup_start"} <= set(must_match_fields())
    saved = load_config("tiny", TINY).to_dict()
    del saved["train"]["seq_warmup_steps"]  # a checkpoint from before the warm-up existed: off
    assert differences(saved, load_config("tiny", TINY)) == []
    assert differences(saved, load_config("tiny", TINY + WARM)) == [("train.seq_warmup_start", 128, 4),
                                                                           ("train.seq_warmup_steps", 0, 4)]


# ---- torch.compile's graph budget --------------------------------------------------------
def test_the_recompile_limit_is_torchs():
    import torch._dynamo.config as dc
    assert DYNAMO_RECOMPILE_LIMIT == getattr(dc, "recompile_limit", getattr(dc, "cache_size_limit", None))


def test_a_warm_up_config_accepts_stays_within_the_recompile_limit():
    """Compiled per block with value embeddings (two kinds of blocks), every row length, the
    full blocks and the evaluation: exactly the graphs validation counts, none run eagerly.
    One length more is refused, with the start that fits."""
    from torch._dynamo.testing import CompileCounter
    from distlm.model.gpt import GPT
    model = ["model.n_layer=4", "model.value_embeds=1", "train.compile=true", "train.compile_scope=block"]
    with pytest.raises(ConfigError, match=r"^train.seq_warmup_start=2 gives 3 warm-up row lengths \(2 to 8\): 10 "
                                          r"graphs .* use train.seq_warmup_start=4 or more$"):
        load_config("tiny", TINY + model + ["train.seq_warmup_steps=6", "train.seq_warmup_start=2"])
    cfg = load_config("tiny", TINY + model + ["train.seq_warmup_steps=6", "train.seq_warmup_start=4"])
    lengths = seq_warmup_lengths(cfg.train, 16) + [16]
    assert lengths == [4, 8, 16]
    torch._dynamo.reset()
    gpt = GPT(updated(cfg, model={"vocab_size": 64}).model)
    counter = CompileCounter()
    for block in gpt.blocks.values():
        block.compile(backend=counter, dynamic=False)
    x = torch.randint(0, 64, (2, 16))
    for n in lengths:
        gpt(x.reshape(-1, n), targets=x.reshape(-1, n)).backward()
    gpt.eval()
    with torch.no_grad():
        gpt(x, targets=x)
    assert counter.frame_count == (len(lengths) + 1) * 2 == DYNAMO_RECOMPILE_LIMIT
    torch._dynamo.reset()


@pytest.mark.parametrize("scope", ["block", "model"])
def test_the_warm_up_compiles_static_graphs(monkeypatch, scope):
    """Without dynamic=False the second row length would make the sequence dimension
    symbolic, for the full-length steps too."""
    from distlm.model.gpt import GPT
    from distlm.parallel.parallelize import apply_compile
    calls = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: calls.append(kw))
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(kw) or fn)
    gpt = GPT(updated(load_config("tiny", TINY), model={"vocab_size": 64}).model)
    apply_compile(gpt, scope, static=True)
    assert calls and all(kw == {"dynamic": False} for kw in calls)
    calls.clear()
    apply_compile(gpt, scope)
    assert calls and all(kw == {} for kw in calls)  # off: compiled as before


# ---- config errors -------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, needle", [
    (["parallel.tp=2", "model.n_head=2", "train.seq_warmup_start=1"], "is not divisible by parallel.tp=2"),
    (["model.block_size=48", "train.seq_warmup_start=16"], "must divide model.block_size=48 by a power of two"),
    (["train.seq_warmup_steps=-1"], "train.seq_warmup_steps must be >= 0, got -1"),
    (["task=classify", "train.seq_warmup_start=4"], "is for language models"),
    (["model.block_size=1024", "train.seq_warmup_start=8"], "use train.seq_warmup_start=16 or more"),
])
def test_bad_warm_up_configs_are_named(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config("tiny", TINY + ["train.seq_warmup_steps=4"] + overrides)
    load_config("tiny", TINY + ["train.seq_warmup_start=1000"])  # off: the start is not read


def test_config_errors_on_the_command_line_are_one_line(tiny_data, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    base = ["train", "--config", "tiny", *TINY, f"data.dir={tiny_data}", f"log.root={tmp_path}",
            "train.seq_warmup_steps=10"]
    cases = {"train.seq_warmup_start=6": "error: train.seq_warmup_start must be a power of two, got 6",
             "train.seq_warmup_start=16": "error: train.seq_warmup_start=16 must be below model.block_size=16",
             "parallel.pp=2": "error: train.seq_warmup_steps=10 does not support parallel.pp=2: a pipeline's "
                              "stages are built for one input shape"}
    procs = {o: subprocess.Popen([sys.executable, "-m", "distlm", *base, "train.seq_warmup_start=4", o], env=env,
                                 text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for o in cases}
    for o, p in procs.items():
        out, err = p.communicate(timeout=300)
        assert p.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, (o, err)
        assert err.startswith(cases[o]), (o, err)
    assert not any(tmp_path.iterdir())  # refused before a run folder exists
