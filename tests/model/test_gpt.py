"""The model alone: GPT-2's parameter count, causality, KV cache, every option."""
import itertools

import pytest
import torch

from distlm.config import ModelConfig, load_config
from distlm.model.generate import KVCache, SamplingConfig, generate_tokens
from distlm.model.gpt import GPT
from distlm.model.loss import lm_loss

OPTIONS = list(itertools.product(["sinusoidal", "learned", "rope"], ["layernorm", "rmsnorm"], ["gelu", "swiglu"],
                                 [True, False]))


def small(**kw) -> ModelConfig:
    base = dict(n_layer=2, n_head=4, d_model=32, d_ff=64, block_size=16, vocab_size=100)
    base.update(kw)
    return ModelConfig(**base)


def test_gpt2_124m_parameter_count():
    cfg = load_config("gpt2-124m-1024", ["model.vocab_size=50257"]).model
    with torch.device("meta"):
        model = GPT(cfg)
    assert cfg.padded_vocab_size == 50304
    assert model.num_params(non_embedding=False) == 124_439_808


@pytest.mark.parametrize("position,norm,mlp,tie", OPTIONS)
def test_causal_and_kv_cache_match_full_recompute(position, norm, mlp, tie):
    torch.manual_seed(0)
    model = GPT(small(position=position, norm=norm, mlp=mlp, tie_embeddings=tie, bias=not tie)).eval()
    idx = torch.randint(0, 100, (2, 12))
    full = model(idx)
    # causality: changing token 8 leaves logits 0..7 unchanged
    idx2 = idx.clone()
    idx2[:, 8] = (idx2[:, 8] + 1) % 100
    assert torch.equal(model(idx2)[:, :8], full[:, :8])
    # KV cache: a prefill of 5, a chunk of 3, then single tokens give the full-recompute logits
    cache = KVCache(model, 2, 16)
    parts = [model(idx[:, :5], cache=cache, start_pos=0), model(idx[:, 5:8], cache=cache, start_pos=5)]
    parts += [model(idx[:, t:t + 1], cache=cache, start_pos=t) for t in range(8, 12)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)


def test_overfits_one_batch():
    torch.manual_seed(0)
    model = GPT(small(n_layer=2, d_model=64, d_ff=128))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(0, 100, (4, 16))
    y = torch.roll(x, -1, 1)
    for _ in range(150):
        loss = lm_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05


def test_meta_init_equals_eager_init():
    cfg = small(position="learned")
    eager = GPT(cfg)
    with torch.device("meta"):
        lazy = GPT(cfg)
    lazy.to_empty(device="cpu")
    lazy.init_weights(0)
    for (n, a), (_, b) in zip(eager.state_dict().items(), lazy.state_dict().items()):
        assert torch.equal(a, b), n
    assert eager.head.weight is eager.tok_emb.weight


def test_init_drawn_in_threads_equals_one_at_a_time():
    cfg = small(position="learned")
    with torch.device("meta"):
        one, many = GPT(cfg), GPT(cfg)
    for m, threads in ((one, 1), (many, 5)):
        m.to_empty(device="cpu")
        m.init_weights(3, threads=threads)
    for (n, a), (_, b) in zip(one.state_dict().items(), many.state_dict().items()):
        assert torch.equal(a, b), n
    assert one.state_dict().keys() == many.state_dict().keys()


def test_generation_is_seeded_and_stops_at_block_size_gracefully():
    torch.manual_seed(0)
    model = GPT(small())
    sc = SamplingConfig(max_new_tokens=40, temperature=1.0, top_k=10, top_p=0.9, seed=3)
    a = torch.stack(list(generate_tokens(model, [1, 2, 3], sc, num_samples=2)), 1)
    b = torch.stack(list(generate_tokens(model, [1, 2, 3], sc, num_samples=2)), 1)
    assert a.shape == (2, 40) and torch.equal(a, b)
    greedy = SamplingConfig(max_new_tokens=5, temperature=0)
    g = torch.stack(list(generate_tokens(model, [1, 2, 3], greedy)), 1)[0]
    assert g[0] == model(torch.tensor([[1, 2, 3]]))[0, -1, :100].argmax()
