#!/usr/bin/env bash
# Tensor parallelism at 1.5B on 2 GPUs, before and after (issue 19), one device call (< 10 min):
#   bash benchmarks/tp_speed.sh            # on a 2-GPU machine; OLD=carry/old holds the code before the change
# Runs `distlm bench` on gpt2-1.5b (20 heads of 80: the same parameters and FLOPs as 25 of 64, and a head
# count TP2 divides), global batch 64, micro-batch 8, compiled per block, model.loss_chunk=0, synthetic data:
#   before_tp2  the code of OLD (a `git archive` of the commit before the change), parallel.tp=2
#   fsdp2       parallel.dp_shard=2 (the reference the target is measured against)
#   tp2         parallel.tp=2 (partial-sum gradients reduced once, the norm on local tensors)
#   tp2_async   parallel.tp=2 parallel.async_tp=true, profiled (run before tp2: the 2026-11-26 call ran out here)
#   tp2_mb16    async TP with micro-batch 16 (more work per GPU per collective)
# Writes $OUT/tp-speed.tgz (logs, bench JSON, profiles) and a summary on stdout.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONSAFEPATH=1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-tp
OUT=${OUT:-/tmp/out}; R=/tmp/tp-speed; OLD=${OLD:-carry/old}; NP=${NP:-2}; BUDGET=${BUDGET:-560}
mkdir -p "$OUT" "$R"
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m
  python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
  echo "commit $(git rev-parse --short HEAD 2>/dev/null)"; } > "$R/machine.txt" 2>&1
head -4 "$R/machine.txt"
M=(--config gpt2-1.5b model.n_head=20 model.vocab_size=50257 model.loss_chunk=0 data.source=synthetic
   train.on_nan=off train.compile=true train.compile_scope=block train.global_batch_size=64)
run() {  # run NAME PYTHONPATH [overrides and flags...]
  local name=$1 path=$2; shift 2
  [ $((BUDGET - SECONDS)) -lt 100 ] && { echo "[$name] skipped: time"; return; }
  PYTHONPATH=$path timeout $((BUDGET - SECONDS)) torchrun --standalone --nproc_per_node $NP -m distlm bench "${M[@]}" \
    "$@" --warmup 3 --steps 6 --no-comm-probe --json "$R/$name.json" > "$R/$name.log" 2>&1
  grep -E "tok/s|MFU|optimizer|step split|memory" "$R/$name.log" | head -8 | sed "s/^/[$name] /"
  grep -m3 -E "Error|error:" "$R/$name.log" | sed "s/^/[$name] /"
  tar -czf "$OUT/tp-speed.tgz" -C /tmp --exclude="*trace*" --exclude="*.pt.trace.json*" tp-speed  # traces are too big to come back
}
run before_tp2 "$PWD/$OLD" parallel.tp=2 train.micro_batch_size=8
run fsdp2 "$PWD" parallel.dp_shard=2 train.micro_batch_size=8
# async TP first: its compile is the longest, and the plain TP2 after the fix was measured on 2026-11-26
run tp2_async "$PWD" parallel.tp=2 parallel.async_tp=true train.micro_batch_size=8 --profile "$R/prof-tp2-async"
run tp2 "$PWD" parallel.tp=2 train.micro_batch_size=8
run tp2_mb16 "$PWD" parallel.tp=2 parallel.async_tp=true train.micro_batch_size=16
python3 - "$R" <<'PY'
import json, sys, glob, os
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    try:
        r = json.load(open(f))
    except ValueError:
        continue
    print(f"{os.path.basename(f)}: {r['tokens_per_s']:,.0f} tok/s, MFU {100 * (r['mfu'] or 0):.1f}%, step "
          f"{1e3 * r['step_s']:.0f} ms, phases ms {{{', '.join(f'{k}: {1e3 * v:.1f}' for k, v in r['phases_s'].items())}}}, "
          f"peak {r['peak_mem_gb']:.1f} GiB" + (f", profile {r['profile']['categories_s']}" if r.get('profile') else ""))
PY
