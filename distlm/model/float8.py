"""Float8 training: the blocks' linear layers multiply in float8 on torch._scaled_mm.

``train.fp8=tensorwise|rowwise`` swaps every ``nn.Linear`` inside ``model.blocks`` for a
``Float8Linear`` (``apply_float8``); the embeddings, the head and the norms stay as they are.
A Float8Linear holds the same parameter tensors in the same dtype under the same names, so
checkpoints do not change: a float8 run resumes in bf16 and back. Only the matmul changes:

    forward       out    = x  @ W^T   x, W in e4m3 (3 mantissa bits, range +-448)
    backward      grad_x = g  @ W     g in e5m2 (2 mantissa bits, range +-57344), W in e4m3
                  grad_W = g^T @ x    g in e5m2, x in e4m3

Gradients take e5m2 for its range: they span more binades than weights and activations.

Scaling is dynamic, from each operand's absolute maximum at the moment of the matmul:
``tensorwise`` one scale per operand; ``rowwise`` one per row of the left operand and one per
column of the right one (each along the contraction dim), which follows outliers more closely
at the price of a slower kernel. Scales are rounded down to powers of two, so scaling is exact
and only the cast to float8 rounds.

torch._scaled_mm wants the left operand row-major and the right one column-major, both
dimensions of the right one and the contraction dim multiples of 16, float32 scales of shape
() (tensorwise) or (M, 1) and (1, N) (rowwise), and, for rowwise, the right operand in e4m3
(hence the gradient is always the left operand). The layer falls back to the plain matmul when
the token count is not a multiple of 16 (a decoding step); config validation refuses model
widths that are not (distlm/config.py).

Under FSDP2 the parameters are all-gathered in their own dtype (bf16 with mixed precision) and
cast to float8 inside the matmul: the all-gather itself does not travel in float8, which would
need a float8 tensor subclass for the sharded parameters.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from distlm.config import ConfigError

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
# Ada (8.9), Hopper (9.0) and later have float8 tensor cores; torch._scaled_mm refuses older cards.
MIN_CAPABILITY = (8, 9)
# torch._scaled_mm's alignment: the contraction dim and both dims of the right operand.
ALIGN = 16
# An all-zero operand would give an infinite scale; any positive floor keeps it finite, and
# zeros cast to zero whatever the scale.
AMAX_FLOOR = 1e-12


@dataclass(frozen=True)
class Float8Recipe:
    """How a linear layer's three matmuls get their float8 operands: the scaling (``amax``) and
    what is kept from the forward for the backward. ``emulate``: each matmul in fp32 on the
    dequantised operands instead of torch._scaled_mm (the same rounded inputs; for CPUs and for
    checking the kernel against it)."""
    name = ""
    emulate: bool = False
    # The gradients' matmuls with the float8 tensor cores' fast (lower-precision) accumulation, as
    # the forward's: off in training, as is usual; benchmarks/tools/float8_layer.py measures both.
    fast_accum_grads: bool = False

    def amax(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        raise NotImplementedError

    def quantize(self, t: torch.Tensor, dtype: torch.dtype, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``t`` in float8 ``dtype``, and the inverse scale that torch._scaled_mm multiplies back
        (``dim`` is the contraction dim: rowwise scales vary along the other one)."""
        scale = power_of_two_scale(self.amax(t, dim), dtype)
        return to_float8(t, scale, dtype), scale.reciprocal()

    def mm(self, a8: torch.Tensor, b8: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
           fast_accum: bool = False) -> torch.Tensor:
        """a8 (M, K) @ b8 (K, N) in float8, with inverse scales sa and sb; bf16 out."""
        if self.emulate:
            return ((a8.float() * sa) @ (b8.float() * sb)).to(torch.bfloat16)
        # Row-major left, column-major right: a copy only where the operand is laid out otherwise
        # (the weight in the input gradient, the activations in the weight gradient).
        a8, b8 = a8.contiguous(), b8.t().contiguous().t()
        return torch._scaled_mm(a8, b8, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast_accum)

    def matmul(self, a: torch.Tensor, b: torch.Tensor, a_dtype: torch.dtype, b_dtype: torch.dtype,
               fast_accum: bool = False) -> torch.Tensor:
        """a (M, K) @ b (K, N), each operand cast to float8 with its own scales; bf16 out."""
        a8, sa = self.quantize(a, a_dtype, dim=1)
        b8, sb = self.quantize(b, b_dtype, dim=0)
        return self.mm(a8, b8, sa, sb, fast_accum)

    def forward(self, ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x (M, K) @ w^T for w (N, K): the layer's forward, saving on ``ctx`` what backward needs."""
        raise NotImplementedError

    def backward(self, ctx, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        raise NotImplementedError


@dataclass(frozen=True)
class TensorwiseRecipe(Float8Recipe):
    """One scale per operand. The float8 activations and both scales are kept from the forward
    (half the bytes of the bf16 activations a plain linear keeps) and the output gradient is cast
    once for both of its matmuls; the weight is kept as it came and cast again with its saved
    scale, since a float8 copy of every unsharded weight would outlive FSDP2's resharding.
    That is eager. Compiled, AOTAutograd's partitioner decides what is kept: for a GPT-2 block
    on the CPU it kept the bf16 inputs and the scales, and casts again in the backward."""
    name = "tensorwise"

    def amax(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.abs().amax().float()

    def forward(self, ctx, x, w):
        x8, sx = self.quantize(x, E4M3, dim=1)
        w8, sw = self.quantize(w, E4M3, dim=1)
        ctx.save_for_backward(x8, sx, w, sw)
        ctx.dtypes = x.dtype, w.dtype
        # Fast accumulation in the forward only, as is usual: gradients keep the full-precision sum.
        return self.mm(x8, w8.t(), sx, sw, fast_accum=True)

    def backward(self, ctx, grad):
        xs, sx, w, sw = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        g8, sg = self.quantize(grad, E5M2, dim=1)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = self.mm(g8, to_float8(w, sw.reciprocal(), E4M3), sg, sw, self.fast_accum_grads).to(x_dtype)
        if ctx.needs_input_grad[1]:
            grad_w = self.mm(g8.t(), xs, sg, sx, self.fast_accum_grads).to(w_dtype)
        return grad_x, grad_w


@dataclass(frozen=True)
class RowwiseRecipe(Float8Recipe):
    """One scale per row of the left operand and per column of the right one, each along the
    contraction dim. The backward contracts along other dims than the forward, so its operands
    are cast again from the originals, which are what is kept."""
    name = "rowwise"

    def amax(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """One absolute maximum per row (dim=1) or per column (dim=0), kept as a (M, 1) or (1, N) column."""
        return t.abs().amax(dim=dim, keepdim=True).float()

    def forward(self, ctx, x, w):
        ctx.save_for_backward(x, w)
        return self.matmul(x, w.t(), E4M3, E4M3, fast_accum=True)

    def backward(self, ctx, grad):
        x, w = ctx.saved_tensors
        grad_x = grad_w = None
        # The gradient is always the left operand: the rowwise kernel takes e4m3 only on the right.
        if ctx.needs_input_grad[0]:
            grad_x = self.matmul(grad, w, E5M2, E4M3, self.fast_accum_grads).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = self.matmul(grad.t(), x, E5M2, E4M3, self.fast_accum_grads).to(w.dtype)
        return grad_x, grad_w


RECIPES: dict[str, Optional[type[Float8Recipe]]] = {"off": None, "tensorwise": TensorwiseRecipe,
                                                    "rowwise": RowwiseRecipe}


def power_of_two_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The largest power of two that keeps ``amax`` within ``dtype``'s finite range (float32).
    A power of two makes multiplying by it exact, so the cast is the only rounding; it costs at
    most one binade of headroom."""
    top = torch.finfo(dtype).max
    return torch.exp2(torch.floor(torch.log2(top / amax.clamp(min=AMAX_FLOOR))))


def to_float8(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t * scale`` cast to ``dtype``, saturated: a plain cast past the top gives e5m2's infinity
    (and e4m3fn's NaN where the conversion does not saturate), and the rounding of the scaled
    largest element can land just past it."""
    top = torch.finfo(dtype).max
    return (t.float() * scale).clamp(-top, top).to(dtype)


class _Float8Matmul(torch.autograd.Function):
    """x (M, K) @ w^T for w (N, K), the three matmuls of a linear layer each in float8, as the
    recipe does them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, recipe: Float8Recipe) -> torch.Tensor:
        ctx.recipe = recipe
        return recipe.forward(ctx, x, w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (*ctx.recipe.backward(ctx, grad), None)


def float8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  recipe: Float8Recipe) -> torch.Tensor:
    """F.linear with the matmul in float8. Under autocast the input is cast to autocast's dtype
    first, as F.linear's would be, and the output is in that dtype; else in the input's."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        x = x.to(torch.get_autocast_dtype(device))
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] % ALIGN:
        # A decoding step or another short input: torch._scaled_mm's weight gradient contracts
        # over the tokens, which must be a multiple of 16; the plain matmul serves these.
        return F.linear(x, weight, bias)
    out = _Float8Matmul.apply(x2, weight, recipe).to(x.dtype)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


class Float8Linear(nn.Linear):
    """nn.Linear whose matmul runs in float8 (``float8_linear``); same parameters, same names."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, recipe: Float8Recipe = TensorwiseRecipe(),
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe = recipe

    @classmethod
    def taking_over(cls, linear: nn.Linear, recipe: Float8Recipe) -> "Float8Linear":
        """A Float8Linear holding ``linear``'s own parameter tensors (not copies)."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False, recipe=recipe)
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This layer's matmul on other weights: the attention's fused q/k/v product concatenates
        the three layers' weights (distlm/model/gpt.py)."""
        return float8_linear(x, weight, bias, self.recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return float8_linear(x, self.weight, self.bias, self.recipe)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, float8={self.recipe.name}"


def apply_float8(model: nn.Module, mode: str, emulate: bool = False) -> int:
    """Swap every nn.Linear inside ``model.blocks`` for a Float8Linear (train.fp8=``mode``; "off"
    leaves the model as it is). Applied to the plain model, before any parallel wrapper, on the
    meta device or not. Returns the number of layers swapped."""
    cls = RECIPES[mode]
    if cls is None:
        return 0
    recipe = cls(emulate=emulate)
    swapped = 0
    for block in model.blocks.values():
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:  # exactly: a subclass may compute something else
                    setattr(parent, name, Float8Linear.taking_over(child, recipe))
                    swapped += 1
    return swapped


def check_float8_device(mode: str, device_type: str, capability: Optional[tuple[int, int]] = None) -> None:
    """Refuse train.fp8 where the matmuls cannot run in float8 fast: a CPU, or a GPU older than
    capability 8.9. torch 2.13 has a CPU torch._scaled_mm, but no fast one: on a loaded 2-core
    CPU a training step of a 4-block, 128-wide model took 424 s
    with it, against 8-12 s in bf16 and 14-19 s with the emulation. The tests use both."""
    if mode == "off":
        return
    if device_type != "cuda":
        raise ConfigError(f"train.fp8={mode} needs a CUDA GPU with float8 tensor cores (capability "
                          f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+: Ada, Hopper or newer); this run is on "
                          f"{device_type}: use train.fp8=off")
    if capability is not None and tuple(capability) < MIN_CAPABILITY:
        raise ConfigError(f"train.fp8={mode} needs CUDA capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer "
                          f"(Ada, Hopper or newer); this GPU has {capability[0]}.{capability[1]}: use train.fp8=off")


def check_float8_on(mode: str, device: torch.device) -> None:
    """check_float8_device for the device a run trains on (its capability read from the card)."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" and mode != "off" else None
    check_float8_device(mode, device.type, capability)
