"""Float8 training (train.fp8, distlm/model/float8.py).

On the CPU: the scaling and casting, the three matmuls of a layer against fp32 (emulated, and
through torch._scaled_mm where this torch has it on the CPU), which layers are swapped, that the
state dict does not change, torch.compile, and the refusals. Under the `gpu` marker, on a GPU
with float8 tensor cores: the kernel against the emulation and a bf16 reference, and training
losses against bf16:
    python -m pytest -q -m gpu tests/model/test_float8.py
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distlm.config import ConfigError, ModelConfig, load_config
from distlm.model.float8 import (E4M3, E5M2, Float8Linear, RowwiseRecipe, TensorwiseRecipe, _Float8Matmul,
                                 apply_float8, check_float8_device, power_of_two_scale, to_float8)
from distlm.model.gpt import GPT

# Float8 rounds each operand element to 3 (e4m3) or 2 (e5m2) mantissa bits: a relative error of
# about 2^-4 and 2^-3 per element, which a long dot product averages to a few percent of the
# result's norm. Measured on the CPU with these shapes: forward 0.037, gradients 0.058-0.060.
FORWARD_TOL = 0.05   # e4m3 x e4m3, relative to the fp32 product's norm
BACKWARD_TOL = 0.08  # e5m2 x e4m3
# The GPU training test's largest gap between a float8 and the bf16 loss curve, at any logged step
# of 60 (the curve falls from 10.9 to about 0.24, by up to 1 nat between two logged steps). The same
# runs on the CPU with the emulated matmul (train.dtype=bf16, tensorwise): largest gap 0.056, mean
# 0.012, final 0.007.
LOSS_TOL = 0.15
RECIPES = [TensorwiseRecipe, RowwiseRecipe]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def has_cpu_scaled_mm(rowwise: bool = False) -> bool:
    """Whether this torch's CPU torch._scaled_mm takes tensorwise scales (or rowwise ones: torch
    2.11's takes only tensorwise, 2.13's both)."""
    try:
        a = torch.zeros(16, 16, dtype=E4M3)
        sa, sb = (torch.ones(16, 1), torch.ones(1, 16)) if rowwise else (torch.tensor(1.0), torch.tensor(1.0))
        torch._scaled_mm(a, a.t(), sa, sb, out_dtype=torch.bfloat16)
        return True
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


# ---- scaling and casting -------------------------------------------------------------------------

def test_scales_are_powers_of_two_that_keep_the_largest_value_in_range():
    for dtype in (E4M3, E5M2):
        top = torch.finfo(dtype).max
        for amax in (1e-3, 0.7, 1.0, 3.0, 500.0, 1e5):
            s = power_of_two_scale(torch.tensor(amax), dtype)
            assert s.dtype == torch.float32 and torch.log2(s) == torch.log2(s).round()
            assert top / 2 < amax * s.item() <= top  # within the top binade: no range wasted
    # an all-zero tensor: a finite scale, zeros stay zeros
    s = power_of_two_scale(torch.tensor(0.0), E4M3)
    assert torch.isfinite(s) and to_float8(torch.zeros(4), s, E4M3).float().eq(0).all()


def test_cast_saturates_instead_of_overflowing():
    # e5m2 has an infinity, and a plain cast past its top reaches it
    assert torch.tensor([1e5]).to(E5M2).float().isinf().all()
    out = to_float8(torch.tensor([1e5, -1e5, 1.0]), torch.tensor(1.0), E5M2).float()
    assert out.tolist() == [57344.0, -57344.0, 1.0]
    out = to_float8(torch.tensor([1000.0, -1000.0, 1.0]), torch.tensor(1.0), E4M3).float()
    assert out.tolist() == [448.0, -448.0, 1.0]


def test_a_power_of_two_scale_rounds_only_in_the_cast():
    """Scaling by 2^k is exact: quantise-dequantise equals a plain cast of the scaled value."""
    torch.manual_seed(0)
    t = torch.randn(64, 32) * 3
    for recipe in (TensorwiseRecipe(), RowwiseRecipe()):
        t8, inv = recipe.quantize(t, E4M3, dim=1)
        back = t8.float() * inv
        assert rel(back, t) < 0.04
        assert torch.equal(back / inv, t8.float())


def test_rowwise_scales_follow_each_row_and_column():
    """A row 10^-6 times smaller than the rest: one scale per tensor sends it below e4m3's
    smallest subnormal (about 2e-3 after scaling), one per row keeps it."""
    torch.manual_seed(0)
    t = torch.randn(32, 64)
    t[3] *= 1e-6
    tw8, tw_inv = TensorwiseRecipe().quantize(t, E4M3, dim=1)
    rw8, rw_inv = RowwiseRecipe().quantize(t, E4M3, dim=1)
    assert tw_inv.shape == () and rw_inv.shape == (32, 1)
    assert rel(tw8[3].float() * tw_inv, t[3]) > 0.5      # flushed to zero, or nearly
    assert rel(rw8[3].float() * rw_inv[3], t[3]) < 0.04  # as precise as any other row
    _, col_inv = RowwiseRecipe().quantize(t, E4M3, dim=0)
    assert col_inv.shape == (1, 64)


# ---- the three matmuls of a layer ------------------------------------------------------------------

def layer_grads(recipe, x, w, g):
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    out = _Float8Matmul.apply(x, w, recipe)
    gx, gw = torch.autograd.grad(out, (x, w), g)
    return out, gx, gw


def operands(device="cpu", M=256, K=128, N=192):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=gen).to(device, torch.bfloat16)
    w = (0.05 * torch.randn(N, K, generator=gen)).to(device)
    g = (1e-4 * torch.randn(M, N, generator=gen)).to(device, torch.bfloat16)  # gradients are small
    return x, w, g


@pytest.mark.parametrize("cls", RECIPES)
def test_emulated_float8_layer_against_fp32(cls):
    x, w, g = operands()
    out, gx, gw = layer_grads(cls(emulate=True), x, w, g)
    assert (out.dtype, gx.dtype, gw.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32)
    assert rel(out, x.float() @ w.t()) < FORWARD_TOL
    assert rel(gx, g.float() @ w) < BACKWARD_TOL
    assert rel(gw, g.float().t() @ x.float()) < BACKWARD_TOL


@pytest.mark.skipif(not has_cpu_scaled_mm(), reason="this torch has no torch._scaled_mm on the CPU")
@pytest.mark.parametrize("cls", RECIPES)
def test_cpu_scaled_mm_matches_the_emulation(cls):
    """The operands' layouts, scale shapes and dtypes as torch._scaled_mm takes them, checked
    against the emulation where a CPU kernel exists (torch 2.13 has one; the GPU test checks the
    CUDA kernel the same way)."""
    if not has_cpu_scaled_mm(rowwise=cls is RowwiseRecipe):
        pytest.skip(f"this torch's CPU torch._scaled_mm does not take {cls.name} scales")
    x, w, g = operands()
    real = layer_grads(cls(), x, w, g)
    emulated = layer_grads(cls(emulate=True), x, w, g)
    for a, b in zip(real, emulated):
        assert rel(a, b) < 1e-2


# ---- the model ------------------------------------------------------------------------------------

def small_model(**kw) -> GPT:
    cfg = ModelConfig(**{**dict(n_layer=2, n_head=4, d_model=64, d_ff=128, block_size=32, vocab_size=256,
                                tie_embeddings=False), **kw})
    torch.manual_seed(0)
    return GPT(cfg)


def test_only_the_blocks_linear_layers_are_swapped_and_the_state_dict_is_the_same():
    """Same parameter tensors under the same names in the same dtypes: a float8 run's
    checkpoint loads into a bf16 run and back."""
    plain, fp8 = small_model(), small_model()
    before = {k: (v.dtype, v.shape, v.data_ptr()) for k, v in fp8.state_dict().items()}
    assert apply_float8(fp8, "rowwise", emulate=True) == 2 * 6  # q, k, v, o, MLP in and out
    after = {k: (v.dtype, v.shape, v.data_ptr()) for k, v in fp8.state_dict().items()}
    assert after == before
    swapped = {n for n, m in fp8.named_modules() if isinstance(m, Float8Linear)}
    assert swapped and all(n.startswith("blocks.") for n in swapped)
    assert type(fp8.head) is nn.Linear and type(fp8.tok_emb) is nn.Embedding
    assert not any(isinstance(m, Float8Linear) for n, m in fp8.named_modules() if "norm" in n)
    # the checkpoint both ways, strict
    fp8.load_state_dict(plain.state_dict(), strict=True)
    plain.load_state_dict(fp8.state_dict(), strict=True)
    assert apply_float8(small_model(), "off") == 0


def test_the_fused_qkv_product_runs_in_float8():
    """The attention multiplies q, k and v as one concatenated matmul (distlm/model/gpt.py); with
    float8 that product must be a float8 one too: 4 float8 matmuls per block, not 3."""
    calls = []

    class Counting(TensorwiseRecipe):
        def forward(self, ctx, x, w):
            calls.append(tuple(w.shape))
            return super().forward(ctx, x, w)

    model = small_model(n_layer=1)
    apply_float8(model, "tensorwise")
    for m in model.modules():
        if isinstance(m, Float8Linear):
            m.recipe = Counting(emulate=True)
    model(torch.randint(0, 256, (2, 32)))
    assert sorted(calls) == sorted([(192, 64), (64, 64), (128, 64), (64, 128)])


def test_the_model_trains_alike_in_emulated_float8_and_falls_back_on_short_inputs():
    plain, fp8 = small_model(), small_model()
    apply_float8(fp8, "tensorwise", emulate=True)
    idx = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = plain(idx, targets=idx), fp8(idx, targets=idx)
    assert a.item() != b.item() and abs(a.item() - b.item()) < 0.02 * a.item()
    a.backward()
    b.backward()
    for (n, p), q in zip(plain.named_parameters(), fp8.parameters()):
        assert q.grad is not None and q.grad.dtype == p.grad.dtype
        # the weight matrices; a key bias's true gradient is zero (softmax ignores it), its noise is not compared
        if p.ndim == 2:
            assert rel(q.grad, p.grad) < 0.15, n
    # 3 tokens (a decoding step): not a multiple of 16, so the plain matmul, exactly
    layer = fp8.blocks["0"].mlp.w_in
    x = torch.randn(1, 3, 64)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("mode", ["off", "tensorwise", "rowwise"])
def test_compiled_blocks_match_eager(mode):
    """The autograd function with its recipe object traces under torch.compile, per block as
    parallelize compiles them, in one graph (aot_eager: the graph capture without Inductor's
    kernels); and a plain block, whose fused q/k/v product now asks its layer for a matmul, too."""
    eager, compiled = small_model(), small_model()
    for m in (eager, compiled):
        apply_float8(m, mode, emulate=True)
    for block in compiled.blocks.values():
        block.compile(backend="aot_eager", fullgraph=True)
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = eager(idx, targets=idx), compiled(idx, targets=idx)
    a.backward()
    b.backward()
    assert abs(a.item() - b.item()) < 1e-6
    for p, q in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7)


# ---- FSDP2 and DDP (the shared 2-rank world, tests/helpers/float8_jobs.py) ------------------------
def world_scenarios(root, data) -> dict[int, list[dict]]:
    from helpers.float8_jobs import JOBS
    if not has_cpu_scaled_mm():
        return {}
    return {2: [{"kind": "float8", "name": name, "overrides": extra} for name, extra in JOBS.items()]}


@pytest.fixture(scope="module")
def two_ranks(worlds):
    return worlds.results(__name__, 2)


@pytest.mark.skipif(not has_cpu_scaled_mm(), reason="this torch has no torch._scaled_mm on the CPU")
@pytest.mark.parametrize("job", ["fsdp2-tensorwise", "fsdp2-rowwise", "ddp2-tensorwise"])
def test_float8_under_fsdp2_and_ddp_matches_one_process(two_ranks, job):
    """parallelize swaps the layers before FSDP2 shards them (or DDP wraps them): the float8
    layers are there, the parameters and the state dict keep their names and fp32 dtype, and 3
    AdamW steps on 2 ranks end close to where one process on the same global batches ends. Not
    to fp32 rounding: each float8 matmul returns bf16, so a rank's half of a weight gradient is
    rounded to 8 bits before the two halves are summed (one process rounds the whole sum once),
    and AdamW's first steps turn such differences of small gradients into differences of up to
    2 x lr. Measured on the 2-core box: losses within 3.3e-4, the weight matrices within 0.6% of
    their norm; a weight that got no gradient would be 15% off."""
    import helpers.float8_jobs as w
    got = two_ranks[job]
    mode = job.split("-")[1]
    cfg, model, gpt, opt = w.build([f"train.fp8={mode}"])
    ref = w.summary(gpt, w.run_steps(cfg, model, opt))
    assert got["float8_layers"] == ref["float8_layers"] == 2 * 6
    plain = GPT(cfg.model)
    assert got["state_dict"] == ref["state_dict"] == {k: str(v.dtype) for k, v in plain.state_dict().items()}
    assert set(got["state_dict"].values()) == {"torch.float32"}
    assert got["losses"] == pytest.approx(ref["losses"], abs=2e-3)
    for name, p in ref["params"].items():
        if p.ndim == 2:
            assert rel(got["params"][name], p) < 2e-2, name


# ---- refusals ---------------------------------------------------------------------------------------

def test_hardware_refusals_name_the_device_and_capability():
    check_float8_device("off", "cpu")
    for ok in ((8, 9), (9, 0), (10, 0)):
        check_float8_device("rowwise", "cuda", ok)
    with pytest.raises(ConfigError, match=r"train.fp8=tensorwise needs a CUDA GPU .* this run is on cpu"):
        check_float8_device("tensorwise", "cpu")
    with pytest.raises(ConfigError, match=r"needs CUDA capability 8.9 .* this GPU has 8.0"):
        check_float8_device("tensorwise", "cuda", (8, 0))
    with pytest.raises(ConfigError, match="this GPU has 7.0"):
        check_float8_device("rowwise", "cuda", (7, 0))


def test_config_refuses_what_float8_cannot_run():
    assert load_config("tiny", ["train.fp8=rowwise"]).train.fp8 == "rowwise"
    with pytest.raises(ConfigError, match="not one of off, tensorwise, rowwise"):
        load_config("tiny", ["train.fp8=e4m3"])
    with pytest.raises(ConfigError, match=r"train.fp8=tensorwise does not support parallel.tp=2"):
        load_config("tiny", ["train.fp8=tensorwise", "parallel.tp=2"])
    with pytest.raises(ConfigError, match=r"model.d_ff to be a multiple of 16 .* got 520"):
        load_config("tiny", ["train.fp8=tensorwise", "model.d_ff=520"])
    with pytest.raises(ConfigError, match=r"model.d_model to be a multiple of 16 .* got 120"):
        load_config("tiny", ["train.fp8=rowwise", "model.d_model=120", "model.n_head=4"])
    load_config("tiny", ["model.d_ff=520"])  # without float8, any width


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_a_float8_run_on_the_cpu_is_refused_in_one_line_before_anything_is_written(tmp_path, capsys):
    from distlm.cli import main
    rc = main(["train", "--config", "tiny", "data.source=synthetic", "model.vocab_size=256", "train.fp8=tensorwise",
               f"log.root={tmp_path}", "log.name=r", "log.progress=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "train.fp8=tensorwise needs a CUDA GPU" in err[0] and "use train.fp8=off" in err[0]
    assert not (tmp_path / "r").exists()


# ---- on a GPU with float8 tensor cores ----------------------------------------------------------------

def float8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.parametrize("cls", RECIPES)
@pytest.mark.gpu
@pytest.mark.skipif(not float8_gpu(), reason="needs a CUDA GPU of capability 8.9+")
def test_cuda_scaled_mm_forward_and_backward(cls):
    """torch._scaled_mm against the emulation (the same rounded operands: what differs is the
    accumulation, within 1e-2) and against bf16 matmuls (within the float8 tolerances above),
    at a gpt2-1.5b MLP's shape."""
    x, w, g = operands("cuda", M=2048, K=1600, N=6400)
    real = layer_grads(cls(), x, w, g)
    emulated = layer_grads(cls(emulate=True), x, w, g)
    for a, b in zip(real, emulated):
        assert torch.isfinite(a).all() and rel(a, b) < 1e-2
    out, gx, gw = real
    assert rel(out, x @ w.to(torch.bfloat16).t()) < FORWARD_TOL
    assert rel(gx, g @ w.to(torch.bfloat16)) < BACKWARD_TOL
    assert rel(gw, g.t() @ x) < BACKWARD_TOL


@pytest.mark.gpu
@pytest.mark.skipif(not float8_gpu(), reason="needs a CUDA GPU of capability 8.9+")
def test_training_in_float8_follows_bf16(tmp_path, tiny_data):
    """60 steps on real text (the tiny preset memorises the small corpus: its loss goes from 10.9
    to about 0.25), bf16 eager, tensorwise compiled as a whole model, rowwise eager: the float8 runs'
    loss curves within LOSS_TOL of bf16's at every logged step. Then the tensorwise run's
    checkpoint resumes in bf16 for 10 more steps."""
    from distlm.train.trainer import Trainer
    base = ["train.max_steps=60", "train.eval_every=0", "train.eval_batches=2", "train.checkpoint_every=60",
            "log.progress=false", "log.tensorboard=false", "log.samples=0", f"log.root={tmp_path}",
            f"data.dir={tiny_data}", "log.every=3", "model.block_size=64"]
    curves = {}
    # one compiled run (compiling is most of this test's time; 3 passed in 99.8 s on an H200 with two)
    for mode, compiled in (("off", False), ("tensorwise", True), ("rowwise", False)):
        t = Trainer(load_config("tiny", base + [f"train.fp8={mode}", f"log.name={mode}",
                                                f"train.compile={str(compiled).lower()}"]))
        assert t.train()["step"] == 60
        assert sum(isinstance(m, Float8Linear) for m in t.module.modules()) == (0 if mode == "off" else 4 * 6)
        curves[mode] = logged_losses(tmp_path / mode)
    assert curves["off"][-1] < 1.0, curves["off"]  # it learned
    for mode in ("tensorwise", "rowwise"):
        gaps = [abs(a - b) for a, b in zip(curves[mode], curves["off"])]
        assert len(gaps) == len(curves["off"]), (mode, curves)
        assert max(gaps) < LOSS_TOL, (mode, curves)
    t = Trainer(load_config("tiny", base + ["train.fp8=off", "log.name=tensorwise", "train.resume=auto",
                                            "train.compile=false", "train.max_steps=70"]))
    assert t.step == 60 and t.train()["step"] == 70


def logged_losses(run) -> list[float]:
    import csv
    with open(run / "metrics.csv", newline="") as f:
        return [float(r["loss"]) for r in csv.DictReader(f) if r.get("loss")]
