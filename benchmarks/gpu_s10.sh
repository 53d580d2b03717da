#!/usr/bin/env bash
# The 4-GPU call after gpu_s9d.sh (< 10 min): what the ninth session could not run.
#   CORPUS=carry/corpus bash benchmarks/gpu_s10.sh          (DRY=1: rehearsed on the CPU box)
# 1. (issue 19) TP2 at micro-batch 16, plain (GPUs 2-3) beside async TP (GPUs 0-1): whether the
#    micro-pipelined all-gathers pay once the host no longer sets the pace;
# 2. (issue 16) speedrun-b64s450@ddp4: 64 sequences a step (16 per GPU), 450 steps, against the
#    4-GPU baseline of gpu_s9d.sh's call (TARGET=<its final loss> rebuilds the table);
# 3. (issue 19) two "nodes" of 2 GPUs (NCCL_HOSTID apart): the kill and restart again, now that a failed
#    NCCL collective ends the worker (the survivors waited 42 s before), and the 1 x 2 resume; then
#    DDP / HSDP / flat FSDP throughput with NVLink inside each node.
# Everything comes back as $OUT/s10.tgz; a summary on stdout.
set -uo pipefail
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; R=/tmp/s10; rm -rf "$R"; mkdir -p "$OUT" "$R"
CORPUS=${CORPUS:-carry/corpus}
[ "${DRY:-0}" = 1 ] && [ -x .venv/bin/python ] && export PATH=$PWD/.venv/bin:$PATH
pack() { tar --warning=no-file-changed -czf "$OUT/s10.tgz.tmp" -C /tmp --exclude='*.distcp' --exclude='*.pt' \
  --exclude='data' --exclude='text' --exclude='inductor-*' --exclude='checkpoints' s10
  [ $? -le 1 ] && mv "$OUT/s10.tgz.tmp" "$OUT/s10.tgz"; }  # 1: a file changed while read (a run still writing)
# `timeout` stops a script, not the runs it started: what a phase leaves running is killed before the next.
leftovers() { pkill -9 -f "distlm (train|bench)" 2>/dev/null; pkill -9 -f torch.distributed.run 2>/dev/null; pkill -9 -f "bin/torchrun" 2>/dev/null; sleep 2; }
{ date -u; nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__)"; echo "commit $(git rev-parse --short HEAD 2>/dev/null)"
} > "$R/machine.txt" 2>&1
head -3 "$R/machine.txt"

# 1.
mkdir -p "$R/tp"
( export PYTHONPATH=$PWD; python3 scripts/build_speedrun_corpus.py "$CORPUS" "$R/sr/text" && python3 -m distlm prepare \
    "$R/sr/text" --out "$R/sr/data" --quiet ) > "$R/prepare.log" 2>&1 &
CUDA_VISIBLE_DEVICES=0,1 OUT=$R/tp TAG=async ITEMS="tp2_async_mb16" BUDGET=140 bash benchmarks/tp_speed.sh > "$R/tp/async.txt" 2>&1 &
CUDA_VISIBLE_DEVICES=2,3 OUT=$R/tp TAG=plain ITEMS="tp2_mb16" BUDGET=140 bash benchmarks/tp_speed.sh > "$R/tp/plain.txt" 2>&1
wait
grep -h "json:" "$R/tp/async.txt" "$R/tp/plain.txt"
leftovers; pack

# 2.
OUT=$R/sr WORK=$R/sr TAG=x4 CORPUS=$CORPUS timeout 140 bash benchmarks/speedrun.sh "speedrun-b64s450@ddp4" \
  2>&1 | sed "s/^/[4 GPUs] /"
leftovers; pack

# 3.
mkdir -p "$R/nodes-elastic" "$R/nodes-throughput"
dev=(); [ "${DRY:-0}" = 1 ] && dev=(DEV=cpu NP=4)
env "${dev[@]}" OUT=$R/nodes-elastic ONLY="3 4" BUDGET=230 COMPILE=false EMULATE=hostid bash benchmarks/two_nodes.sh 2>&1 \
  | sed "s/^/[two nodes] /"
leftovers; pack
env "${dev[@]}" OUT=$R/nodes-throughput ONLY="1 2" BUDGET=$((560 - SECONDS)) COMPILE=false EMULATE=hostid \
  bash benchmarks/two_nodes.sh 2>&1 | sed "s/^/[two nodes] /"
leftovers; pack
