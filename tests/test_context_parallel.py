"""Context parallelism (distlm/parallel/context.py) against one process, on CPU with gloo, fp32.

The split itself is checked here directly (head and tail chunks, positions, the inverse,
the balance of causal work). Then two launches of tests/context_worker.py train a tiny GPT
for a few AdamW steps with clipping on the same global batches as the single-process
reference in this process, and every step's loss (the mean over the whole global batch)
and gradient norm must agree to fp32 rounding:
  - 2 ranks: cp=2 with learned, sinusoidal and rotary positions, and with the modern block
    (document masks, a window, value embeddings, U-net skips); with activation checkpointing
    and compiled blocks; a cp=2 run saved at step 2
    and resumed, which must continue bit for bit;
  - 4 ranks: cp=4; cp=2 x FSDP2 and cp=2 x DDP (data and context averaged together);
    cp=2 x TP2 with sequence parallelism and loss_parallel, plain and modern.
This process then resumes the cp=2 checkpoint without context parallelism.
About 40 s of launches on the 2-core box.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import context_worker as worker
from distlm.model.gpt import GPT
from distlm.parallel.context import ContextParallel, shard_positions, shard_sequence, unshard_sequence
from test_distributed import check, torchrun

pytestmark = [pytest.mark.dist, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

WORKER = Path(__file__).resolve().parent / "context_worker.py"
STEPS, SAVE_AT = 4, 2
TOL = 1e-5
MODEL = ["model.n_layer=2", "model.n_head=4", "model.d_model=64", "model.d_ff=128", "model.block_size=32",
         "model.vocab_size=256", "model.position=learned"]
VARIANTS = {
    "gpt2": MODEL,
    "llama": MODEL + ["model.position=rope", "model.norm=rmsnorm", "model.mlp=swiglu",
                      "model.tie_embeddings=false", "model.bias=false"],
    "sinus": MODEL + ["model.position=sinusoidal", "model.norm=rmsnorm"],
    # A 64-token vocabulary, so that the end-of-text token (5) cuts each 32-token row into a
    # few documents, some of them across the chunk boundaries; a window shorter than a row.
    "modern": MODEL + ["model.n_layer=4", "model.position=rope", "model.qk_norm=true", "model.mlp=relu2",
                       "model.logit_softcap=2", "model.attn_mask=doc", "model.eot_id=5", "model.attn_window=12",
                       "model.value_embeds=1", "model.skip_connections=true", "model.vocab_size=64"],
}


# ---- the split --------------------------------------------------------------------------
def test_each_rank_holds_a_head_and_a_tail_chunk():
    assert shard_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shard_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    x = torch.arange(2 * 24).reshape(2, 24)
    for cp in (1, 2, 3):
        parts = [shard_sequence(x, cp, r) for r in range(cp)]
        for r, part in enumerate(parts):
            assert torch.equal(part, x[:, shard_positions(24, cp, r)])
        assert torch.equal(unshard_sequence(parts), x)
    with pytest.raises(ValueError, match="2 x cp = 4"):
        shard_positions(18, 2, 0)


def test_causal_work_is_balanced():
    """Every rank's queries see as many keys: (2cp + 1) c^2 pairs each."""
    for cp in (2, 4):
        T = 8 * cp
        pairs = [int((shard_positions(T, cp, r) + 1).sum()) for r in range(cp)]
        assert len(set(pairs)) == 1, pairs


@pytest.mark.parametrize("variant", ["gpt2", "sinus", "modern"])
def test_one_rank_through_the_shard_path_equals_the_plain_model(variant):
    """cp=1: the shard's positions and attention override give the model's own numbers."""
    model = GPT(worker.model_config(VARIANTS[variant]))
    x, y = worker.global_batch(1, model.cfg.vocab_size, model.cfg.block_size)
    xs, ys, shard = ContextParallel(None).shard(x, y)
    assert torch.allclose(model(xs, targets=ys, shard=shard), model(x, targets=y), rtol=1e-6, atol=1e-6)


# ---- launches -----------------------------------------------------------------------------
def launch(root: Path, nproc: int, jobs: list[dict]) -> dict:
    plan, out = root / f"plan_{nproc}.json", root / f"results_{nproc}.json"
    plan.write_text(json.dumps({"out": str(out), "jobs": jobs}))
    check([torchrun("--standalone", f"--nproc_per_node={nproc}", str(WORKER), str(plan))], root / f"launch_{nproc}.log",
          timeout=300)
    return json.loads(out.read_text())


def job(name: str, variant: str, **layout) -> dict:
    return {"name": name, "layout": layout, "model": VARIANTS[variant], "steps": STEPS}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cp")


@pytest.fixture(scope="module")
def reference() -> dict:
    return {v: worker.reference(VARIANTS[v], STEPS) for v in VARIANTS}


@pytest.fixture(scope="module")
def two(root) -> dict:
    ckpt = str(root / "cp2_step2")
    jobs = [job("cp2_gpt2", "gpt2", cp=2), job("cp2_llama", "llama", cp=2), job("cp2_sinus", "sinus", cp=2),
            {**job("cp2_checkpointed_compiled_llama", "llama", cp=2), "checkpoint_compile": True},
            {**job("cp2_modern", "modern", cp=2), "save_at": SAVE_AT, "save_dir": ckpt},
            {**job("cp2_modern_resumed", "modern", cp=2), "resume": ckpt, "resume_step": SAVE_AT}]
    return launch(root, 2, jobs)


@pytest.fixture(scope="module")
def four(root) -> dict:
    return launch(root, 4, [job("cp4_gpt2", "gpt2", cp=4),
                            job("cp2_fsdp2_modern", "modern", cp=2, dp=2, dp_mode="fsdp"),
                            job("cp2_fsdp2_llama", "llama", cp=2, dp=2, dp_mode="fsdp"),
                            job("cp2_ddp2_gpt2", "gpt2", cp=2, dp=2, dp_mode="ddp"),
                            job("cp2_tp2_gpt2", "gpt2", cp=2, tp=2),
                            job("cp2_tp2_modern", "modern", cp=2, tp=2)])


def assert_close(name: str, got: list, want: list) -> None:
    assert len(got) == len(want), (name, got)
    for step, (a, b) in enumerate(zip(got, want), 1):
        for what, u, v in zip(("loss", "grad_norm"), a, b):
            assert math.isclose(u, v, rel_tol=TOL, abs_tol=TOL), f"{name} step {step} {what}: {u!r} vs {v!r}"


@pytest.mark.parametrize("name", ["cp2_gpt2", "cp2_llama", "cp2_sinus", "cp2_modern", "cp2_checkpointed_compiled_llama"])
def test_cp2_matches_one_process(two, reference, name):
    assert_close(name, two[name]["trace"], reference[name.split("_")[-1]])


@pytest.mark.parametrize("name", ["cp4_gpt2", "cp2_fsdp2_modern", "cp2_fsdp2_llama", "cp2_ddp2_gpt2",
                                  "cp2_tp2_gpt2", "cp2_tp2_modern"])
def test_cp_compositions_match_one_process(four, reference, name):
    assert_close(name, four[name]["trace"], reference[name.split("_")[-1]])


def test_cp2_resume_is_bit_exact(two):
    """Saved after step 2 and resumed: steps 3 and 4 are the uninterrupted run's, exactly."""
    assert two["cp2_modern_resumed"]["trace"] == two["cp2_modern"]["trace"][SAVE_AT:]


def test_cp2_checkpoint_resumes_in_one_process(root, two, reference):
    """Context parallelism shards activations only: its checkpoint continues without it."""
    got = worker.reference(VARIANTS["modern"], STEPS, start=SAVE_AT + 1, resume=str(root / "cp2_step2"))
    assert_close("cp2 -> cp1", got, reference["modern"][SAVE_AT:])
