#!/usr/bin/env bash
# Twelfth session, call 2 (4 GPUs, < 10 min), rehearsed with DRY=1:
#   CORPUS=carry/corpus bash benchmarks/gpu_s17.sh          (carry: carry/corpus)
# 1. (issue 19) async TP with the TP group registered for symmetric memory again (distlm/parallel/tp.py,
#    register_symm_mem_group: without it inductor's pass fused nothing from c4d1e45 on). gpt2-1.5b at
#    micro-batch 32, profiled: GPUs 0-1 async TP (its fusions logged), GPUs 2-3 plain TP2, at once; then
#    GPUs 0-1 FSDP2 at micro-batch 16 (its best) and GPUs 2-3 async TP again, so each pair ran both
#    a TP2 and the other layout.
# Everything comes back as $OUT/s17.tgz; a summary on stdout. Every `timeout` has -k (see gpu_s10.sh).
NAME=s17; source benchmarks/device_call.sh
CORPUS=${CORPUS:-carry/corpus}
corpus_in_background "$CORPUS"

# 1.
mkdir -p "$R/tp"
tp_pair() {  # tp_pair GPUS TAG ITEMS BUDGET [env...]
  local gpus=$1 tag=$2 items=$3 budget=$4; shift 4
  env "$@" CUDA_VISIBLE_DEVICES=$gpus OUT=$R/tp TAG=$tag ITEMS="$items" BUDGET=$budget \
    timeout -k 10 $((budget + 5)) bash benchmarks/tp_speed.sh > "$R/tp/$tag.txt" 2>&1
}
tp_pair 0,1 a "tp2_async_mb32_prof" 175 TORCH_LOGS=+torch._inductor.fx_passes.micro_pipeline_tp &
tp_pair 2,3 b "tp2_mb32_prof" 175
wait
leftovers
tp_pair 0,1 c "fsdp2_mb16" 150 &
tp_pair 2,3 d "tp2_async_mb32" 150
wait
leftovers
grep -h "json:" "$R"/tp/[abcd].txt
for tag in a b c d; do
  d=/tmp/tp-speed-$tag
  cp "$d"/*.log "$d"/*.json "$R/tp/" 2>/dev/null
  for prof in "$d"/prof-*; do [ -d "$prof" ] && mkdir -p "$R/tp/$(basename "$prof")" && cp -r "$prof"/rank0 "$R/tp/$(basename "$prof")/"; done
done
echo "[async TP] fused matmul->reduce-scatter (rank 0 log): $(grep -c 'successfully fused matmul reduce scatter' "$R/tp/tp2_async_mb32_prof.log" 2>/dev/null)"
grep -m2 -h "no matching\|skipping" "$R/tp/tp2_async_mb32_prof.log" 2>/dev/null | sed "s/^/[async TP] /"
for f in "$R"/tp/prof-*/rank0/profile.md; do
  [ -f "$f" ] && { echo "== $f"; grep -E "^\| (communication|copies|matmul|compute|idle|no kernel)" "$f"; grep -iE "nccl|memcpy" "$f" | head -4; }
done
pack
