"""One large model under several model-parallel layouts, side by side (FSDP, TP, PP and their mixes).

    python benchmarks/run.py layouts --gpus 2 [--layouts fsdp2,tp2] [--config gpt2-1.5b] [--micro 8,16,32]
        [--async-tp] [--inductor KEY=VALUE,...] [--profile] [--plan] [--before DIR] [--nccl-sizes] [--host-overhead]

Each layout name joins axes and degrees (ddp2, fsdp4, tp2, pp2, tp2_fsdp2, tp2_pp2); each
(layout, micro-batch) pair is one `distlm bench` of --config with synthetic tokens. The default
model is gpt2-1.5b with 20 heads of 80 (GPT-2's 25 heads admit no TP degree but 5; 20 heads keep
the parameters and FLOPs), global batch 64, compiled per block, whole logits.
--async-tp adds parallel.async_tp=true to the TP layouts. --inductor sets torch._inductor.config
keys for every run (through benchmarks/tools/inductor_knobs.py), e.g.
reorder_for_compute_comm_overlap=true or aten_distributed_optimizations.enable_overlap_scheduling=true.
--plan first prints `distlm plan`'s ranking of the layouts. --before DIR measures the code in DIR too.
--nccl-sizes times all-gather, reduce-scatter and all-reduce of TP's message sizes under NCCL's
default protocol and NCCL_PROTO=Simple and LL128. --host-overhead measures the host's cost of a TP
block call on one process (no GPU needed).
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
    p.add_argument("--async-tp", action="store_true", help="parallel.async_tp=true for the TP layouts")
    p.add_argument("--inductor", default="", metavar="KEY=VALUE,...", help="torch._inductor.config settings")
    p.add_argument("--profile", action="store_true", help="profile each run: compute, hidden and exposed communication")
    p.add_argument("--plan", action="store_true", help="first run `distlm plan` for these GPUs")
    p.add_argument("--gpu-mem-gb", type=float, default=79, help="--plan: memory per GPU (default 79)")
    p.add_argument("--before", metavar="DIR", help="also run each layout with the code in DIR, first")
    p.add_argument("--nccl-sizes", action="store_true", help="NCCL's time for TP's message sizes, three protocols")
    p.add_argument("--host-overhead", action="store_true", help="the host's cost of a TP block call (one process)")


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
    if args.nccl_sizes:
        for proto in ("default", "Simple", "LL128"):
            env = {} if proto == "default" else {"NCCL_PROTO": proto}
            steps.append(Step(f"nccl-{proto}", [ctx.python, "-m", "torch.distributed.run", "--standalone",
                                                "--nproc_per_node=2", "benchmarks/tools/nccl_sizes.py", "--json",
                                                "{dir}/result.json"], env=env))
    if args.host_overhead:
        steps.append(Step("host-overhead", [ctx.python, "benchmarks/tools/tp_host_overhead.py", "--compile"]))
    entry = ["benchmarks/tools/inductor_knobs.py"] if args.inductor else None
    env = {"INDUCTOR": args.inductor} if args.inductor else {}
    for name in names:
        nproc, lay = layout(name)
        if nproc > gpus and not ctx.cpu:
            raise ValueError(f"layout {name} needs {nproc} GPUs, --gpus is {gpus}")
        if args.async_tp and "parallel.tp" in " ".join(lay):
            lay.append("parallel.async_tp=true")
        for micro in int_list(args.micro):
            run = f"{name}-m{micro}"
            cmd = ctx.tiny(["bench", "--config", args.config, *model, "data.source=synthetic", "train.on_nan=off",
                            *lay, f"train.micro_batch_size={micro}", *args.set, "--warmup", str(args.warmup),
                            "--steps", str(args.steps), "--no-comm-probe", "--json", "{dir}/result.json"])
            if ctx.cpu:  # the tiny model: heads and a batch every layout divides
                cmd += ["model.n_head=4", "train.global_batch_size=32", f"train.micro_batch_size={min(micro, 4)}"]
            argv = ctx.distlm(cmd, nproc)
            if entry:  # the same launch, with inductor's settings applied before distlm starts
                argv = ([ctx.python, *entry, *cmd] if nproc <= 1 else
                        [ctx.python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                         *entry, *cmd])
            if args.before:
                steps.append(Step(f"before-{run}", argv, env={**env, "PYTHONPATH": args.before}))
            steps.append(Step(run, argv + (["--profile", "{dir}/profile"] if args.profile else []), env=env))
    return steps
