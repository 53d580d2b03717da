"""Where the optimizer step of a preset goes, part by part, on one device.

    python benchmarks/tools/optimizer_parts.py [--config speedrun-124m] [--repeats 20] [--json FILE] [KEY=VALUE ...]

Builds the preset's model and optimizer (as the Trainer does, one process), gives every
parameter a random gradient, and times with device events: the whole ``optimizer.step()``;
the AdamW groups alone; then, for each Newton-Schulz bucket of the Muon groups (the stacked
momenta of one shape), Newton-Schulz as distlm runs it and two candidates that leave the
polynomial as it is: each step's two element-wise updates folded into the matmuls
(``baddbmm``: the b*G + c*G@G and a*X + P@X sums done in the matmul's epilogue, one rounding
instead of three) and the same function under torch.compile. Each candidate's largest
deviation from the current result is printed beside its time, and its singular values'
range, which Muon needs inside NS_BAND.

The figures steer the optimizer's rework; nothing here changes training. On a CPU it runs with
the small overrides given (e.g. model.n_layer=2 model.d_model=64 model.n_head=2 model.d_ff=128
model.vocab_size=256 model.value_embeds=1) and checks only the plumbing.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from distlm.config import load_config, updated  # noqa: E402
from distlm.model.gpt import GPT  # noqa: E402
from distlm.optim.muon import NS_BAND, NS_COEFFS, newton_schulz  # noqa: E402
from distlm.train.optim import build_optimizer  # noqa: E402


def ns_folded(g: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16, coeffs=NS_COEFFS,
              eps: float = 1e-7) -> torch.Tensor:
    """newton_schulz with each step's sums inside the matmuls (baddbmm's beta/alpha)."""
    a, b, c = coeffs
    tall = g.size(-2) > g.size(-1)
    x = g.mT if tall else g
    x = (x / (torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True) + eps)).to(dtype)
    for _ in range(steps):
        gram = x @ x.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x.mT if tall else x


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of fn() over repeats, after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def singular_range(x: torch.Tensor) -> tuple[float, float]:
    s = torch.linalg.svdvals(x.float())
    return float(s.min()), float(s.max())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="speedrun-124m")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", type=Path)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = load_config(args.config, args.overrides)
    if cfg.model.vocab_size is None:
        cfg = updated(cfg, model={"vocab_size": 50257})
    if cfg.optim.name != "muon":
        print(f"error: {args.config} trains with optim.name={cfg.optim.name}, not muon", file=sys.stderr)
        return 2
    ns_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = GPT(cfg.model).to(device)
    opt = build_optimizer(model, cfg, device.type, ns_dtype=ns_dtype)
    for prm in model.parameters():
        prm.grad = torch.randn_like(prm) * 1e-3
    for g in opt.param_groups:
        g["lr"] = 1e-12  # the weights barely move over the repeats
    out = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "config": args.config, "overrides": args.overrides}
    out["step_s"] = timed(opt.step, device, args.repeats)
    adamw = [g for g in opt.param_groups if g["kind"] == "adamw"]
    out["adamw_params"] = sum(prm.numel() for g in adamw for prm in g["params"])

    @torch.no_grad()
    def adamw_only():
        for g in adamw:
            opt._adamw_step(g)
    out["adamw_s"] = timed(adamw_only, device, args.repeats)
    buckets: dict = {}
    for g in opt.param_groups:
        if g["kind"] == "muon":
            for prm in g["params"]:
                buckets.setdefault((tuple(prm.shape), g["split"], g["ns_steps"]), []).append(prm)
    compiled = torch.compile(ns_folded)
    out["buckets"] = []
    for (shape, split, steps), params in buckets.items():
        stack = torch.stack([prm.grad for prm in params])
        stack = stack.reshape(len(params) * split, shape[0] // split, shape[1])
        ref = newton_schulz(stack, steps, ns_dtype)
        row = {"shape": list(shape), "split": split, "matrices": len(params)}
        for name, fn in (("current", newton_schulz), ("baddbmm", ns_folded), ("baddbmm_compiled", compiled)):
            got = fn(stack, steps, ns_dtype)
            row[name] = {"s": timed(lambda: fn(stack, steps, ns_dtype), device, args.repeats),
                         "max_abs_diff": float((got.float() - ref.float()).abs().max()),
                         "singular_range": singular_range(got[0])}
        out["buckets"].append(row)
    print(f"{out['device']}, torch {out['torch']}, {args.config}: optimizer.step {1e3 * out['step_s']:.2f} ms; "
          f"AdamW groups ({out['adamw_params'] / 1e6:.1f}M params) {1e3 * out['adamw_s']:.2f} ms; NS band {NS_BAND}")
    for row in out["buckets"]:
        parts = ", ".join(f"{k} {1e3 * row[k]['s']:.2f} ms (max diff {row[k]['max_abs_diff']:.1e}, "
                          f"s in [{row[k]['singular_range'][0]:.2f}, {row[k]['singular_range'][1]:.2f}])"
                          for k in ("current", "baddbmm", "baddbmm_compiled"))
        print(f"  {row['matrices']} x {tuple(row['shape'])} split {row['split']}: {parts}")
    if args.json:
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
