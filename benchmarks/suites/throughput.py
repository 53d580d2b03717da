"""Tokens/s, MFU, step split and memory of one model on one machine (`distlm bench`).

    python benchmarks/run.py throughput [--gpus 1] [--config gpt2-124m-1024] [--variants NAME=OVERRIDES;...]
        [--layout fsdp4] [--profile] [--ceilings] [--memory-cap-gib 79] [--before DIR] [--loss-curves STEPS]

Each variant is one `distlm bench` with synthetic tokens; the default variants are the settings
the speed page compares (compile per block or whole model, micro-batch 32 and 64, chunked loss).
--layout runs every variant under that layout (e.g. fsdp4 for gpt2-1.5b on 4 GPUs, see
`layouts` for a sweep). --before DIR measures the same variants with the code in DIR (a
`git archive` of an older commit) first, so a before/after pair shares one machine (profiled
alike with --profile), and a last step tables each pair (benchmarks/tools/compare_bench.py).
--loss-curves STEPS trains the plain path (eager, whole logits) and the fast path (whole-model
compile, chunked loss) on the bundled Gutenberg books (prepared by the suite's corpus step) for STEPS
steps and compares the losses step by step.
"""
from __future__ import annotations

from run import Context, Step
from suites import add_common, bundled_corpus, layout

DEFAULT_VARIANTS = ("block-m16=train.compile_scope=block train.micro_batch_size=16;"
                    "model-m32=train.compile_scope=model train.micro_batch_size=32;"
                    "model-m32-chunk=train.compile_scope=model train.micro_batch_size=32 model.loss_chunk=8192;"
                    "model-m64-chunk=train.compile_scope=model train.micro_batch_size=64 train.global_batch_size=128 "
                    "model.loss_chunk=8192")


def variants(text: str) -> list[tuple[str, list[str]]]:
    out = []
    for item in filter(None, (v.strip() for v in text.split(";"))):
        name, sep, overrides = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--variants: {item!r} is not NAME=OVERRIDES")
        out.append((name, overrides.split()))
    return out


def add_arguments(p) -> None:
    add_common(p, "gpt2-124m-1024", warmup=5, steps=10)
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="NAME=OVERRIDES;... one bench each")
    p.add_argument("--layout", default="one", help="e.g. fsdp4, tp2, ddp2 (default: one process)")
    p.add_argument("--profile", action="store_true", help="also profile each variant (device time by category)")
    p.add_argument("--ceilings", action="store_true", help="first measure the matmul rate and memory bandwidth")
    p.add_argument("--memory-cap-gib", type=float, default=0, help="hold each process to this much GPU memory")
    p.add_argument("--before", metavar="DIR", help="also run each variant with the code in DIR, first")
    p.add_argument("--loss-curves", type=int, default=0, metavar="STEPS", help="plain against fast path, STEPS steps")


def plan(args, ctx: Context) -> list[Step]:
    nproc, lay = layout(args.layout)
    if nproc > max(ctx.gpus, 1) and not ctx.cpu:
        raise ValueError(f"--layout {args.layout} needs {nproc} GPUs, --gpus is {ctx.gpus}")
    steps = []
    if args.ceilings:
        steps.append(Step("ceilings", ctx.distlm(["bench", "--ceilings", "--json", "{dir}/result.json"]
                                                 + (["--device", "cpu"] if ctx.cpu else []))))
    flags = ["--warmup", str(args.warmup), "--steps", str(args.steps), "--json", "{dir}/result.json"]
    if args.memory_cap_gib:
        flags += ["--memory-cap-gib", str(args.memory_cap_gib)]
    profile = ["--profile", "{dir}/profile"] if args.profile else []
    pairs = []
    for name, overrides in variants(args.variants):
        cmd = ctx.tiny(["bench", "--config", args.config, "data.source=synthetic", "train.on_nan=off", *lay,
                        *overrides, *args.set, *flags])
        if args.before:
            # Profiled too when the newer code is: the profiler slows a step, and a pair must
            # differ only in the code.
            steps.append(Step(f"before-{name}", ctx.distlm(cmd + profile, nproc), env={"PYTHONPATH": args.before}))
            pairs += [f"{{out}}/{{stamp}}-before-{name}", f"{{out}}/{{stamp}}-{name}"]
        steps.append(Step(name, ctx.distlm(cmd + profile, nproc)))
    if pairs:
        steps.append(Step("before-after", [ctx.python, "benchmarks/tools/compare_bench.py", *pairs,
                                           "--json", "{dir}/result.json"]))
    if args.loss_curves:
        train = ["train", "--config", args.config, f"train.max_steps={args.loss_curves}", "train.global_batch_size=32",
                 "train.micro_batch_size=16", "train.eval_every=100", "train.eval_batches=10", "log.every=1",
                 "log.progress=false", "log.tensorboard=false", "train.on_nan=off", "log.root={out}", *args.set]
        corpus, data = bundled_corpus(ctx)
        steps.append(corpus)
        steps.append(Step("curve-plain", ctx.distlm(ctx.tiny(train + ["log.name={stamp}-plain", "train.compile=false",
                                                                      "model.loss_chunk=0"]) + data)))
        steps.append(Step("curve-fast", ctx.distlm(ctx.tiny(train + ["log.name={stamp}-fast", "train.compile=true",
                                                                     "train.compile_scope=model",
                                                                     "model.loss_chunk=8192"]) + data)))
        steps.append(Step("curve-compare", [ctx.python, "benchmarks/tools/compare_curves.py", "{out}/{stamp}-plain",
                                            "{out}/{stamp}-fast", "--plot", "{dir}/curves.png",
                                            "--json", "{dir}/result.json"]))
    return steps
