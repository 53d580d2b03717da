"""The modern-block options of GPT, each against a numerical
reference: QK-norm, ReLU^2, zero-initialised projections, logit soft-cap (both loss paths and
generation), value embeddings, U-net skips, document masks and sliding windows (dense path
on CPU; FlexAttention on CUDA under the `gpu` mark), and the HF export/import refusals.
The TP2 run with these options is a job of tests/layout/test_tensor.py's 2-rank launch.
"""
from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from distlm.config import ConfigError, ModelConfig, ParallelConfig
from distlm.layout import check_model_split
from distlm.model.attention import block_mask, dense_mask, document_ids, flex_attention
from distlm.model.generate import KVCache
from distlm.model.gpt import GPT, skip_source, value_embed_table
from distlm.model.loss import chunked_head_loss, lm_loss

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
EOT = 3
BASE = dict(n_layer=4, n_head=4, d_model=32, d_ff=64, block_size=48, vocab_size=50, bias=False)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def model_of(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(**{**BASE, **kw})).eval()


def ids(B=2, T=24, seed=1, vocab=50) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(EOT + 1, vocab, (B, T), generator=g)  # no end-of-text unless placed


def visible(row: list[int], window: int = 0) -> torch.Tensor:
    """(T, T) bool by the rule's words, one pair at a time: i sees j if j <= i, no
    end-of-text token lies in (j, i] (an EOT opens the document it precedes), and i - j < W."""
    T = len(row)
    out = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        for j in range(i + 1):
            out[i, j] = EOT not in row[j + 1:i + 1] and (not window or i - j < window)
    return out


def reference_forward(model: GPT, idx: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The model's logits with attention written out (softmax of masked scores) and the
    mask ``allowed`` (B, T, T) given: no SDPA, no mask builder of the model."""
    B, T = idx.shape
    x = model.embed(idx)
    rope = model.rope_at(0, T)
    for block in model.blocks.values():
        a = block.attn
        q, k, v = a.project(block.attn_norm(x), rope)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(a.head_dim)
        p = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1)
        x = x + a.wo((p @ v).transpose(1, 2).reshape(B, T, -1))
        x = x + block.mlp(block.mlp_norm(x))
    return model.head(model.norm(x))


# ---- QK-norm, ReLU^2, zero-initialised projections -----------------------------------
def test_qk_norm_gives_unit_rms_per_head():
    for position in ("learned", "rope"):  # rope rotates pairs: the norm survives it
        m = model_of(qk_norm=True, position=position)
        x = torch.randn(2, 10, 32) * 30  # large enough that norm_eps (1e-5) is below 1e-6 relative
        q, k, v = m.blocks["0"].attn.project(x, m.rope_at(0, 10))
        for t in (q, k):
            rms = t.pow(2).mean(-1).sqrt()  # (B, H, T): one value per head and token
            assert torch.allclose(rms, torch.ones_like(rms), atol=1e-5)
        assert not torch.allclose(v.pow(2).mean(-1), torch.ones(2, 4, 10), atol=1e-2)  # values untouched
    plain = model_of(position="rope").blocks["0"].attn.project(x, m.rope_at(0, 10))[0]
    assert not torch.allclose(plain.pow(2).mean(-1).sqrt(), torch.ones(2, 4, 10), atol=1e-2)


def test_relu2_is_relu_squared():
    mlp = model_of(mlp="relu2").blocks["0"].mlp
    x = torch.randn(3, 5, 32)
    h = mlp.w_in(x)
    assert (h < 0).any()
    torch.testing.assert_close(mlp(x), mlp.w_out(torch.relu(h) ** 2), rtol=0, atol=0)


def test_zero_init_proj_makes_every_block_the_identity():
    m, plain = model_of(zero_init_proj=True), model_of()
    x = torch.randn(2, 12, 32)
    rope = m.rope_at(0, 12)
    for block in m.blocks.values():
        assert torch.equal(block(x, rope), x)
        assert not block.attn.wo.weight.any() and not block.mlp.w_out.weight.any()
    # the (seed, name) draws of every other parameter are unchanged
    ref = dict(plain.named_parameters())
    for name, p in m.named_parameters():
        if not name.endswith(("wo.weight", "w_out.weight")):
            assert torch.equal(p, ref[name]), name
    assert not torch.equal(plain.blocks["0"](x, rope), x)


# ---- logit soft-cap ----------------------------------------------------------------------
def test_softcap_bounds_logits_in_forward_and_generation():
    cap = 0.1  # initial logits are small (std ~ 0.02 sqrt(d))
    m, plain = model_of(logit_softcap=cap), model_of()
    plain.load_state_dict(m.state_dict())
    idx = ids(T=20)
    logits = m(idx)
    raw = plain(idx)
    assert raw.abs().max() > cap  # the cap has something to do
    assert logits.abs().max() < cap
    torch.testing.assert_close(logits, cap * torch.tanh(raw / cap))
    # generation reads the same forward, through the KV cache
    cache = KVCache(m, 2, 48)
    steps = [m(idx[:, :12], cache=cache, start_pos=0)] + [m(idx[:, t:t + 1], cache=cache, start_pos=t)
                                                          for t in range(12, 20)]
    torch.testing.assert_close(torch.cat(steps, 1), logits, atol=1e-5, rtol=1e-5)


def test_softcap_chunked_loss_and_gradients_match_whole_logits():
    torch.manual_seed(0)
    x = torch.randn(3, 40, 16, requires_grad=True)
    w = (0.8 * torch.randn(70, 16)).requires_grad_()
    t = torch.randint(0, 70, (3, 40))
    cap = 3.0
    ref = lm_loss(cap * torch.tanh(F.linear(x, w) / cap), t)
    gx, gw = torch.autograd.grad(ref, (x, w))
    assert (F.linear(x, w).abs() > cap).float().mean() > 0.1  # the cap bends many logits
    for chunk in (7, 40, 1000):  # ragged last chunk, one chunk per row block, one chunk
        got = chunked_head_loss(x, w, t, chunk, softcap=cap)
        cx, cw = torch.autograd.grad(got, (x, w))
        assert abs(got.item() - ref.item()) < 1e-5
        torch.testing.assert_close(cx, gx, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cw, gw, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # the evaluation branch
        assert abs(chunked_head_loss(x, w, t, 7, softcap=cap).item() - ref.item()) < 1e-5
    # without the cap's derivative the gradients would differ: the check has teeth
    nocap = torch.autograd.grad(lm_loss(F.linear(x, w), t), (x,))[0]
    assert (nocap - gx).abs().max() > 1e-3


def test_softcap_model_loss_chunked_equals_whole():
    whole = model_of(logit_softcap=5.0, position="rope")
    chunked = GPT(dataclasses.replace(whole.cfg, loss_chunk=17))
    chunked.load_state_dict(whole.state_dict())
    idx, tgt = ids(T=30), ids(T=30, seed=2)
    a, b = whole(idx, targets=tgt), chunked(idx, targets=tgt)
    a.backward(), b.backward()
    assert abs(a.item() - b.item()) < 1e-5
    for (name, p), q in zip(whole.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)


# ---- value embeddings and U-net skips ---------------------------------------------------
def test_value_embedding_wiring_and_numerics():
    m = model_of(value_embeds=2, n_layer=5)
    assert [value_embed_table(m.cfg, i) for i in range(5)] == [0, 1, None, 1, 0]
    assert [b.attn.ve_weight is not None for b in m.blocks.values()] == [True, True, False, True, True]
    with torch.no_grad():
        for b in m.blocks.values():
            if b.attn.ve_weight is not None:
                b.attn.ve_weight.scale.fill_(0.7)
    # the attention's values gain scale * table row
    a, x, e = m.blocks["1"].attn, torch.randn(2, 6, 32), torch.randn(2, 6, 32)
    v_plain, v_mixed = a.project(x)[2], a.project(x, ve=e)[2]
    torch.testing.assert_close(v_mixed - v_plain, 0.7 * e.reshape(2, 6, 4, 8).transpose(1, 2))
    # the whole forward against blocks called by hand with table i at blocks i and L-1-i
    idx = ids(T=16)
    x = m.embed(idx)
    tables = [m.value_embeds[str(i)](idx) for i in range(2)]
    for i, table in enumerate([0, 1, None, 1, 0]):
        x = m.blocks[str(i)](x, None, None, 0, None, True, tables[table] if table is not None else None)
    torch.testing.assert_close(m(idx), m.head(m.norm(x)), atol=0, rtol=0)


def test_skip_wiring_and_numerics():
    m = model_of(skip_connections=True, n_layer=5)
    assert [skip_source(m.cfg, i) for i in range(5)] == [None, None, None, 1, 0]  # the odd middle gets none
    with torch.no_grad():
        m.skip_weights["3"].scale.fill_(0.5)
        m.skip_weights["4"].scale.fill_(-2.0)
    idx = ids(T=16)
    b = [m.blocks[str(i)] for i in range(5)]
    x0 = m.embed(idx)
    x1 = b[0](x0)
    x2 = b[1](x1)
    x3 = b[2](x2)
    x4 = b[3](x3 + 0.5 * x2)   # block 3 receives block 1's output
    x5 = b[4](x4 - 2.0 * x1)   # block 4 receives block 0's output
    torch.testing.assert_close(m(idx), m.head(m.norm(x5)), atol=1e-6, rtol=1e-6)


def test_blocks_compiled_one_at_a_time_compile_once_per_kind():
    """12 layers, 3 value-embedding tables and U-net skips: two kinds of block (with a
    table or not), so two graphs. With the skips added inside the blocks there were four
    kinds, and a fifth graph for the middle block, whose skip is its own input."""
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    m = model_of(n_layer=12, value_embeds=3, skip_connections=True).train()
    ref = model_of(n_layer=12, value_embeds=3, skip_connections=True).train()
    counter = CompileCounter()
    for block in m.blocks.values():
        block.compile(backend=counter)
    idx, tgt = ids(T=16), ids(T=16, seed=3)
    loss = m(idx, targets=tgt)
    loss.backward()
    assert counter.frame_count == 2
    torch.testing.assert_close(loss, ref(idx, targets=tgt), rtol=0, atol=0)
    torch._dynamo.reset()


@pytest.mark.parametrize("opt", [dict(value_embeds=2), dict(skip_connections=True)], ids=["value_embeds", "skips"])
def test_value_embeds_and_skips_change_outputs_and_get_gradients(opt):
    m, plain = model_of(**opt).train(), model_of().train()
    missing, unexpected = plain.load_state_dict(m.state_dict(), strict=False)
    assert not missing and unexpected  # same shared weights; the option's own are extra
    idx, tgt = ids(T=20), ids(T=20, seed=3)
    assert (m(idx) - plain(idx)).abs().max() > 1e-3
    m(idx, targets=tgt).backward()
    for name, p in m.named_parameters():
        if name.startswith("value_embeds") or name.endswith(".scale"):
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_options_are_validated():
    for bad, match in ((dict(value_embeds=3), "model.value_embeds=3"), (dict(logit_softcap=-1.0), "logit_softcap"),
                       (dict(attn_window=-2), "attn_window"), (dict(dropout=0.1, attn_mask="doc", eot_id=EOT),
                                                               "dropout"),
                       (dict(eot_id=50), "eot_id")):
        with pytest.raises(ConfigError, match=match):
            GPT(ModelConfig(**{**BASE, **bad}))
    with pytest.raises(ConfigError, match="eot_id"):
        model_of(attn_mask="doc")(ids())
    # a pipeline stage has no token ids or earlier outputs: refused with these options
    for opt in (dict(value_embeds=1), dict(skip_connections=True), dict(attn_mask="doc"), dict(attn_window=8)):
        with pytest.raises(ConfigError, match="parallel.pp=2 does not support model"):
            check_model_split(ModelConfig(**{**BASE, **opt}), ParallelConfig(pp=2))
    check_model_split(ModelConfig(**{**BASE, "qk_norm": True, "mlp": "relu2", "logit_softcap": 9.0}),
                      ParallelConfig(pp=2, tp=2))


# ---- document masks and windows ---------------------------------------------------------
def test_document_ids_open_a_document_at_each_end_of_text():
    idx = torch.tensor([[5, 6, EOT, 7, EOT, EOT, 8], [EOT, 5, 5, 5, 5, 5, 5]])
    assert document_ids(idx, EOT).tolist() == [[0, 0, 1, 1, 2, 3, 3], [1, 1, 1, 1, 1, 1, 1]]


def test_dense_mask_is_the_rule():
    idx = ids(B=3, T=20, seed=4)
    idx[0, [3, 9, 10]] = EOT
    idx[1, 0] = EOT
    for window in (0, 1, 5):
        got = dense_mask(20, 20, "cpu", docs=document_ids(idx, EOT), window=window)
        want = torch.stack([visible(r, window) for r in idx.tolist()])[:, None]
        assert torch.equal(got, want)


def test_second_document_equals_running_it_alone_with_rope():
    # RoPE scores depend on relative positions only, so the second document attends
    # exactly as it would at position 0; the first is untouched by what follows it.
    m = model_of(attn_mask="doc", eot_id=EOT, position="rope")
    a, b = ids(B=1, T=9, seed=5), ids(B=1, T=12, seed=6)
    b[0, 0] = EOT  # a document as the data stores it: ... doc A, EOT, doc B
    both = torch.cat([a, b], 1)
    with torch.no_grad():
        out = m(both)
        torch.testing.assert_close(out[:, 9:], m(b), atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(out[:, :9], m(a), atol=2e-5, rtol=1e-5)
        causal = model_of(position="rope")(both)
    assert (causal[:, 9:] - out[:, 9:]).abs().max() > 1e-3  # plain causal attention would mix them


@pytest.mark.parametrize("position", ["learned", "sinusoidal", "rope"])
@pytest.mark.parametrize("mask,window", [("doc", 0), ("doc", 5), ("causal", 7)])
def test_masked_model_matches_explicit_reference(position, mask, window):
    # Absolute positions do not restart per document: the reference is the same model
    # with attention written out under the rule's mask, not the document run alone.
    m = model_of(attn_mask=mask, attn_window=window, eot_id=EOT, position=position, qk_norm=True, mlp="relu2")
    idx = ids(B=3, T=24, seed=7)
    idx[0, [5, 6, 15]] = EOT
    idx[1, 0] = EOT
    allowed = torch.stack([visible(r if mask == "doc" else [0] * 24, window) for r in idx.tolist()])
    with torch.no_grad():
        torch.testing.assert_close(m(idx), reference_forward(m, idx, allowed), atol=1e-5, rtol=1e-5)


def test_window_applies_in_cached_generation():
    # With a KV cache the window is applied (each step sees its last W keys); document
    # boundaries are not (the context is one document), so the prompt here has no EOT.
    for mask in ("causal", "doc"):
        m = model_of(attn_window=6, attn_mask=mask, eot_id=EOT, position="rope")
        idx = ids(B=2, T=30, seed=8)
        with torch.no_grad():
            full = m(idx)
            cache = KVCache(m, 2, 48)
            got = [m(idx[:, :10], cache=cache, start_pos=0), m(idx[:, 10:14], cache=cache, start_pos=10)]
            got += [m(idx[:, t:t + 1], cache=cache, start_pos=t) for t in range(14, 30)]
        torch.testing.assert_close(torch.cat(got, 1), full, atol=1e-5, rtol=1e-5)


# ---- FlexAttention's BlockMask -----------------------------------------------------------
def _tiles(counts, indices) -> torch.Tensor:
    B, _, n = counts.shape
    out = torch.zeros(B, n, n, dtype=torch.bool)
    for b in range(B):
        for i in range(n):
            out[b, i, indices[b, 0, i, :counts[b, 0, i]].long()] = True
    return out


def _rows(B: int, T: int) -> torch.Tensor:
    """Rows with no boundary, an EOT first, boundaries near and across tile edges, a dense run."""
    idx = ids(B=B, T=T, seed=9)
    idx[1, 0] = EOT
    idx[1, [127, 128, 200]] = EOT
    idx[2, 1:T:37] = EOT
    idx[3, 250:256] = EOT
    return idx


@pytest.mark.skipif(flex_attention is None, reason="no FlexAttention in this torch")
@pytest.mark.parametrize("docs_on", [True, False], ids=["doc", "nodoc"])
@pytest.mark.parametrize("window", [0, 1, 100, 300])
def test_block_mask_tiles_cover_the_rule(docs_on, window):
    """On any device: every tile holding a visible pair is listed, and a tile marked full
    holds only visible pairs (the kernel skips the mask there). T = 300: a ragged last tile."""
    if not docs_on and not window:
        return  # plain causal takes the SDPA path, never a BlockMask
    T, idx = 300, _rows(4, 300)
    docs = document_ids(idx, EOT) if docs_on else None
    bm = block_mask(docs, 4 if docs_on else 1, T, window, "cpu")
    n, pad = bm.kv_num_blocks.shape[-1], bm.kv_num_blocks.shape[-1] * 128 - T
    dense = dense_mask(T, T, "cpu", docs=docs, window=window)[:, 0]

    def per_tile(fill: bool) -> torch.Tensor:  # positions past T count as `fill`
        return F.pad(dense, (0, pad, 0, pad), value=fill).reshape(-1, n, 128, n, 128)
    any_visible, all_visible = per_tile(False).any(4).any(2), per_tile(True).all(4).all(2)
    partial, full = _tiles(bm.kv_num_blocks, bm.kv_indices), _tiles(bm.full_kv_num_blocks, bm.full_kv_indices)
    assert not (partial & full).any()
    assert ((partial | full) >= any_visible).all(), "a tile with visible pairs is missing"
    assert (all_visible >= full).all(), "a tile marked full hides a masked pair"
    if not window or window >= 2 * 128:  # some tile pair lies wholly inside the window
        assert full.any(), "no tile uses the unmasked fast path"


@pytest.mark.skipif(flex_attention is None, reason="no FlexAttention in this torch")
def test_flex_mask_function_matches_dense_on_cpu():
    """Eager FlexAttention (forward, CPU) applies the BlockMask's mask function at every
    pair: it equals SDPA under the dense mask."""
    T, idx = 300, _rows(4, 300)
    docs = document_ids(idx, EOT)
    q, k, v = (torch.randn(4, 2, T, 16) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile"
        for window in (0, 70):
            got = flex_attention(q, k, v, block_mask=block_mask(docs, 4, T, window, "cpu"))
            want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(T, T, "cpu", docs=docs, window=window))
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("window", [0, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_attention_matches_dense_reference_on_cuda(window, dtype):
    from distlm.model.attention import attend
    T, idx = 300, _rows(4, 300).cuda()
    docs = document_ids(idx, EOT)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(4, 4, T, 64, device="cuda", generator=g, dtype=dtype).requires_grad_() for _ in range(3))
    got = attend(q, k, v, block_mask(docs, 4, T, window, "cuda"), True, 0.0)
    gq = torch.autograd.grad(got.float().square().sum(), (q, k, v))
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    want = F.scaled_dot_product_attention(q32, k32, v32, attn_mask=dense_mask(T, T, "cuda", docs=docs, window=window))
    wq = torch.autograd.grad(want.square().sum(), (q32, k32, v32))
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    assert (got.float() - want).abs().max() < tol
    for a, b in zip(gq, wq):
        assert (a.float() - b).norm() / b.norm() < tol


@pytest.mark.gpu
@cuda
def test_model_on_cuda_flex_equals_dense_path(monkeypatch):
    import distlm.model.gpt as gpt
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=4, n_head=4, d_model=256, d_ff=512, block_size=512, vocab_size=500, position="rope",
                      attn_mask="doc", attn_window=200, eot_id=EOT, qk_norm=True, mlp="relu2", logit_softcap=15.0,
                      value_embeds=1, skip_connections=True)
    m = GPT(cfg).cuda()
    idx = torch.randint(4, 500, (4, 512), device="cuda")
    idx[:, ::97] = EOT
    tgt = torch.roll(idx, -1, 1)

    def loss_and_grads():
        m.zero_grad()
        loss = m(idx, targets=tgt)
        loss.backward()
        return loss.item(), [p.grad.clone() for p in m.parameters()]
    assert type(m.attention_mask(idx)).__name__ == "BlockMask"
    flex = loss_and_grads()
    monkeypatch.setattr(gpt, "flex_usable", lambda device: False)
    assert isinstance(m.attention_mask(idx), torch.Tensor)
    dense = loss_and_grads()
    assert abs(flex[0] - dense[0]) < 1e-4
    for a, b in zip(flex[1], dense[1]):
        assert (a - b).norm() <= 1e-3 * b.norm() + 1e-7


@pytest.mark.gpu
@cuda
def test_softcap_chunked_loss_compiled_on_cuda():
    torch.manual_seed(0)
    x = torch.randn(4, 256, 128, device="cuda", requires_grad=True)
    w = (0.3 * torch.randn(1000, 128, device="cuda")).requires_grad_()
    t = torch.randint(0, 1000, (4, 256), device="cuda")
    fused = torch.compile(lambda x, w, t: chunked_head_loss(x, w, t, 300, softcap=4.0))
    ref = lm_loss(4.0 * torch.tanh(F.linear(x, w) / 4.0), t)
    got = fused(x, w, t)
    assert abs(got.item() - ref.item()) < 1e-4
    for a, b in zip(torch.autograd.grad(got, (x, w)), torch.autograd.grad(ref, (x, w))):
        assert (a - b).norm() / b.norm() < 1e-4


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("scope", ["block", "model"])
def test_trainer_compiled_with_every_option_on_cuda(tmp_path, scope):
    from distlm.config import load_config
    from distlm.train.trainer import Trainer
    cfg = load_config("tiny", ["data.source=synthetic", "model.vocab_size=1000", "train.max_steps=6",
                               "train.compile=true", f"train.compile_scope={scope}", "train.eval_every=0",
                               "log.progress=false", f"log.root={tmp_path}", "log.name=g", "log.every=3",
                               "model.n_layer=4", "model.position=rope", "model.qk_norm=true", "model.mlp=relu2",
                               "model.zero_init_proj=true", "model.logit_softcap=15", "model.value_embeds=1",
                               "model.skip_connections=true", "model.attn_mask=doc", "model.attn_window=64",
                               f"model.eot_id={EOT}", "model.loss_chunk=512"])
    summary = Trainer(cfg).train()
    assert summary["step"] == 6 and summary["train_loss"] < 7.5


# ---- Hugging Face export and import ---------------------------------------------------------
INEXPRESSIBLE = [("qk_norm", True), ("logit_softcap", 30.0), ("value_embeds", 1), ("skip_connections", True),
                 ("attn_mask", "doc"), ("attn_window", 64)]
LLAMA = dict(position="rope", norm="rmsnorm", mlp="swiglu")


@pytest.mark.parametrize("field,value", INEXPRESSIBLE, ids=[f for f, _ in INEXPRESSIBLE])
def test_export_refuses_each_inexpressible_option(field, value):
    from distlm.interop.hf import ExportError, hf_architecture
    for arch in (LLAMA, dict(position="learned", norm="layernorm", mlp="gelu")):
        if field == "qk_norm" and arch is LLAMA:  # Qwen3 has it (tests/interop/test_hf_variants.py)
            continue
        with pytest.raises(ExportError, match=f"model.{field}={value}") as e:
            hf_architecture(ModelConfig(**{**BASE, **arch, field: value}))
        assert "\n" not in str(e.value)
    with pytest.raises(ExportError, match="model.mlp=relu2"):  # relu2 exports only with RoPE (Arcee, Apertus)
        hf_architecture(ModelConfig(**{**BASE, **LLAMA, "position": "learned", "mlp": "relu2"}))
    assert hf_architecture(ModelConfig(**{**BASE, **LLAMA, "zero_init_proj": True})) == "llama"  # only an init


def test_distlm_export_command_refuses_with_one_line(tmp_path, capsys):
    pytest.importorskip("safetensors")
    from helpers.checkpoints import make_run

    from distlm.cli import main
    from distlm.data.tokenizer import train_bpe
    from conftest import SAMPLE_TEXT
    make_run(tmp_path / "run", train_bpe(SAMPLE_TEXT[:2], 270), **LLAMA, value_embeds=1, logit_softcap=30.0)
    assert main(["export", "--format", "hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: model.logit_softcap=30.0") and "model.value_embeds=1" in err and "\n" not in err
    assert not (tmp_path / "hf").exists()


def test_import_refuses_options_hf_lacks(tmp_path):
    transformers = pytest.importorskip("transformers")
    from distlm.interop import InteropError, apply_hf_model_config, load_hf_into
    conf = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    transformers.GPT2LMHeadModel(conf).save_pretrained(tmp_path)
    for field, value in INEXPRESSIBLE[:4]:
        with pytest.raises(InteropError, match=f"model.{field}={value}"):
            apply_hf_model_config(ModelConfig(**{field: value}), tmp_path)
    # attention masks are a training choice over the same weights: allowed
    cfg = apply_hf_model_config(ModelConfig(attn_mask="doc", attn_window=16, eot_id=EOT), tmp_path)
    assert load_hf_into(GPT(cfg), tmp_path) > 0
