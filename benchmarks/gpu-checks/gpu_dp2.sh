#!/usr/bin/env bash
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TR="python3 -m torch.distributed.run --standalone --nproc_per_node 2"
A="--config gpt2-124m data.source=synthetic model.vocab_size=50257 train.max_steps=30 train.warmup_steps=5 log.every=5 log.progress=false train.eval_every=0 train.checkpoint_every=0 log.root=/tmp/runs log.tensorboard=false"
run() { name=$1; shift; echo "=== $name $*"; start=$(date +%s); "$@" 2>&1 | grep -v "^W1\|^\*\*\*\|OMP_NUM"; echo "=== $name wall $(( $(date +%s) - start )) s"; }
{
run offload $TR -m distlm train $A log.name=offload parallel.dp_shard=2 parallel.cpu_offload=true train.max_steps=10
run single_c python3 -m distlm train $A log.name=single_c train.compile=true
run fsdp_c $TR -m distlm train $A log.name=fsdp_c parallel.dp_shard=2 train.compile=true
run ddp_c $TR -m distlm train $A log.name=ddp_c parallel.dp_replicate=2 train.compile=true
run fsdp_mb32 $TR -m distlm train $A log.name=fsdp_mb32 parallel.dp_shard=2 train.micro_batch_size=32
} 2>&1 | tee "$OUT/train2.log"
for r in offload single_c fsdp_c ddp_c fsdp_mb32; do echo "== $r"; cut -d, -f1,3,5,6,8 /tmp/runs/$r/metrics.csv; done > "$OUT/metrics2.txt" 2>&1
