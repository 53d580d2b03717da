#!/usr/bin/env bash
# DDP / FSDP2 / resume-across-layouts / distlm env on 2 GPUs with NCCL, torch 2.11.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TR="python3 -m torch.distributed.run --standalone --nproc_per_node 2"
python3 - <<'PY' 2>&1 | tee "$OUT/api.txt"
import inspect, torch
from torch.distributed.device_mesh import init_device_mesh, DeviceMesh
print(torch.__version__)
print("init_device_mesh", inspect.signature(init_device_mesh))
print("_flatten", inspect.signature(DeviceMesh._flatten))
PY
$TR -m distlm env 2>&1 | grep -v "^W1" | tee "$OUT/env.txt"
$TR .devcheck/timeouts.py 2>&1 | grep -v "^W1" | tee -a "$OUT/env.txt"
A="--config gpt2-124m data.source=synthetic model.vocab_size=50257 train.max_steps=30 train.warmup_steps=5 log.every=5 log.progress=false train.eval_every=0 train.checkpoint_every=15 log.root=/tmp/runs log.tensorboard=false"
run() { name=$1; shift; echo "=== $name $*"; start=$(date +%s); "$@" 2>&1 | grep -v "^W1\|^\*\*\*"; echo "=== $name wall $(( $(date +%s) - start )) s"; }
{
run single python3 -m distlm train $A log.name=single
run fsdp2 $TR -m distlm train $A log.name=fsdp parallel.dp_shard=2
run ddp2 $TR -m distlm train $A log.name=ddp parallel.dp_replicate=2
run fsdp_to_ddp $TR -m distlm train $A log.name=fsdp_to_ddp parallel.dp_replicate=2 train.resume=/tmp/runs/fsdp/checkpoints/step_0000015
run ddp_to_fsdp_zero2 $TR -m distlm train $A log.name=ddp_to_fsdp parallel.dp_shard=2 parallel.reshard_after_forward=false train.resume=/tmp/runs/ddp/checkpoints/step_0000015
run fsdp_to_single python3 -m distlm train $A log.name=fsdp_to_single train.resume=/tmp/runs/fsdp/checkpoints/step_0000015
run offload $TR -m distlm train $A log.name=offload parallel.dp_shard=2 parallel.cpu_offload=true train.max_steps=10 train.checkpoint_every=0
run fsdp_fp32 $TR -m distlm train $A log.name=fsdp_fp32 parallel.dp_shard=2 parallel.mixed_precision=false train.max_steps=10 train.checkpoint_every=0
} 2>&1 | tee "$OUT/train.log"
for r in single fsdp ddp fsdp_to_ddp ddp_to_fsdp fsdp_to_single offload fsdp_fp32; do echo "== $r"; cut -d, -f1,3,5,6,8 /tmp/runs/$r/metrics.csv; done > "$OUT/metrics.txt" 2>&1
