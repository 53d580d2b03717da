#!/usr/bin/env bash
# Ninth session, second 4-GPU call: all four GPUs, one job after the other.
#   CORPUS=carry/corpus bash benchmarks/gpu_s9b.sh      (RUNS overrides the speedrun list)
# 1. time to quality on 4 GPUs (issue 16): speedrun.sh "$RUNS" (default: the recipe and the nanoGPT
#    baseline under DDP4, then the 64-sequence variant);
# 2. two "nodes" of 2 GPUs (issue 19): two_nodes.sh, eager (COMPILE=false), EMULATE=hostid (NCCL sees
#    two hosts: NVLink inside a node, sockets between): bandwidth probe, DDP/HSDP/FSDP throughput,
#    kill and restart of node 1, cross-layout resumes of its checkpoint (items 1 3 4 first, then 2).
# 3. TP2 at micro-batch 16 on GPUs 0-1 beside FSDP2 at micro-batch 16 on GPUs 2-3.
# Everything comes back as $OUT/s9b.tgz; a summary on stdout.
set -uo pipefail
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; R=/tmp/s9b; rm -rf "$R"; mkdir -p "$OUT" "$R"
BUDGET=${BUDGET:-570}; SR_BUDGET=${SR_BUDGET:-230}
pack() { tar --warning=no-file-changed -czf "$OUT/s9b.tgz.tmp" -C /tmp --exclude='*.distcp' --exclude='*.pt' s9b
  [ $? -le 1 ] && mv "$OUT/s9b.tgz.tmp" "$OUT/s9b.tgz"; }  # 1: a file changed while read (a run still writing)
{ date -u; nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
  echo "commit $(git rev-parse --short HEAD 2>/dev/null)"; } > "$R/machine.txt" 2>&1
head -3 "$R/machine.txt"
OUT=$R WORK=/tmp/speedrun-s9b TAG=x4 CORPUS=${CORPUS:-carry/corpus} timeout "$SR_BUDGET" \
  bash benchmarks/speedrun.sh "${RUNS:-speedrun@ddp4 baseline@ddp4 speedrun-b64s450@ddp4}" 2>&1 | sed "s/^/[speedrun] /"
pkill -f "distlm train" 2>/dev/null; sleep 2; pack
# the kill/restart and the resumes first (never run on GPUs yet), then the throughput items if time is left
mkdir -p "$R/elastic" "$R/throughput"
OUT=$R/elastic ONLY="1 3 4" BUDGET=$((BUDGET - SECONDS - 120)) COMPILE=false EMULATE=hostid bash benchmarks/two_nodes.sh 2>&1 \
  | sed "s/^/[two nodes] /"
pack
# 3. TP2 with twice the work per block call (issue 19), beside FSDP2 at the same micro-batch
mkdir -p "$R/tp"
CUDA_VISIBLE_DEVICES=0,1 OUT=$R/tp TAG=mb16 ITEMS="tp2_mb16" BUDGET=$((BUDGET - SECONDS)) \
  bash benchmarks/tp_speed.sh > "$R/tp/tp.txt" 2>&1 &
CUDA_VISIBLE_DEVICES=2,3 OUT=$R/tp TAG=fsdp-mb16 ITEMS="fsdp2_mb16" BUDGET=$((BUDGET - SECONDS)) \
  bash benchmarks/tp_speed.sh > "$R/tp/fsdp.txt" 2>&1
wait; tail -2 "$R/tp/tp.txt" "$R/tp/fsdp.txt"
pack
