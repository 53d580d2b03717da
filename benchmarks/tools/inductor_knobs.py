"""`distlm` with some of inductor's process-wide settings changed, for experiments only:

    INDUCTOR="reorder_for_compute_comm_overlap=true" torchrun ... benchmarks/tools/inductor_knobs.py bench ...

INDUCTOR holds comma-separated KEY=VALUE pairs (true/false, integers, or strings); each KEY must
already exist in torch._inductor.config, so a typo fails at once. A setting that pays becomes a
distlm option; this wrapper is how it is measured first.
"""
import os
import sys

import torch._inductor.config as inductor_config

from distlm.cli import main


def parse(value: str):
    low = value.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(value)
    except ValueError:
        return value


for pair in filter(None, os.environ.get("INDUCTOR", "").split(",")):
    key, _, value = pair.partition("=")
    obj, name = inductor_config, key
    while "." in name:  # a nested section: aten_distributed_optimizations.enable_overlap_scheduling
        head, name = name.split(".", 1)
        obj = getattr(obj, head)
    if not hasattr(obj, name):
        sys.exit(f"error: INDUCTOR: torch._inductor.config has no setting {key!r}")
    setattr(obj, name, parse(value))
    print(f"inductor: {key} = {getattr(obj, name)!r}", flush=True)

sys.exit(main())
