"""Compiled per block (train.compile_scope=block), the work between the blocks runs in
compiled regions too: the token and value embeddings (forward gather, backward scatter) and the
U-net skips' mixing. Each is one small graph, compiled once (the skip region reused by every
skip), and the losses and gradients are those of the path that ran them eagerly.

The features are speedrun-124m's (RoPE, RMSNorm, QK-norm, ReLU^2, soft-capped chunked loss,
value embeddings, U-net skips) at a size the CPU compiles in seconds, in fp32.
"""
from __future__ import annotations

import collections

import pytest
import torch

from distlm.config import load_config
from distlm.model.gpt import GPT
from distlm.parallel.parallelize import apply_compile

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
VOCAB = 64
SMALL = ["model.n_layer=4", "model.n_head=2", "model.d_model=32", "model.d_ff=64", "model.block_size=16",
         f"model.vocab_size={VOCAB}", "model.value_embeds=2", "model.loss_chunk=24"]
# Profiler ranges that mark a compiled graph's forward or backward; an aten op below one ran
# inside a compiled region.
COMPILED = ("Torch-Compiled Region", "CompiledFunction", "CompiledFxGraph")
REGIONS = ("embed_tokens", "add_skip")  # GPT's methods that run between the blocks


def small_model() -> GPT:
    cfg = load_config("speedrun-124m", SMALL).model
    assert cfg.skip_connections and cfg.value_embeds == 2 and cfg.loss_chunk  # the features under test
    torch.manual_seed(0)
    return GPT(cfg).train()


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (3, 16), generator=g), torch.randint(0, VOCAB, (3, 16), generator=g)


def eager_between_blocks(model: GPT) -> GPT:
    """The per-block compile as it was before 2026-11-27: blocks and head compiled, the
    embeddings and skips eager (the compiled regions removed from the instance)."""
    for name in REGIONS:
        model.__dict__.pop(name, None)
    return model


def loss_and_grads(model: GPT):
    model.zero_grad(set_to_none=True)
    idx, tgt = batch()
    loss = model(idx, targets=tgt)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def eager_top_level_ops(model: GPT) -> collections.Counter:
    """aten ops of one forward+backward that ran outside every compiled region (only the
    outermost op of a nest is counted: one op calling another is one eager call)."""
    from torch.profiler import ProfilerActivity, profile
    model.zero_grad(set_to_none=True)
    idx, tgt = batch()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(idx, targets=tgt).backward()
    out = collections.Counter()
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        parent, outermost, compiled = e.cpu_parent, True, False
        while parent is not None:
            outermost = outermost and not parent.name.startswith("aten::")
            compiled = compiled or any(k in parent.name for k in COMPILED)
            parent = parent.cpu_parent
        if outermost and not compiled:
            out[e.name] += 1
    return out


@pytest.fixture(scope="module")
def models():
    torch._dynamo.reset()
    new, old = small_model(), small_model()
    apply_compile(new, "block")
    apply_compile(old, "block")
    eager_between_blocks(old)
    yield new, old
    torch._dynamo.reset()


def test_regions_compiled_give_the_eager_path_losses_and_gradients(models):
    new, old = models
    reference = small_model()  # nothing compiled
    for _ in range(2):  # the second pass runs the cached graphs
        (loss_new, g_new), (loss_old, g_old) = loss_and_grads(new), loss_and_grads(old)
        loss_ref, g_ref = loss_and_grads(reference)
        torch.testing.assert_close(loss_new, loss_old, rtol=0, atol=1e-6)
        torch.testing.assert_close(loss_new, loss_ref, rtol=0, atol=1e-6)
        assert g_new.keys() == g_old.keys() == g_ref.keys()
        # the embedding tables, the skip gates and the value-embedding gates are among them
        assert {"tok_emb.weight", "value_embeds.0.weight", "skip_weights.3.scale"} <= g_new.keys()
        for name in g_new:
            torch.testing.assert_close(g_new[name], g_old[name], rtol=0, atol=1e-6, msg=name)
            torch.testing.assert_close(g_new[name], g_ref[name], rtol=0, atol=1e-6, msg=name)


def test_no_embedding_or_skip_kernels_run_eagerly(models):
    new, old = models
    before = eager_top_level_ops(old)
    # The old path ran them eagerly: 3 gathers forward and 3 scatters backward (the token
    # table and 2 value tables), 2 skips (x * gate, then + x; backward: two products and the
    # gate's sum).
    assert before["aten::embedding"] == 3 and before["aten::embedding_backward"] == 3
    assert before["aten::mul"] >= 2 and before["aten::add"] >= 2
    after = eager_top_level_ops(new)
    for op in ("aten::embedding", "aten::embedding_backward", "aten::mul", "aten::add", "aten::sum"):
        assert after[op] == 0, (op, after)
    # What is left: bookkeeping (the backward's seed, the rope tables' slices, views) and
    # autograd's sums (add_) of the gradients two consumers send to one tensor, a skip's
    # source or a value embedding.
    assert set(after) <= {"aten::slice", "aten::view_as", "aten::reshape", "aten::view", "aten::ones_like",
                          "aten::add_", "aten::detach", "aten::empty", "aten::empty_strided", "aten::zeros",
                          "aten::zero_", "aten::fill_"}, after


def test_each_region_is_compiled_once(models):
    new, _ = models
    loss_and_grads(new)
    get = torch._C._dynamo.eval_frame._debug_get_cache_entry_list
    # 4 blocks, each reading a value table (2 tables, 2 readers each): one block graph, one
    # for the embeddings, one for the 2 skips (block 2 receives block 1's output, which is also
    # its input; block 3 receives block 0's).
    assert len(get(type(new.blocks["0"]).forward.__code__)) == 1
    assert len(get(GPT.embed_tokens.__code__)) == 1
    assert len(get(GPT.add_skip.__code__)) == 1


def test_regions_only_where_the_options_add_work_and_not_under_tensor_parallelism():
    """TP lays out these modules' inputs and outputs with hooks on DTensors (parameters that
    carry a device mesh when apply_compile runs); the regions are left eager there, as before
    (the blocks are still compiled). A plain GPT (no value embeddings, no skips) compiles no
    region: its token lookup is not worth a graph's compile time."""
    plain, tp = small_model(), small_model()
    tp.tok_emb.weight.device_mesh = "stands for a TP mesh"
    gpt2 = GPT(load_config("gpt2-124m", ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.d_ff=64",
                                         "model.block_size=16", f"model.vocab_size={VOCAB}"]).model)
    for m in (plain, tp, gpt2):
        apply_compile(m, "block")
    assert set(REGIONS) <= set(plain.compiled_regions) and set(REGIONS) <= set(vars(plain))
    assert not set(REGIONS) & set(vars(tp))
    assert gpt2.compiled_regions == () and not set(REGIONS) & set(vars(gpt2))


def test_ddp_leaves_each_compiled_block_one_graph(tmp_path):
    """Under DDP, dynamo would cut each compiled block's graph at the edges of DDP's gradient
    buckets: more graphs to compile cold and to load warm. The plan's compute context for DDP
    with per-block compile turns the cuts off (parallelize.compiler_settings), so the model
    compiles as many graphs as without DDP, and gives the same loss and gradients. DDP here runs
    on a one-process gloo world, which is enough for dynamo to see it."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from distlm.parallel.parallelize import compiler_settings
    from distlm.parallel.applied import compute_context
    from distlm.train.compile_cache import cache_counters

    # Blocks of 3 MB of fp32 gradients: past DDP's 1 MB first bucket, where the first cut falls.
    wide = SMALL + ["model.d_model=256", "model.d_ff=1024", "model.n_head=4"]

    def graphs_and_result(wrap, settings):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = GPT(load_config("speedrun-124m", wide).model).train()
        apply_compile(model, "block")
        before = sum(cache_counters())
        with compute_context(torch.device("cpu"), None, compiler_settings=settings):
            loss, grads = loss_and_grads(wrap(model))
        return sum(cache_counters()) - before, loss, grads

    block_ddp = compiler_settings(load_config("speedrun-124m", SMALL + ["train.compile=true"]), ddp=True)
    assert block_ddp == (("optimize_ddp", False),)
    assert compiler_settings(load_config("speedrun-124m", SMALL + ["train.compile=true",
                                                                    "train.compile_scope=model"]), ddp=True) == ()
    assert compiler_settings(load_config("speedrun-124m", SMALL + ["train.compile=true"]), ddp=False) == ()

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        ddp = lambda m: DDP(m, bucket_cap_mb=25)  # noqa: E731
        plain, loss0, grads0 = graphs_and_result(lambda m: m, ())
        cut, _, _ = graphs_and_result(ddp, ())
        whole, loss1, grads1 = graphs_and_result(ddp, block_ddp)
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
    assert cut > plain, (cut, plain)  # dynamo's cuts, as torch does them by default
    assert whole == plain, (whole, plain)
    assert torch.allclose(loss1, loss0, atol=1e-6)
    grads1 = {k.removeprefix("module."): g for k, g in grads1.items()}  # named through DDP's wrapper
    assert grads1.keys() == grads0.keys()
    for name, g in grads0.items():
        assert torch.allclose(grads1[name], g, atol=1e-6), name


@pytest.mark.parametrize("settings", [(), (("optimize_ddp", False),)])
def test_compute_context_autocasts_with_and_without_compiler_settings(settings):
    """Every bf16 run on a GPU goes through this context, with compiler settings (DDP with
    per-block compile) or without (one GPU, FSDP2, whole-model compile). Both paths enter
    autocast, and the settings hold only inside."""
    from distlm.parallel.applied import compute_context

    before = torch._dynamo.config.optimize_ddp
    with compute_context(torch.device("cpu"), torch.bfloat16, compiler_settings=settings):
        assert torch.is_autocast_enabled("cpu")
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
        assert torch._dynamo.config.optimize_ddp == (False if settings else before)
    assert not torch.is_autocast_enabled("cpu")
    assert torch._dynamo.config.optimize_ddp == before
