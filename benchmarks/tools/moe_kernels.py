"""The routed experts' MLP, forward and backward, in the three forms of distlm/model/moe.py.

    python benchmarks/tools/moe_kernels.py [--model speedrun-moe] [--micro 32] [--json FILE]
    python benchmarks/tools/moe_kernels.py --cpu     (tiny shapes, fp32, eager: plumbing only)

One MoE block's experts for a micro-batch of the preset (tokens x top_k routed copies, sorted by
expert), under bf16 autocast, each form eager and compiled:
  grouped   torch._grouped_mm over the group offsets (one kernel per matmul)
  bmm       every expert padded to the busiest one's count, torch.bmm (the model pads to its
            token count instead, a static shape: E/k x the useful FLOPs)
  loop      one matmul per expert, split by the counts read on the host
Loads: "even" (every expert the same count) and "skewed" (a Zipf-like draw: the first experts
take most copies). TFLOP/s counts the useful FLOPs only (6 x copies x d x f per matmul, forward
and backward), so a padded form's wasted work shows as a lower rate. CUDA-event medians over
--iters calls after a warm-up.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # timing.py beside it; PYTHONSAFEPATH keeps it off
from timing import median_seconds  # noqa: E402
from distlm.config import load_config  # noqa: E402
from distlm.model.moe import KERNELS, expert_mlp, expert_width  # noqa: E402


def expert_ids(copies: int, experts: int, load: str, device) -> torch.Tensor:
    if load == "even":
        ids = torch.arange(copies, device=device) % experts
    else:
        weights = 1.0 / torch.arange(1, experts + 1, dtype=torch.float32)
        ids = torch.multinomial(weights, copies, replacement=True, generator=torch.Generator().manual_seed(0))
    return torch.sort(ids.to(device)).values


def measure(m, micro: int, device, load: str, kernel: str, compiled: bool, iters: int) -> dict:
    E, k, d, f = m.moe.experts, m.moe.top_k, m.d_model, expert_width(m)
    copies = micro * m.block_size * k
    ids = expert_ids(copies, E, load, device)
    counts = torch.bincount(ids, minlength=E)
    gated = m.mlp == "swiglu"
    ws = [torch.randn(E, d, f, device=device, requires_grad=True) for _ in range(2 if gated else 1)]
    ws.append(torch.randn(E, f, d, device=device, requires_grad=True))
    xs = torch.randn(copies, d, device=device, requires_grad=True)
    amp = torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda")

    capacity = int(counts.max())  # bmm padded to the busiest expert (the model pads to its token count)

    def body(xs, w_in, w_gate, w_out, ids, counts):
        return expert_mlp(xs, ids, counts, w_in, w_gate, w_out, m.mlp, kernel, capacity)

    fn = torch.compile(body) if compiled else body
    w_in, w_out = ws[0], ws[-1]
    w_gate = ws[1] if gated else None

    def step():
        with amp:
            y = fn(xs, w_in, w_gate, w_out, ids, counts)
        y.float().square().mean().backward()

    try:
        seconds = median_seconds(step, device, iters, warmup=3)
    except (RuntimeError, torch.OutOfMemoryError) as e:  # e.g. bmm's padded batch past memory
        return {"load": load, "kernel": kernel, "compiled": compiled, "error": str(e).splitlines()[0][:120]}
    flops = 6 * copies * d * f * (3 if gated else 2)
    return {"load": load, "kernel": kernel, "compiled": compiled, "ms": 1e3 * seconds,
            "tflops": flops / seconds / 1e12, "max_over_mean": float(counts.max() / counts.float().mean())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="speedrun-moe", help="preset whose MoE block is timed")
    p.add_argument("--micro", type=int, default=32, help="sequences per forward")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--kernels", default=",".join(KERNELS))
    p.add_argument("--no-compile", action="store_true", help="eager only")
    p.add_argument("--json", type=Path)
    p.add_argument("--cpu", action="store_true", help="tiny shapes, fp32, eager: checks the plumbing")
    args = p.parse_args(argv)
    m = load_config(args.model).model
    device = torch.device("cpu" if args.cpu else "cuda")
    if args.cpu:
        import dataclasses
        m = dataclasses.replace(m, d_model=64, block_size=32, moe=dataclasses.replace(m.moe, d_ff=32))
        args.micro, args.iters, args.no_compile = 2, 2, True
    print(f"{args.model}: {m.moe.experts} experts, top {m.moe.top_k}, d {m.d_model}, f {expert_width(m)}, "
          f"{args.micro} x {m.block_size} tokens, torch {torch.__version__}"
          + (f", {torch.cuda.get_device_name()}" if device.type == "cuda" else ""))
    rows = []
    print(f"{'load':<7} {'kernel':<8} {'mode':<9} {'ms':>9} {'TFLOP/s':>8}")
    for load in ("even", "skewed"):
        for kernel in args.kernels.split(","):
            for compiled in (False,) if args.no_compile else (False, True):
                r = measure(m, args.micro, device, load, kernel, compiled, args.iters)
                rows.append(r)
                mode = "compiled" if compiled else "eager"
                print(f"{load:<7} {kernel:<8} {mode:<9} " + (f"{r['ms']:>9.3f} {r['tflops']:>8.1f}" if "ms" in r
                                                            else f"failed: {r['error']}"), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "micro": args.micro, "torch": torch.__version__,
                                         "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
