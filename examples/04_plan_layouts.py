"""Which layout for gpt2-1.5b on 4 GPUs? The planner's table and pick, from Python.

    python examples/04_plan_layouts.py [GPUS] [GPU_MEM_GIB]

Then train with the recommended layout, e.g.
    torchrun --nproc_per_node 4 -m distlm train --config gpt2-1.5b model.n_head=20 parallel.dp_shard=4
"""
import sys

from distlm.config import load_config
from distlm.planner import explain, format_table, plan

gpus = int(sys.argv[1]) if len(sys.argv) > 1 else 4
mem = float(sys.argv[2]) if len(sys.argv) > 2 else 79.0
# 20 heads of 80 instead of GPT-2's 25 of 64: same size, and tensor parallelism can split it.
cfg = load_config("gpt2-1.5b", ["model.vocab_size=50257", "model.n_head=20"])
estimates = plan(cfg.model, gpus, mem, global_batch=64, micro_batch=8)
print(format_table(estimates[:6]))
print(explain(next(e for e in estimates if e.fits), estimates, mem))
