"""One large model under several model-parallel layouts, side by side (FSDP, TP, PP and their mixes).

    python benchmarks/run.py layouts --gpus 2 [--layouts fsdp2,tp2] [--config gpt2-1.5b] [--micro 8,16,32]
        [--profile] [--plan] [--before DIR]

Each layout name joins axes and degrees (ddp2, fsdp4, tp2, pp2, tp2_fsdp2, tp2_pp2); each
(layout, micro-batch) pair is one `distlm bench` of --config with synthetic tokens. The default
model is gpt2-1.5b with 20 heads of 80 (GPT-2's 25 heads admit no TP degree but 5; 20 heads keep
the parameters and FLOPs), global batch 64, compiled per block, whole logits.
--plan first prints `distlm plan`'s ranking of the layouts. --before DIR measures the code in DIR too.
"""
from __future__ import annotations

from run import Context, Step
from suites import add_common, int_list, layout

GPT2_15B = ["model.n_head=20", "model.vocab_size=50257", "model.loss_chunk=0", "train.compile=true",
            "train.compile_scope=block", "train.global_batch_size=64"]


def add_arguments(p) -> None:
    add_common(p, "gpt2-1.5b", warmup=3, steps=6)
    p.add_argument("--layouts", help="comma-separated layouts (default: fsdpN,tpN, and on 4 GPUs also tp2_fsdp2,pp2_fsdp2)")
    p.add_argument("--micro", default="8", help="micro-batch sizes, e.g. 8,16,32 (default 8)")
    p.add_argument("--profile", action="store_true", help="profile each run: compute, hidden and exposed communication")
    p.add_argument("--plan", action="store_true", help="first run `distlm plan` for these GPUs")
    p.add_argument("--gpu-mem-gb", type=float, default=79, help="--plan: memory per GPU (default 79)")
    p.add_argument("--before", metavar="DIR", help="also run each layout with the code in DIR, first")


def plan(args, ctx: Context) -> list[Step]:
    gpus = max(ctx.gpus, 1)
    names = args.layouts.split(",") if args.layouts else (
        [f"fsdp{gpus}", f"tp{gpus}"] + (["tp2_fsdp2", "pp2_fsdp2"] if gpus == 4 else []))
    model = GPT2_15B if args.config == "gpt2-1.5b" else []
    steps = []
    if args.plan:
        steps.append(Step("plan", ctx.distlm(["plan", "--config", args.config, *model[:2], "--gpus", str(gpus),
                                              "--gpu-mem-gb", str(args.gpu_mem_gb), "--global-batch", "64",
                                              "--micro-batch", str(int_list(args.micro)[0])])))
    for name in names:
        nproc, lay = layout(name)
        if nproc > gpus and not ctx.cpu:
            raise ValueError(f"layout {name} needs {nproc} GPUs, --gpus is {gpus}")
        for micro in int_list(args.micro):
            run = f"{name}-m{micro}"
            cmd = ctx.tiny(["bench", "--config", args.config, *model, "data.source=synthetic", "train.on_nan=off",
                            *lay, f"train.micro_batch_size={micro}", *args.set, "--warmup", str(args.warmup),
                            "--steps", str(args.steps), "--no-comm-probe", "--json", "{dir}/result.json"])
            if ctx.cpu:  # the tiny model: heads and a batch every layout divides
                cmd += ["model.n_head=4", "train.global_batch_size=32", f"train.micro_batch_size={min(micro, 4)}"]
            argv = ctx.distlm(cmd, nproc)
            if args.before:
                steps.append(Step(f"before-{run}", argv, env={"PYTHONPATH": args.before}))
            steps.append(Step(run, argv + (["--profile", "{dir}/profile"] if args.profile else [])))
    return steps
