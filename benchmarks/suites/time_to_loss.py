"""Time to a validation loss: the speedrun-124m recipe against nanoGPT's recipe, same data, same machine.

    python benchmarks/run.py time-to-loss --corpus DIR [--runs "baseline speedrun"] [--extra OVERRIDES]
        [--target LOSS] [--warm] [--nanogpt DIR] [--corpora prose,docs] [--docs-corpus FILE] [--concurrent]

RUN is nanogpt (nanoGPT's own train.py from the --nanogpt checkout, through
tools/nanogpt_recipe.py: its recipe, timed from its launch and scored over the whole val split),
baseline (the same recipe through distlm), speedrun, or speedrun-NAME for an ablation (ABLATIONS
below); RUN@ddpN or
RUN@fsdpN runs it on N GPUs (a run that sets its micro-batch keeps its global batch, split evenly;
speedrun-124m's data_parallel table gives 4 GPUs 64 sequences a step for 300 steps); RUN+warm runs RUN again on the
compile cache RUN left (a repeated run on one machine). Every other run starts from an empty
cache folder (compiled graphs, and the imports' bytecode where the installation keeps none:
distlm/bytecode.py), so its time counts imports, set-up and compilation: each run is timed from its
own process start. The corpus (Gutenberg + State of the Union + GCIDE, about 21M GPT-2 tokens) is laid
out by scripts/build_speedrun_corpus.py from --corpus (../shared/data/corpus) and prepared on the
machine that runs it; GCIDE is GPL and is never vendored. Validation covers the whole val split.
The report (tools/speedrun_report.py) gives seconds and tokens to the baseline's final loss (or
--target), steady tok/s, MFU, the start-up split and the two plots; runs on 4 GPUs are timed to the
final loss of nanoGPT (else the baseline) on 4 GPUs, runs on one GPU to the one-GPU one.

--corpora prose,docs runs every RUN on each corpus: prose is the corpus above; docs is technical
documentation (scripts/build_docs_corpus.py: docstrings of the standard library and of permissively
licensed packages), read from --docs-corpus FILE (a docs.jsonl built on another machine and
carried) or built on this one. Runs on docs are named docs-RUN, and each corpus gets its report.

--launcher distlm starts distlm's multi-GPU runs as `distlm train --nproc-per-node N` instead of
`torchrun ... -m distlm train` (the same ranks; torchrun's own import reads distlm's kept bytecode).

--concurrent runs the one-GPU runs at once, one per GPU (CUDA_VISIBLE_DEVICES=i), --gpus of them at
a time, each still timed from its own launch with its own compile cache; the report says which
ran together. Multi-GPU runs, and a +warm run whose cold run is in the same batch, run after.

The baseline is nanoGPT's recipe through the gpt2-124m-1024 preset (64 x 1024 tokens a step,
AdamW 0.9/0.95, weight decay 0.1, lr 6e-4, 100 warm-up steps, cosine to 6e-5, 1,500 steps, clip
1.0, bf16) in distlm's fastest step settings. --nanogpt DIR also runs nanoGPT's own bench.py from a
checkout in DIR (an ignored folder such as carry/nanogpt; never vendored) on the same card, as a
reference for the step speed.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from run import Context, Step

BASELINE = ["--config", "gpt2-124m-1024", "train.max_steps=1500", "train.global_batch_size=64",
            "train.micro_batch_size=64", "optim.adamw.lr=6e-4", "train.min_lr_ratio=0.1", "train.warmup_steps=100",
            "train.decay=cosine", "optim.adamw.weight_decay=0.1", "train.grad_clip=1.0", "optim.adamw.beta1=0.9",
            "optim.adamw.beta2=0.95", "train.dtype=bf16", "train.compile=true", "train.compile_scope=model",
            "model.loss_chunk=8192", "train.eval_every=250"]
SPEEDRUN = ["--config", "speedrun-124m"]

# Each changes one piece of the recipe (the time-to-loss page gives what each measured).
ABLATIONS = {
    "adamw": "optim.name=adamw optim.adamw.lr=1.5e-3 optim.adamw.beta1=0.9",  # Muon off
    "plainblock": "model.qk_norm=false model.mlp=gelu model.zero_init_proj=false model.logit_softcap=0",
    "cosine": "train.decay=cosine",  # no WSD cool-down
    "docmask": "model.attn_mask=doc",  # document-masked attention (FlexAttention)
    "valemb": "model.value_embeds=3 model.skip_connections=true",
    "novalemb": "model.value_embeds=0 model.skip_connections=false",
    "ve6": "model.value_embeds=6",
    "embedlr": "optim.muon.embed_lr=0.3", "embedlr1": "optim.muon.embed_lr=0.1", "embedlr6": "optim.muon.embed_lr=0.6",
    "noembedlr": "optim.muon.embed_lr=0",
    "block": "train.compile_scope=block", "model": "train.compile_scope=model",
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
    # The preset distlm/configs/speedrun-moe.yaml: a mixture of experts at speedrun-124m's active shape
    # (tests/model/test_moe.py checks that the two say the same).
    "moe": "model.moe.experts=16 model.moe.top_k=3 model.moe.d_ff=768 model.moe.shared=1 model.moe.first_dense=1 "
           "model.moe.bias_rate=0.005",
    # Fewer, wider experts at the same active width (2 x 1024 routed + 1024 shared = 3072): larger
    # groups for the grouped matmul, half the routed weights for Muon to orthogonalise.
    "moe8": "model.moe.experts=8 model.moe.top_k=2 model.moe.d_ff=1024 model.moe.shared=1 model.moe.first_dense=1 "
            "model.moe.bias_rate=0.005",
    # moe8 with the routing biases moving 4x as fast: the load evener sooner in a 600-step run.
    "moe8b": "model.moe.experts=8 model.moe.top_k=2 model.moe.d_ff=1024 model.moe.shared=1 model.moe.first_dense=1 "
             "model.moe.bias_rate=0.02",
    # Four wide experts, one a token, beside a shared one of the same width (1536 + 1536 = 3072):
    # the fewest groups and the least routing for the same active width.
    "moe4": "model.moe.experts=4 model.moe.top_k=1 model.moe.d_ff=1536 model.moe.shared=1 model.moe.first_dense=1 "
            "model.moe.bias_rate=0.005",
    # moe8 in every other block (blocks 1, 3, ...; the rest dense): half the routing's cost.
    "moe8e2": "model.moe.experts=8 model.moe.top_k=2 model.moe.d_ff=1024 model.moe.shared=1 model.moe.first_dense=1 "
              "model.moe.every=2 model.moe.bias_rate=0.005",
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
    p.add_argument("--nanogpt", metavar="DIR", help="nanoGPT's checkout: runs named nanogpt, and its bench.py")
    p.add_argument("--corpora", default="prose", help="comma-separated: prose, docs (default prose)")
    p.add_argument("--docs-corpus", metavar="FILE", help="a docs.jsonl from scripts/build_docs_corpus.py "
                                                         "(default: build it on this machine)")
    p.add_argument("--concurrent", action="store_true", help="one-GPU runs at once, one per GPU")
    p.add_argument("--launcher", choices=("torchrun", "distlm"), default="torchrun",
                   help="distlm's runs above one GPU: torchrun ... -m distlm train, or distlm train --nproc-per-node N "
                        "(torchrun's entry point in a distlm process: distlm/launch/local.py)")
    p.add_argument("--no-nanogpt-bench", action="store_true",
                   help="leave out nanoGPT's bench.py (the step-speed reference --nanogpt adds)")


def run_args(run: str, extra: list[str], cpu: bool) -> tuple[str, int, list[str], bool]:
    """(name, processes, distlm train arguments, warm) of one RUN."""
    m = re.fullmatch(r"(nanogpt|baseline|speedrun(?:-([a-z0-9]+))?)(?:@(ddp|fsdp)(\d+))?(\+warm)?", run)
    if not m or (m.group(2) and m.group(2) not in ABLATIONS) or (m.group(1) == "nanogpt" and m.group(3) == "fsdp"):
        raise ValueError(f"run {run!r}: expected nanogpt[@ddpN], baseline or speedrun[-ABLATION][@ddpN|@fsdpN]"
                         f"[+warm]; ablations: {', '.join(sorted(ABLATIONS))}")
    recipe, ablation, axis, n, warm = m.groups()
    if recipe == "nanogpt":  # its own train.py: tools/nanogpt_recipe.py builds the command
        return run.replace("@", "-at-").replace("+", "-"), int(n) if n else 1, [], bool(warm)
    args = list(BASELINE) if recipe == "baseline" else [*SPEEDRUN, *extra, *(ABLATIONS[ablation].split()
                                                                                if ablation else [])]
    if cpu:
        # two blocks hold one value-embedding table at most (the recipe's 3 need 6 blocks)
        args += CPU + ([] if recipe == "baseline" else ["model.value_embeds=1"])
    given = [a.split("=", 1)[1] for a in args if a.startswith("train.global_batch_size=")]
    global_batch = int(given[-1]) if given else (64 if recipe == "baseline" else 32)
    nproc = int(n) if n else 1
    if axis:  # each GPU takes its share of the global batch
        args.append(f"parallel.{'dp_replicate' if axis == 'ddp' else 'dp_shard'}={nproc}")
        if any(a.startswith("train.micro_batch_size=") for a in args):
            args.append(f"train.micro_batch_size={global_batch // nproc}")
        # else the preset's own data_parallel table may grow the batch, and auto fits the
        # micro-batch to what each GPU then holds
        if axis == "fsdp":
            args.append("train.compile_scope=block")
    return run.replace("@", "-at-").replace("+", "-"), nproc, args, bool(warm)


CORPORA = ("prose", "docs")


def corpus_step(corpus: str, args, ctx: Context, nanogpt: bool) -> Step:
    """Lay out the corpus, prepare it (GPT-2 tokens) and, for nanoGPT, export its train.bin/val.bin."""
    if corpus == "prose":
        text = f'"$0" scripts/build_speedrun_corpus.py "$1" "$2/text"'
        source = args.corpus
    elif args.docs_corpus:
        text = 'mkdir -p "$2/text" && cp "$1" "$2/text/docs.jsonl"'
        source = args.docs_corpus
    else:
        text = '"$0" scripts/build_docs_corpus.py --out "$2/text/docs.jsonl"' + (' --max-mb 0.5' if ctx.cpu else '')
        source = "-"
    inputs = '"$2/text"' if corpus == "prose" else '"$2/text/docs.jsonl"'  # not the licence list beside it
    script = f'{text} && "$0" -m distlm prepare {inputs} --out "$2/data" --quiet'
    if nanogpt:
        script += ' && "$0" benchmarks/tools/nanogpt_recipe.py export "$2/data" "$2/nanogpt"'
    return Step("corpus" if corpus == "prose" else f"corpus-{corpus}", ["bash", "-c", script, ctx.python, source,
                                                                         "{dir}"])


@dataclass
class Job:
    """One run of one corpus: its name, processes, command (with {dir}: its folder) and cache."""
    name: str
    nproc: int
    argv: list[str]
    cache: str
    warm: bool
    cold_name: str


def jobs_for(corpus: str, args, ctx: Context) -> list[Job]:
    prefix = "" if corpus == "prose" else f"{corpus}-"
    folder = "{out}/{stamp}-" + ("corpus" if corpus == "prose" else f"corpus-{corpus}")
    common = [f"data.dir={folder}/data", "train.checkpoint_every=0", "log.root={out}", "log.progress=false",
              "log.tensorboard=false", "log.samples=0"] + ([] if ctx.cpu else ["train.eval_batches=0"])
    jobs = []
    for run in args.runs.split():
        name, nproc, train, warm = run_args(run, args.extra.split(), ctx.cpu)
        name = prefix + name
        cold_name = name[:-len("-warm")] if warm else name
        if run.startswith("nanogpt"):
            # nanoGPT's DDP takes cuda:LOCAL_RANK whatever --device says: on the CPU, one process
            nproc = 1 if ctx.cpu else nproc
            launch = [ctx.python, "benchmarks/tools/nanogpt_recipe.py", "run", "--nanogpt", args.nanogpt, "--data",
                      f"{folder}/nanogpt", "--run-dir", f"{{out}}/{{stamp}}-{name}-run", "--gpus", str(nproc),
                      "--python", ctx.python, "--launch-time", "{dir}/launch_time.txt", "--result",
                      "{dir}/result.json", *(["--cpu", "--val-blocks", "64"] if ctx.cpu else [])]
        elif nproc > 1 and args.launcher == "distlm":
            launch = [*ctx.distlm(["train", *train, *common, f"log.name={{stamp}}-{name}-run"]),
                      f"--nproc-per-node={nproc}"]
        else:
            launch = ctx.distlm(["train", *train, *common, f"log.name={{stamp}}-{name}-run"], nproc)
        jobs.append(Job(name, nproc, launch, "{out}/inductor-" + cold_name, warm, cold_name))
    return jobs


def sequential(job: Job) -> Step:
    # An empty compile cache per run unless +warm: the time to loss includes compilation.
    argv = job.argv if job.warm else ["bash", "-c", f'rm -rf "{job.cache}" && exec "$@"', "bash", *job.argv]
    return Step(job.name, argv, env={"TORCHINDUCTOR_CACHE_DIR": job.cache, "DISTLM_CACHE_DIR": job.cache})


def concurrent(jobs: list[Job], index: int) -> Step:
    """One step that starts each job on its own GPU at once, each in its own folder (the layout a
    step of its own has: command.txt, launch_time.txt, log.txt), and waits for all of them."""
    lines = ["pids=()"]
    for gpu, job in enumerate(jobs):
        where = "{out}/{stamp}-" + job.name
        cmd = shlex.join(job.argv).replace("{dir}", where)
        clear = "" if job.warm else f"rm -rf {shlex.quote(job.cache)} && "
        lines += [f"mkdir -p {shlex.quote(where)}",
                  f"printf '%s\\n' {shlex.quote(f'CUDA_VISIBLE_DEVICES={gpu} TORCHINDUCTOR_CACHE_DIR={job.cache} DISTLM_CACHE_DIR={job.cache} {cmd}')}"
                  f" > {shlex.quote(where + '/command.txt')}",
                  f"( {clear}date +%s.%N > {shlex.quote(where + '/launch_time.txt')} && "
                  f"CUDA_VISIBLE_DEVICES={gpu} TORCHINDUCTOR_CACHE_DIR={shlex.quote(job.cache)} "
                  f"DISTLM_CACHE_DIR={shlex.quote(job.cache)} exec {cmd} ) "
                  f"> {shlex.quote(where + '/log.txt')} 2>&1 &",
                  "pids+=($!)"]
    lines += ['rc=0; for p in "${{pids[@]}}"; do wait "$p" || rc=$?; done',  # braces doubled: filled by run.py
              f"echo 'ran at once, one per GPU: {', '.join(j.name for j in jobs)}'", 'exit "$rc"']
    return Step(f"concurrent{index}", ["bash", "-c", "\n".join(lines)])


def plan(args, ctx: Context) -> list[Step]:
    corpora = [c for c in args.corpora.split(",") if c]
    bad = [c for c in corpora if c not in CORPORA]
    if bad or not corpora:
        raise ValueError(f"--corpora {args.corpora!r}: expected a comma-separated subset of {', '.join(CORPORA)}")
    wants_nanogpt = any(r.startswith("nanogpt") for r in args.runs.split())
    if wants_nanogpt and not args.nanogpt:
        raise ValueError("runs named nanogpt need --nanogpt DIR (nanoGPT's checkout, e.g. carry/nanogpt)")
    steps = [corpus_step(c, args, ctx, wants_nanogpt) for c in corpora]
    all_jobs = {c: jobs_for(c, args, ctx) for c in corpora}
    together: list[str] = []
    if args.concurrent:
        width = max(ctx.gpus, 1)
        single = [j for c in corpora for j in all_jobs[c] if j.nproc == 1]
        batches: list[list[Job]] = []
        for job in single:  # the first batch with room, after the one holding its cold run (a +warm run)
            after = next((i + 1 for i, b in enumerate(batches) if job.warm and any(j.name == job.cold_name for j in b)),
                         0)
            free = next((i for i in range(after, len(batches)) if len(batches[i]) < width), None)
            if free is None:
                batches.append([])
                free = len(batches) - 1
            batches[free].append(job)
        for i, batch in enumerate(batches):
            steps.append(concurrent(batch, i) if len(batch) > 1 else sequential(batch[0]))
            together += [j.name for j in batch] if len(batch) > 1 else []
        steps += [sequential(j) for c in corpora for j in all_jobs[c] if j.nproc > 1]
    else:
        steps += [sequential(j) for c in corpora for j in all_jobs[c]]
    for corpus in corpora:
        specs = [f"{{out}}/{{stamp}}-{j.name}-run=@{{out}}/{{stamp}}-{j.name}/launch_time.txt" for j in all_jobs[corpus]]
        env = {"TARGET": str(args.target)} if args.target else {}
        if together:
            env["CONCURRENT"] = ",".join(together)
        report = [ctx.python, "benchmarks/tools/speedrun_report.py", "{dir}", *specs]
        steps.append(Step("report" if corpus == "prose" else f"report-{corpus}", report, env=env,
                          result="speedrun-table.json"))
    if args.nanogpt and not ctx.cpu and not args.no_nanogpt_bench:  # bench.py needs CUDA
        # PYTHONSAFEPATH (set on some images) keeps the script's folder off sys.path, and
        # bench.py imports its model.py from there.
        steps.append(Step("nanogpt-bench", ["bash", "-c", 'cd "$0" && exec env -u PYTHONSAFEPATH "$1" bench.py '
                                            '--real_data=False --compile=True --batch_size=12 --block_size=1024',
                                            args.nanogpt, ctx.python]))
    return steps
