#!/usr/bin/env bash
# The eleventh session's second 4-GPU call (< 10 min), rehearsed with DRY=1:
#   CORPUS=carry/corpus OLD=carry/old_tp10 bash benchmarks/gpu_s14.sh     (carry: carry/corpus carry/old_tp10)
# 1. (issue 19) gpt2-1.5b, two pairs of GPUs at once (inductor's async-TP pass logs each fusion):
#    GPUs 0-1: async TP at micro-batch 16 with the code before the row-parallel bias moved after the
#              reduction (OLD), then async TP at micro-batch 32;
#    GPUs 2-3: async TP at micro-batch 16 (this code), then FSDP2 at micro-batch 16 (the TP target's reference);
# 2. (issue 16) what DDP costs the recipe's 4-GPU step: bench speedrun-124m at 16 sequences a GPU on one GPU
#    (no communication), under DDP4, under DDP4 with gradients averaged in bf16, and with 100 MB buckets too;
# 3. (issue 16) time to loss on 4 GPUs: speedrun-b64s300bf16@ddp4 (bf16 gradient averaging), baseline@ddp4.
# Everything comes back as $OUT/s14.tgz; a summary on stdout. Every `timeout` has -k (see gpu_s10.sh).
NAME=s14; source benchmarks/device_call.sh
CORPUS=${CORPUS:-carry/corpus}; OLD=${OLD:-carry/old_tp10}
[ -d "$OLD/distlm" ] || echo "warning: $OLD/distlm missing: the before row will fail"

mkdir -p "$R/sr"
( export PYTHONPATH=$PWD; python3 scripts/build_speedrun_corpus.py "$CORPUS" "$R/sr/text" && python3 -m distlm prepare \
    "$R/sr/text" --out "$R/sr/data" --quiet ) > "$R/prepare.log" 2>&1 &

# 1.
mkdir -p "$R/tp"
export TORCH_LOGS="+torch._inductor.fx_passes.micro_pipeline_tp"
CUDA_VISIBLE_DEVICES=0,1 OUT=$R/tp TAG=a OLD=$OLD ITEMS="before_tp2_async_mb16 tp2_async_mb32" BUDGET=200 \
  timeout -k 10 205 bash benchmarks/tp_speed.sh > "$R/tp/a.txt" 2>&1 &
CUDA_VISIBLE_DEVICES=2,3 OUT=$R/tp TAG=b ITEMS="tp2_async_mb16 fsdp2_mb16" BUDGET=200 \
  timeout -k 10 205 bash benchmarks/tp_speed.sh > "$R/tp/b.txt" 2>&1
wait
unset TORCH_LOGS
grep -h "json:" "$R/tp/a.txt" "$R/tp/b.txt"
for f in /tmp/tp-speed-a/*async*.log /tmp/tp-speed-b/*async*.log; do
  [ -f "$f" ] && echo "[fusions] $(basename "$f"): $(grep -c 'successfully fused matmul reduce scatter' "$f") reduce-scatter," \
    "$(grep -c 'no producer matmul found' "$f") without a producer matmul, $(grep -ci 'more than one user' "$f") with other users"
done
cp /tmp/tp-speed-a/*.log /tmp/tp-speed-b/*.log "$R/tp/" 2>/dev/null
leftovers; pack

# 2.
export TORCHINDUCTOR_CACHE_DIR=$R/inductor-bench   # one cache: the later benches compile nothing new
M=(--config speedrun-124m data.source=synthetic train.global_batch_size=64 train.micro_batch_size=16)
[ "${DRY:-0}" = 1 ] && M=(--config tiny data.source=synthetic train.device=cpu train.compile=false train.micro_batch_size=4)
bench() {  # bench NAME NPROC [overrides...]
  local name=$1 np=$2; shift 2
  PYTHONPATH=$PWD timeout -k 5 100 torchrun --standalone --nproc_per_node "$np" -m distlm bench "${M[@]}" "$@" \
    --warmup 8 --steps 20 --no-comm-probe --json "$R/bench-$name.json" > "$R/bench-$name.log" 2>&1
  grep -E "tok/s \(|^error" "$R/bench-$name.log" | head -2 | sed "s/^/[bench $name] /"
}
bench x1 1 train.global_batch_size=16
bench ddp4 4 parallel.dp_replicate=4
bench ddp4-bf16 4 parallel.dp_replicate=4 parallel.grad_reduce_dtype=bf16
bench ddp4-bf16-b100 4 parallel.dp_replicate=4 parallel.grad_reduce_dtype=bf16 parallel.ddp_bucket_mb=100
unset TORCHINDUCTOR_CACHE_DIR
leftovers; pack
wait

# 3.
left=$((575 - SECONDS))
OUT=$R/sr WORK=$R/sr TAG=x4 CORPUS=$CORPUS timeout -k 10 "$left" bash benchmarks/speedrun.sh \
  "speedrun-b64s300bf16@ddp4 baseline@ddp4" > "$R/x4.txt" 2>&1
sed "s/^/[4 GPUs] /" "$R/x4.txt" | grep -v "^\[4 GPUs\] *$" | tail -8
leftovers; pack
