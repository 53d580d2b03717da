"""AdamW's groups on a side CUDA stream beside Muon's (distlm/optim/side_stream.py), on a GPU.

The side stream changes where AdamW's kernels queue, not what they compute: the same steps
with both parts on the caller's stream (``Inline``) must give the same parameters and state.
The ordering is what can go wrong, so each test widens the window a missing wait would open:
a long chain of matmuls on the caller's stream before the gradient is written (the side
stream must wait for it), and a read of the parameters on the caller's stream right after
the step (it must wait for the side stream). Run with: python -m pytest -m gpu tests/test_muon_side_stream.py
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from distlm.optim.muon import Muon
from distlm.optim.side_stream import Inline, SideStream

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# A large AdamW table (long memory-bound kernels on the side stream) beside small Muon matrices.
TABLE, MATRIX = (1 << 16, 512), (256, 256)


def _setup(seed: int = 0):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    table = nn.Parameter(torch.randn(TABLE, device=dev, generator=g) * 0.02)
    gain = nn.Parameter(torch.ones(TABLE[1], device=dev))
    mats = [nn.Parameter(torch.randn(MATRIX, device=dev, generator=g) * 0.02) for _ in range(4)]
    opt = Muon([{"params": [table, gain], "kind": "adamw", "fused": True, "weight_decay": 0.1},
                {"params": mats, "lr_scale": 20.0}], lr=1e-3, ns_dtype=torch.bfloat16)
    return table, gain, mats, opt


def _busy(n: int = 30) -> None:
    """Queue a few ms of matmuls on the current stream, so a kernel that does not wait for it
    runs first."""
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(n):
        x = torch.tanh(x @ x)


def _train(overlap) -> tuple[list, list, list]:
    table, gain, mats, opt = _setup()
    dev = table.device
    if overlap is not None:
        opt._overlap[dev] = overlap
    tokens = torch.randint(0, TABLE[0], (8, 64), device=dev, generator=torch.Generator(device=dev).manual_seed(1))
    losses, seen = [], []
    for _ in range(3):
        h = torch.nn.functional.embedding(tokens, table) * gain
        for m in mats:
            h = torch.tanh(h[..., :MATRIX[1]] @ m.T)
        loss = h.float().pow(2).mean()
        loss.backward()
        _busy()  # the gradients' last writer is late: the side stream must wait for it
        for p in [table, gain, *mats]:
            p.grad.neg_()  # a real write, queued behind the matmuls
        opt.step()
        seen.append(table.detach()[tokens].clone())  # read right after the step, on the caller's stream
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    torch.cuda.synchronize()
    state = [t.clone() for p in [table, gain] for t in (opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]
    return [p.detach().clone() for p in [table, gain, *mats]] + state, losses, seen


def test_the_side_stream_is_used_on_cuda():
    table, gain, mats, opt = _setup()
    for p in [table, gain, *mats]:
        p.grad = torch.randn_like(p)
    opt.step()
    assert isinstance(opt._overlap[table.device], SideStream)


def test_side_stream_results_equal_the_default_stream_results():
    side, side_losses, side_seen = _train(None)
    inline, inline_losses, inline_seen = _train(Inline())
    # The same kernels in the same order per stream: equal up to any non-determinism of the
    # kernels themselves (none expected). A missed wait shows as a difference of a whole update
    # (lr = 1e-3 against the tolerance's 1e-7): a stale gradient has the opposite sign.
    for a, b in zip(side_losses, inline_losses):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    for a, b in zip(side, inline):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    # What the caller's stream read right after each step is the updated table.
    for a, b in zip(side_seen, inline_seen):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def test_the_steps_peak_memory_is_the_declared_temporaries():
    """MuonSpec.step_temporaries (what the planner adds for the step) against the allocator's
    peak during a step of a GPT with the speedrun's block shapes, after the state exists."""
    from distlm.config import load_config
    from distlm.model.gpt import GPT
    from distlm.optim import REGISTRY
    from distlm.optim.base import MATRIX
    from distlm.optim.groups import matrix_params
    from distlm.train.optim import build_optimizer
    cfg = load_config("speedrun-124m", ["model.n_layer=4", "model.vocab_size=1024", "model.value_embeds=1"])
    dev = torch.device("cuda")
    model = GPT(cfg.model).to(dev)
    opt = build_optimizer(model, cfg, "cuda", ns_dtype=torch.bfloat16)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()  # makes the state
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    opt.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    matrices = sum(p.numel() for p in sum(matrix_params(model), []))
    declared = 4 * REGISTRY["muon"].step_temporaries[MATRIX] * matrices
    assert 0.8 * declared <= peak <= 1.1 * declared, f"peak {peak / 2**20:.1f} MiB, declared {declared / 2**20:.1f} MiB"
