#!/usr/bin/env bash
# The eleventh session's third 4-GPU call (< 9 min), rehearsed with DRY=1:
#   CORPUS=carry/corpus bash benchmarks/gpu_s15.sh          (carry: carry/corpus)
# 1. (issue 19) gpt2-1.5b, two pairs of GPUs at once:
#    GPUs 0-1: TP2 at micro-batch 32 without async TP, then with it (same GPUs: the async gain at 32);
#    GPUs 2-3: FSDP2 at micro-batch 16, the TP target's reference, again;
# 2. (issue 16) a second sample of time to loss on 4 GPUs: speedrun-b64s300@ddp4 and baseline@ddp4.
# Everything comes back as $OUT/s15.tgz; a summary on stdout. Every `timeout` has -k (see gpu_s10.sh).
NAME=s15; source benchmarks/device_call.sh
CORPUS=${CORPUS:-carry/corpus}
mkdir -p "$R/sr"
( export PYTHONPATH=$PWD; python3 scripts/build_speedrun_corpus.py "$CORPUS" "$R/sr/text" && python3 -m distlm prepare \
    "$R/sr/text" --out "$R/sr/data" --quiet ) > "$R/prepare.log" 2>&1 &

# 1.
mkdir -p "$R/tp"
CUDA_VISIBLE_DEVICES=0,1 OUT=$R/tp TAG=a ITEMS="tp2_mb32 tp2_async_mb32" BUDGET=200 \
  timeout -k 10 205 bash benchmarks/tp_speed.sh > "$R/tp/a.txt" 2>&1 &
CUDA_VISIBLE_DEVICES=2,3 OUT=$R/tp TAG=b ITEMS="fsdp2_mb16" BUDGET=200 \
  timeout -k 10 205 bash benchmarks/tp_speed.sh > "$R/tp/b.txt" 2>&1
wait
grep -h "json:" "$R/tp/a.txt" "$R/tp/b.txt"
cp /tmp/tp-speed-a/*.log /tmp/tp-speed-a/*.json /tmp/tp-speed-b/*.log /tmp/tp-speed-b/*.json "$R/tp/" 2>/dev/null
leftovers; pack

# 2.
left=$((500 - SECONDS))
OUT=$R/sr WORK=$R/sr TAG=x4 CORPUS=$CORPUS timeout -k 10 "$left" bash benchmarks/speedrun.sh \
  "speedrun-b64s300@ddp4 baseline@ddp4" > "$R/x4.txt" 2>&1
sed "s/^/[4 GPUs] /" "$R/x4.txt" | grep -v "^\[4 GPUs\] *$" | tail -8
leftovers; pack
