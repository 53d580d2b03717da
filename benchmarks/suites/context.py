"""Context parallelism: memory per GPU and tokens/s against context length and GPUs; its loss curve.

    python benchmarks/run.py context --gpus 4 [--config llama-124m] [--contexts 8192,32768,131072]
        [--sizes 1,2,4] [--large gpt2-1.5b@16384] [--loss-curves 300] [--curve-context 8192]

Throughput: one `distlm bench` per (context T, GPUs n), each a single row of T tokens split over
n GPUs (parallel.cp=n; n = 1 is one GPU holding the whole row), compiled, with the chunked loss
and without activation checkpointing (`--set parallel.activation_checkpoint=full` adds it), so
memory shows what each GPU keeps. A run that does not fit ends with an out-of-memory error: its
log says so and results.jsonl keeps its exit status. `distlm plan` gives the estimates to set
beside them (e.g. `distlm plan --config llama-124m --gpus 4 --global-batch 1 --micro-batch 1
model.block_size=131072`).
The default model is llama-124m (rotary positions: GPT-2's learned table would need a row per
position, 100M parameters at 128k). --large CONFIG@T runs CONFIG at T tokens on all GPUs
(gpt2-1.5b at 16k: parallel.cp=4, and beside it FSDP2 over 4 GPUs with a whole row each).
--loss-curves STEPS trains the model at --curve-context tokens on one GPU and on all GPUs
(parallel.cp=gpus) on the same global batches of the bundled Gutenberg books (prepared by the
suite's corpus step, GPT-2's tokenizer) and compares the losses step by step
(benchmarks/tools/compare_curves.py). `--contexts ""` runs the curves alone.
"""
from __future__ import annotations

from run import Context, Step
from suites import add_common, bundled_corpus, int_list

FAST = ["train.compile=true", "model.loss_chunk=8192"]


def add_arguments(p) -> None:
    add_common(p, "llama-124m", warmup=3, steps=8)
    p.add_argument("--contexts", default="8192,32768,131072", help="row lengths in tokens (default 8k, 32k, 128k)")
    p.add_argument("--sizes", default="1,2,4", help="GPUs a row is split over (those <= --gpus run)")
    p.add_argument("--large", default="gpt2-1.5b@16384", help="CONFIG@T on all GPUs; 'none' to skip")
    p.add_argument("--loss-curves", type=int, default=0, metavar="STEPS", help="one GPU against cp=gpus, STEPS steps")
    p.add_argument("--curve-context", type=int, default=8192, help="row length of the loss curves (default 8k)")


def bench(ctx: Context, config: str, context: int, layout: list[str], rows: int, args) -> list[str]:
    return ctx.tiny(["bench", "--config", config, "data.source=synthetic", "train.on_nan=off",
                     f"model.block_size={context}", f"train.global_batch_size={rows}", "train.micro_batch_size=1",
                     *FAST, *layout, *args.set, "--warmup", str(args.warmup), "--steps", str(args.steps),
                     "--json", "{dir}/result.json"])


def plan(args, ctx: Context) -> list[Step]:
    contexts, sizes = int_list(args.contexts), int_list(args.sizes)
    room = 2 if ctx.cpu else ctx.gpus  # the CPU plumbing check runs at most 2 processes
    sizes = [n for n in sizes if n <= room]
    if not sizes:
        raise ValueError(f"--sizes {args.sizes}: none fits --gpus {ctx.gpus}")
    steps = []
    for T in contexts:
        for n in sizes:
            # cp=n, one row: every GPU holds T/n of its tokens; n = 1 is the single-GPU baseline
            steps.append(Step(f"cp{n}-{T // 1024}k", ctx.distlm(bench(ctx, args.config, T, [f"parallel.cp={n}"], 1,
                                                                      args), n), timeout_s=args.timeout))
    if args.large != "none":
        config, _, T = args.large.partition("@")
        if not T.isdigit():
            raise ValueError(f"--large {args.large!r} is not CONFIG@TOKENS")
        n = room
        steps.append(Step(f"large-cp{n}", ctx.distlm(bench(ctx, config, int(T), [f"parallel.cp={n}"], 1, args), n),
                          timeout_s=args.timeout))
        steps.append(Step(f"large-fsdp{n}", ctx.distlm(bench(ctx, config, int(T), [f"parallel.dp_shard={n}"], n, args),
                                                       n), timeout_s=args.timeout))
    if args.loss_curves:
        n = room
        train = ["train", "--config", args.config, f"model.block_size={args.curve_context}",
                 f"train.max_steps={args.loss_curves}", "train.global_batch_size=8", "train.micro_batch_size=1",
                 "train.eval_every=100", "train.eval_batches=8", "log.every=1", "log.progress=false",
                 "log.tensorboard=false", "log.samples=0", "train.on_nan=off", "log.root={out}", *FAST, *args.set]
        corpus, data = bundled_corpus(ctx)
        steps.append(corpus)
        steps.append(Step("curve-one", ctx.distlm(ctx.tiny(train + ["log.name={stamp}-one"]) + data)))
        steps.append(Step(f"curve-cp{n}", ctx.distlm(ctx.tiny(train + [f"log.name={{stamp}}-cp{n}",
                                                                       f"parallel.cp={n}"]) + data, n)))
        steps.append(Step("curve-compare", [ctx.python, "benchmarks/tools/compare_curves.py", "{out}/{stamp}-one",
                                            f"{{out}}/{{stamp}}-cp{n}", "--plot", "{dir}/curves.png",
                                            "--json", "{dir}/result.json"]))
    return steps
