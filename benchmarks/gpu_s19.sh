#!/usr/bin/env bash
# Twelfth session, call 4 (4 GPUs, < 6 min), rehearsed with DRY=1:   bash benchmarks/gpu_s19.sh
# It ran at commit 390215f. The option it measured (parallel.tp_batch_chunks) and its tp_speed.sh items were
# removed after it (slower, or out of memory: benchmarks/RESULTS.md, twelfth session); check out 390215f to
# run it again.
# (issue 19) parallel.tp_batch_chunks: each block runs its micro-batch as chunks interleaved sub-layer by
# sub-layer, so one chunk's collectives can run beside another chunk's matmuls. gpt2-1.5b, TP2 at
# micro-batch 32, profiled; two GPU pairs at once, three rounds:
#   GPUs 0-1: 2 chunks + inductor's overlap scheduler | GPUs 2-3: 2 chunks alone
#   GPUs 0-1: FSDP2 at 16                             | GPUs 2-3: plain TP2 at 32
#   GPUs 0-1: 4 chunks + the overlap scheduler        | GPUs 2-3: 2 chunks + inductor's reordering
# Everything comes back as $OUT/s19.tgz; a summary on stdout. Every `timeout` has -k (see gpu_s10.sh).
NAME=s19; source benchmarks/device_call.sh
mkdir -p "$R/tp"
tp_pair() {  # tp_pair GPUS TAG ITEMS BUDGET
  CUDA_VISIBLE_DEVICES=$1 OUT=$R/tp TAG=$2 ITEMS="$3" BUDGET=$4 timeout -k 10 $(($4 + 5)) bash benchmarks/tp_speed.sh \
    > "$R/tp/$2.txt" 2>&1
}
round() {  # round ITEM_A ITEM_B TAG_A TAG_B BUDGET
  tp_pair 0,1 "$3" "$1" "$5" &
  tp_pair 2,3 "$4" "$2" "$5"
  wait
  leftovers
  grep -h "json:\|skipped\|rror" "$R/tp/$3.txt" "$R/tp/$4.txt" | head -6
}
round tp2_mb32_c2_overlap tp2_mb32_c2 a b 150
round fsdp2_mb16 tp2_mb32 c d 120
round tp2_mb32_c4_overlap tp2_mb32_c2_reorder e f 150
for tag in a b c d e f; do
  d=/tmp/tp-speed-$tag
  cp "$d"/*.log "$d"/*.json "$R/tp/" 2>/dev/null
  for prof in "$d"/prof-*; do [ -d "$prof" ] && mkdir -p "$R/tp/$(basename "$prof")" && cp -r "$prof"/rank0 "$R/tp/$(basename "$prof")/"; done
done
for f in "$R"/tp/prof-*/rank0/profile.md; do
  [ -f "$f" ] && { echo "== $f"; grep -E "^\| (communication|compute|no kernel)|per step" "$f" | cut -c1-150; }
done
pack
