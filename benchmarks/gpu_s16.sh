#!/usr/bin/env bash
# The next 4-GPU call (< 8 min), prepared in the eleventh session and rehearsed with DRY=1:
#   CORPUS=carry/corpus bash benchmarks/gpu_s16.sh          (carry: carry/corpus)
# 1. (issue 19) gpt2-1.5b at micro-batch 32, profiled, two pairs of GPUs at once: GPUs 0-1 async TP,
#    GPUs 2-3 plain TP2. What is left of TP2's step against FSDP2's: its collectives, or the host; and
#    whether inductor's fused reduce-scatter matmuls ran (the profile's top kernels);
# 2. (issue 16) the 1-GPU recipe's step profiled (speedrun-124m, 32 sequences): what the 12 ms optimizer
#    phase is, kernels or host;
# 3. (issue 16) speedrun-b64s300@ddp4 without compilation (eager), then compiled, both from an empty
#    compile cache: does a 300-step run on 4 GPUs earn back its ~28 s of compilation?
# Profiles now also split each step on the GPU's timeline: compute, communication hidden beside it,
# communication alone (exposed), no kernel.
# Everything comes back as $OUT/s16.tgz; a summary on stdout. Every `timeout` has -k (see gpu_s10.sh).
NAME=s16; source benchmarks/device_call.sh
CORPUS=${CORPUS:-carry/corpus}
corpus_in_background "$CORPUS"

# 1.
mkdir -p "$R/tp"
CUDA_VISIBLE_DEVICES=0,1 OUT=$R/tp TAG=a ITEMS="tp2_async_mb32_prof" BUDGET=170 \
  timeout -k 10 175 bash benchmarks/tp_speed.sh > "$R/tp/a.txt" 2>&1 &
CUDA_VISIBLE_DEVICES=2,3 OUT=$R/tp TAG=b ITEMS="tp2_mb32_prof" BUDGET=170 \
  timeout -k 10 175 bash benchmarks/tp_speed.sh > "$R/tp/b.txt" 2>&1
wait
grep -h "json:" "$R/tp/a.txt" "$R/tp/b.txt"
for d in /tmp/tp-speed-a /tmp/tp-speed-b; do
  cp "$d"/*.log "$d"/*.json "$R/tp/" 2>/dev/null
  for prof in "$d"/prof-*; do [ -d "$prof" ] && mkdir -p "$R/tp/$(basename "$prof")" && cp -r "$prof"/rank0 "$R/tp/$(basename "$prof")/"; done
done
leftovers; pack

# 2.
M=(--config speedrun-124m data.source=synthetic)
[ "${DRY:-0}" = 1 ] && M=(--config tiny data.source=synthetic train.device=cpu train.compile=false)
PYTHONPATH=$PWD CUDA_VISIBLE_DEVICES=0 timeout -k 5 100 python3 -m distlm bench "${M[@]}" --warmup 8 --steps 10 \
  --no-comm-probe --profile "$R/prof-x1" --json "$R/bench-x1.json" > "$R/bench-x1.log" 2>&1
grep -E "tok/s \(|^profile|^timeline|^error" "$R/bench-x1.log" | head -4 | sed "s/^/[bench x1] /"
leftovers; pack
wait

# 3.
speedrun_runs "speedrun-b64s300eager@ddp4 speedrun-b64s300@ddp4" 545
leftovers; pack
