"""How throughput scales with GPUs along one axis: DDP, FSDP2, TP or PP.

    python benchmarks/run.py scaling --gpus 4 --axis ddp|fsdp|tp|pp [--sizes 1,2,4] [--mode weak|strong]
        [--config gpt2-124m-1024] [--independent] [--pp-sweep 1,2,4,8] [--horovod] [--classify] [--repeat N]

ddp and fsdp: `distlm bench --scaling` (one torchrun launch per size; speed-up, efficiency,
exposed communication, an Amdahl fit, a plot and advice). tp and pp: one `distlm bench` per
size with parallel.tp / parallel.pp at that degree. --repeat N (ddp, fsdp) runs the scaling
measurement N times in turn and puts the repetitions side by side (tools/scaling_repeats.py): the
lowest efficiency is what a goal such as "95% every time" is about. --independent also runs one process per GPU
at once with no communication (how much of a DDP loss is the host or the power cap, not the
all-reduce). --pp-sweep runs the pipeline bubble sweep (naive, GPipe, 1F1B) at --gpus stages.
--horovod trains 50 steps under torch DDP and under Horovod (needs Horovod built: make horovod).
--classify runs the classification study: the two small classifiers on the bundled 20 Newsgroups
subset, with the settings that turn negative scaling positive.
"""
from __future__ import annotations

from run import Context, Step
from suites import add_common, int_list

CLASSIFY_RUNS = {  # name: (model, per-GPU global batch, micro-batch, extra)
    "small-b32": ("small", 32, 32, []), "large-b32": ("large", 32, 32, []), "small-b256": ("small", 256, 256, []),
    "small-accum4": ("small", 128, 32, []), "small-bucket100": ("small", 32, 32, ["parallel.ddp_bucket_mb=100"])}
CLASSIFY_MODELS = {"small": ["model.n_layer=2", "model.d_model=128", "model.n_head=4", "model.d_ff=512"],
                   "large": ["model.n_layer=4", "model.d_model=256", "model.n_head=4", "model.d_ff=1024"]}


def add_arguments(p) -> None:
    add_common(p, "gpt2-124m-1024", warmup=6, steps=12)
    p.add_argument("--axis", choices=("ddp", "fsdp", "tp", "pp"), default="ddp")
    p.add_argument("--sizes", help="world sizes, e.g. 1,2,4 (default: powers of two up to --gpus)")
    p.add_argument("--mode", choices=("weak", "strong"), default="weak")
    p.add_argument("--independent", action="store_true", help="also one process per GPU at once, no communication")
    p.add_argument("--repeat", type=int, default=1, help="ddp/fsdp: the measurement N times in turn (1, N GPUs, 1, "
                                                         "N, ...) and every repetition side by side")
    p.add_argument("--pp-sweep", metavar="MICROBATCHES", help="e.g. 1,2,4,8,16,32: the bubble sweep")
    p.add_argument("--horovod", action="store_true", help="torch DDP against Horovod, 50 steps of distlm train")
    p.add_argument("--classify", action="store_true", help="the classification study instead of --config")


def plan(args, ctx: Context) -> list[Step]:
    gpus = max(ctx.gpus, 1)
    sizes = int_list(args.sizes) if args.sizes else [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= gpus]
    if max(sizes) > gpus and not ctx.cpu:
        raise ValueError(f"--sizes {args.sizes} needs {max(sizes)} GPUs, --gpus is {gpus}")
    flags = ["--warmup", str(args.warmup), "--steps", str(args.steps)]
    base = ["--config", args.config, "data.source=synthetic", "train.on_nan=off", *args.set]
    steps = []
    if args.classify:
        return classify(args, ctx, sizes, flags)
    if args.axis in ("ddp", "fsdp"):
        axis = "dp_replicate" if args.axis == "ddp" else "dp_shard"
        if args.repeat < 1:
            raise ValueError(f"--repeat {args.repeat}: must be at least 1")
        # Repetitions one after another, each measuring every size in turn: interleaved, so a
        # slow spell of the machine lands in one repetition instead of biasing one size.
        names = [f"{args.axis}-{args.mode}" + (f"-r{i}" if args.repeat > 1 else "") for i in range(1, args.repeat + 1)]
        for name in names:
            steps.append(Step(name, ctx.distlm(ctx.tiny(
                ["bench", "--scaling", ",".join(map(str, sizes)), "--axis", axis, "--mode", args.mode, *base, *flags,
                 "--out-dir", "{dir}"])), result=f"scaling-{args.mode}.json"))
        if args.repeat > 1:
            steps.append(Step(f"{args.axis}-{args.mode}-repeats", [ctx.python, "benchmarks/tools/scaling_repeats.py",
                                                                   "{dir}", *(f"{{out}}/{{stamp}}-{n}" for n in names)],
                              result="repeats.json"))
    else:
        for n in sizes:
            lay = [f"parallel.{args.axis}={n}"] if n > 1 else []
            steps.append(Step(f"{args.axis}{n}", ctx.distlm(ctx.tiny(["bench", *base, *lay, *flags, "--no-comm-probe",
                                                                     "--json", "{dir}/result.json"]), n)))
    if args.independent:
        launch = [ctx.distlm(ctx.tiny(["bench", *base, *flags, "--json", f"{{dir}}/gpu{i}.json",
                                       f"log.name=independent{i}"])) for i in range(gpus)]
        env = {} if ctx.cpu else {"CUDA_VISIBLE_DEVICES": "0"}
        steps.append(Step("independent", launch[0], env=env, background=[
            ["env", f"CUDA_VISIBLE_DEVICES={i}", *cmd] if not ctx.cpu else cmd for i, cmd in enumerate(launch[1:], 1)],
            result="gpu0.json"))
    if args.pp_sweep:
        int_list(args.pp_sweep)
        steps.append(Step("pp-sweep", ctx.distlm(ctx.tiny(["bench", *base, f"parallel.pp={gpus}", "train.compile=false",
                                                            "--pp-sweep", args.pp_sweep, *flags, "--out-dir", "{dir}"]),
                                                 gpus), result="pp-sweep.json"))
    if args.horovod:
        train = ctx.tiny(["train", "--config", args.config, "data.source=synthetic", "train.on_nan=off",
                          "train.max_steps=50", "log.every=10", "train.eval_every=0", "log.samples=0",
                          f"train.global_batch_size={32 * gpus}", "train.micro_batch_size=16", "log.progress=false",
                          "log.tensorboard=false", "log.root={dir}", f"parallel.dp_replicate={gpus}", *args.set])
        steps.append(Step("train-ddp", ctx.distlm(train + ["log.name=ddp"], gpus)))
        steps.append(Step("train-horovod", [ctx.python, "-m", "horovod.runner.launch", "-np", str(gpus), "-H",
                                            f"localhost:{gpus}", "--gloo", ctx.python, "-m", "distlm", *train,
                                            "parallel.engine=horovod", "log.name=horovod"]))
    return steps


def classify(args, ctx: Context, sizes: list[int], flags: list[str]) -> list[Step]:
    data = "{out}/{stamp}-prepare/20news4-L128"
    steps = [Step("prepare", ctx.distlm(["prepare", "--task", "classify", "distlm/assets/20news4/20news4.jsonl.xz",
                                         "--out", "{dir}/20news4-L128", "--max-len", "128"]))]
    common = ["--config", "classify", f"data.dir={data}", "train.on_nan=off", "log.tensorboard=false", *args.set]
    if ctx.cpu:
        common += ["train.device=cpu", "train.compile=false"]
    for name, (model, gbs, micro, extra) in CLASSIFY_RUNS.items():
        steps.append(Step(name, ctx.distlm(["bench", "--scaling", ",".join(map(str, sizes)), "--axis", "dp_replicate",
                                            "--mode", "weak", *common, *CLASSIFY_MODELS[model],
                                            f"train.global_batch_size={gbs}", f"train.micro_batch_size={micro}",
                                            *extra, *flags, "--out-dir", "{dir}"]), result="scaling-weak.json"))
    n = max(sizes)
    steps.append(Step("train-accuracy", ctx.distlm(["train", *common, f"parallel.dp_replicate={n}",
                                                    f"train.global_batch_size={32 * n}", "train.micro_batch_size=32",
                                                    "train.max_steps=300", "train.eval_every=0", "log.progress=false",
                                                    "log.root={dir}", "log.name=ddp"], n)))
    return steps
