"""Two "nodes" on one host: the inter-node link, DDP / HSDP / FSDP across it, a node killed and replaced.

    python benchmarks/run.py multi-node --gpus 4 [--items bandwidth,throughput,restart,resume]
        [--emulate hostid|disable] [--compile] [--port 29611]

Two torchrun launchers of gpus/2 processes each (--nnodes 2, --node_rank 0/1, c10d rendezvous on
localhost), each with its own CUDA_VISIBLE_DEVICES. --emulate hostid (the default) gives each its
own NCCL_HOSTID, so NCCL sees two hosts: NVLink inside a node, its socket transport between;
--emulate disable puts every link on sockets (NCCL_P2P_DISABLE, NCCL_SHM_DISABLE). Items:
bandwidth (all-reduce of 256 MB under one launcher and across the two), throughput (`distlm bench`
of gpt2-124m-1024 under DDP with one launcher and with two, then HSDP and flat FSDP across two),
restart (train 60 steps with checkpoints every 20, kill node 1 after the first, start it again; the
run must resume and finish), resume (that run's last checkpoint continued under one launcher as
FSDP over all GPUs and as DDP over half). On a real cluster use scripts/slurm instead.
"""
from __future__ import annotations

from run import Context, Step

ITEMS = ("bandwidth", "throughput", "restart", "resume")


def add_arguments(p) -> None:
    p.add_argument("--items", default=",".join(ITEMS), help=f"comma-separated, of {', '.join(ITEMS)}")
    p.add_argument("--emulate", choices=("hostid", "disable"), default="hostid")
    p.add_argument("--compile", action="store_true", help="compile the model (default: eager, no compile time)")
    p.add_argument("--port", type=int, default=29611)
    p.add_argument("--config", default="gpt2-124m-1024")


def plan(args, ctx: Context) -> list[Step]:
    items = args.items.split(",")
    unknown = [i for i in items if i not in ITEMS]
    if unknown:
        raise ValueError(f"--items: unknown {', '.join(unknown)}; items are {', '.join(ITEMS)}")
    np = 2 if ctx.cpu else ctx.gpus
    if np < 2 or np % 2:
        raise ValueError(f"two nodes need an even number of GPUs, --gpus is {ctx.gpus}")
    per, dev = np // 2, "cpu" if ctx.cpu else "cuda"
    env = {"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

    def node(rank: int, rdzv: str, cmd: list[str]) -> list[str]:
        net = [f"NCCL_HOSTID=distlm-node{rank}"] if args.emulate == "hostid" else ["NCCL_P2P_DISABLE=1",
                                                                                    "NCCL_SHM_DISABLE=1"]
        gpus = ",".join(str(rank * per + i) for i in range(per)) if dev == "cuda" else ""
        return ["env", f"CUDA_VISIBLE_DEVICES={gpus}", *net, ctx.python, "-m", "torch.distributed.run", "--nnodes", "2",
                "--nproc_per_node", str(per), "--node_rank", str(rank), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"localhost:{args.port}", "--rdzv-id", rdzv, *cmd]

    def two(name: str, cmd: list[str], result: str = "result.json") -> Step:
        return Step(name, node(0, name, cmd), env=env, background=[node(1, name, cmd)], result=result)

    one = ["--standalone", f"--nproc_per_node={np}"]
    model = ["--config", args.config, "data.source=synthetic", "train.on_nan=off", f"train.compile={str(args.compile).lower()}",
             f"train.global_batch_size={16 * np}", "train.micro_batch_size=16"]
    if ctx.cpu:
        model = ["--config", "tiny", "data.source=synthetic", f"train.global_batch_size={4 * np}",
                 "train.micro_batch_size=2", "train.device=cpu"]
    else:
        model.insert(2, "model.vocab_size=50257")
    steps = []
    if "bandwidth" in items:
        probe = ["benchmarks/tools/allreduce.py", dev, "--json", "{dir}/result.json"]
        steps.append(Step("allreduce-one", [ctx.python, "-m", "torch.distributed.run", *one, *probe], env=env))
        steps.append(two("allreduce-two", probe))
    if "throughput" in items:
        bench = ["-m", "distlm", "bench", *model, "--warmup", "3", "--steps", "8", "--json", "{dir}/result.json"]
        steps.append(Step("ddp-one", [ctx.python, "-m", "torch.distributed.run", *one, *bench,
                                      f"parallel.dp_replicate={np}"], env=env))
        steps.append(two("ddp-two", bench + [f"parallel.dp_replicate={np}"]))
        if per >= 2:
            steps.append(two("hsdp-two", bench + ["parallel.dp_replicate=2", f"parallel.dp_shard={per}"]))
            steps.append(two("fsdp-two", bench + [f"parallel.dp_shard={np}"]))
    train = [*model, "train.max_steps=60", "train.checkpoint_every=20", "train.eval_every=0", "log.samples=0",
             "parallel.timeout_s=60", f"parallel.dp_replicate={np}", "log.progress=false", "log.tensorboard=false"]
    if "restart" in items or "resume" in items:
        steps.append(Step("restart", [ctx.python, "benchmarks/tools/node_restart.py", "--dir", "{dir}",
                                      "--nproc-per-node", str(per), "--device", dev, "--emulate", args.emulate,
                                      "--port", str(args.port), "--", *train], env=env))
    if "resume" in items:
        ckpt = "{out}/{stamp}-restart/runs/elastic/checkpoints/step_0000060"
        for name, n, lay in (("resume-fsdp-all", np, f"parallel.dp_shard={np}"),
                             ("resume-ddp-half", per, f"parallel.dp_replicate={per}")):
            cmd = ["train", *model, f"train.global_batch_size={(4 if ctx.cpu else 16) * np}", f"train.resume={ckpt}",
                   "train.max_steps=65", "train.checkpoint_every=0", "train.eval_every=0", "log.samples=0",
                   "log.root={dir}", "log.name=resume", "log.progress=false", "log.tensorboard=false"]
            steps.append(Step(name, ctx.distlm(cmd + ([lay] if n > 1 else []), n), env=env))
    return steps
