#!/usr/bin/env bash
# Device-tool calls for issue 4, two parts of < 9 minutes, on NP GPUs (default 4; NP=2 on a 2-GPU machine):
#   NP=4 bash benchmarks/gpu_model_parallel.sh A   # gpt2-1.5b under FSDP4, TP2xDP2, PP2xDP2, TP2xPP2 (+ the planner's view)
#   NP=2 bash benchmarks/gpu_model_parallel.sh A   # gpt2-1.5b under DDP2, FSDP2, PP2, TP2
#   NP=4 bash benchmarks/gpu_model_parallel.sh B   # pipeline bubble sweep (naive / GPipe / 1F1B) on gpt2-355m, PP=NP
# gpt2-1.5b has 25 heads, which no TP degree but 5 divides; these runs use 20 heads of 80
# (model.n_head=20): the same parameters and FLOPs, and a head size cuDNN/flash attention take.
# Everything lands in $OUT/mp-<part>.tgz plus a summary on stdout.
set -uo pipefail
part=${1:-A}
NP=${NP:-4}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
OUT=${OUT:-/tmp/out}; R=/tmp/mp-$part; mkdir -p "$OUT" "$R"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m;
  python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"; } > "$R/machine.txt" 2>&1
head -3 "$R/machine.txt"
pack() { tar -czf "$OUT/mp-$part.tgz" -C /tmp "mp-$part"; }
M=(--config gpt2-1.5b model.n_head=20 model.vocab_size=50257 data.source=synthetic train.on_nan=off
   train.global_batch_size=64 train.micro_batch_size=8)
if [ "$part" = A ]; then
  python3 -m distlm plan "${M[@]:0:3}" --gpus $NP --gpu-mem-gb 80 --global-batch 64 --micro-batch 8 > "$R/plan.txt" 2>&1
  if [ "$NP" = 4 ]; then
    LAYOUTS=("fsdp4:parallel.dp_shard=4" "tp2_dp2:parallel.tp=2 parallel.dp_shard=2"
             "pp2_dp2:parallel.pp=2 parallel.dp_shard=2" "tp2_pp2:parallel.tp=2 parallel.pp=2")
  else
    LAYOUTS=("ddp2:parallel.dp_replicate=2" "fsdp2:parallel.dp_shard=2" "pp2:parallel.pp=2" "tp2:parallel.tp=2")
  fi
  for v in "${LAYOUTS[@]}"; do
    name=${v%%:*}; lay=${v#*:}
    [ $SECONDS -gt 470 ] && { echo "[$name] skipped: time"; continue; }
    timeout $((520 - SECONDS)) torchrun --standalone --nproc_per_node $NP -m distlm bench "${M[@]}" $lay \
      train.compile=true --warmup 3 --steps 6 --no-comm-probe --results "$R/bench.md" --json "$R/$name.json" \
      > "$R/$name.log" 2>&1
    grep -E "tok/s|MFU|memory" "$R/$name.log" | sed "s/^/[$name] /"
    grep -m3 -E "Error|error:" "$R/$name.log" | sed "s/^/[$name] /"
    pack
  done
else
  timeout 300 torchrun --standalone --nproc_per_node $NP -m distlm bench --config gpt2-355m model.vocab_size=50257 \
    data.source=synthetic train.on_nan=off train.compile=false parallel.pp=$NP train.global_batch_size=32 \
    --pp-sweep 1,2,4,8,16,32 --warmup 2 --steps 4 --out-dir "$R/pp-sweep" > "$R/pp-sweep.log" 2>&1
  grep -E "^\||error" "$R/pp-sweep.log" | head -20
  pack
  if [ -f benchmarks/gpu_classify.sh ] && [ $SECONDS -lt 300 ]; then
    OUT=/tmp/mp-B/classify timeout $((540 - SECONDS)) bash benchmarks/gpu_classify.sh > "$R/classify.log" 2>&1
    tail -30 "$R/classify.log"
  fi
fi
pack
