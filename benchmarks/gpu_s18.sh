#!/usr/bin/env bash
# Twelfth session, call 3 (4 GPUs, < 9 min), rehearsed with DRY=1:
#   CORPUS=carry/corpus bash benchmarks/gpu_s18.sh          (carry: carry/corpus)
# 1. (issue 19) Call 2 showed async TP, now fusing, no faster than plain TP2 (63.4k against 64.3k
#    tok/s), with 205 ms a step of TP collectives exposed. Two other ways to hide them, gpt2-1.5b at
#    micro-batch 32, profiled: inductor's compute/communication reordering (GPUs 0-1) and its overlap
#    scheduler (GPUs 2-3), at once; then plain TP2 (GPUs 0-1) beside FSDP2 at 16 (GPUs 2-3).
# 2. The gpu-marked tests on GPUs 0-1 (the new one: async TP's fusions happen).
# 3. (issue 16) a third same-call pair on 4 GPUs: baseline@ddp4 and speedrun-b64s300@ddp4.
# Everything comes back as $OUT/s18.tgz; a summary on stdout. Every `timeout` has -k (see gpu_s10.sh).
NAME=s18; source benchmarks/device_call.sh
CORPUS=${CORPUS:-carry/corpus}
corpus_in_background "$CORPUS"

# 1.
mkdir -p "$R/tp"
tp_pair() {  # tp_pair GPUS TAG ITEMS BUDGET
  CUDA_VISIBLE_DEVICES=$1 OUT=$R/tp TAG=$2 ITEMS="$3" BUDGET=$4 timeout -k 10 $(($4 + 5)) bash benchmarks/tp_speed.sh \
    > "$R/tp/$2.txt" 2>&1
}
tp_pair 0,1 a "tp2_mb32_reorder" 150 &
tp_pair 2,3 b "tp2_mb32_overlap" 150
wait
leftovers
tp_pair 0,1 c "tp2_mb32" 120 &
tp_pair 2,3 d "fsdp2_mb16" 120
wait
leftovers
grep -h "json:\|skipped\|rror" "$R"/tp/[abcd].txt | head -12
for tag in a b c d; do
  d=/tmp/tp-speed-$tag
  cp "$d"/*.log "$d"/*.json "$R/tp/" 2>/dev/null
  for prof in "$d"/prof-*; do [ -d "$prof" ] && mkdir -p "$R/tp/$(basename "$prof")" && cp -r "$prof"/rank0 "$R/tp/$(basename "$prof")/"; done
done
for f in "$R"/tp/prof-*/rank0/profile.md; do
  [ -f "$f" ] && { echo "== $f"; grep -E "^\| (communication|compute|no kernel)|per step" "$f" | cut -c1-150; }
done
pack

# 2.
CUDA_VISIBLE_DEVICES=0,1 PYTHONPATH=$PWD timeout -k 5 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py \
  > "$R/gpu-tests.log" 2>&1
tail -3 "$R/gpu-tests.log" | sed "s/^/[gpu tests] /"
[ "${DRY:-0}" = 1 ] || pkill -9 -f pytest 2>/dev/null
leftovers; pack
wait

# 3.
speedrun_runs "baseline@ddp4 speedrun-b64s300@ddp4" 560
leftovers; pack
