#!/usr/bin/env bash
# One device call on a 4-GPU machine (issue 5): why DDP weak scaling drops at 4 GPUs, gpt2-1.5b FSDP4, and the
# llama-7b preset on 4 GPUs capped at 79 GiB each (an 80 GB card).
#   SRC=/path/snapshot COMMIT=abc1234 bash benchmarks/gpu_x4.sh        (ONLY="1 3" picks items; BUDGET seconds)
# 1. DDP diagnosis, gpt2-124m-1024 (synthetic, compile per block, micro 16, 64 sequences per GPU per step):
#    one process alone; four independent processes at once, one per GPU (no communication at all); DDP over 4
#    (with the no-sync probe). nvidia-smi samples clocks, power and throttle reasons all along (read only).
# 2. llama-7b, FSDP2 over 4 + full activation checkpointing, --memory-cap-gib 79
# 3. gpt2-1.5b (20 heads), FSDP2 over 4, global 128, micro 16, chunked loss
# 4. gpt2-1.5b on one GPU, same micro-batch, with --profile (the compute-only reference for item 3)
# Results: $OUT/x4.tgz (rewritten after each item); a summary on stdout.
set -uo pipefail
# `python -m` puts the current directory ahead of PYTHONPATH: without this, a run from the repository root
# imports the checkout's distlm, not the snapshot's (it happened: benchmarks/RESULTS.md, third session)
export PYTHONSAFEPATH=1
CODE=${SRC:-$PWD}
export PYTHONPATH=$CODE PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
OUT=${OUT:-/tmp/out}; R=/tmp/res-x4; rm -rf "$R"; mkdir -p "$OUT" "$R"
BUDGET=${BUDGET:-540}
PY=${PY:-python3}; NP=${NP:-4}
X=()
if [ "${DRY:-0}" = 1 ]; then   # tiny CPU model, 2 processes: checks the plumbing here
  X=(model.n_layer=1 model.d_model=64 model.n_head=2 model.d_ff=128 model.block_size=32 train.device=cpu
     train.compile=false); PY=${PY_DRY:-.venv/bin/python}; NP=2; fi
left() { echo $((BUDGET - SECONDS)); }
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
cap() { local t=$(($(left) - 10)); [ "$t" -lt "$1" ] && echo "$t" || echo "$1"; }
pack() { tar -czf "$OUT/x4.tgz.tmp" -C /tmp --exclude='trace.json.gz' res-x4 && mv "$OUT/x4.tgz.tmp" "$OUT/x4.tgz"; }
show() { grep -hE "tok/s|exposed|MFU|peak memory|profile \(|Error|error" "$@" | grep -v "^W" | head -12; }
B=(-m distlm bench data.source=synthetic train.on_nan=off)
TR=("$PY" -m torch.distributed.run --standalone --nproc_per_node "$NP")

{ date -u; echo "code: ${COMMIT:-?} in $CODE"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv; nvidia-smi topo -m
  "$PY" -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None)"
} > "$R/machine.txt" 2>&1; cat "$R/machine.txt"
nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_event_reasons.active \
  --format=csv -lms 1000 > "$R/smi.csv" 2>/dev/null &
SMI=$!

M124=(--config gpt2-124m-1024 train.compile=true train.micro_batch_size=16)
if want 1; then
  t=$(cap 120); echo "== 1a one process alone ($t s)" | tee -a "$R/timeline.txt"
  CUDA_VISIBLE_DEVICES=0 timeout -k 5 "$t" "$PY" "${B[@]}" "${M124[@]}" train.global_batch_size=64 "${X[@]}" \
    --warmup 5 --steps 10 --json "$R/1a-alone.json" --results "$R/results.md" > "$R/1a-alone.log" 2>&1
  show "$R/1a-alone.log"; pack
  t=$(cap 120); echo "== 1b four independent processes ($t s)" | tee -a "$R/timeline.txt"
  for i in $(seq 0 $((NP - 1))); do
    CUDA_VISIBLE_DEVICES=$i timeout -k 5 "$t" "$PY" "${B[@]}" "${M124[@]}" train.global_batch_size=64 "${X[@]}" \
      log.name=indep$i --warmup 5 --steps 10 --json "$R/1b-indep$i.json" > "$R/1b-indep$i.log" 2>&1 &
  done
  wait $(jobs -p | grep -v "^$SMI$") 2>/dev/null
  show "$R"/1b-indep*.log; pack
  t=$(cap 150); echo "== 1c DDP over $NP ($t s)" | tee -a "$R/timeline.txt"
  timeout -k 5 "$t" "${TR[@]}" "${B[@]}" "${M124[@]}" train.global_batch_size=$((64 * NP)) parallel.dp_replicate=$NP \
    "${X[@]}" --warmup 5 --steps 10 --json "$R/1c-ddp.json" --results "$R/results.md" > "$R/1c-ddp.log" 2>&1
  show "$R/1c-ddp.log"; pack
fi
if want 2; then
  t=$(cap 200); echo "== 2 llama-7b FSDP$NP + AC, capped at 79 GiB ($t s)" | tee -a "$R/timeline.txt"
  timeout -k 5 "$t" "${TR[@]}" "${B[@]}" --config llama-7b model.vocab_size=50257 train.compile=true \
    parallel.dp_shard=$NP parallel.activation_checkpoint=full train.global_batch_size=$((8 * NP)) \
    train.micro_batch_size=4 model.loss_chunk=4096 "${X[@]}" --warmup 2 --steps 3 --no-comm-probe \
    --memory-cap-gib 79 --json "$R/2-llama7b.json" --results "$R/results.md" > "$R/2-llama7b.log" 2>&1
  show "$R/2-llama7b.log"; pack
fi
G15=(--config gpt2-1.5b model.n_head=20 model.vocab_size=50257 train.compile=true train.micro_batch_size=16
     model.loss_chunk=8192)
if want 3; then
  t=$(cap 150); echo "== 3 gpt2-1.5b FSDP$NP, global 128, micro 16 ($t s)" | tee -a "$R/timeline.txt"
  timeout -k 5 "$t" "${TR[@]}" "${B[@]}" "${G15[@]}" parallel.dp_shard=$NP train.global_batch_size=128 "${X[@]}" \
    --warmup 3 --steps 5 --json "$R/3-fsdp.json" --results "$R/results.md" > "$R/3-fsdp.log" 2>&1
  show "$R/3-fsdp.log"; pack
fi
if want 4; then
  t=$(cap 150); echo "== 4 gpt2-1.5b one GPU, global 32, micro 16 ($t s)" | tee -a "$R/timeline.txt"
  CUDA_VISIBLE_DEVICES=0 timeout -k 5 "$t" "$PY" "${B[@]}" "${G15[@]}" train.global_batch_size=32 "${X[@]}" \
    --warmup 3 --steps 5 --profile "$R/prof-1.5b" --json "$R/4-one.json" --results "$R/results.md" > "$R/4-one.log" 2>&1
  show "$R/4-one.log"; pack
fi
kill $SMI 2>/dev/null
# clocks and power by phase: the sampler's rows, summarised per GPU
"$PY" - "$R/smi.csv" > "$R/smi-summary.txt" 2>&1 <<'EOF'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))[1:]
by = {}
for r in rows:
    try:
        by.setdefault(r[1].strip(), []).append((float(r[2].split()[0]), float(r[4].split()[0]), r[7].strip()))
    except (ValueError, IndexError):
        pass
for gpu, v in sorted(by.items()):
    busy = [x for x in v if x[1] > 200]  # samples under load
    if busy:
        sm = sorted(x[0] for x in busy)
        print(f"GPU {gpu}: {len(busy)} loaded samples, SM clock min/median/max {sm[0]:.0f}/{sm[len(sm)//2]:.0f}/{sm[-1]:.0f} MHz, "
              f"power max {max(x[1] for x in busy):.0f} W, throttle reasons seen {sorted(set(x[2] for x in busy))}")
EOF
cat "$R/smi-summary.txt"; echo "== results"; cat "$R/results.md" 2>/dev/null; cat "$R/timeline.txt"; pack
