"""One linear layer, forward and backward, in bf16 and in float8: where a float8 step's time goes.

    python benchmarks/tools/float8_layer.py [--model gpt2-1.5b] [--micro 16] [--json FILE]
    python benchmarks/tools/float8_layer.py --cpu     (tiny shapes, emulated float8, eager: plumbing only)

For each of the model's block matmul shapes (tokens M = micro-batch x context; the fused q/k/v,
the attention output, the MLP's), compiled with torch.compile like a block:
  bf16         F.linear on bf16 operands, forward + backward
  tensorwise,  distlm's float8 layer (distlm/model/float8.py), forward + backward, casts included
  rowwise
  tensorwise, fast-accumulating gradients: the same with the backward's two matmuls in the
               tensor cores' fast accumulation too (training keeps it off)
  fp8 mm only  the three torch._scaled_mm calls on operands already in float8 and in the layouts
               the kernel wants: the floor the casts, scales and transposes add to
  torchao      torchao's float8 training layer (torchao.float8), tensorwise and rowwise, where torchao
               is installed: the same layer from a library, for comparison ("-" where it is not)
Times are CUDA-event medians over --iters calls after a warm-up. A float8 layer slower than
"fp8 mm only" by more than the matmuls' saving over bf16 loses to bf16; the table says by how much.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # timing.py beside it; PYTHONSAFEPATH keeps it off
from distlm.config import load_config  # noqa: E402
from timing import median_seconds  # noqa: E402
from distlm.model.float8 import E4M3, E5M2, RECIPES, float8_linear  # noqa: E402


def shapes(model: str, micro: int) -> list[tuple[str, int, int, int]]:
    """(name, M, K, N) of the block's matmuls, N the output width."""
    m = load_config(model).model
    M, d, f = micro * m.block_size, m.d_model, m.d_ff
    mlp_in = [("w_in", M, d, f)] + ([("w_gate", M, d, f)] if m.mlp == "swiglu" else [])
    return [("qkv", M, d, 3 * d), ("wo", M, d, d), *mlp_in, ("w_out", M, f, d)]


def layer_step(forward, x, w, g):
    def step():
        x.grad = w.grad = None
        forward(x, w).backward(g)
    return step


def torchao_layer(w: torch.Tensor, recipe: str):
    """torchao's float8 training linear holding a copy of ``w``, or None without torchao."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return None
    holder = torch.nn.Sequential(torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype))
    holder[0].weight = torch.nn.Parameter(w.detach().clone())
    convert_to_float8_training(holder, config=Float8LinearConfig.from_recipe_name(recipe))
    return holder


def module_step(module, x, g):
    def step():
        x.grad = None
        for p in module.parameters():
            p.grad = None
        module(x).backward(g)
    return step


def matmuls_only(M: int, K: int, N: int, device, emulate: bool):
    """The three float8 matmuls of a layer on ready operands (no cast, no scale, no transpose)."""
    one = torch.ones((), device=device)
    x8 = torch.randn(M, K, device=device).to(E4M3)
    w8t = torch.randn(N, K, device=device).to(E4M3).t()            # (K, N) column-major
    g8 = torch.randn(M, N, device=device).to(E5M2)
    w8 = torch.randn(K, N, device=device).to(E4M3).t()             # (N, K) column-major
    g8t = torch.randn(N, M, device=device).to(E5M2)                # (N, M) row-major
    x8c = torch.randn(K, M, device=device).to(E4M3).t()            # (M, K) column-major

    def mm(a, b, fast):
        if emulate:
            return (a.float() @ b.float()).to(torch.bfloat16)
        return torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16, use_fast_accum=fast)

    def step():
        mm(x8, w8t, True)
        mm(g8, w8, False)
        mm(g8t, x8c, False)
    return step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-1.5b", help="preset whose block shapes are timed")
    p.add_argument("--micro", type=int, default=16, help="micro-batch (sequences) per GPU")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", type=Path)
    p.add_argument("--cpu", action="store_true", help="tiny shapes, emulated float8, eager: checks the plumbing")
    args = p.parse_args(argv)
    cpu = args.cpu or not torch.cuda.is_available()
    if cpu and not args.cpu:
        print("error: no CUDA device; --cpu checks the plumbing on tiny shapes", file=sys.stderr)
        return 2
    device = torch.device("cpu" if cpu else "cuda")
    compile_ = (lambda f: f) if cpu else (lambda f: torch.compile(f, dynamic=False))
    todo = [("tiny", 64, 32, 48)] if cpu else shapes(args.model, args.micro)
    iters = 2 if cpu else args.iters
    rows = []
    for name, M, K, N in todo:
        # Every variant of every shape compiles float8_linear's frame again: past dynamo's
        # recompile limit (8) the later ones would silently run eager. A fresh dynamo per shape
        # keeps each variant compiled.
        torch._dynamo.reset()
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(M, K, generator=gen).to(device, torch.bfloat16).requires_grad_()
        w = (0.02 * torch.randn(N, K, generator=gen)).to(device, torch.bfloat16).requires_grad_()
        g = torch.randn(M, N, generator=gen).to(device, torch.bfloat16)
        variants = {"bf16": compile_(lambda x, w: F.linear(x, w))}
        for key, mode, fast in (("tensorwise", "tensorwise", False), ("rowwise", "rowwise", False),
                                ("tensorwise_fast_grads", "tensorwise", True)):
            recipe = RECIPES[mode](emulate=cpu, fast_accum_grads=fast)
            variants[key] = compile_(lambda x, w, recipe=recipe: float8_linear(x, w, None, recipe))
        row = {"layer": name, "M": M, "K": K, "N": N}
        for key, fwd in variants.items():
            step = layer_step(fwd, x, w, g)
            step()  # compiles
            row[key] = median_seconds(step, device, iters)
        for recipe in ("tensorwise", "rowwise"):
            layer = None if cpu else torchao_layer(w, recipe)
            if layer is None:
                row[f"torchao_{recipe}"] = None
                continue
            step = module_step(compile_(layer), x, g)
            step()
            row[f"torchao_{recipe}"] = median_seconds(step, device, iters)
        mm_step = matmuls_only(M, K, N, device, cpu)
        mm_step()
        row["fp8_mm_only"] = median_seconds(mm_step, device, iters)
        row["tflops_bf16"] = 6 * M * K * N / row["bf16"] / 1e12
        rows.append(row)
    print(f"{args.model if not cpu else 'tiny (CPU, emulated)'}, micro-batch {args.micro}, "
          f"{torch.cuda.get_device_name() if not cpu else 'CPU'}, torch {torch.__version__}; ms per forward + backward")
    keys = ("bf16", "tensorwise", "rowwise", "tensorwise_fast_grads", "fp8_mm_only", "torchao_tensorwise",
            "torchao_rowwise")
    print("| layer | M x K x N | bf16 | tensorwise | rowwise | tensorwise, fast-accumulating gradients "
          "| fp8 mm only | torchao tensorwise | torchao rowwise | tensorwise × bf16 | casts etc. (tensorwise) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    total = {"layer": "block", "M": "", "K": "", "N": "",
             **{k: None if any(r[k] is None for r in rows) else sum(r[k] for r in rows) for k in keys}}
    for r in [*rows, total]:
        shape = f"{r['M']} x {r['K']} x {r['N']}" if r["M"] else ""
        print(f"| {r['layer']} | {shape} | " + " | ".join("-" if r[k] is None else f"{1e3 * r[k]:.3f}" for k in keys)
              + f" | {r['bf16'] / r['tensorwise']:.2f} | {1e3 * (r['tensorwise'] - r['fp8_mm_only']):.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "micro": args.micro, "rows": rows,
                                         "total_s": {k: total[k] for k in keys}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
