#!/usr/bin/env bash
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; rm -rf /tmp/runs
TR="python3 -m torch.distributed.run --standalone --nproc_per_node 4"
A="--config gpt2-124m data.source=synthetic model.vocab_size=50257 train.max_steps=20 train.warmup_steps=5 log.every=5 log.progress=false train.eval_every=0 train.checkpoint_every=10 log.root=/tmp/runs log.tensorboard=false"
run() { name=$1; shift; echo "=== $name"; start=$(date +%s); "$@" > "$OUT/$name.log" 2>&1; echo "rc $?"; grep -v "^W1\|\*\*\*\|OMP_NUM" "$OUT/$name.log" | grep "step \|Error\|resumed" | tail -5; echo "=== $name wall $(( $(date +%s) - start )) s"; }
{
$TR -m distlm env | grep -v "^W1\|\*\*\*\|OMP_NUM"
run hsdp $TR -m distlm train $A log.name=hsdp parallel.dp_replicate=2 parallel.dp_shard=2
run fsdp4 $TR -m distlm train $A log.name=fsdp4 parallel.dp_shard=4
run ddp4 $TR -m distlm train $A log.name=ddp4 parallel.dp_replicate=4
run hsdp_to_ddp4 $TR -m distlm train $A log.name=hsdp_to_ddp4 parallel.dp_replicate=4 train.resume=/tmp/runs/hsdp/checkpoints/step_0000010
} 2>&1 | tee "$OUT/summary.txt"
