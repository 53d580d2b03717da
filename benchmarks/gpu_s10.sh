#!/usr/bin/env bash
# Tenth session, 4-GPU call 2 (< 10 min):   CORPUS=carry/corpus bash benchmarks/gpu_s10.sh   (DRY=1: rehearsed on CPU)
# 1. (issue 19) gpt2-1.5b on two pairs of GPUs at once, three runs each, one after the other:
#    GPUs 0-1: async TP at micro-batch 16, async TP at 32, FSDP2 at 16;
#    GPUs 2-3: plain TP at 16, plain TP at 32, FSDP2 at 8 (the reference setting).
#    Whether the micro-pipelined all-gathers pay once the host no longer sets the pace, and what the
#    micro-batch FSDP2 cannot hold (32) buys TP;
# 2. (issue 19) two "nodes" of 2 GPUs (NCCL_HOSTID apart): the kill and restart again, now that a failed
#    NCCL collective ends the worker (the survivors waited 42 s before), and the 1 x 2 resume.
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
CUDA_VISIBLE_DEVICES=0,1 OUT=$R/tp TAG=a ITEMS="tp2_async_mb16 tp2_async_mb32 fsdp2_mb16" BUDGET=240 \
  bash benchmarks/tp_speed.sh > "$R/tp/a.txt" 2>&1 &
CUDA_VISIBLE_DEVICES=2,3 OUT=$R/tp TAG=b ITEMS="tp2_mb16 tp2_mb32 fsdp2" BUDGET=240 \
  bash benchmarks/tp_speed.sh > "$R/tp/b.txt" 2>&1
wait
grep -h "json:" "$R/tp/a.txt" "$R/tp/b.txt"; grep -h "Error\|error:" /tmp/tp-speed-a/*.log /tmp/tp-speed-b/*.log | head -4
leftovers; pack

# 2.
mkdir -p "$R/nodes-elastic"
dev=(); [ "${DRY:-0}" = 1 ] && dev=(DEV=cpu NP=4)
env "${dev[@]}" OUT=$R/nodes-elastic ONLY="3 4" BUDGET=$((570 - SECONDS)) COMPILE=false EMULATE=hostid \
  bash benchmarks/two_nodes.sh 2>&1 | sed "s/^/[two nodes] /"
leftovers; pack
