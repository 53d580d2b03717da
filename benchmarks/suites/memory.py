"""The planner's memory estimate against the measured peak, for each optimizer, on one GPU.

    python benchmarks/run.py memory [--config gpt2-124m-1024] [--optimizers adamw,muon,...] [--micro 2,8]

One `distlm bench` per optimizer of the registry (optim.name, distlm/optim/), synthetic tokens,
one process: its JSON holds the peak memory the step allocated (peak_mem_gb, after the warm-up,
so the optimizer's state exists) and the planner's estimate for the same run (planned_mem_gb,
with the state that optimizer declares, and its terms). A last step tabulates planned against
measured and fails when an optimizer's estimate is more than 10% off (the goal for Muon and
every optimizer added after it). --micro sets the micro-batch (and the global batch to it, no
accumulation); a small one leaves the optimizer's state a large share of the peak, a large one
tests the activations' estimate. A preset's optim.muon.* (speedrun-124m's embed_lr) is Muon's
alone: the other optimizers run the same preset without it.
"""
from __future__ import annotations

import sys

from run import ROOT, Context, Step
from suites import add_common, int_list


def registered() -> list[str]:
    sys.path.insert(0, str(ROOT))  # this checkout's registry, as the steps will run it
    from distlm.optim import REGISTRY
    return list(REGISTRY)


def add_arguments(p) -> None:
    add_common(p, "gpt2-124m-1024", warmup=3, steps=3)
    p.add_argument("--optimizers", default=None, help="comma-separated optim.name values (default: every registered)")
    p.add_argument("--micro", default="2,8", help="micro-batch sizes to run, comma-separated (default 2,8)")
    p.add_argument("--tolerance", type=float, default=0.10, help="largest relative error allowed (default 0.10)")


def plan(args, ctx: Context) -> list[Step]:
    known = registered()
    names = args.optimizers.split(",") if args.optimizers else known
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--optimizers: {', '.join(unknown)} not registered; one of {', '.join(known)}")
    steps, folders = [], []
    for micro in int_list(args.micro):
        for name in names:
            step = f"{name}-m{micro}"
            cmd = ctx.tiny(["bench", "--config", args.config, "data.source=synthetic", "train.on_nan=off",
                            f"optim.name={name}", f"train.micro_batch_size={micro}",
                            f"train.global_batch_size={micro}", *args.set, "--warmup", str(args.warmup),
                            "--steps", str(args.steps), "--json", "{dir}/result.json"])
            steps.append(Step(step, ctx.distlm(cmd)))
            folders.append(f"{{out}}/{{stamp}}-{step}")
    steps.append(Step("compare", [ctx.python, "benchmarks/tools/memory_report.py", *folders,
                                  "--tolerance", str(args.tolerance), "--json", "{dir}/result.json"]))
    return steps
