"""Tensor and pipeline parallelism, and their compositions, against one process (CPU, gloo).

Same method as tests/layout/test_data.py: each layout trains on the same global batches as the
single-process reference, so per-step losses and grad norms must agree to fp32 rounding.
Scenarios of the shared worlds (tests/helpers/worlds.py), each a Trainer job:
  - 2 ranks: TP2 plain and TP2 + SP + loss_parallel, on several model variants (the modern
    block's options among them); PP2 under every schedule (naive, gpipe, 1f1b,
    interleaved-1f1b, zero-bubble);
  - 4 ranks: TP4; PP4 under 1f1b and interleaved-1f1b; TP2xDP2 (FSDP2 and replicated),
    PP2xDP2, TP2xPP2; a TP2xDP2 checkpoint resumed as FSDP4 and as TP2xPP2;
  - 8 ranks: DP2xTP2xPP2, once (no 8-GPU machine is lent; this is where 3-D is checked);
  - this process resumes the TP2xDP2 checkpoint as one process.
"""
from __future__ import annotations

from pathlib import Path

import csv
import json
import math

import pytest

from distlm.config import ConfigError, load_config
from helpers.runs import assert_matches, ckpt, trace, train_here

pytestmark = [pytest.mark.dist, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

STEPS, SAVE_AT = 5, 3
# Six blocks, so that 4 ranks x 2 virtual stages still give each stage something to do;
# clipping active every step; learned positions (replicated under TP, first stage only
# under PP) and tied embeddings (split over the vocabulary under TP, held by the first
# and last stage under PP) are the hard cases.
BASE = ["model.n_layer=6", "model.n_head=4", "model.d_model=64", "model.d_ff=128", "model.block_size=32",
        "model.vocab_size=256", "model.position=learned", "data.source=synthetic",
        f"train.max_steps={STEPS}", "train.global_batch_size=16", "train.micro_batch_size=4",
        "optim.adamw.lr=1e-2", "train.min_lr_ratio=0.1", "train.warmup_steps=2", "train.grad_clip=0.3",
        "train.eval_every=0", f"train.checkpoint_every={SAVE_AT}", "train.keep_last=5",
        "log.every=1", "log.progress=false", "log.tensorboard=false", "parallel.timeout_s=60"]
# Llama-style: rope, rmsnorm, swiglu, untied head, no biases.
LLAMA = ["model.position=rope", "model.norm=rmsnorm", "model.mlp=swiglu", "model.tie_embeddings=false",
         "model.bias=false"]
# Sinusoidal positions (a buffer added after the vocabulary-parallel embedding) with rmsnorm.
# AdamW's eps raised as in with_data() below: at eps=1e-8 this variant drifted to 7e-5 by step 5
# (losses still equal to 5e-7), the eps amplification explained there.
SINUS = ["model.position=sinusoidal", "model.norm=rmsnorm", "optim.adamw.eps=1e-5"]
# The modern block: QK-norm, ReLU^2, soft-capped logits (a cap low enough to bend
# them), document masks with a window, a value embedding and U-net skips. A 64-token vocabulary
# so that the end-of-text token (5) cuts the synthetic rows into documents, ~8 per step.
MODERN = ["model.position=rope", "model.qk_norm=true", "model.mlp=relu2", "model.logit_softcap=2",
          "model.attn_mask=doc", "model.eot_id=5", "model.attn_window=20", "model.value_embeds=1",
          "model.skip_connections=true", "model.vocab_size=64"]
SCHEDULES = ["naive", "gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"]
# Every run saves its final checkpoint; the step-3 save in the middle of training (which must
# not change what follows) is kept for one job of each layout and dropped for the variants
# of a layout already covered: each save is a collective DCP write of a second or two.
NO_MIDRUN_SAVE = "train.checkpoint_every=0"
# Tensor parallelism acts inside each block, and on the CPU its cost is the DTensor dispatch and the
# gloo collectives of every block and micro-batch (4 ranks on 2 cores wait on each other's turn):
# its jobs take two blocks (one per stage where a pipeline splits them) and, without a pipeline,
# the whole local batch in one micro-batch (micro-batches=16 // data ranks).
TP = ["model.n_layer=2"]


def whole_batch(data_ranks: int = 1) -> str:
    return f"train.micro_batch_size={16 // data_ranks}"


def with_data(data: Path) -> list[str]:
    """Real tokens with a validation split, so evaluation runs (through the schedule under PP).
    GPT-2's 50k vocabulary on a 64-wide model: at the synthetic runs' learning rate the loss
    jumps around, so a gentler one. And AdamW's eps is raised to 1e-5: on this text some
    gradient elements are near-cancelling sums smaller than eps=1e-8, and AdamW's first steps
    scale g by about lr/(|g| + eps), so the ~1e-11 rounding difference of a TP rank's other
    summation order became a 4e-6 weight difference after two steps (measured); with
    eps=1e-5 the weights agree to 1.2e-7."""
    return [f"data.dir={data}", "data.source=tokens", "model.vocab_size=null", "train.eval_every=5",
            "train.eval_batches=4", "optim.adamw.lr=2e-3", "train.min_lr_ratio=0.1", "optim.adamw.eps=1e-5"]


def job(root: Path, name: str, *extra: str, **kw) -> dict:
    return {"kind": "train", "name": name, "overrides": BASE + [f"log.root={root}", f"log.name={name}", *extra], **kw}


def steps(n: int = STEPS) -> range:
    return range(1, n + 1)


# `distlm bench --pp-sweep` (the bubble against the microbatch count), run after the 2-rank jobs.
PP_SWEEP = ["bench", "model.n_layer=2", "model.n_head=2", "model.d_model=32", "model.d_ff=64", "model.block_size=16",
            "model.vocab_size=128", "data.source=synthetic", "parallel.pp=2", "train.global_batch_size=8",
            "parallel.timeout_s=60", "--pp-sweep", "1,2,4", "--warmup", "1", "--steps", "1"]


def world_scenarios(root: Path, data: Path) -> dict[int, list[dict]]:
    two = [job(root, "pp2_data", "parallel.pp=2", *with_data(data)),
           job(root, "tp2_data", "parallel.tp=2", NO_MIDRUN_SAVE, *TP, *with_data(data)),
           job(root, "tp2_plain", "parallel.tp=2", "parallel.sequence_parallel=false",
               "parallel.loss_parallel=false", NO_MIDRUN_SAVE, *TP, whole_batch(), count_collectives=True),
           job(root, "tp2_sp", "parallel.tp=2", *TP, whole_batch(), count_collectives=True),
           job(root, "tp2_sp_llama", "parallel.tp=2", NO_MIDRUN_SAVE, *TP, whole_batch(), *LLAMA),
           job(root, "tp2_sp_sinus", "parallel.tp=2", NO_MIDRUN_SAVE, *TP, whole_batch(), *SINUS),
           job(root, "tp2_sp_modern", "parallel.tp=2", NO_MIDRUN_SAVE, *TP, whole_batch(), *MODERN,
               count_collectives=True),
           job(root, "pp2_1f1b_llama", "parallel.pp=2", NO_MIDRUN_SAVE, *LLAMA)]
    two += [job(root, f"pp2_{s}", "parallel.pp=2", f"parallel.pp_schedule={s}",
                *([] if s == "1f1b" else [NO_MIDRUN_SAVE])) for s in SCHEDULES]
    two.append({"kind": "cli", "name": "pp_sweep",
                "argv": PP_SWEEP + [f"log.root={root / 'sweep-runs'}", "--out-dir", str(root / "sweep")]})
    four = [job(root, "tp4", "parallel.tp=4", *TP, whole_batch()),
            job(root, "pp4_1f1b", "parallel.pp=4"),
            job(root, "pp4_interleaved", "parallel.pp=4", "parallel.pp_schedule=interleaved-1f1b", NO_MIDRUN_SAVE),
            job(root, "tp2_fsdp2", "parallel.tp=2", "parallel.dp_shard=2", *TP, whole_batch(2), grad_norms=True),
            job(root, "tp2_ddp2", "parallel.tp=2", "parallel.dp_replicate=2", *TP, whole_batch(2), grad_norms=True),
            job(root, "pp2_fsdp2", "parallel.pp=2", "parallel.dp_shard=2", "parallel.pp_schedule=gpipe"),
            job(root, "pp2_ddp2", "parallel.pp=2", "parallel.dp_replicate=2"),
            job(root, "tp2_pp2", "parallel.tp=2", "parallel.pp=2", *TP),
            # Cross-layout: the TP2xDP2 checkpoint of step 3 continues under other layouts.
            job(root, "from_tp_to_fsdp4", "parallel.dp_shard=4", *TP, f"train.resume={ckpt(root, 'tp2_fsdp2', SAVE_AT)}"),
            job(root, "from_tp_to_tp2pp2", "parallel.tp=2", "parallel.pp=2", *TP,
                f"train.resume={ckpt(root, 'tp2_fsdp2', SAVE_AT)}")]
    eight = [job(root, "dp2_tp2_pp2", "parallel.dp_shard=2", "parallel.tp=2", "parallel.pp=2", *TP)]
    return {2: two, 4: four, 8: eight}


@pytest.fixture(scope="module")
def root(worlds) -> Path:
    return worlds.root(__name__)


@pytest.fixture(scope="module")
def reference(root, tiny_data) -> dict:
    """One process, one big micro-batch, for each model variant (tp_*: the two-block model)."""
    out = {}
    for variant, extra in (("gpt2", [whole_batch()]),
                           ("llama", [whole_batch(), NO_MIDRUN_SAVE, *LLAMA]),
                           # validation takes eval_batches micro-batches: the same micro-batch size as the runs
                           ("data", with_data(tiny_data)),
                           ("tp_gpt2", [*TP, whole_batch()]),
                           ("tp_llama", [*TP, whole_batch(), NO_MIDRUN_SAVE, *LLAMA]),
                           ("tp_sinus", [*TP, whole_batch(), NO_MIDRUN_SAVE, *SINUS]),
                           ("tp_modern", [*TP, whole_batch(), NO_MIDRUN_SAVE, *MODERN]),
                           ("tp_data", [*TP, *with_data(tiny_data)])):
        train_here(job(root, f"ref_{variant}", *extra)["overrides"])
        out[variant] = trace(root / f"ref_{variant}")
    return out


@pytest.fixture(scope="module")
def two(worlds, reference):
    return worlds.results(__name__, 2)


@pytest.fixture(scope="module")
def four(worlds, reference):
    return worlds.results(__name__, 4)


@pytest.fixture(scope="module")
def eight(worlds, reference):
    return worlds.results(__name__, 8)


# ---- tensor parallel ------------------------------------------------------------------
@pytest.mark.parametrize("name,variant", [("tp2_plain", "tp_gpt2"), ("tp2_sp", "tp_gpt2"), ("tp2_sp_llama", "tp_llama"),
                                          ("tp2_sp_sinus", "tp_sinus"), ("tp2_sp_modern", "tp_modern")])
def test_tp2_matches_one_process(root, two, reference, name, variant):
    assert_matches(root / name, reference[variant], steps())
    assert all(not r["init_mismatched"] for r in two[name]), "TP shards must hold slices of the same init"


def test_tp4_matches_one_process(root, four, reference):
    assert_matches(root / "tp4", reference["tp_gpt2"], steps())


def test_tp_backward_reduces_each_block_input_once(two):
    """The block's input is gathered once (attention's and the MLP's), so its gradient must be
    reduced once: a reduce-scatter with SP, an all-reduce without. Each q/k/v (and MLP input)
    projection all-reduced its own partial input gradient before (4 full all-reduces per block
    in the backward instead of 2 reduce-scatters: 4x the bytes at TP2)."""
    L = 2  # the TP jobs' blocks
    sp, plain = (two[name][0]["update_collectives"]["forward_backward"] for name in ("tp2_sp", "tp2_plain"))
    # SP, per block and pass: 2 all-gathers and 2 reduce-scatters (one pair each for attention
    # and the MLP). Outside the blocks: the final norm's gather into the head and its backward
    # (a reduce-scatter), the embedding's slice onto the sequence (an all-gather backward), the
    # embedding's all-reduce and loss_parallel's three (max, sum, target logit).
    assert sp == {"all_gather_into_tensor": 4 * L + 2, "reduce_scatter_tensor": 4 * L + 1, "all_reduce": 4}, sp
    # Without SP: per block an all-reduce after each row-parallel layer (forward) and one per
    # gathered input (backward); outside, the embedding's, the logits' gather and the head
    # input's gradient.
    assert plain.get("all_reduce") == 4 * L + 2 and "reduce_scatter_tensor" not in plain, plain


def test_tp_gathers_block_inputs_in_the_autocast_dtype(two):
    """Under bf16 autocast the norms' output is fp32 and the projections cast it to bf16: the
    block input is cast before its all-gather, so every block collective moves bf16, the
    gathers forward and their gradients' reduce-scatters backward included (before: 2 fp32
    all-gathers and 2 fp32 reduce-scatters per block, half of TP's bytes)."""
    L = 2
    seen = two["tp2_sp"][0]["update_collectives"]["autocast_dtypes"]
    ag, rs = seen["all_gather_into_tensor"], seen["reduce_scatter_tensor"]
    # per block: 2 input gathers forward, 2 gathers of the output's gradient backward; the same
    # for reduce-scatters. The rest (the final norm's gather into the head, the embedding) may be fp32.
    assert ag.get("bfloat16", 0) >= 4 * L and rs.get("bfloat16", 0) >= 4 * L, seen
    assert ag.get("float32", 0) <= 2 and rs.get("float32", 0) <= 1, seen


@pytest.mark.parametrize("name", ["tp2_sp", "tp2_sp_modern", "tp2_plain"])
def test_tp_update_issues_few_collectives(two, name):
    """Partial-sum gradients are reduced once, in one bucket per mesh dim; the norm is one
    all-reduce per group of gradients; the optimizer step communicates nothing (it did one
    all-reduce per replicated parameter and read, ~300 a step at 1.5B, before)."""
    assert len(two[name]) == 2
    for r in two[name]:
        c = r["update_collectives"]
        assert c["optimizer"] == 0, c
        assert c["reduce"] <= 1 and c["clip"] <= 2, c
        by_local, by_dtensor = r["grad_norms"]
        assert by_local > 0 and math.isclose(by_local, by_dtensor, rel_tol=1e-5)


@pytest.mark.parametrize("name", ["tp2_fsdp2", "tp2_ddp2"])
def test_grad_norm_on_2d_meshes_equals_dtensors_own(four, name):
    """FSDP2 over TP shards dim 0 again (a _StridedShard, which is not a Shard to torch 2.13):
    the local-squares norm must still sum it over both mesh dims."""
    assert len(four[name]) == 4
    for r in four[name]:
        by_local, by_dtensor = r["grad_norms"]
        assert by_local > 0 and math.isclose(by_local, by_dtensor, rel_tol=1e-5), (by_local, by_dtensor)


def test_tp_keeps_tied_embedding(two):
    assert all(r["tied_after_training"] for r in two["tp2_sp"])


def test_every_parameter_is_a_dtensor_on_one_mesh_under_tp(two):
    """A learned position table and norms without SP used to stay plain tensors beside
    DTensors, which fused AdamW (CUDA) and the foreach path refuse in one group (first seen
    on 2x H200). Now each is a replicated DTensor, and AdamW keeps its two groups."""
    for name in ("tp2_sp", "tp2_plain", "pp2_1f1b"):
        assert all(r["optimizer_groups_one_mesh"] and r["optimizer_groups"] == 2 for r in two[name]), name


# ---- pipeline parallel ----------------------------------------------------------------
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_every_schedule_matches_one_process(root, two, reference, schedule):
    assert_matches(root / f"pp2_{schedule}", reference["gpt2"], steps())


def test_pp2_untied_llama(root, two, reference):
    assert_matches(root / "pp2_1f1b_llama", reference["llama"], steps())


@pytest.mark.parametrize("name", ["pp4_1f1b", "pp4_interleaved"])
def test_pp4_matches_one_process(root, four, reference, name):
    assert_matches(root / name, reference["gpt2"], steps())


@pytest.mark.parametrize("name,variant", [("pp2_data", "data"), ("tp2_data", "tp_data")])
def test_validation_loss_matches_one_process(root, two, reference, name, variant):
    assert_matches(root / name, reference[variant], steps())
    val = {n: [float(r["val_loss"]) for r in csv.DictReader(open(root / n / "metrics.csv")) if r["val_loss"]]
           for n in (name, f"ref_{variant}")}
    assert val[name] and val[name] == pytest.approx(val[f"ref_{variant}"], rel=1e-5)


def test_pipeline_checkpoint_generates_in_one_process(root, two, reference, capsys):
    """A PP run's checkpoint (each stage saved its part) loads whole into one process."""
    import torch
    from distlm.cli import main
    from distlm.model.load import load_model
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = load_model(root / "pp2_data")[0](ids)
        b = load_model(root / "ref_data")[0](ids)
    assert torch.allclose(a, b, atol=1e-4)
    assert main(["generate", "--checkpoint", str(root / "pp2_data"), "--prompt", "It is a truth",
                 "--max-new-tokens", "8", "--seed", "0", "--no-stream"]) == 0
    assert "It is a truth" in capsys.readouterr().out


# ---- compositions ---------------------------------------------------------------------
@pytest.mark.parametrize("name,variant", [("tp2_fsdp2", "tp_gpt2"), ("tp2_ddp2", "tp_gpt2"), ("pp2_fsdp2", "gpt2"),
                                          ("pp2_ddp2", "gpt2"), ("tp2_pp2", "tp_gpt2")])
def test_2d_layouts_match_one_process(root, four, reference, name, variant):
    assert_matches(root / name, reference[variant], steps())


@pytest.mark.slow
def test_3d_dp2_tp2_pp2_matches_one_process(root, eight, reference):
    assert_matches(root / "dp2_tp2_pp2", reference["tp_gpt2"], steps())


# ---- checkpoints across layouts -------------------------------------------------------
@pytest.mark.parametrize("name", ["from_tp_to_fsdp4", "from_tp_to_tp2pp2"])
def test_tp_dp_checkpoint_resumes_under_other_layouts(root, four, reference, name):
    assert all(r["start_step"] == SAVE_AT for r in four[name])
    assert_matches(root / name, reference["tp_gpt2"], range(SAVE_AT + 1, STEPS + 1))


def test_tp_dp_checkpoint_resumes_in_one_process(root, four, reference):
    t = train_here(BASE + TP + [whole_batch(), f"log.root={root}", "log.name=from_tp_to_one",
                                f"train.resume={ckpt(root, 'tp2_fsdp2', SAVE_AT)}"])
    assert t.step == STEPS
    assert_matches(root / "from_tp_to_one", reference["tp_gpt2"], range(SAVE_AT + 1, STEPS + 1))


# ---- config errors (no launch) --------------------------------------------------------
@pytest.mark.parametrize("extra,needle", [
    (["parallel.tp=3", "model.n_head=4"], "does not divide model.n_head=4"),
    (["parallel.tp=2", "model.n_head=4", "model.d_ff=129"], "does not divide model.d_ff=129"),
    (["parallel.pp=2", "train.global_batch_size=12", "train.micro_batch_size=4", "parallel.pp_microbatches=5"],
     "parallel.pp_microbatches=5"),
    (["parallel.pp=2", "parallel.pp_virtual_stages=0"], "pp_virtual_stages must be positive"),
    (["parallel.tp=2", "parallel.engine=horovod"], "parallel.tp=2 needs parallel.engine=torch"),
])
def test_bad_model_parallel_config(extra, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, ["model.vocab_size=256", *extra])


ROW_PARALLEL_GRAPH = r"""
import torch, torch.distributed as dist
from torch._functorch.aot_autograd import aot_module_simplified
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from distlm.config import load_config
from distlm.model.gpt import GPT
from distlm.parallel.tp import apply_tp

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)  # collectives traced, not run
cfg = load_config("tiny", ["model.n_layer=1", "model.d_model=64", "model.n_head=4", "model.d_ff=128",
                           "model.block_size=32", "model.vocab_size=256", "model.dropout=0.0", "model.bias=true"])
model = GPT(cfg.model)
apply_tp(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), cfg.parallel)
graphs = []
def backend(gm, inputs):
    def forward_graph(g, _):
        graphs.append(g.graph)
        return g.forward
    return aot_module_simplified(gm, inputs, fw_compiler=forward_graph, bw_compiler=lambda g, _: g.forward)
block = next(iter(model.blocks.values()))
torch.compile(block, backend=backend)(torch.randn(2, 16, 64, requires_grad=True)).sum().backward()

def producer(node):  # the op that computed what a reduce-scatter sends, past views, splits and cats
    while any(k in str(node.target) for k in ("view", "split", "cat", "getitem", "reshape")):
        node = node.all_input_nodes[0]
    return str(node.target)
print(sorted(producer(n.all_input_nodes[0]) for n in graphs[0].nodes if "reduce_scatter" in str(n.target)))
"""


def test_row_parallel_matmuls_feed_their_reduce_scatters_directly():
    """Async TP fuses a reduce-scatter only with a matmul that feeds it directly. With torch's
    RowwiseParallel a biased layer's bias was added inside the matmul (addmm), so no
    reduce-scatter of a GPT-2-style block could be fused; the plan now adds it after
    the reduction. Traced on one process with a fake group of two: every reduce-scatter of the
    block's forward (attention and MLP outputs) is fed by a plain mm."""
    import subprocess
    import sys
    from conftest import ROOT
    p = subprocess.run([sys.executable, "-c", ROW_PARALLEL_GRAPH], capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == "['aten.mm.default', 'aten.mm.default']", p.stdout


# ---- the pipeline bubble sweep (distlm bench --pp-sweep) --------------------------------
def test_pp_sweep_writes_table_json_and_plot(root, two):
    """`distlm bench --pp-sweep` as torchrun runs it, inside the 2-rank world (after its jobs)."""
    assert two["pp_sweep"]["rc"] == 0
    out = root / "sweep"
    rows = json.loads((out / "pp-sweep.json").read_text())
    got = {(r["schedule"], r["microbatches"]) for r in rows}
    assert got == {("naive", 1), ("gpipe", 1), ("gpipe", 2), ("gpipe", 4), ("1f1b", 2), ("1f1b", 4)}
    for r in rows:  # theory: (pp-1)/(m+pp-1); naive (pp-1)/pp
        want = 0.5 if r["schedule"] == "naive" else 1 / (r["microbatches"] + 1)
        assert r["bubble_theory"] == pytest.approx(want) and r["step_ms"] > 0
    table = [line for line in (out / "pp-sweep.md").read_text().splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(rows)
    import matplotlib.image
    assert matplotlib.image.imread(out / "pp-sweep.png").shape[0] > 100
