#!/usr/bin/env bash
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; rm -rf /tmp/runs
B='"data.source=synthetic", "model.vocab_size=50257", "train.max_steps=20", "train.warmup_steps=5", "log.every=5", "log.progress=false", "train.eval_every=0", "train.checkpoint_every=10", "log.root=/tmp/runs", "log.tensorboard=false", "parallel.dp_shard=2", "model=gpt2-124m"'
cat > /tmp/plan.json <<J
{"out": "/tmp/runs/res.json", "jobs": [{"name": "restart", "crash_after_first_save": true, "overrides": [$B, "log.name=restart", "train.resume=auto"]}]}
J
python3 -m torch.distributed.run --standalone --nproc_per_node 2 --max_restarts 1 tests/dist_worker.py /tmp/plan.json > $OUT/restart.log 2>&1; echo "restart rc $?"
grep -v "^W1\|\*\*\*\|OMP_NUM" $OUT/restart.log | grep "step \|resumed\|Error\|attempt" | tail -8
python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m distlm train model=gpt2-124m data.source=synthetic model.vocab_size=50257 train.max_steps=20 train.warmup_steps=5 log.every=5 log.progress=false train.eval_every=0 log.root=/tmp/runs log.tensorboard=false log.name=plain parallel.dp_shard=2 > $OUT/plain.log 2>&1; echo "plain rc $?"
grep "step \|Error" $OUT/plain.log | tail -4
