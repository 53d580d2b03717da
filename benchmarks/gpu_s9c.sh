#!/usr/bin/env bash
# Ninth session, one-GPU call (issue 16's remaining ablations), < 10 min:
#   CORPUS=carry/corpus bash benchmarks/gpu_s9c.sh
# 1. every `gpu`-marked test (pytest -m gpu), on the code as it stands;
# 2. speedrun.sh "speedrun speedrun-docmask speedrun-cosine": the recipe against document-masked
#    attention (FlexAttention) and against a cosine schedule instead of WSD, same 600 steps, loss over
#    the whole val split, each from a cold compile cache.
# Everything comes back as $OUT/s9c.tgz; a summary on stdout.
set -uo pipefail
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; R=/tmp/s9c; rm -rf "$R"; mkdir -p "$OUT" "$R"
BUDGET=${BUDGET:-570}
pack() { tar --warning=no-file-changed -czf "$OUT/s9c.tgz.tmp" -C /tmp --exclude='*.distcp' --exclude='*.pt' s9c
  [ $? -le 1 ] && mv "$OUT/s9c.tgz.tmp" "$OUT/s9c.tgz"; }  # 1: a file changed while read (a run still writing)
{ date -u; nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__)"; echo "commit $(git rev-parse --short HEAD 2>/dev/null)"
} > "$R/machine.txt" 2>&1
head -3 "$R/machine.txt"
PYTHONPATH=$PWD timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ > "$R/gpu-tests.log" 2>&1
tail -3 "$R/gpu-tests.log" | sed "s/^/[pytest -m gpu] /"
pack
OUT=$R WORK=/tmp/speedrun-s9c TAG=x1 CORPUS=${CORPUS:-carry/corpus} timeout $((BUDGET - SECONDS)) \
  bash benchmarks/speedrun.sh "${RUNS:-speedrun speedrun-docmask speedrun-cosine}" 2>&1 | sed "s/^/[speedrun] /"
pack
