"""Mixture-of-experts blocks (distlm/model/moe.py): routing, dropless dispatch, the three matmul
forms, bias balancing, the auxiliary loss, Muon on 3-D weights, compile, checkpointing, and a
training run read back as a user reads it."""
import csv
import dataclasses
import shutil

import pytest
import torch
import torch.nn.functional as F

from distlm.config import ConfigError, load_config
from distlm.model.gpt import GPT, flops_per_token
from distlm.model.moe import KERNELS, MoE, ExpertBalance, expert_mlp, inactive_params, moe_layers

MOE = ["model.moe.experts=4", "model.moe.top_k=2", "model.mlp=swiglu", "model.norm=rmsnorm", "model.position=rope",
       "model.bias=false"]


def model_cfg(*extra, vocab=256):
    cfg = load_config("tiny", MOE + list(extra)).model
    return dataclasses.replace(cfg, vocab_size=vocab)


def moe_block(*extra, seed=0) -> MoE:
    torch.manual_seed(seed)
    m = GPT(model_cfg(*extra))
    return next(mod for mod in m.modules() if isinstance(mod, MoE))


def reference(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: its top-k experts by biased score, each expert's MLP, summed with the
    normalised unbiased scores. No sorting, no grouping."""
    out = []
    for t in x.reshape(-1, x.shape[-1]):
        s = torch.sigmoid(m.router.weight.float() @ t.float())
        top = torch.topk(s + m.expert_bias, m.top_k).indices
        w = s[top] / s[top].sum() * m.route_scale
        y = torch.zeros_like(t)
        for e, we in zip(top.tolist(), w):
            h = F.silu(t @ m.experts.w_gate[e]) * (t @ m.experts.w_in[e])
            y = y + we * (h @ m.experts.w_out[e])
        if m.shared is not None:
            y = y + m.shared(t[None])[0]
        out.append(y)
    return torch.stack(out).reshape(x.shape)


@pytest.mark.parametrize("kernel", KERNELS)
def test_every_kernel_is_the_token_by_token_sum(kernel):
    m = moe_block("model.moe.shared=1", "model.moe.d_ff=48")
    m.kernel = kernel
    x = torch.randn(2, 7, m.experts.w_in.shape[1])
    torch.testing.assert_close(m(x), reference(m, x), rtol=1e-5, atol=1e-6)


def test_routing_uses_the_bias_for_the_choice_only():
    m = moe_block()
    x = torch.randn(12, m.experts.w_in.shape[1])
    chosen, weights, scores = m.route(x)
    assert chosen.shape == (12, 2)
    torch.testing.assert_close(weights.sum(-1), torch.ones(12))
    # A large bias on expert 3 puts it in every token's choice; the weights stay the unbiased scores'.
    m.expert_bias[3] = 10.0
    chosen_b, weights_b, _ = m.route(x)
    assert (chosen_b == 3).any(-1).all()
    gathered = scores.gather(1, chosen_b)
    torch.testing.assert_close(weights_b, gathered / gathered.sum(-1, keepdim=True))


def test_dropless_under_a_skewed_router():
    """Every token chosen by the same two experts: nothing is dropped, whatever the load."""
    m = moe_block()
    with torch.no_grad():
        m.router.weight.zero_()
        m.expert_bias.copy_(torch.tensor([1.0, 1.0, 0.0, 0.0]))
    x = torch.randn(3, 5, m.experts.w_in.shape[1])
    for kernel in KERNELS:
        m.kernel = kernel
        torch.testing.assert_close(m(x), reference(m, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernels_agree_forward_and_backward(kernel):
    torch.manual_seed(1)
    E, d, f, M = 5, 16, 24, 40
    ids = torch.sort(torch.randint(0, E - 1, (M,))).values  # the last expert gets no token
    counts = torch.bincount(ids, minlength=E)
    ws = [torch.randn(E, d, f, requires_grad=True), torch.randn(E, d, f, requires_grad=True),
          torch.randn(E, f, d, requires_grad=True)]
    xs = torch.randn(M, d, requires_grad=True)

    def run(k):
        y = expert_mlp(xs, ids, counts, *ws, "swiglu", k)
        grads = torch.autograd.grad(y.square().sum(), [xs, *ws])
        return y, grads

    y_loop, g_loop = run("loop")
    y, g = run(kernel)
    torch.testing.assert_close(y, y_loop, rtol=1e-5, atol=1e-5)
    for a, b in zip(g, g_loop):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_matmul_on_the_gpu_against_the_loop():
    torch.manual_seed(0)
    E, d, f, M = 8, 768, 1024, 4096
    ids = torch.sort(torch.randint(0, E, (M,), device="cuda")).values
    counts = torch.bincount(ids, minlength=E)
    ws = [torch.randn(E, d, f, device="cuda") / d ** 0.5, torch.randn(E, d, f, device="cuda") / d ** 0.5,
          torch.randn(E, f, d, device="cuda") / f ** 0.5]
    xs = torch.randn(M, d, device="cuda")
    with torch.autocast("cuda", torch.bfloat16):
        grouped = expert_mlp(xs, ids, counts, *ws, "swiglu", "grouped").float()
        padded = expert_mlp(xs, ids, counts, *ws, "swiglu", "bmm").float()
    loop = expert_mlp(xs, ids, counts, *ws, "swiglu", "loop")
    for got in (grouped, padded):  # bf16 against fp32: the relative error of bf16's rounding
        assert ((got - loop).norm() / loop.norm()).item() < 1e-2
    # A whole MoE model, compiled in one graph around the grouped matmul, under bf16 autocast.
    cfg = model_cfg("model.moe.kernel=grouped", "model.d_model=128")
    torch.manual_seed(0)
    m = GPT(cfg).cuda()
    x, y = torch.randint(0, 256, (2, 16), device="cuda"), torch.randint(0, 256, (2, 16), device="cuda")
    with torch.autocast("cuda", torch.bfloat16):
        eager = m(x, targets=y)
        torch._dynamo.reset()
        compiled = torch.compile(m, fullgraph=True)(x, targets=y)
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=2e-2)
    compiled.backward()
    assert all(p.grad is not None for p in m.parameters())


def test_bias_moves_toward_an_even_load_on_a_skewed_batch():
    torch.manual_seed(0)
    cfg = model_cfg("model.moe.bias_rate=0.01")
    m = GPT(cfg)
    balance = ExpertBalance.of(m, cfg).attach()
    block = balance.layers[0][1]
    d = cfg.d_model
    v = torch.randn(d)
    with torch.no_grad():  # a batch along v, which experts 0 and 1 score high
        block.router.weight.normal_(0, 0.3)
        block.router.weight[:2] += v / v.norm()
    x = v / v.norm() * 4 + torch.randn(256, d)
    block(x)
    load = block.meter.clone()
    assert load[:2].sum() > load[2:].sum()
    balance.step()
    bias = block.expert_bias
    mean = load.mean()
    assert torch.equal(bias, 0.01 * torch.sign(mean - load))
    assert (bias[load > mean] < 0).all() and (bias[load < mean] > 0).all()
    assert block.meter.sum() == 0  # counted afresh each step
    first = balance.metrics()["moe/0/load_max_over_mean"]
    assert first > 1.5
    for _ in range(200):
        block(x)
        balance.step()
    assert balance.metrics()["moe/0/load_max_over_mean"] < 1.2
    # Evaluation does not count.
    block.eval()
    block(x)
    assert block.meter.sum() == 0


def test_aux_loss_joins_the_training_loss_and_reaches_the_router():
    cfg = model_cfg("model.moe.aux_loss=0.1", "model.moe.bias_rate=0")
    torch.manual_seed(0)
    m = GPT(cfg)
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    loss = m(x, targets=y)
    aux = sum(b.aux_loss for b in m.aux_losses)
    plain = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, aux_loss=0.0))
    torch.manual_seed(0)
    m0 = GPT(plain)
    torch.testing.assert_close(loss, m0(x, targets=y) + aux)
    # Its value: E/(kN) sum_i count_i mean_share_i, in [~1, E/k] and 1 when even.
    block = m.aux_losses[0]
    h = torch.randn(32, cfg.d_model)
    block(h)
    chosen, _, scores = block.route(h)
    counts = torch.bincount(chosen.flatten(), minlength=4).float()
    share = (scores / scores.sum(-1, keepdim=True)).mean(0)
    torch.testing.assert_close(block.aux_loss, 0.1 * 4 / (2 * 32) * (counts * share).sum())
    grad = torch.autograd.grad(block.aux_loss, block.router.weight)[0]
    assert grad.abs().sum() > 0
    m.eval()
    torch.testing.assert_close(m(x, targets=y), m0.eval()(x, targets=y))  # evaluation: no aux term


def test_placement_widths_and_active_flops():
    cfg = model_cfg("model.n_layer=6", "model.moe.every=2", "model.moe.first_dense=1", "model.moe.d_ff=32",
                    "model.moe.shared=2", "model.moe.experts=8")
    assert moe_layers(cfg) == [1, 3, 5]
    m = GPT(cfg)
    block = m.blocks["1"].mlp
    assert tuple(block.experts.w_in.shape) == (8, cfg.d_model, 32)
    assert tuple(block.experts.w_out.shape) == (8, 32, cfg.d_model)
    assert block.shared.w_in.weight.shape[0] == 64
    assert not isinstance(m.blocks["2"].mlp, MoE)
    per_expert = 3 * cfg.d_model * 32
    assert inactive_params(cfg) == 3 * (8 - 2) * per_expert
    dense = flops_per_token(cfg, m.num_params()) + 6 * inactive_params(cfg)
    assert dense - flops_per_token(cfg, m.num_params()) == 6 * 3 * 6 * per_expert


def test_muon_orthogonalises_each_expert_separately():
    from distlm.optim.muon import Muon
    torch.manual_seed(0)
    E, d, f = 3, 8, 20
    w3 = torch.nn.Parameter(torch.randn(E, d, f))
    # The same experts as nn.Linear weights (out, in): the transposes.
    w2 = [torch.nn.Parameter(w3[e].detach().t().clone()) for e in range(E)]
    g = torch.randn(E, d, f)
    w3.grad = g.clone()
    for e in range(E):
        w2[e].grad = g[e].t().clone()
    for params in ([w3], w2):
        Muon([dict(params=params, kind="muon")], lr=0.1, ns_dtype=torch.float32).step()
    for e in range(E):
        torch.testing.assert_close(w3[e].detach(), w2[e].detach().t(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError):
        Muon([dict(params=[torch.nn.Parameter(torch.randn(2, 2, 2, 2))], kind="muon")])


def test_compiles_whole_without_a_graph_break():
    # The padded form on a CPU: the grouped matmul's compile-time shape rule wants bf16 (the GPU
    # test compiles that one).
    cfg = model_cfg("model.moe.kernel=bmm", "model.moe.aux_loss=0.01")
    torch.manual_seed(0)
    m = GPT(cfg)
    balance = ExpertBalance.of(m, cfg).attach()
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    eager = m(x, targets=y)
    counted = balance.layers[0][1].meter.clone()
    balance.layers[0][1].meter.zero_()
    torch._dynamo.reset()
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, targets=y), eager)
    assert torch.equal(balance.layers[0][1].meter, counted)  # the counts survive compilation


def test_activation_checkpointing_gives_the_same_gradients():
    from distlm.parallel.parallelize import apply_activation_checkpointing
    cfg = model_cfg()
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        m = GPT(cfg)
        if ckpt:
            apply_activation_checkpointing(m, "full")
        m(x, targets=y).backward()
        grads.append([p.grad for p in m.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_refusals_name_the_field():
    for extra, words in ((["model.moe.top_k=5"], "model.moe.top_k=5"),
                         (["parallel.tp=2"], "parallel.tp=2"),
                         (["parallel.pp=2"], "parallel.pp=2"),
                         (["model.moe.first_dense=4"], "model.moe.first_dense=4"),
                         (["model.moe.bias_rate=-1"], "model.moe.bias_rate"),
                         (["model.moe.kernel=fast"], "model.moe.kernel")):
        with pytest.raises(ConfigError) as e:
            load_config("tiny", MOE + extra)
        assert words in str(e.value) and "\n" not in str(e.value)


TINY = ["model.n_layer=2", "model.n_head=2", "model.d_model=32", "model.d_ff=64", "model.block_size=16",
        "train.global_batch_size=8", "train.micro_batch_size=4", "train.eval_every=0", "train.warmup_steps=2",
        "log.every=1", "log.progress=false", "train.seed=7", "log.samples=0", "optim.adamw.lr=3e-3",
        "model.moe.bias_rate=0.01"]


def rows(run_dir):
    with open(run_dir / "metrics.csv", newline="") as f:
        return [r for r in csv.DictReader(f) if r["loss"]]


def test_training_a_tiny_moe_learns_logs_its_load_and_resumes_bit_exact(tmp_path, tiny_data, capsys):
    from distlm.train.trainer import Trainer
    common = MOE + TINY + [f"data.dir={tiny_data}", "train.max_steps=8", "train.checkpoint_every=4",
                           "train.keep_last=5", f"log.root={tmp_path}"]
    summary = Trainer(load_config("tiny", common + ["log.name=full"])).train()
    out = capsys.readouterr().out
    assert "N: active parameters" in out and "moe max/mean" in out
    run = tmp_path / "full"
    losses = [float(r["loss"]) for r in rows(run)]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(str(run / "tensorboard"))
    ea.Reload()
    tags = ea.Tags()["scalars"]
    for layer in ("0", "1"):
        for what in ("load_max_over_mean", "load_min_over_mean", "bias_spread"):
            assert f"train/moe/{layer}/{what}" in tags
    spread = [e.value for e in ea.Scalars("train/moe/0/bias_spread")]
    assert spread[0] > 0 and all(v >= 1.0 for v in (e.value for e in ea.Scalars("train/moe/0/load_max_over_mean")))
    # Bit-exact resume: the routing biases are checkpointed with the weights.
    shutil.copytree(run, tmp_path / "crashed")
    shutil.rmtree(tmp_path / "crashed" / "checkpoints" / "step_0000008")
    trainer = Trainer(load_config("tiny", common + ["log.name=crashed", "train.resume=auto"]))
    assert trainer.step == 4
    trainer.train()
    for a, b in zip(rows(run), rows(tmp_path / "crashed")):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), a["step"]
    assert summary["val_loss"] == pytest.approx(float(rows(tmp_path / "crashed")[-1]["val_loss"]), abs=0)


def test_the_moe_preset_is_the_speedrun_at_its_active_shape():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from suites.time_to_loss import ABLATIONS
    preset = load_config("speedrun-moe")
    assert preset == load_config("speedrun-124m", ABLATIONS["moe"].split())
    m = dataclasses.replace(preset.model, vocab_size=50304)
    dense = dataclasses.replace(m, moe=dataclasses.replace(m.moe, experts=0))
    with torch.device("meta"):
        n_moe, n_dense = GPT(m).num_params(), GPT(dense).num_params()
    # Same FLOPs per token but the router's (12 - 1 blocks x 16 x 768 x 6).
    assert flops_per_token(m, n_moe) - flops_per_token(dense, n_dense) == 6 * 11 * 16 * 768


def test_kernel_benchmark_runs_on_the_cpu(tmp_path, capsys):
    import json
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "tools"))
    import moe_kernels
    assert moe_kernels.main(["--cpu", "--json", str(tmp_path / "k.json")]) == 0
    rows = json.loads((tmp_path / "k.json").read_text())["rows"]
    assert {(r["load"], r["kernel"]) for r in rows} == {(load, k) for load in ("even", "skewed") for k in KERNELS}
    assert all(r["ms"] > 0 for r in rows)


# ---- the planner ----------------------------------------------------------------------------
def test_planner_counts_the_experts_memory_and_their_all_to_all(tmp_path):
    from test_planner import SMALL, measured_peak_bytes
    from distlm.planner import Candidate, estimate, layouts
    cfg = load_config(None, SMALL + ["model.moe.experts=8", "model.moe.top_k=2", "model.moe.shared=1",
                                     "model.moe.d_ff=64", "model.moe.kernel=grouped"])
    m = cfg.model
    # Memory: within 25% of what one process's step holds at its peak, measured.
    measured = measured_peak_bytes(cfg, 8, "none", tmp_path)
    one = estimate(m, Candidate(1, 1, 1, 1), 8, 8, 80, compute_bytes=4)
    assert 0.75 <= one.total_gb * 2**30 / measured <= 1.25, (one.total_gb * 2**30, measured)
    with torch.device("meta"):
        n = sum(p.numel() for p in GPT(m).parameters())
    assert one.params_gb * 2**30 == pytest.approx(4 * n, rel=0.01)
    # Expert parallelism: the routed experts' state divided by ep, the rest replicated (DDP) or
    # sharded with the data shards (FSDP2); the tokens' all-to-all: 4 per MoE block (dispatch
    # and combine, forward and backward), top_k copies of each token, (ep-1)/ep of them sent.
    ep = estimate(m, Candidate(1, 1, 1, 1, ep=4), 32, 8, 80, compute_bytes=4)
    experts = m.n_layer * 8 * 2 * m.d_model * 64
    assert (one.params_gb - ep.params_gb) * 2**30 == pytest.approx(4 * experts * 3 / 4, rel=1e-6)
    copies = 8 * m.block_size * 2
    assert ep.sent_gb["ep"] * 1e9 == pytest.approx(4 * m.n_layer * (3 / 4) * copies * m.d_model * 4)
    fsdp = estimate(m, Candidate(1, 2, 1, 1, ep=2), 32, 8, 80, compute_bytes=4)
    assert fsdp.params_gb * 2**30 == pytest.approx(4 * (n - experts) / 4 + 4 * experts / 4, rel=0.01)
    names = {lay.name for lay in layouts(4, m)}
    assert {"ddp4", "fsdp4", "ep4", "ddp2xep2", "fsdp2xep2", "ep4+ac"} <= names
    assert not any("tp" in name or "pp" in name for name in names)  # refused for an MoE model


@pytest.mark.parametrize("kernel", ["loop", "bmm"])
def test_bf16_autocast_tracks_fp32(kernel):
    cfg = model_cfg(f"model.moe.kernel={kernel}", "model.moe.shared=1")
    torch.manual_seed(0)
    m = GPT(cfg)
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    fp32 = m(x, targets=y)
    with torch.autocast("cpu", torch.bfloat16):
        bf16 = m(x, targets=y)
    assert abs(bf16.item() - fp32.item()) < 2e-2 * fp32.item()
    bf16.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
