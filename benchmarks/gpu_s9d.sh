#!/usr/bin/env bash
# Ninth session, last 4-GPU call (< 10 min):   CORPUS=carry/corpus bash benchmarks/gpu_s9d.sh
# 1. (issue 19) TP2 and FSDP2 of gpt2-1.5b at micro-batch 16, side by side (GPUs 0-1 and 2-3);
#    the corpus is prepared on the CPU meanwhile;
# 2. (issue 16) one GPU each, at once: the recipe (GPU 0), document-masked attention (GPU 1), a cosine
#    schedule instead of WSD (GPU 2), 600 steps each, val loss over the whole split; GPU 3 runs every
#    `gpu`-marked test. Their wall times share the machine, their losses do not depend on it;
# 3. (issue 16) all four GPUs: speedrun@ddp4 and baseline@ddp4, one after the other.
# Everything comes back as $OUT/s9d.tgz; a summary on stdout. Its first run (2026-11-27, call 3) returned only
# item 1: the corpus step had no PYTHONPATH and pack() dropped archives when a file changed under tar (both fixed).
set -uo pipefail
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; R=/tmp/s9d; rm -rf "$R"; mkdir -p "$OUT" "$R"
CORPUS=${CORPUS:-carry/corpus}
# DRY=1: the same steps on the CPU box (tiny models, a few steps; speedrun.sh and tp_speed.sh shrink
# their runs), to find a broken step before it costs device time.
[ "${DRY:-0}" = 1 ] && [ -x .venv/bin/python ] && export PATH=$PWD/.venv/bin:$PATH
pack() { tar --warning=no-file-changed -czf "$OUT/s9d.tgz.tmp" -C /tmp --exclude='*.distcp' --exclude='*.pt' --exclude='data' --exclude='text' \
  --exclude='inductor-*' --exclude='checkpoints' s9d
  [ $? -le 1 ] && mv "$OUT/s9d.tgz.tmp" "$OUT/s9d.tgz"; }  # 1: a file changed while read (a run still writing)
{ date -u; nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
  echo "commit $(git rev-parse --short HEAD 2>/dev/null)"; } > "$R/machine.txt" 2>&1
head -3 "$R/machine.txt"

# `timeout` stops a script, not the runs it started (and a trainer given SIGTERM first finishes its step):
# what a phase leaves running is killed before the next phase takes the GPUs.
leftovers() { pkill -9 -f "distlm (train|bench)" 2>/dev/null; pkill -9 -f torch.distributed.run 2>/dev/null; pkill -9 -f "bin/torchrun" 2>/dev/null; sleep 2; }

# 1.
mkdir -p "$R/tp" "$R/sr0"
( export PYTHONPATH=$PWD; python3 scripts/build_speedrun_corpus.py "$CORPUS" "$R/sr0/text" && python3 -m distlm prepare "$R/sr0/text" \
    --out "$R/sr0/data" --quiet ) > "$R/prepare.log" 2>&1 &
prep=$!
CUDA_VISIBLE_DEVICES=0,1 OUT=$R/tp TAG=tp ITEMS="tp2_mb16" BUDGET=140 bash benchmarks/tp_speed.sh > "$R/tp/tp.txt" 2>&1 &
CUDA_VISIBLE_DEVICES=2,3 OUT=$R/tp TAG=fsdp ITEMS="fsdp2_mb16" BUDGET=140 bash benchmarks/tp_speed.sh > "$R/tp/fsdp.txt" 2>&1
wait
grep -h "json:" "$R/tp/tp.txt" "$R/tp/fsdp.txt"; grep -h "error" /tmp/tp-speed-tp/*.log /tmp/tp-speed-fsdp/*.log \
  | grep -v "error_file\|errors.html" | head -4
leftovers; pack

# 2.
for i in 1 2; do mkdir -p "$R/sr$i" && cp -r "$R/sr0/data" "$R/sr$i/data"; done
one() {  # one GPU RUN
  CUDA_VISIBLE_DEVICES=$1 OUT=$R/sr$1 WORK=$R/sr$1 TAG=x1 CORPUS=$CORPUS timeout 170 \
    bash benchmarks/speedrun.sh "$2" > "$R/sr$1/job.txt" 2>&1
}
one 0 speedrun & one 1 speedrun-docmask & one 2 speedrun-cosine &
CUDA_VISIBLE_DEVICES=3 PYTHONPATH=$PWD timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ \
  > "$R/gpu-tests.log" 2>&1
wait
tail -2 "$R/gpu-tests.log" | sed "s/^/[pytest -m gpu] /"
grep -h "rc " "$R"/sr?/job.txt
leftovers; pack

# 3.
OUT=$R/sr0 WORK=$R/sr0 TAG=x4 CORPUS=$CORPUS timeout 245 bash benchmarks/speedrun.sh "speedrun@ddp4 baseline@ddp4" \
  2>&1 | sed "s/^/[4 GPUs] /"
leftovers; pack
