"""`distlm plan`: the memory estimate against a measured peak, and the command's output.

The measurement is PyTorch's own memory profiler over one real training step (forward,
backward, AdamW) on CPU: parameters, gradients, optimizer state, activations and
temporaries, at their peak together. The planner is asked about the same model in fp32.
"""
from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from distlm.cli import main
from distlm.config import load_config
from distlm.model.gpt import GPT
from distlm.model.loss import lm_loss
from distlm.parallel.parallelize import apply_activation_checkpointing
from distlm.planner import Layout, estimate, layouts

SMALL = ["model.vocab_size=512", "model.n_layer=4", "model.d_model=128", "model.n_head=4", "model.d_ff=512",
         "model.block_size=128"]


def measured_peak_bytes(cfg, batch: int, ac: str, tmp_path) -> float:
    torch.manual_seed(0)
    model = GPT(cfg.model)
    if ac != "none":
        apply_activation_checkpointing(model, ac)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.block_size))
    y = torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.block_size))

    def step():
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    step()  # AdamW allocates its state on the first step; measure a steady one
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        step()
    out = tmp_path / "timeline.json"
    with pytest.warns(FutureWarning):  # deprecated for CUDA in favour of memory snapshots; the CPU path stays
        prof.export_memory_timeline(str(out), device="cpu")
    import json
    _, sizes = json.loads(out.read_text())
    return float(max(sum(s) for s in sizes))


@pytest.mark.parametrize("extra,batch,ac", [
    ([], 8, "none"),
    (["model.mlp=swiglu", "model.position=rope", "model.norm=rmsnorm", "model.tie_embeddings=false"], 8, "none"),
    ([], 16, "full"),
])
def test_estimate_within_25_percent_of_measured_peak(extra, batch, ac, tmp_path):
    cfg = load_config(None, SMALL + extra)
    measured = measured_peak_bytes(cfg, batch, ac, tmp_path)
    est = estimate(cfg.model, Layout(1, 1, 1, 1, ac), batch, batch, 80, compute_bytes=4)
    ratio = est.total_gb * 2**30 / measured
    assert 0.75 <= ratio <= 1.25, f"estimate {est.total_gb * 2**10:.1f} MiB vs measured {measured / 2**20:.1f} MiB"


def test_sharding_divides_model_state():
    cfg = load_config("gpt2-1.5b", ["model.vocab_size=50257", "model.n_head=20"])
    one = estimate(cfg.model, Layout(4, 1, 1, 1), 64, 8, 80)
    fsdp = estimate(cfg.model, Layout(1, 4, 1, 1), 64, 8, 80)
    tp = estimate(cfg.model, Layout(2, 1, 2, 1), 64, 8, 80)
    assert fsdp.optim_gb == pytest.approx(one.optim_gb / 4, rel=1e-6)
    assert tp.activations_gb < one.activations_gb / 1.5  # TP + SP splits most saved tensors
    assert one.comm_gb > 0 and fsdp.comm_gb > one.comm_gb  # ZeRO-3 gathers parameters besides reducing
    names = {lay.name for lay in layouts(4, cfg.model)}
    assert {"ddp4", "fsdp4", "ddp2xtp2", "fsdp2xpp2", "tp2xpp2", "fsdp4+ac"} <= names


def test_plan_command_prints_a_ranked_table_and_a_recommendation(capsys):
    assert main(["plan", "--config", "gpt2-1.5b", "--gpus", "4", "--global-batch", "64", "--micro-batch", "8",
                 "model.n_head=20"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "layout" not in line]
    assert len(rows) == len(layouts(4, load_config("gpt2-1.5b", ["model.n_head=20"]).model))
    assert "recommended:" in out and "parallel." in out.split("recommended:")[1]


def test_plan_says_when_nothing_fits(capsys):
    assert main(["plan", "--config", "gpt2-1.5b", "--gpus", "1", "--gpu-mem-gb", "4"]) == 1
    assert "no layout fits in 4 GiB" in capsys.readouterr().out


def test_plan_rejects_a_split_the_model_cannot_take(capsys):
    assert main(["plan", "--config", "gpt2-1.5b", "--gpus", "4", "parallel.tp=2"]) == 2
    assert "does not divide model.n_head=25" in capsys.readouterr().err
