"""Muon's step over stacks of matrices (distlm/optim/muon.py, distlm/parallel/whole_matrix.py),
on a CPU, and its peak memory on a GPU.

The step works a stack at a time: one foreach pass for the momenta of every matrix, Newton-Schulz
on each stack of one shape (on CUDA in its folded form, the sums inside the matmuls), and one
foreach add per stack. Each matrix's update must still be the per-matrix rule: checked here
against an independent per-matrix reference, and the folded Newton-Schulz against the unfolded
one."""
from __future__ import annotations

import math
import weakref

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from distlm.optim.muon import NEWTON_SCHULZ, Muon, newton_schulz, newton_schulz_folded


@pytest.mark.parametrize("shape", [(5, 24, 24), (4, 16, 40), (3, 40, 16), (2, 3, 12, 20), (20, 12)])
def test_folded_newton_schulz_is_the_same_polynomial(shape):
    torch.manual_seed(0)
    g = torch.randn(shape)
    ref, got = newton_schulz(g, dtype=torch.float32), newton_schulz_folded(g, dtype=torch.float32)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-6)
    # ... and not a copy of it: the sums really run inside the matmuls (different last bits)
    assert not torch.equal(got, ref) or g.shape[-1] == 0
    assert torch.count_nonzero(newton_schulz_folded(torch.zeros(shape))) == 0  # padding stays zero


def test_folded_newton_schulz_in_bf16_keeps_the_band():
    torch.manual_seed(1)
    g = torch.randn(6, 64, 96)
    s = torch.linalg.svdvals(newton_schulz_folded(g, dtype=torch.bfloat16).double())
    assert s.min() > 0.66 and s.max() < 1.23


def test_cpus_keep_the_unfolded_form_and_cuda_takes_the_folded_one():
    # A CPU run keeps the bits it had before the folded form existed.
    assert NEWTON_SCHULZ.get("cpu", newton_schulz) is newton_schulz
    assert NEWTON_SCHULZ["cuda"] is newton_schulz_folded


def _params():
    """Matrices of three shapes over four Muon groups (two of one shape at different rates,
    one without Nesterov, one of q/k/v blocks), plus AdamW's vectors."""
    torch.manual_seed(2)
    shapes = [(24, 16), (24, 16), (16, 40), (48, 16), (48, 16), (24, 16), (16, 40), (24, 16)]
    mats = [nn.Parameter(torch.randn(s) * 0.1) for s in shapes]
    vecs = [nn.Parameter(torch.randn(16)), nn.Parameter(torch.randn(10, 16))]
    groups = [
        {"params": vecs, "kind": "adamw", "weight_decay": 0.05},
        {"params": mats[0:3], "lr_scale": 20.0, "weight_decay": 0.1},
        {"params": mats[5:7], "lr_scale": 5.0, "momentum": 0.9, "nesterov": False},
        {"params": mats[3:5], "lr_scale": 10.0, "split": 3, "weight_decay": 0.02},
        {"params": mats[7:8], "lr_scale": 20.0, "momentum": 0.8},
    ]
    return mats, vecs, groups


def _reference_step(mats, groups, state):
    """The Muon rule one matrix at a time, written out independently of distlm's step."""
    for group in groups[1:]:
        lr = 1e-3 * group["lr_scale"]
        mu, split = group.get("momentum", 0.95), group.get("split", 1)
        for p in group["params"]:
            buf = state.setdefault(id(p), torch.zeros_like(p))
            buf.mul_(mu).add_(p.grad, alpha=1 - mu)
            m = p.grad * (1 - mu) + buf * mu if group.get("nesterov", True) else buf
            p.data.mul_(1 - lr * group.get("weight_decay", 0.0))
            rows, cols = p.shape[0] // split, p.shape[1]
            orth = torch.cat([newton_schulz(block, dtype=torch.float32) for block in m.split(rows)])
            p.data.add_(orth, alpha=-lr * math.sqrt(max(1.0, rows / cols)))


def test_stacked_step_is_the_per_matrix_rule():
    mats, vecs, groups = _params()
    ref = [p.detach().clone() for p in mats]
    opt = Muon(groups, lr=1e-3, ns_dtype=torch.float32)
    state: dict = {}
    ref_params = [nn.Parameter(r) for r in ref]
    where = {id(p): i for i, p in enumerate(mats)}
    ref_groups = [dict(g, params=[ref_params[where[id(p)]] for p in g["params"]]) for g in groups[1:]]
    for step in range(3):
        torch.manual_seed(10 + step)
        for p, r in zip(mats, ref_params):
            p.grad = torch.randn_like(p)
            r.grad = p.grad.clone()
        for v in vecs:
            v.grad = torch.randn_like(v)
        opt.step()
        _reference_step(ref_params, [None, *ref_groups], state)
    assert opt.last_orthogonalised == len(mats)
    for p, r in zip(mats, ref_params):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=1e-6)


class _Counting:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def test_momentum_is_one_pass_and_the_update_one_pass_per_stack(monkeypatch):
    mats, vecs, groups = _params()
    for g in groups[1:]:  # one momentum setting for all: one pass over every matrix
        g.pop("momentum", None)
        g.pop("nesterov", None)
    opt = Muon(groups, lr=1e-3, ns_dtype=torch.float32)
    for p in [*mats, *vecs]:
        p.grad = torch.randn_like(p)
    lerp_, add_ = _Counting(torch._foreach_lerp_), _Counting(torch._foreach_add_)
    monkeypatch.setattr(torch, "_foreach_lerp_", lerp_)
    monkeypatch.setattr(torch, "_foreach_add_", add_)
    opt.step()
    assert lerp_.calls == 1
    # stacks: (24,16) at rates 20 and 5 (two step sizes), (16,40) at 20 and 5, (48,16) split 3
    assert add_.calls == 5


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of every tensor storage an op creates while some tensor still uses it;
    ``peak``: the most at once."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.users: dict = {}
        self.size: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0]
                  if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            key, n = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
            if key in self.users:
                self.users[key] += 1
            elif key in inputs or n == 0:
                continue  # an in-place result or a view of something older than the step
            else:
                self.users[key], self.size[key] = 1, n
                self.live += n
                self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._release, key)
        return out

    def _release(self, key) -> None:
        self.users[key] -= 1
        if not self.users[key]:
            del self.users[key]
            self.live -= self.size.pop(key)


def test_the_declared_step_temporaries_cover_the_steps_peak(monkeypatch):
    """MuonSpec.step_temporaries against every tensor a Muon step (the folded form, bf16, as on
    CUDA) allocates, counted on a GPT with the speedrun's block shapes after the state exists."""
    from distlm.config import load_config
    from distlm.model.gpt import GPT
    from distlm.optim import REGISTRY
    from distlm.optim.base import MATRIX
    from distlm.optim.groups import matrix_params
    from distlm.train.optim import build_optimizer
    monkeypatch.setitem(NEWTON_SCHULZ, "cpu", newton_schulz_folded)
    cfg = load_config("speedrun-124m", ["model.n_layer=2", "model.vocab_size=256", "model.value_embeds=1",
                                        "model.d_model=64", "model.d_ff=256", "model.n_head=2",
                                        "optim.muon.ns_dtype=bf16"])
    model = GPT(cfg.model)
    opt = build_optimizer(model, cfg, "cpu")
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()  # makes the state
    counter = _LiveBytes()
    with torch.no_grad(), counter:
        opt._muon_step([g for g in opt.param_groups if g["kind"] == "muon"])
    declared = 4 * REGISTRY["muon"].step_temporaries[MATRIX] * sum(p.numel() for p in sum(matrix_params(model), []))
    assert 0.8 * declared <= counter.peak <= declared, (counter.peak, declared)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_steps_peak_memory_is_the_declared_temporaries():
    """MuonSpec.step_temporaries (what the planner adds for the step) against the allocator's
    peak during a step of a GPT with the speedrun's block shapes, after the state exists."""
    from distlm.config import load_config
    from distlm.model.gpt import GPT
    from distlm.optim import REGISTRY
    from distlm.optim.base import MATRIX
    from distlm.optim.groups import matrix_params
    from distlm.train.optim import build_optimizer
    cfg = load_config("speedrun-124m", ["model.n_layer=4", "model.vocab_size=1024", "model.value_embeds=1",
                                        "optim.muon.ns_dtype=bf16"])
    dev = torch.device("cuda")
    model = GPT(cfg.model).to(dev)
    opt = build_optimizer(model, cfg, "cuda")
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
