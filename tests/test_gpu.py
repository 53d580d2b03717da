"""CUDA-only checks; skipped where CUDA is absent. Run them through the device tool:
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
