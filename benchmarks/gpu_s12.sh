#!/usr/bin/env bash
# The next 4-GPU call (< 10 min), prepared in the tenth session and rehearsed with DRY=1:
#   git archive 13b9091~1 | tar -x -C carry/old_tp10      # the TP code before the bias change (ignored folder)
#   CORPUS=carry/corpus OLD=carry/old_tp10 bash benchmarks/gpu_s12.sh       (carry: carry/corpus carry/old_tp10)
# 1. (issue 19) gpt2-1.5b, two pairs of GPUs at once, two runs each:
#    GPUs 0-1: async TP at micro-batch 16 with the code before the row-parallel bias moved after the
#              reduction (OLD), then async TP at micro-batch 32;
#    GPUs 2-3: async TP at micro-batch 16 (this code: the forward reduce-scatters can be fused), then
#              FSDP2 at micro-batch 16, the reference for the TP target;
# 2. (issue 16) all four GPUs: speedrun-b64s350@ddp4 (64 sequences a step, 350 steps: the 450-step run
#    passed the target between its last two evaluations), speedrun-b64s450@ddp4, baseline@ddp4;
# 3. (issue 16) in the time left, a profile of the 4-GPU recipe's step (bench, DDP4, 16 sequences a GPU).
# Everything comes back as $OUT/s12.tgz; a summary on stdout. Every `timeout` has -k (see gpu_s10.sh).
NAME=s12; source benchmarks/device_call.sh
CORPUS=${CORPUS:-carry/corpus}; OLD=${OLD:-carry/old_tp10}
[ -d "$OLD/distlm" ] || echo "warning: $OLD/distlm missing: the before row will fail"

# the corpus, in the background (~10 s), for item 2
( export PYTHONPATH=$PWD; python3 scripts/build_speedrun_corpus.py "$CORPUS" "$R/sr/text" && python3 -m distlm prepare \
    "$R/sr/text" --out "$R/sr/data" --quiet ) > "$R/prepare.log" 2>&1 &

# 1.
mkdir -p "$R/tp"
CUDA_VISIBLE_DEVICES=0,1 OUT=$R/tp TAG=a OLD=$OLD ITEMS="before_tp2_async_mb16 tp2_async_mb32" BUDGET=200 \
  timeout -k 10 205 bash benchmarks/tp_speed.sh > "$R/tp/a.txt" 2>&1 &
CUDA_VISIBLE_DEVICES=2,3 OUT=$R/tp TAG=b ITEMS="tp2_async_mb16 fsdp2_mb16" BUDGET=200 \
  timeout -k 10 205 bash benchmarks/tp_speed.sh > "$R/tp/b.txt" 2>&1
wait
grep -h "json:" "$R/tp/a.txt" "$R/tp/b.txt"; grep -h "Error\|error:" /tmp/tp-speed-a/*.log /tmp/tp-speed-b/*.log | head -4
leftovers; pack

# 2.
OUT=$R/sr WORK=$R/sr TAG=x4 CORPUS=$CORPUS timeout -k 10 300 bash benchmarks/speedrun.sh \
  "speedrun-b64s350@ddp4 speedrun-b64s450@ddp4 baseline@ddp4" > "$R/x4.txt" 2>&1
sed "s/^/[4 GPUs] /" "$R/x4.txt" | grep -v "^\[4 GPUs\] *$" | tail -9
leftovers; pack

# 3.
left=$((560 - SECONDS))
if [ "$left" -gt 70 ]; then
  M=(--config speedrun-124m data.source=synthetic train.global_batch_size=64 train.micro_batch_size=16)
  [ "${DRY:-0}" = 1 ] && M=(--config tiny data.source=synthetic train.device=cpu train.compile=false train.micro_batch_size=4)
  PYTHONPATH=$PWD timeout -k 5 "$left" torchrun --standalone --nproc_per_node 4 -m distlm bench "${M[@]}" \
    parallel.dp_replicate=4 --warmup 8 --steps 10 --no-comm-probe --profile "$R/prof-x4" --json "$R/bench-x4.json" \
    > "$R/bench-x4.log" 2>&1
  grep -E "tok/s \(|MFU|^profile|^error" "$R/bench-x4.log" | head -4 | sed "s/^/[bench x4] /"
else
  echo "[bench x4] skipped: ${left} s left"
fi
leftovers; pack
