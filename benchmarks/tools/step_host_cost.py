"""The host's side of a training step: what forward, backward and the optimizer's step cost the
CPU thread that issues them, with the arithmetic made negligible.

    python benchmarks/tools/step_host_cost.py [--config speedrun-124m] [--scopes eager,block,model]
                                              [--device cpu|cuda] [--reps 30] [--out FILE.md] [-- OVERRIDES]

A step waits for its host when the GPU finishes its kernels sooner than Python, the dispatcher and
the launches can issue them: `speedrun-124m` at 16 sequences a GPU, the share of each GPU on 2 and 4
GPUs, is such a step (docs/results/speed.md). This builds the preset at a narrow width (64 wide,
64 tokens, a 512-token vocabulary; the layer count and every option kept, so the same graphs and the
same kernels are issued, each on a few thousand numbers) and times each phase on the host clock:
the median over ``--reps`` steps after three that compile, every variant taking a step in turn so
that a drifting load touches each alike. On a GPU the phases are timed without waiting for the
device, whose queue these kernels never fill, so the figures are the host's: Python, the dispatcher,
the compiled graphs' wrappers and the launches.

For each compile scope (``eager``: nothing compiled; ``block``: each block, the head with the loss
and the regions between the blocks, train.compile_scope=block; ``model``: one graph) it gives
forward, backward and optimizer milliseconds. For ``block`` it also gives what each compiled region
between the blocks (GPT.compiled_regions) costs the host against the same code run eagerly: the
difference of the step with and without that region compiled, per call.

On the CPU the kernels run on the timing thread, so the figures include their (small) arithmetic
and differ in kind from a GPU host's: a compiled CPU kernel is a C++ function (run here on one
thread, since an OpenMP start at every call would swamp the rest), a compiled GPU kernel a Triton
launch. What a GPU host pays is measured with ``--device cuda`` on that host.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from distlm.config import load_config  # noqa: E402
from distlm.model.gpt import GPT  # noqa: E402
from distlm.parallel.parallelize import apply_compile  # noqa: E402
from distlm.train.optim import build_optimizer  # noqa: E402

NARROW = ["model.d_model=64", "model.n_head=2", "model.d_ff=128", "model.block_size=64", "model.vocab_size=512",
          "model.dropout=0.0"]
TOKENS = 64
WARMUP = 3  # the first steps compile


def build(config: str, overrides: list[str], scope: str, device: torch.device, eager_regions: tuple[str, ...] = ()):
    ns_dtype = "bf16" if device.type == "cuda" else "fp32"  # Muon's Newton-Schulz: tensor cores, or fp32
    cfg = load_config(config, NARROW + overrides + [f"optim.muon.ns_dtype={ns_dtype}"])
    torch.manual_seed(0)
    with device:
        model = GPT(cfg.model)
    if scope != "eager":
        apply_compile(model, scope)
    for name in eager_regions:  # back to the method of the class: that region runs eagerly
        model.__dict__.pop(name, None)
    return model, build_optimizer(model, cfg, device.type), cfg


class Variant:
    """One model and optimizer, stepped one step at a time, so that variants can take turns: on a
    small, shared machine the load drifts within seconds, and turns give each variant the same."""

    def __init__(self, model, optimizer, cfg, device: torch.device):
        self.model, self.optimizer, self.device = model, optimizer, device
        g = torch.Generator().manual_seed(0)
        vocab = cfg.model.vocab_size
        self.x = torch.randint(0, vocab, (1, TOKENS), generator=g).to(device)
        self.y = torch.randint(0, vocab, (1, TOKENS), generator=g).to(device)
        self.phases: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}

    def step(self, record: bool) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # each step starts with the device's queue empty
        t0 = time.perf_counter()
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.device.type == "cuda"):
            loss = self.model(self.x, targets=self.y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if record:
            for name, seconds in zip(self.phases, (t1 - t0, t2 - t1, t3 - t2)):
                self.phases[name].append(seconds)

    def medians(self) -> dict[str, float]:
        """Median host milliseconds of each phase, and their sum."""
        out = {name: 1e3 * statistics.median(values) for name, values in self.phases.items()}
        out["step"] = sum(out.values())
        return out


def region_calls(model: GPT, name: str) -> int:
    """How many times one forward calls region ``name``."""
    calls = 0
    original = getattr(model, name)

    def counting(*args, **kwargs):
        nonlocal calls
        calls += 1
        return original(*args, **kwargs)

    setattr(model, name, counting)
    try:
        with torch.no_grad():
            model(torch.zeros(1, TOKENS, dtype=torch.long, device=next(model.parameters()).device))
    finally:
        setattr(model, name, original)
    return calls


def report(config: str, overrides: list[str], scopes: list[str], device: torch.device, reps: int) -> str:
    variants: dict[tuple[str, str], Variant] = {}  # (scope, region run eagerly or "") -> variant
    for scope in scopes:
        variants[scope, ""] = Variant(*build(config, overrides, scope, device), device)
    regions = variants["block", ""].model.compiled_regions if "block" in scopes else ()
    for name in regions:
        variants["block", name] = Variant(*build(config, overrides, "block", device, eager_regions=(name,)), device)
    for variant in variants.values():  # the first steps compile, one variant after another
        for _ in range(WARMUP):
            variant.step(record=False)
    for _ in range(reps):  # then the variants take turns, a step each
        for variant in variants.values():
            variant.step(record=True)
    t = {key: variant.medians() for key, variant in variants.items()}
    lines = [f"# The host's side of a step: `{config}` at a narrow width ({', '.join(NARROW + overrides)}), "
             f"1 x {TOKENS} tokens, {device.type}, torch {torch.__version__}, median of {reps} steps taken in turns", "",
             "| compile scope | forward ms | backward ms | optimizer ms | step ms |", "|---|---|---|---|---|"]
    for scope in scopes:
        m = t[scope, ""]
        lines.append(f"| {scope} | {m['forward']:.2f} | {m['backward']:.2f} | {m['optimizer']:.2f} | {m['step']:.2f} |")
    if regions:
        lines += ["", "Each region between the blocks compiled (scope `block`) against the same code run eagerly, "
                  "everything else compiled in both: the difference in host microseconds per call (positive: "
                  "the compiled region costs the host more).", "",
                  "| region | calls a step | forward, compiled − eager | backward, compiled − eager |",
                  "|---|---|---|---|"]
        compiled = t["block", ""]
        for name in regions:
            calls = region_calls(variants["block", ""].model, name)
            # Only the region differs between the two models, so the difference in each phase is its own.
            fwd, bwd = (1e3 * (compiled[phase] - t["block", name][phase]) / calls for phase in ("forward", "backward"))
            lines.append(f"| `{name}` | {calls} | {fwd:+.0f} µs | {bwd:+.0f} µs |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="speedrun-124m")
    parser.add_argument("--scopes", default="eager,block,model")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", type=Path, help="also write the tables to this Markdown file")
    args = parser.parse_args(argv)
    scopes = [s for s in args.scopes.split(",") if s]
    bad = [s for s in scopes if s not in ("eager", "block", "model")]
    if bad:
        parser.error(f"--scopes: {bad[0]!r} is not eager, block or model")
    if args.device == "cpu":
        # One thread: a compiled CPU kernel opens an OpenMP parallel region at every call, whose
        # start-up on a few cores costs more than the Python around it; a GPU's host has no such cost.
        torch.set_num_threads(1)
    text = report(args.config, overrides, scopes, torch.device(args.device), args.reps)
    print(text, end="")
    if args.out:
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(args.out)


if __name__ == "__main__":
    main()
