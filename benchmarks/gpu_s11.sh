#!/usr/bin/env bash
# Tenth session, 4-GPU call 3 (< 6 min):   CORPUS=carry/corpus bash benchmarks/gpu_s11.sh   (DRY=1: rehearsed on CPU)
# 1. (issue 19) two "nodes" of 2 GPUs (NCCL_HOSTID apart): the kill and restart again, now that a failed
#    NCCL collective ends the worker (the survivors waited 42 s for SIGKILL in the ninth session), then
#    the 1 x 2 and 1 x 4 resumes of its checkpoint;
# 2. (issue 16) the 4-GPU recipe (speedrun-b64s450) under FSDP2, against baseline@ddp4 of gpu_s10.sh's call;
# meanwhile, on GPU 3, every `gpu`-marked test again: three failed in gpu_s10.sh's call after a Trainer
# test had left TF32 on for the process (tests/conftest.py now restores the flags after each test).
# Everything comes back as $OUT/s11.tgz; a summary on stdout. Every `timeout` has -k (see gpu_s10.sh).
set -uo pipefail
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; R=/tmp/s11; rm -rf "$R"; mkdir -p "$OUT" "$R"
CORPUS=${CORPUS:-carry/corpus}
[ "${DRY:-0}" = 1 ] && [ -x .venv/bin/python ] && export PATH=$PWD/.venv/bin:$PATH
pack() { tar --warning=no-file-changed -czf "$OUT/s11.tgz.tmp" -C /tmp --exclude='*.distcp' --exclude='*.pt' \
  --exclude='data' --exclude='text' --exclude='inductor-*' --exclude='checkpoints' s11
  [ $? -le 1 ] && mv "$OUT/s11.tgz.tmp" "$OUT/s11.tgz"; }  # 1: a file changed while read (a run still writing)
leftovers() { pkill -9 -f "distlm (train|bench)" 2>/dev/null; pkill -9 -f torch.distributed.run 2>/dev/null
  pkill -9 -f "bin/torchrun" 2>/dev/null; sleep 2; }
{ date -u; nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__)"; echo "commit $(git rev-parse --short HEAD 2>/dev/null)"
} > "$R/machine.txt" 2>&1
head -3 "$R/machine.txt"

# the corpus, in the background (~10 s), for item 2
( export PYTHONPATH=$PWD; python3 scripts/build_speedrun_corpus.py "$CORPUS" "$R/sr/text" && python3 -m distlm prepare \
    "$R/sr/text" --out "$R/sr/data" --quiet ) > "$R/prepare.log" 2>&1 &

# meanwhile: the gpu tests on GPU 3 (the two-node run's models are small)
( CUDA_VISIBLE_DEVICES=3 PYTHONPATH=$PWD timeout -k 5 ${TESTS_BUDGET:-280} python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/ -rs > "$R/gpu-tests.log" 2>&1 ) &
tests=$!

# 1.
mkdir -p "$R/nodes-elastic"
dev=(); [ "${DRY:-0}" = 1 ] && dev=(DEV=cpu NP=4)
env "${dev[@]}" OUT=$R/nodes-elastic ONLY="3 4" BUDGET=${NODES_BUDGET:-200} COMPILE=false EMULATE=hostid \
  timeout -k 10 "${NODES_BUDGET:-200}" bash benchmarks/two_nodes.sh > "$R/nodes.txt" 2>&1
sed "s/^/[two nodes] /" "$R/nodes.txt" | grep -E "elastic|resume|error|Error|waited|ended" | tail -14
# (not `leftovers`: a gpu test may be running `distlm bench` in a subprocess)
pkill -9 -f "distlm train" 2>/dev/null; pkill -9 -f torch.distributed.run 2>/dev/null; sleep 2; pack

# 2.
OUT=$R/sr WORK=$R/sr TAG=x4 CORPUS=$CORPUS timeout -k 10 "${SR_BUDGET:-115}" bash benchmarks/speedrun.sh \
  ${RUNS:-"speedrun-b64s450@fsdp4"} > "$R/x4.txt" 2>&1
sed "s/^/[4 GPUs] /" "$R/x4.txt" | grep -v "^\[4 GPUs\] *$" | tail -5
wait "$tests"; tail -3 "$R/gpu-tests.log" | sed "s/^/[pytest -m gpu] /"
leftovers; pkill -9 -f pytest 2>/dev/null; pack
