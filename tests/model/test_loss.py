"""The speed paths compute the same thing as the plain ones: the chunked head + loss, the
fused q/k/v matmul, the loss inside the compiled forward; and `distlm bench --profile` and
`--ceilings` report what they measured."""
import json

import pytest
import torch
import torch.nn.functional as F

from distlm.config import ModelConfig, load_config
from distlm.model.gpt import GPT
from distlm.model.loss import chunked_head_loss, lm_loss


@pytest.mark.parametrize("chunk", [7, 37, 111, 4096])  # uneven, one row of chunks, exact, one chunk
def test_chunked_head_loss_matches_whole_logits(chunk):
    torch.manual_seed(0)
    x = torch.randn(3, 37, 16, requires_grad=True)
    w = torch.randn(101, 16, requires_grad=True)
    t = torch.randint(0, 101, (3, 37))
    ref = lm_loss(F.linear(x, w), t)
    gx, gw = torch.autograd.grad(3.0 * ref, (x, w))
    loss = chunked_head_loss(x, w, t, chunk)
    cx, cw = torch.autograd.grad(3.0 * loss, (x, w))  # a scaled upstream gradient reaches both
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cx, gx, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(cw, gw, rtol=1e-5, atol=1e-7)
    with torch.no_grad():  # evaluation takes the gradient-free loop
        torch.testing.assert_close(chunked_head_loss(x, w, t, chunk), ref, rtol=1e-6, atol=1e-6)


def test_chunked_head_loss_under_bf16_autocast_is_close():
    torch.manual_seed(0)
    x = torch.randn(2, 64, 32, requires_grad=True)
    w = (0.1 * torch.randn(256, 32)).requires_grad_()
    t = torch.randint(0, 256, (2, 64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = lm_loss(F.linear(x, w), t)
        loss = chunked_head_loss(x, w, t, 48)
    gx, gw = torch.autograd.grad(ref, (x, w))
    cx, cw = torch.autograd.grad(loss, (x, w))
    assert cx.dtype == torch.float32 and cw.dtype == torch.float32  # the parameters' dtype, as autocast's
    assert abs(loss.item() - ref.item()) < 2e-3
    assert (cx - gx).abs().max() < 2e-2 * gx.abs().max() and (cw - gw).abs().max() < 2e-2 * gw.abs().max()


def cfg_small(**kw) -> ModelConfig:
    base = dict(n_layer=2, n_head=4, d_model=32, d_ff=64, block_size=16, vocab_size=100, bias=True)
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("chunk", [0, 10])
def test_loss_in_forward_and_fused_qkv_equal_the_plain_model(chunk):
    torch.manual_seed(0)
    fast = GPT(cfg_small(loss_chunk=chunk, position="rope"))
    plain = GPT(cfg_small(position="rope"))
    plain.load_state_dict(fast.state_dict())
    for block in plain.blocks.values():
        block.attn.fused_qkv = False
    x, y = torch.randint(0, 100, (2, 16)), torch.randint(0, 100, (2, 16))
    torch.testing.assert_close(fast(x), plain(x), rtol=1e-5, atol=1e-6)
    a = fast(x, targets=y)
    b = lm_loss(plain(x), y)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    a.backward()
    b.backward()
    for (n, p), q in zip(fast.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=n)


TINY = ["model.n_layer=2", "model.n_head=2", "model.d_model=32", "model.d_ff=64", "model.block_size=16",
        "model.vocab_size=97", "data.source=synthetic", "train.global_batch_size=8", "train.micro_batch_size=4",
        "train.warmup_steps=2", "train.eval_every=0", "log.progress=false", "log.tensorboard=false", "train.seed=3"]


def losses(tmp_path, name, extra, steps=4):
    from distlm.train.trainer import Trainer
    cfg = load_config("tiny", TINY + [f"log.root={tmp_path}", f"log.name={name}", *extra])
    t = Trainer(cfg)
    out = [(float(a), float(b)) for a, b in (t.train_step() for _ in range(steps))]
    return out, t


def test_optimized_path_trains_like_the_plain_path(tmp_path):
    """Compiled whole model (the loss inside its graph), chunked loss, fused q/k/v against
    the eager model with separate q/k/v and the whole logits: same losses and gradient
    norms, step after step, to float rounding (Inductor reorders sums)."""
    plain, t = losses(tmp_path, "plain", [])
    assert t.module.blocks["0"].attn.fused_qkv  # the default path fuses q/k/v
    from distlm.train.trainer import Trainer
    cfg = load_config("tiny", TINY + [f"log.root={tmp_path}", "log.name=unfused"])
    u = Trainer(cfg)
    for block in u.module.blocks.values():
        block.attn.fused_qkv = False
    ref = [(float(a), float(b)) for a, b in (u.train_step() for _ in range(4))]
    fast, _ = losses(tmp_path, "fast", ["train.compile=true", "train.compile_scope=model", "model.loss_chunk=12"])
    for (l0, g0), (l1, g1), (l2, g2) in zip(ref, plain, fast):
        assert l1 == pytest.approx(l0, rel=1e-5) and g1 == pytest.approx(g0, rel=1e-4)
        assert l2 == pytest.approx(l0, rel=1e-5) and g2 == pytest.approx(g0, rel=1e-4)


def test_bench_profile_and_ceilings(tmp_path):
    from distlm.bench.ceilings import measure, report
    from distlm.bench.throughput import run_bench
    cfg = load_config("tiny", TINY + [f"log.root={tmp_path}", "log.name=p"])
    r = run_bench(cfg, warmup=1, steps=2, profile_dir=tmp_path / "prof")
    cats = r["profile"]["categories_s"]
    assert cats["matmul"] > 0 and cats["attention"] > 0
    md = (tmp_path / "prof" / "profile.md").read_text()
    assert "| matmul |" in md and "idle" in md and "`aten::mm`" in md
    s = json.loads((tmp_path / "prof" / "profile.json").read_text())
    assert s["busy_s"] == pytest.approx(sum(s["categories_s"].values()))
    import gzip
    trace = json.loads(gzip.open(tmp_path / "prof" / "trace.json.gz").read())
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])  # Perfetto reads this file
    # The host: on a CPU the step runs on one thread, busy for most of the profiled step and no
    # longer than it, its matmuls among its largest own times.
    (host,) = s["host"]
    assert 0.5 * s["step_s"] < host["busy_s"] <= s["step_s"] * 1.05
    assert "aten::mm" in [k["name"] for k in host["top"]]
    assert f"| {host['thread']} | {1e3 * host['busy_s']:.2f} |" in md
    assert r["profile"]["host_busy_s"] == [host["busy_s"]]
    c = measure(torch.device("cpu"), quick=True)
    assert c["matmul_tflops_best"] > 0 and c["copy_gbs"] > 0
    assert c["ridge_flops_per_byte"] == pytest.approx(c["matmul_tflops_best"] * 1e3 / c["copy_gbs"])
    assert "FLOP/s" in report(c) and "0.0 TFLOP/s" not in report(c)  # a CPU's rate in GFLOP/s
