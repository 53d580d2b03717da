#!/usr/bin/env bash
# Tenth session, 4-GPU call 2 (< 10 min):   CORPUS=carry/corpus bash benchmarks/gpu_s10.sh   (DRY=1: rehearsed on CPU)
# 1. at once: (issue 19) gpt2-1.5b TP2 on GPUs 0-1, async TP then plain TP, micro-batch 16; (issue 16) the
#    document-mask (GPU 2) and cosine (GPU 3) ablations of speedrun-124m, 600 steps each, val loss over the
#    whole split (the recipe's own loss at 600 steps does not depend on the machine: 2.0340 and 2.0322 in
#    the eighth and ninth sessions);
# 2. (issue 16) all four GPUs: speedrun-b64s450@ddp4 (16 sequences a GPU, 450 steps), then baseline@ddp4;
# 3. (issue 16) every `gpu`-marked test, on GPU 0, in the time left.
# Everything comes back as $OUT/s10.tgz; a summary on stdout.
# Every `timeout` has -k: call 1 (gpu_s9d.sh) lost 8 minutes when a phase outlived its `timeout`: the
# trainer records SIGTERM to save at the end of its step, and a Trainer inside pytest kept the test
# session alive past the TERM, so nothing but SIGKILL ended it.
set -uo pipefail
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; R=/tmp/s10; rm -rf "$R"; mkdir -p "$OUT" "$R"
CORPUS=${CORPUS:-carry/corpus}
[ "${DRY:-0}" = 1 ] && [ -x .venv/bin/python ] && export PATH=$PWD/.venv/bin:$PATH
pack() { tar --warning=no-file-changed -czf "$OUT/s10.tgz.tmp" -C /tmp --exclude='*.distcp' --exclude='*.pt' \
  --exclude='data' --exclude='text' --exclude='inductor-*' --exclude='checkpoints' s10
  [ $? -le 1 ] && mv "$OUT/s10.tgz.tmp" "$OUT/s10.tgz"; }  # 1: a file changed while read (a run still writing)
# `timeout` stops a script, not the runs it started: what a phase leaves running is killed before the next.
leftovers() { pkill -9 -f "distlm (train|bench)" 2>/dev/null; pkill -9 -f torch.distributed.run 2>/dev/null
  pkill -9 -f "bin/torchrun" 2>/dev/null; pkill -9 -f "pytest" 2>/dev/null; sleep 2; }
{ date -u; nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__)"; echo "commit $(git rev-parse --short HEAD 2>/dev/null)"
} > "$R/machine.txt" 2>&1
head -3 "$R/machine.txt"

# 0. the corpus (~10 s)
( export PYTHONPATH=$PWD; python3 scripts/build_speedrun_corpus.py "$CORPUS" "$R/sr/text" && python3 -m distlm prepare \
    "$R/sr/text" --out "$R/sr/data" --quiet ) > "$R/prepare.log" 2>&1
tail -1 "$R/prepare.log"
for i in 2 3; do mkdir -p "$R/sr$i" && cp -r "$R/sr/data" "$R/sr$i/data"; done

# 1.
mkdir -p "$R/tp"
CUDA_VISIBLE_DEVICES=0,1 OUT=$R/tp TAG=a ITEMS="tp2_async_mb16 tp2_mb16" BUDGET=195 \
  timeout -k 10 200 bash benchmarks/tp_speed.sh > "$R/tp/a.txt" 2>&1 &
one() {  # one GPU RUN
  CUDA_VISIBLE_DEVICES=$1 OUT=$R/sr$1 WORK=$R/sr$1 TAG=x1 CORPUS=$CORPUS timeout -k 10 190 \
    bash benchmarks/speedrun.sh "$2" > "$R/sr$1/job.txt" 2>&1
}
one 2 speedrun-docmask & one 3 speedrun-cosine &
wait
grep -h "json:" "$R/tp/a.txt"; grep -h "Error\|error:" /tmp/tp-speed-a/*.log | head -4
grep -h "rc " "$R"/sr?/job.txt
leftovers; pack

# 2.
OUT=$R/sr WORK=$R/sr TAG=x4 CORPUS=$CORPUS timeout -k 10 250 bash benchmarks/speedrun.sh \
  "speedrun-b64s450@ddp4 baseline@ddp4" > "$R/x4.txt" 2>&1
sed "s/^/[4 GPUs] /" "$R/x4.txt" | grep -v "^\[4 GPUs\] *$" | tail -12
leftovers; pack

# 3.
left=$((560 - SECONDS))
if [ "$left" -gt 60 ]; then
  CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD timeout -k 5 "$left" python3 -m pytest -q -p no:cacheprovider -m gpu tests/ \
    > "$R/gpu-tests.log" 2>&1
  tail -3 "$R/gpu-tests.log" | sed "s/^/[pytest -m gpu] /"
else
  echo "[pytest -m gpu] skipped: ${left} s left"
fi
leftovers; pack
