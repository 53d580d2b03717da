"""Where the optimizer step of a preset goes, part by part, on one device; and the step of
another copy of distlm's code beside this one's.

    python benchmarks/tools/optimizer_parts.py [--config speedrun-124m] [--repeats 20] [--json FILE] [KEY=VALUE ...]
    python benchmarks/tools/optimizer_parts.py --before DIR [--rounds 3] [--bench-rounds 1] [--out DIR] [KEY=VALUE ...]

Parts (the first form): builds the preset's model and optimizer (as the Trainer does, one
process), gives every parameter a random gradient, and times with device events: the whole
``optimizer.step()``; the AdamW groups alone; then, for each Newton-Schulz bucket of the Muon
groups (the stacked momenta of one shape), Newton-Schulz in its unfolded form
(``newton_schulz``), its folded form (``newton_schulz_folded``: each step's two element-wise
updates inside the matmuls, ``baddbmm``'s beta/alpha, one rounding instead of three; what CUDA
runs) and the folded form under torch.compile. Each form's largest deviation from the unfolded
result is printed beside its time, and its singular values' range, which Muon needs inside
NS_BAND.

Before and after (``--before DIR``, DIR holding another copy of the ``distlm`` package, e.g.
``mkdir OLD && git archive main distlm | tar -x -C OLD``): each code in its own processes, in
turns: ``--rounds`` times ``optimizer.step()`` of the preset (median ms of ``--repeats``), then
``--bench-rounds`` times ``distlm bench --config PRESET data.source=synthetic train.on_nan=off``
(tok/s, step and optimizer phase). Prints ms per optimizer step and whole-step tok/s, old
against new; logs and JSON go to ``--out``.

On a CPU the parts run with the small overrides given (e.g. model.n_layer=2 model.d_model=64
model.n_head=2 model.d_ff=128 model.vocab_size=256 model.value_embeds=1); ``--before`` with
``--cpu`` adds such a model and train.device=cpu. Either checks only the plumbing there.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # timing.py beside it; PYTHONSAFEPATH keeps it off
from timing import median_seconds  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# --cpu: a model a 2-core box steps through in well under a second, compiled nowhere.
TINY = ["model.n_layer=2", "model.d_model=64", "model.n_head=2", "model.d_ff=128", "model.vocab_size=256",
        "model.value_embeds=1", "model.block_size=32", "model.loss_chunk=0", "train.device=cpu",
        "train.compile=false", "train.global_batch_size=4", "train.micro_batch_size=2"]
# PYTHONSAFEPATH: `python -m distlm` would put the current folder ahead of PYTHONPATH, and the
# --before run would import this checkout's distlm.
ENV = {"PYTHONUNBUFFERED": "1", "PYTHONSAFEPATH": "1"}


def use_code(code: Path) -> None:
    """Import distlm from ``code`` (this checkout unless --code names another copy)."""
    sys.path.insert(0, str(code))


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of fn() over repeats, after two warm-up calls."""
    return median_seconds(fn, device, repeats, warmup=2)


def singular_range(x: torch.Tensor) -> tuple[float, float]:
    s = torch.linalg.svdvals(x.float())
    return float(s.min()), float(s.max())


def ns_folded(g: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The folded Newton-Schulz that the imported distlm runs on CUDA (distlm/optim/muon.py)."""
    from distlm.optim.muon import newton_schulz_folded
    return newton_schulz_folded(g, *args, **kwargs)


def build(config: str, overrides: list[str], device: torch.device):
    """The preset's model and optimizer as one process builds them, every parameter with a
    random gradient and every group's lr tiny (the weights barely move over the repeats)."""
    from distlm.config import load_config, updated
    from distlm.model.gpt import GPT
    from distlm.train.optim import build_optimizer
    ns_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = load_config(config, [*overrides, f"optim.muon.ns_dtype={'bf16' if ns_dtype is torch.bfloat16 else 'fp32'}"])
    if cfg.model.vocab_size is None:
        cfg = updated(cfg, model={"vocab_size": 50257})
    if cfg.optim.name != "muon":
        print(f"error: {config} trains with optim.name={cfg.optim.name}, not muon", file=sys.stderr)
        raise SystemExit(2)
    torch.manual_seed(0)
    model = GPT(cfg.model).to(device)
    opt = build_optimizer(model, cfg, device.type)
    for prm in model.parameters():
        prm.grad = torch.randn_like(prm) * 1e-3
    for g in opt.param_groups:
        g["lr"] = 1e-12
    return opt, ns_dtype


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name() if device.type == "cuda" else "cpu"


def step_only(args, device: torch.device) -> int:
    """One figure for the before/after comparison: median seconds of optimizer.step()."""
    import distlm
    opt, _ = build(args.config, args.overrides, device)
    print(json.dumps({"step_s": timed(opt.step, device, args.repeats), "distlm": distlm.__file__,
                      "device": device_name(device)}))
    return 0


def parts(args, device: torch.device) -> int:
    from distlm.optim.muon import NS_BAND, newton_schulz, newton_schulz_folded
    opt, ns_dtype = build(args.config, args.overrides, device)
    out = {"device": device_name(device), "torch": torch.__version__, "config": args.config,
           "overrides": args.overrides}
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
    forms = (("unfolded", newton_schulz), ("folded", newton_schulz_folded),
             ("folded_compiled", torch.compile(newton_schulz_folded)))
    out["buckets"] = []
    for (shape, split, steps), params in buckets.items():
        stack = torch.stack([prm.grad for prm in params])
        stack = stack.reshape(len(params) * split, shape[0] // split, shape[1])
        ref = newton_schulz(stack, steps, ns_dtype)
        row = {"shape": list(shape), "split": split, "matrices": len(params)}
        for name, fn in forms:
            got = fn(stack, steps, ns_dtype)
            row[name] = {"s": timed(lambda: fn(stack, steps, ns_dtype), device, args.repeats),
                         "max_abs_diff": float((got.float() - ref.float()).abs().max()),
                         "singular_range": singular_range(got[0])}
        out["buckets"].append(row)
    print(f"{out['device']}, torch {out['torch']}, {args.config}: optimizer.step {1e3 * out['step_s']:.2f} ms; "
          f"AdamW groups ({out['adamw_params'] / 1e6:.1f}M params) {1e3 * out['adamw_s']:.2f} ms; NS band {NS_BAND}")
    for row in out["buckets"]:
        text = ", ".join(f"{k} {1e3 * row[k]['s']:.2f} ms (max diff {row[k]['max_abs_diff']:.1e}, "
                         f"s in [{row[k]['singular_range'][0]:.2f}, {row[k]['singular_range'][1]:.2f}])"
                         for k, _ in forms)
        print(f"  {row['matrices']} x {tuple(row['shape'])} split {row['split']}: {text}")
    if args.json:
        write_json(args.json, out)
    return 0


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


def run(cmd: list[str], code: Path, log: Path, timeout: int, env: dict) -> tuple[int, str]:
    """``cmd`` with ``code``'s distlm first on the path; its output to ``log``."""
    full_env = {**os.environ, **ENV, **env, "PYTHONPATH": str(code)}
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        f.write(" ".join(cmd) + f"\n# PYTHONPATH={code}\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=full_env, stdout=f, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, log.read_text()


def median(xs: list[float]):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def measure_steps(args, codes: dict, overrides: list[str], out: Path, env: dict, failed: list) -> dict:
    """optimizer.step() of each code, each measurement its own process, the codes in turns."""
    steps: dict = {name: [] for name in codes}
    for r in range(args.rounds):
        for name, code in codes.items():
            cmd = [args.python, str(Path(__file__).resolve()), "--step-only", "--code", str(code),
                   "--config", args.config, "--repeats", str(args.repeats), *overrides]
            log = out / f"step-{name}-{r}.log"
            rc, text = run(cmd, code, log, args.timeout, env)
            line = text.strip().splitlines()[-1] if text.strip() else ""
            if rc != 0 or not line.startswith("{"):
                failed.append(f"step-{name}-{r}: rc {rc}, {log}")
                continue
            steps[name].append(json.loads(line))
            print(f"round {r} {name}: optimizer.step {1e3 * steps[name][-1]['step_s']:.2f} ms", flush=True)
    return steps


def measure_benches(args, codes: dict, overrides: list[str], out: Path, env: dict, failed: list) -> dict:
    """One `distlm bench` per code and round, the codes in turns."""
    benches: dict = {k: [] for k in codes}
    for r in range(args.bench_rounds):
        for name, code in codes.items():
            js, log = out / f"bench-{name}-{r}.json", out / f"bench-{name}-{r}.log"
            js.unlink(missing_ok=True)
            cmd = [args.python, "-m", "distlm", "bench", "--config", args.config, "data.source=synthetic",
                   "train.on_nan=off", *overrides, "--warmup", str(args.bench_warmup), "--steps",
                   str(args.bench_steps), "--json", str(js)]
            t0 = time.perf_counter()
            rc, _ = run(cmd, code, log, args.timeout, env)
            if rc != 0 or not js.is_file():
                failed.append(f"bench-{name}-{r}: rc {rc}, {log}")
                continue
            b = json.loads(js.read_text())
            benches[name].append(b)
            print(f"bench {r} {name}: {b['tokens_per_s']:,.0f} tok/s, step {1e3 * b['step_s']:.1f} ms, optimizer "
                  f"phase {1e3 * b['phases_s'].get('optimizer', 0):.1f} ms ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    return benches


def summarise(steps: list[dict], benches: list[dict]) -> dict:
    def ms(x):
        return None if x is None else 1e3 * x
    return {"optimizer_step_ms": ms(median([x["step_s"] for x in steps])),
            "bench_tokens_per_s": median([b["tokens_per_s"] for b in benches]),
            "bench_mfu": median([b["mfu"] for b in benches if b.get("mfu") is not None]),
            "bench_step_ms": ms(median([b["step_s"] for b in benches])),
            "bench_optimizer_phase_ms": ms(median([b["phases_s"].get("optimizer", 0.0) for b in benches])),
            "device": (steps or benches or [{}])[0].get("device")}


def compare(args) -> int:
    """The old code (--before) and this checkout's, each in its own processes, in turns."""
    before = Path(args.before).resolve()
    if not (before / "distlm" / "__init__.py").is_file():
        print(f"error: --before {before}: no distlm/__init__.py there", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    overrides = (TINY if args.cpu else []) + args.overrides
    codes = {"old": before, "new": ROOT}
    failed: list = []
    # One compile cache for the run, outside OUT (it would be fetched back with the results).
    with tempfile.TemporaryDirectory(prefix="optimizer-parts-inductor-") as cache:
        env = {"TORCHINDUCTOR_CACHE_DIR": cache}
        steps = measure_steps(args, codes, overrides, out, env, failed)
        benches = measure_benches(args, codes, overrides, out, env, failed)
    summary = {name: summarise(steps[name], benches.get(name, [])) for name in steps}
    write_json(out / "optimizer-parts.json", {"config": args.config, "overrides": overrides, "torch": torch.__version__,
                                              "codes": {k: str(v) for k, v in codes.items()}, "steps": steps,
                                              "benches": benches, "summary": summary, "failed": failed})

    def cell(x, fmt):
        return "-" if x is None else format(x, fmt)
    print(f"\n{args.config} on {summary['new']['device']}, torch {torch.__version__}: medians of {args.rounds} "
          f"optimizer measurements ({args.repeats} steps each) and {args.bench_rounds} bench run(s) per code")
    print("| code | optimizer.step ms | tok/s | MFU | step ms | optimizer phase ms |")
    print("|---|---|---|---|---|---|")
    for name in summary:
        s = summary[name]
        mfu = None if s["bench_mfu"] is None else 100 * s["bench_mfu"]
        print(f"| {name} ({codes.get(name, codes['new'])}) | {cell(s['optimizer_step_ms'], '.2f')} | "
              f"{cell(s['bench_tokens_per_s'], ',.0f')} | {cell(mfu, '.1f')} | {cell(s['bench_step_ms'], '.1f')} | "
              f"{cell(s['bench_optimizer_phase_ms'], '.1f')} |")
    old, new = summary["old"], summary["new"]
    if old["optimizer_step_ms"] and new["optimizer_step_ms"]:
        print(f"optimizer.step: {new['optimizer_step_ms'] - old['optimizer_step_ms']:+.2f} ms, "
              f"{new['optimizer_step_ms'] / old['optimizer_step_ms']:.3f}x of old")
    if old["bench_tokens_per_s"] and new["bench_tokens_per_s"]:
        print(f"whole step: {new['bench_tokens_per_s'] / old['bench_tokens_per_s']:.3f}x old tok/s")
    for f in failed:
        print(f"FAILED {f}", file=sys.stderr)
    print(f"wrote {out / 'optimizer-parts.json'}")
    return 1 if failed else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="speedrun-124m")
    p.add_argument("--repeats", type=int, default=20, help="optimizer steps timed per measurement")
    p.add_argument("--json", type=Path, help="parts: write the figures here")
    p.add_argument("--before", metavar="DIR", help="compare with the distlm package in DIR (see above)")
    p.add_argument("--rounds", type=int, default=3, help="--before: optimizer.step measurements per code")
    p.add_argument("--bench-rounds", type=int, default=1, help="--before: distlm bench runs per code")
    p.add_argument("--bench-warmup", type=int, default=5)
    p.add_argument("--bench-steps", type=int, default=20)
    p.add_argument("--out", default="bench-out/optimizer-parts", help="--before: folder for the logs and JSON")
    p.add_argument("--timeout", type=int, default=600, help="--before: seconds per process")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--cpu", action="store_true", help="--before: a tiny model on the CPU, the plumbing only")
    p.add_argument("--step-only", action="store_true", help=argparse.SUPPRESS)  # one code's step, own process
    p.add_argument("--code", type=Path, default=ROOT, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = p.parse_args(argv)
    if args.before:
        if args.cpu:
            args.rounds, args.repeats = min(args.rounds, 2), min(args.repeats, 3)
            args.bench_warmup, args.bench_steps = min(args.bench_warmup, 1), min(args.bench_steps, 2)
        return compare(args)
    use_code(args.code)
    on_cpu = "train.device=cpu" in args.overrides or not torch.cuda.is_available()
    device = torch.device("cpu" if on_cpu else "cuda")
    return step_only(args, device) if args.step_only else parts(args, device)


if __name__ == "__main__":
    sys.exit(main())
