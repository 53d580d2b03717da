"""CUDA-only checks; skipped where CUDA is absent. Run them on a CUDA machine:
    python3 -m pytest -q -m gpu tests/test_gpu.py
"""
import pytest
import torch

from distlm.config import ModelConfig, load_config
from distlm.model.generate import KVCache
from distlm.model.gpt import GPT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_bf16_cache_matches_recompute_on_cuda():
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=2, n_head=4, d_model=128, d_ff=256, block_size=64, vocab_size=500, position="rope")
    model = GPT(cfg).cuda().eval()
    idx = torch.randint(0, 500, (2, 40), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        full = model(idx).float()
        cache = KVCache(model, 2, 64, dtype=torch.bfloat16)
        a = model(idx[:, :30], cache=cache, start_pos=0)
        b = torch.cat([model(idx[:, t:t + 1], cache=cache, start_pos=t) for t in range(30, 40)], 1)
    got = torch.cat([a, b], 1).float()
    assert (got - full).norm() / full.norm() < 2e-2


def test_trainer_runs_bf16_compiled_on_cuda(tmp_path):
    from distlm.train.trainer import Trainer
    cfg = load_config("tiny", ["data.source=synthetic", "model.vocab_size=1000", "train.max_steps=6",
                               "train.compile=true", "train.eval_every=0", "log.progress=false",
                               f"log.root={tmp_path}", "log.name=g", "log.every=3"])
    t = Trainer(cfg)
    assert t.device.type == "cuda" and t.amp_dtype == torch.bfloat16
    summary = t.train()
    assert summary["step"] == 6 and summary["train_loss"] < 7.5
    assert next(t.optimizer.param_groups[0]["params"].__iter__()).dtype == torch.float32  # fp32 master weights


def test_chunked_loss_compiled_on_cuda_matches_whole_logits():
    """The Inductor kernels of the chunked head + loss (bf16 matmuls, fp32 softmax statistics)
    against the whole-logits loss under the same autocast."""
    import torch.nn.functional as F

    from distlm.model.loss import chunked_head_loss, lm_loss
    torch.manual_seed(0)
    x = torch.randn(4, 256, 128, device="cuda", requires_grad=True)
    w = (0.05 * torch.randn(1000, 128, device="cuda")).requires_grad_()
    t = torch.randint(0, 1000, (4, 256), device="cuda")
    fused = torch.compile(lambda x, w, t: chunked_head_loss(x, w, t, 300))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = lm_loss(F.linear(x, w), t)
        got = fused(x, w, t)
    gx, gw = torch.autograd.grad(ref, (x, w))
    cx, cw = torch.autograd.grad(got, (x, w))
    assert abs(got.item() - ref.item()) < 1e-3 * ref.item()
    for a, b in ((cx, gx), (cw, gw)):
        assert a.dtype == torch.float32 and (a - b).norm() / b.norm() < 1e-2


def test_context_split_attention_matches_whole_rows_in_bf16_on_cuda():
    """Each rank's two query chunks over the whole row's keys (causal_lower_right, the flash
    path) against one causal SDPA of the row, bf16 on the GPU (distlm/parallel/context.py)."""
    from helpers.context_jobs import sharded_against_whole
    for cp in (2, 4):
        got, want = sharded_against_whole(cp, None, 0, device="cuda", dtype=torch.bfloat16)
        assert (got - want).norm() / want.norm() < 1e-2, cp


def test_weights_are_drawn_on_the_gpu_the_same_each_time_at_the_stated_scale():
    """init_weights draws on the device holding the parameters: a second model from the same
    seed is equal, another seed is not, and the draws follow the stated init (N(0, 0.02),
    residual projections 1/sqrt(2L) of that, zero biases, unit norms)."""
    cfg = ModelConfig(n_layer=4, n_head=4, d_model=256, d_ff=1024, block_size=64, vocab_size=4096, bias=True)

    def drawn(seed):
        with torch.device("meta"):
            m = GPT(cfg)
        m.to_empty(device="cuda")
        m.init_weights(seed, torch.device("cuda"))
        return dict(m.named_parameters())

    a, b, c = drawn(3), drawn(3), drawn(4)
    assert all(p.device.type == "cuda" for p in a.values())
    assert all(torch.equal(a[n], b[n]) for n in a)
    wq = next(n for n in a if n.endswith("weight") and a[n].dim() == 2 and "emb" not in n and "wo" not in n
              and "w_out" not in n)
    assert not torch.equal(a[wq], c[wq])
    assert a[wq].float().std().item() == pytest.approx(0.02, rel=0.05) and abs(a[wq].float().mean().item()) < 1e-3
    wo = next(n for n in a if n.endswith("wo.weight"))
    assert a[wo].float().std().item() == pytest.approx(0.02 / (2 * cfg.n_layer) ** 0.5, rel=0.05)
    assert all(not a[n].any() for n in a if n.endswith("bias"))
    assert all(bool((a[n] == 1).all()) for n in a if n.endswith("norm.weight"))
