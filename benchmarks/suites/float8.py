"""Float8 against bf16 (train.fp8): tokens/s of large models under FSDP2, the loss after N steps of real text, speedrun-124m.

    python benchmarks/run.py float8 --gpus 4 [--items layer,speed,loss,speedrun] [--models gpt2-1.5b,llama-7b]
        [--recipes tensorwise,rowwise] [--loss-steps 1000] [--loss-recipes tensorwise]
        [--corpus DIR] [--profile]

Items, each a group of steps, all in one run of the suite so bf16 and float8 share the machine:

  layer     one linear layer of each model's blocks, forward + backward, compiled, on one GPU: bf16,
            each recipe, and the float8 matmuls alone on ready operands, so the casts' and
            transposes' cost is seen apart from the matmuls' gain (benchmarks/tools/float8_layer.py;
            about a minute).
  speed     `distlm bench` of each model under FSDP2 on --gpus GPUs (gpt2-1.5b: micro-batch 16, ZeRO-2,
            global batch 128; llama-7b: full activation checkpointing, micro-batch 4, global batch 32),
            compiled per block, synthetic tokens, once in bf16 and once per recipe: tokens/s, the
            float8/bf16 ratio, MFU (against the dense bf16 peak, as every MFU here), peak memory.
            About 1.5 min per gpt2-1.5b bench on 4 x H200 (most of it start-up and compilation).
  loss      `distlm train` of each model for --loss-steps steps on real text (the time-to-loss corpus,
            prepared on the machine), bf16 and each --loss-recipes, same seed and data order: the final
            validation loss and the mean training loss of the last tenth. gpt2-1.5b at global batch 16
            (16k tokens a step), llama-7b at global batch 4 (8k tokens); at 1,000 steps an estimated
            3 min per gpt2-1.5b run and 4-5 min per llama-7b run on 4 GPUs, from the speed item's tok/s
            (not yet timed; each run writes its final checkpoint, deleted after the step).
  speedrun  the `speedrun-124m` recipe on one GPU, bf16 and each --recipes: seconds from launch to the
            end, final validation loss, tokens/s (the time-to-loss suite's `speedrun-fp8` runs do the
            same against the nanoGPT baseline).

A last step prints one compact table per item (benchmarks/tools/float8_report.py). With --cpu every
step shrinks to a tiny model on the CPU, where float8 is refused, so its float8 steps run with
train.fp8=off (and the layer tool emulates float8 on tiny shapes): that checks the plumbing and the
report, and measures nothing.
"""
from __future__ import annotations

from run import Context, Step
from suites import add_common

# Per model: the settings of its bf16 figures on the speed page, and its loss runs' batch.
SPEED = {
    "gpt2-1.5b": ["train.micro_batch_size=16", "train.global_batch_size=128", "parallel.reshard_after_forward=false",
                  "train.compile=true", "train.compile_scope=block"],
    "llama-7b": ["parallel.activation_checkpoint=full", "train.micro_batch_size=4", "train.global_batch_size=32",
                 "train.compile=true", "train.compile_scope=block"],
}
LOSS = {
    "gpt2-1.5b": ["train.global_batch_size=16", "train.micro_batch_size=4", "parallel.reshard_after_forward=false"],
    "llama-7b": ["train.global_batch_size=4", "train.micro_batch_size=1", "parallel.activation_checkpoint=full"],
}
ITEMS = ("layer", "speed", "loss", "speedrun")
# What --cpu runs instead of the models: tiny, so every step finishes in seconds.
CPU = ["model.n_layer=2", "model.d_model=64", "model.n_head=2", "model.d_ff=128", "model.block_size=32",
       "train.device=cpu", "train.compile=false", "model.loss_chunk=0", "train.global_batch_size=8",
       "train.micro_batch_size=4", "model.value_embeds=0", "model.skip_connections=false"]


def add_arguments(p) -> None:
    add_common(p, "gpt2-1.5b", warmup=3, steps=5)
    p.add_argument("--items", default=",".join(ITEMS), help=f"comma-separated, of {', '.join(ITEMS)}")
    p.add_argument("--models", default="gpt2-1.5b,llama-7b", help="presets for speed and loss, of "
                                                                  f"{', '.join(SPEED)}")
    p.add_argument("--recipes", default="tensorwise,rowwise", help="train.fp8 values against bf16 (speed, speedrun)")
    p.add_argument("--loss-recipes", default="tensorwise", help="train.fp8 values against bf16 in the loss runs")
    p.add_argument("--loss-steps", type=int, default=1000, help="training steps of each loss run (default 1000)")
    p.add_argument("--corpus", default="../shared/data/corpus", help="folder holding gutenberg/ sotu/ gcide/")
    p.add_argument("--memory-cap-gib", type=float, default=0, help="hold each process to this much GPU memory")
    p.add_argument("--profile", action="store_true", help="speed: also profile each bench (device time by category)")


def names(text: str, allowed, what: str) -> list[str]:
    out = [x for x in text.split(",") if x]
    bad = [x for x in out if x not in allowed]
    if bad or not out:
        raise ValueError(f"{what} {text!r}: expected a comma-separated list of {', '.join(allowed)}")
    return out


def plan(args, ctx: Context) -> list[Step]:
    items = names(args.items, ITEMS, "--items")
    models = names(args.models, SPEED, "--models")
    recipes = names(args.recipes, ("tensorwise", "rowwise"), "--recipes")
    loss_recipes = names(args.loss_recipes, ("tensorwise", "rowwise"), "--loss-recipes")
    if args.loss_steps < 1:
        raise ValueError(f"--loss-steps must be positive, got {args.loss_steps}")
    gpus = 1 if ctx.cpu else ctx.gpus
    fsdp = [f"parallel.dp_shard={gpus}"] if gpus > 1 else []
    steps: list[Step] = []
    report: list[str] = []

    def fp8(label: str) -> list[str]:
        """The overrides of a row: "off" or a recipe. On the CPU, which refuses float8, every row
        runs in bf16 (the plumbing is what is checked there)."""
        return ["train.fp8=off" if ctx.cpu else f"train.fp8={label}"]

    def labels(recipes_: list[str]) -> list[str]:
        """bf16, then each recipe."""
        return ["off", *recipes_]

    def shrink(cmd: list[str]) -> list[str]:
        return [*cmd, *CPU] if ctx.cpu else cmd

    if "layer" in items:
        for model in models:
            tool = [ctx.python, "benchmarks/tools/float8_layer.py", "--model", model,
                    "--micro", micro_of(SPEED[model]), "--json", "{dir}/result.json"]
            steps.append(Step(f"layer-{model}", tool + (["--cpu"] if ctx.cpu else [])))
    if "speed" in items:
        flags = ["--warmup", str(args.warmup), "--steps", str(args.steps), "--json", "{dir}/result.json",
                 "--no-comm-probe"]
        if args.memory_cap_gib:
            flags += ["--memory-cap-gib", str(args.memory_cap_gib)]
        for model in models:
            for recipe in labels(recipes):
                name = f"speed-{model}-{recipe}"
                cmd = shrink(["bench", "--config", model, "data.source=synthetic", "train.on_nan=off", *fsdp,
                              *SPEED[model], *fp8(recipe), *args.set])
                profile = ["--profile", "{dir}/profile"] if args.profile else []
                steps.append(Step(name, ctx.distlm([*cmd, *flags, *profile], gpus)))
                report.append(f"speed:{model}:{recipe}={{out}}/{{stamp}}-{name}/result.json")
    if "loss" in items or "speedrun" in items:
        steps.append(Step("corpus", ["bash", "-c", '"$0" scripts/build_speedrun_corpus.py "$1" "$2/text" && '
                                     '"$0" -m distlm prepare "$2/text" --out "$2/data" --quiet',
                                     ctx.python, args.corpus, "{dir}"]))
    data = "{out}/{stamp}-corpus/data"
    common = [f"data.dir={data}", "log.root={out}", "log.progress=false", "log.tensorboard=false", "log.samples=0",
              "train.checkpoint_every=0"]
    if "loss" in items:
        for model in models:
            for recipe in labels(loss_recipes):
                name = f"loss-{model}-{recipe}"
                run = f"{{out}}/{{stamp}}-{name}-run"
                cmd = shrink(["train", "--config", model, *fsdp, *LOSS[model], f"train.max_steps={args.loss_steps}",
                              "train.eval_every=0", "train.eval_batches=40",
                              "train.compile=true", "train.compile_scope=block", "log.every=10", *fp8(recipe),
                              *common, f"log.name={{stamp}}-{name}-run", *args.set])
                steps.append(Step(name, cleaned(ctx.distlm(cmd, gpus), run)))
                report.append(f"loss:{model}:{recipe}={run}")
    if "speedrun" in items:
        for recipe in labels(recipes):
            name = f"speedrun-{recipe}"
            run = f"{{out}}/{{stamp}}-{name}-run"
            cmd = shrink(["train", "--config", "speedrun-124m", *fp8(recipe), *common, f"log.name={{stamp}}-{name}-run",
                          *(["train.max_steps=4", "train.eval_every=2", "train.eval_batches=4"] if ctx.cpu else []),
                          *args.set])
            steps.append(Step(name, cleaned(ctx.distlm(cmd, 1), run)))
            report.append(f"speedrun:speedrun-124m:{recipe}={run}@{{out}}/{{stamp}}-{name}/launch_time.txt")
    if report:  # the layer item prints its own table
        steps.append(Step("report", [ctx.python, "benchmarks/tools/float8_report.py", "{dir}", *report]))
    return steps


def micro_of(overrides: list[str]) -> str:
    return next(o.split("=", 1)[1] for o in overrides if o.startswith("train.micro_batch_size="))


def cleaned(launch: list[str], run: str) -> list[str]:
    """The launch, then its run's checkpoints deleted (a llama-7b one is 80 GB; the figures are
    in metrics.csv), keeping the launch's exit status."""
    return ["bash", "-c", '"$@"; rc=$?; rm -rf "$0/checkpoints"; exit $rc', run, *launch]
