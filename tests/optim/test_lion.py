"""Lion (distlm/optim/lion.py, optim.name=lion): its update rule, its groups, a bit-exact resume
in one process, and runs on two gloo ranks (FSDP2 and DDP, one resumed on the other layout and
one on a single process) against the one-process reference, with the harness of
tests/layout/test_data.py."""
from __future__ import annotations

import csv
import math
import shutil
from pathlib import Path

import pytest
import torch

from distlm.config import ConfigError, load_config
from distlm.optim.lion import Lion
from distlm.train.optim import build_optimizer
from fixture_digest import checkpoint_digest

LION = ["optim.name=lion", "optim.lion.lr=3e-3", "train.min_lr_ratio=0.1", "optim.lion.weight_decay=0.5"]


def test_a_step_is_the_sign_of_the_interpolated_momentum_with_decoupled_decay():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5, 4))
    w0, m0 = w.detach().clone(), torch.randn(5, 4)
    opt = Lion([w], lr=0.01, betas=(0.8, 0.95), weight_decay=0.5)
    opt.state[w]["exp_avg"] = m0.clone()
    g = torch.randn(5, 4)
    w.grad = g.clone()
    opt.step()
    expected = w0 * (1 - 0.01 * 0.5) - 0.01 * torch.sign(0.8 * m0 + 0.2 * g)
    assert torch.allclose(w.detach(), expected, rtol=0, atol=1e-7)
    assert torch.allclose(opt.state[w]["exp_avg"], 0.95 * m0 + 0.05 * g, rtol=0, atol=1e-6)
    # every element moves by the rate (plus the decay), whatever the gradient's size
    assert torch.allclose((w.detach() - w0 * (1 - 0.005)).abs(), torch.full((5, 4), 0.01), atol=1e-7)


def test_lion_takes_adamws_groups_with_its_own_decay_and_the_schedules_rate():
    from distlm.model.gpt import GPT
    cfg = load_config(None, ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.d_ff=64",
                             "model.block_size=16", "model.vocab_size=128", "optim.name=lion", "optim.lion.lr=2e-4",
                             "optim.lion.beta1=0.85", "optim.lion.beta2=0.98", "optim.lion.weight_decay=0.7"])
    model = GPT(cfg.model)
    opt = build_optimizer(model, cfg, "cpu")
    assert isinstance(opt, Lion)
    assert [(g["lr"], g["betas"], g["weight_decay"]) for g in opt.param_groups] == \
        [(2e-4, (0.85, 0.98), 0.7), (2e-4, (0.85, 0.98), 0.0)]
    decayed = {id(p) for p in opt.param_groups[0]["params"]}
    assert id(model.tok_emb.weight) not in decayed and all(p.ndim == 2 for p in opt.param_groups[0]["params"])
    with pytest.raises(ConfigError, match=r"optim\.lion\.beta2 must be in \[0, 1\), got 1\.0"):
        load_config(None, ["optim.name=lion", "optim.lion.beta2=1.0"])


# ---- bit-exact resume, one process ----------------------------------------------------
CLI_TINY = ["model.n_layer=2", "model.n_head=2", "model.d_model=32", "model.d_ff=64", "model.block_size=16",
            "model.vocab_size=128", "data.source=synthetic", "train.global_batch_size=4",
            "train.micro_batch_size=2", "train.warmup_steps=1", "train.eval_every=0", "train.device=cpu",
            "log.every=1", "log.progress=false", "log.tensorboard=false", "log.samples=0", *LION]


def _losses(run: Path) -> dict[str, tuple[str, str]]:
    with open(run / "metrics.csv") as f:
        return {r["step"]: (r["loss"], r["grad_norm"]) for r in csv.DictReader(f) if r.get("loss")}


def test_lion_resumes_bit_exactly(tmp_path):
    """Six steps straight (saving at 3 and 6), and a run resumed from step 3 to 6: the same
    logged losses and gradient norms, and every tensor of the step-6 checkpoints the same."""
    from distlm.cli import main
    base = [*CLI_TINY, f"log.root={tmp_path}", "train.max_steps=6", "train.checkpoint_every=3"]
    assert main(["train", *base, "log.name=straight"]) == 0
    straight = tmp_path / "straight"
    assert main(["train", *base, "log.name=resumed",
                 f"train.resume={straight / 'checkpoints' / 'step_0000003'}"]) == 0
    resumed = tmp_path / "resumed"
    after = {s: v for s, v in _losses(straight).items() if int(s) > 3}
    assert _losses(resumed) == after and sorted(after) == ["4", "5", "6"]  # the same strings: the same bits
    final = "checkpoints/step_0000006"
    digests = checkpoint_digest(resumed / final)
    assert digests == checkpoint_digest(straight / final)
    assert any(".exp_avg" in k for k in digests) and not any("exp_avg_sq" in k for k in digests)


# ---- two ranks, across layouts (the shared 2-rank world, tests/helpers/worlds.py) ----------
LION_DP = [*LION, "model.position=learned"]


def world_scenarios(root: Path, data: Path) -> dict[int, list[dict]]:
    from helpers.runs import SAVE_AT, ckpt, dp_overrides
    fsdp = f"train.resume={ckpt(root, 'fsdp2', SAVE_AT)}"
    return {2: [{"kind": "train", "name": "fsdp2", "overrides": dp_overrides(root, "fsdp2", *LION_DP, "parallel.dp_shard=2")},
                {"kind": "train", "name": "ddp2", "overrides": dp_overrides(root, "ddp2", *LION_DP, "parallel.dp_replicate=2")},
                {"kind": "train", "name": "fsdp2_to_ddp2",
                 "overrides": dp_overrides(root, "fsdp2_to_ddp2", *LION_DP, "parallel.dp_replicate=2", fsdp)}]}


@pytest.mark.dist
def test_lion_on_fsdp2_and_ddp2_and_across_layouts_matches_one_process(worlds):
    """FSDP2 and DDP with Lion against one process; DDP2 resumed from FSDP2's step-3
    checkpoint (its state resharded into replicas), and one process resumed from it too."""
    from helpers.runs import SAVE_AT, STEPS, ckpt, dp_overrides, trace, train_here
    root = worlds.root(__name__)
    reference = trace(train_here(dp_overrides(root, "ref", *LION_DP, "train.micro_batch_size=16")).run_dir)
    runs = worlds.results(__name__, 2)
    fsdp = ckpt(root, "fsdp2", SAVE_AT)
    one = train_here(dp_overrides(root, "fsdp2_to_1", *LION_DP, "train.micro_batch_size=8", f"train.resume={fsdp}"))
    assert {r["resumed_from"] for r in runs["fsdp2_to_ddp2"]} == {str(fsdp)}
    assert one.resumed_from == fsdp
    # Lion moves every element by +-lr: a sign that rounding flipped would show as a jump,
    # so the traces are held to the same fp32 tolerance as AdamW's (tests/layout/test_data.py).
    for name, first in (("fsdp2", 1), ("ddp2", 1), ("fsdp2_to_ddp2", 4), ("fsdp2_to_1", 4)):
        got = trace(root / name)
        assert sorted(got) == list(range(first, STEPS + 1)), name
        for s in got:
            for a, b in zip(got[s], reference[s]):
                assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5), (name, s, a, b)
