"""Runs several task=classify training jobs in one torchrun launch (tests/tasks/test_classify.py).

    torchrun --standalone --nproc_per_node 2 tests/helpers/classify_worker.py PLAN.json

PLAN.json: {"out": "results.json", "jobs": [{"name": "ddp2", "overrides": [...]}, ...]}. Each
job is the Trainer the CLI builds; losses and grad norms land in each run's metrics.csv,
the last evaluation in its eval-val.json. Rank 0 writes what only a live process sees to ``out``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from distlm.config import load_config
from distlm.train.trainer import Trainer


def main(plan_path: str) -> None:
    torch.set_num_threads(1)
    plan = json.loads(Path(plan_path).read_text())
    results = {}
    for job in plan["jobs"]:
        trainer = Trainer(load_config(None, job["overrides"]))
        info = {"start_step": trainer.step, "resumed_from": str(trainer.resumed_from or ""),
                "model_type": type(trainer.model).__name__, "dp_rank": trainer.dims.dp_rank}
        trainer.train()
        info["last_eval"] = trainer.task.last
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, info)
        results[job["name"]] = gathered
    if dist.get_rank() == 0:
        Path(plan["out"]).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
