#!/usr/bin/env bash
# One device-tool call: GPU tests, the demo, gpt2-124m-1024 for 50 steps, and `distlm bench`.
# Run from the repo root on the GPU box:  bash benchmarks/gpu_foundation.sh   (writes into $OUT)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch; print('torch', torch.__version__)"; nproc; } | tee "$OUT/machine.txt"
python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 | tail -4
start=$(date +%s.%N)
python3 -m distlm prepare distlm/assets/gutenberg/gutenberg.tar.xz --out /tmp/data/gutenberg-gpt2 --quiet
echo "prepare gpt2 gutenberg: $(python3 -c "print(f'{$(date +%s.%N)-$start:.1f}')") s" | tee -a "$OUT/machine.txt"
python3 -m distlm demo --root /tmp/runs --data-root /tmp/data 2>&1 | grep -v '%|' | tee "$OUT/demo.log"
cp /tmp/runs/demo-*/loss.png "$OUT/demo-loss.png" 2>/dev/null
python3 -m distlm train --config gpt2-124m-1024 data.dir=/tmp/data/gutenberg-gpt2 train.max_steps=50 \
  train.compile=true log.every=10 train.eval_every=50 log.root=/tmp/runs log.name=g124 log.progress=false 2>&1 | tee "$OUT/train124.log"
for c in true false; do
  python3 -m distlm bench --config gpt2-124m-1024 data.source=synthetic train.compile=$c \
    --warmup 8 --steps 20 --json "$OUT/bench124-compile-$c.json" --results "$OUT/bench.md" 2>&1 | tail -5
done
