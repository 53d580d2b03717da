#!/usr/bin/env bash
# The eleventh session's first 4-GPU call (< 10 min), rehearsed with DRY=1:
#   CORPUS=carry/corpus bash benchmarks/gpu_s13.sh          (carry: carry/corpus)
# 1. (issue 16) a profile of the 4-GPU recipe's step: bench, DDP4, 16 sequences a GPU, with the
#    step split into forward+backward and optimizer;
# 2. (issue 16) all four GPUs, one run after the other: baseline@ddp4 and speedrun-b64s300@ddp4
#    (64 sequences a step, 300 steps: 19.7M tokens, the 1-GPU recipe's), each from an empty compile
#    cache; then both again on the caches they left (+warm: a repeated run); then
#    speedrun-b64s350@ddp4 if time is left.
# Everything comes back as $OUT/s13.tgz; a summary on stdout. Every `timeout` has -k (see gpu_s10.sh).
NAME=s13; source benchmarks/device_call.sh
CORPUS=${CORPUS:-carry/corpus}

# the corpus, in the background (~10 s), for item 2
mkdir -p "$R/sr"
( export PYTHONPATH=$PWD; python3 scripts/build_speedrun_corpus.py "$CORPUS" "$R/sr/text" && python3 -m distlm prepare \
    "$R/sr/text" --out "$R/sr/data" --quiet ) > "$R/prepare.log" 2>&1 &
prep=$!

# 1.
M=(--config speedrun-124m data.source=synthetic train.global_batch_size=64 train.micro_batch_size=16)
[ "${DRY:-0}" = 1 ] && M=(--config tiny data.source=synthetic train.device=cpu train.compile=false train.micro_batch_size=4)
PYTHONPATH=$PWD timeout -k 5 110 torchrun --standalone --nproc_per_node 4 -m distlm bench "${M[@]}" \
  parallel.dp_replicate=4 --warmup 8 --steps 10 --no-comm-probe --profile "$R/prof-x4" --json "$R/bench-x4.json" \
  > "$R/bench-x4.log" 2>&1
grep -E "tok/s|MFU|optimizer|^profile|^error" "$R/bench-x4.log" | head -8 | sed "s/^/[bench x4] /"
leftovers; pack
wait $prep

# 2.
left=$((575 - SECONDS))
OUT=$R/sr WORK=$R/sr TAG=x4 CORPUS=$CORPUS timeout -k 10 "$left" bash benchmarks/speedrun.sh \
  "baseline@ddp4 speedrun-b64s300@ddp4 speedrun-b64s300@ddp4+warm baseline@ddp4+warm speedrun-b64s350@ddp4" \
  > "$R/x4.txt" 2>&1
sed "s/^/[4 GPUs] /" "$R/x4.txt" | grep -v "^\[4 GPUs\] *$" | tail -12
leftovers; pack
