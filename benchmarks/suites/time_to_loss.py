"""Time to a validation loss: the speedrun-124m recipe against nanoGPT's recipe, same data, same machine.

    python benchmarks/run.py time-to-loss --corpus DIR [--runs "baseline speedrun"] [--extra OVERRIDES]
        [--target LOSS] [--warm] [--nanogpt DIR]

RUN is baseline, speedrun, or speedrun-NAME for an ablation (ABLATIONS below); RUN@ddpN or
RUN@fsdpN runs it on N GPUs (the global batch stays, split evenly); RUN+warm runs RUN again on the
compile cache RUN left (a repeated run on one machine). Every other run starts from an empty
compile cache, so its time counts imports, set-up and compilation: each run is timed from its own
process start. The corpus (Gutenberg + State of the Union + GCIDE, about 21M GPT-2 tokens) is laid
out by scripts/build_speedrun_corpus.py from --corpus (../shared/data/corpus) and prepared on the
machine that runs it; GCIDE is GPL and is never vendored. Validation covers the whole val split.
The report (tools/speedrun_report.py) gives seconds and tokens to the baseline's final loss (or
--target), steady tok/s, MFU, the start-up split and the two plots.

The baseline is nanoGPT's recipe through the gpt2-124m-1024 preset (64 x 1024 tokens a step,
AdamW 0.9/0.95, weight decay 0.1, lr 6e-4, 100 warm-up steps, cosine to 6e-5, 1,500 steps, clip
1.0, bf16) in distlm's fastest step settings. --nanogpt DIR also runs nanoGPT's own bench.py from a
checkout in DIR (an ignored folder such as carry/nanogpt; never vendored) on the same card, as a
reference for the step speed.
"""
from __future__ import annotations

import re

from run import Context, Step

BASELINE = ["--config", "gpt2-124m-1024", "train.max_steps=1500", "train.global_batch_size=64",
            "train.micro_batch_size=64", "train.lr=6e-4", "train.min_lr=6e-5", "train.warmup_steps=100",
            "train.decay=cosine", "train.weight_decay=0.1", "train.grad_clip=1.0", "train.beta1=0.9",
            "train.beta2=0.95", "train.dtype=bf16", "train.compile=true", "train.compile_scope=model",
            "model.loss_chunk=8192", "train.eval_every=250"]
SPEEDRUN = ["--config", "speedrun-124m"]

# Each changes one piece of the recipe (the time-to-loss page gives what each measured).
ABLATIONS = {
    "adamw": "optim.name=adamw train.lr=1.5e-3 train.beta1=0.9",  # Muon off
    "plainblock": "model.qk_norm=false model.mlp=gelu model.zero_init_proj=false model.logit_softcap=0",
    "cosine": "train.decay=cosine",  # no WSD cool-down
    "docmask": "model.attn_mask=doc",  # document-masked attention (FlexAttention)
    "valemb": "model.value_embeds=3 model.skip_connections=true",
    "novalemb": "model.value_embeds=0 model.skip_connections=false",
    "ve6": "model.value_embeds=6",
    "embedlr": "optim.embed_lr=0.3", "embedlr1": "optim.embed_lr=0.1", "embedlr6": "optim.embed_lr=0.6",
    "noembedlr": "optim.embed_lr=0",
    "block": "train.compile_scope=block", "model": "train.compile_scope=model",
    "evalcompiled": "train.eval_compile=true",
    "seqwarm": "train.seq_warmup_steps=150 train.seq_warmup_start=256",
    "b16": "train.global_batch_size=16 train.micro_batch_size=16 train.max_steps=1200 train.eval_every=600",
    "b64": "train.global_batch_size=64 train.micro_batch_size=64",
    # 64-sequence steps: 300 steps hold the 19.7M tokens of the 1-GPU recipe (the 4-GPU form)
    "b64s300": "train.global_batch_size=64 train.micro_batch_size=64 train.max_steps=300 train.eval_every=150",
    "b64s300eager": "train.global_batch_size=64 train.micro_batch_size=64 train.max_steps=300 train.eval_every=150 "
                    "train.compile=false",
    "b64s300bf16": "train.global_batch_size=64 train.micro_batch_size=64 train.max_steps=300 train.eval_every=150 "
                   "parallel.grad_reduce_dtype=bf16",
    "b64s350": "train.global_batch_size=64 train.micro_batch_size=64 train.max_steps=350 train.eval_every=175",
    "b64s450": "train.global_batch_size=64 train.micro_batch_size=64 train.max_steps=450 train.eval_every=150",
    "fp8": "train.fp8=tensorwise", "fp8row": "train.fp8=rowwise",  # the blocks' matmuls in float8
    "s500": "train.max_steps=500", "s540": "train.max_steps=540", "s600": "train.max_steps=600",
}

# --cpu: a tiny model for 4 steps; it checks the plumbing and measures nothing.
CPU = ["model.n_layer=2", "model.d_model=64", "model.n_head=2", "model.d_ff=128", "model.block_size=64",
       "train.device=cpu", "train.compile=false", "train.max_steps=4", "train.eval_every=2", "train.warmup_steps=1",
       "train.global_batch_size=8", "train.micro_batch_size=8", "train.eval_batches=4"]


def add_arguments(p) -> None:
    p.add_argument("--corpus", default="../shared/data/corpus", help="folder holding gutenberg/ sotu/ gcide/")
    p.add_argument("--runs", default="baseline speedrun", help="space-separated RUN[@ddpN|@fsdpN][+warm]")
    p.add_argument("--extra", default="", help="overrides for every speedrun* run, before the ablation's")
    p.add_argument("--target", type=float, help="the loss to time to (default: the baseline's final loss)")
    p.add_argument("--nanogpt", metavar="DIR", help="also run nanoGPT's bench.py from this checkout")


def run_args(run: str, extra: list[str], cpu: bool) -> tuple[str, int, list[str], bool]:
    """(name, processes, distlm train arguments, warm) of one RUN."""
    m = re.fullmatch(r"(baseline|speedrun(?:-([a-z0-9]+))?)(?:@(ddp|fsdp)(\d+))?(\+warm)?", run)
    if not m or (m.group(2) and m.group(2) not in ABLATIONS):
        raise ValueError(f"run {run!r}: expected baseline or speedrun[-ABLATION][@ddpN|@fsdpN][+warm]; "
                         f"ablations: {', '.join(sorted(ABLATIONS))}")
    recipe, ablation, axis, n, warm = m.groups()
    args = list(BASELINE) if recipe == "baseline" else [*SPEEDRUN, *extra, *(ABLATIONS[ablation].split()
                                                                                if ablation else [])]
    if cpu:
        args += CPU
    given = [a.split("=", 1)[1] for a in args if a.startswith("train.global_batch_size=")]
    global_batch = int(given[-1]) if given else (64 if recipe == "baseline" else 32)
    nproc = int(n) if n else 1
    if axis:  # the global batch stays; each GPU takes its share in one micro-batch
        args += [f"parallel.{'dp_replicate' if axis == 'ddp' else 'dp_shard'}={nproc}",
                 f"train.micro_batch_size={global_batch // nproc}"]
        if axis == "fsdp":
            args.append("train.compile_scope=block")
    return run.replace("@", "-at-").replace("+", "-"), nproc, args, bool(warm)


def plan(args, ctx: Context) -> list[Step]:
    data = "{out}/{stamp}-corpus/data"
    steps = [Step("corpus", ["bash", "-c", f'"$0" scripts/build_speedrun_corpus.py "$1" "$2/text" && '
                             f'"$0" -m distlm prepare "$2/text" --out "$2/data" --quiet',
                             ctx.python, args.corpus, "{dir}"])]
    common = [f"data.dir={data}", "train.checkpoint_every=0", "log.root={out}", "log.progress=false",
              "log.tensorboard=false", "log.samples=0"] + ([] if ctx.cpu else ["train.eval_batches=0"])
    specs = []
    for run in args.runs.split():
        name, nproc, train, warm = run_args(run, args.extra.split(), ctx.cpu)
        cache = "{out}/inductor-" + (name[:-len("-warm")] if warm else name)
        # An empty compile cache per run unless +warm: the time to loss includes compilation.
        launch = ctx.distlm(["train", *train, *common, f"log.name={{stamp}}-{name}-run"], nproc)
        cold = [] if warm else ["rm", "-rf", cache, "&&"]
        steps.append(Step(name, ["bash", "-c", " ".join(cold) + ' exec "$@"', "bash", *launch] if cold else launch,
                          env={"TORCHINDUCTOR_CACHE_DIR": cache}))
        specs.append(f"{{out}}/{{stamp}}-{name}-run=@{{out}}/{{stamp}}-{name}/launch_time.txt")
    report = [ctx.python, "benchmarks/tools/speedrun_report.py", "{dir}", *specs]
    steps.append(Step("report", report, env={"TARGET": str(args.target)} if args.target else {},
                      result="speedrun-table.json"))
    if args.nanogpt:
        steps.append(Step("nanogpt-bench", ["bash", "-c", 'cd "$0" && exec "$1" bench.py --real_data=False '
                                            '--compile=True --batch_size=12 --block_size=1024',
                                            args.nanogpt, ctx.python]))
    return steps
