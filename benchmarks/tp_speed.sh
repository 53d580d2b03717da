#!/usr/bin/env bash
# Tensor parallelism at 1.5B, before and after (issue 19), one device call (< 10 min):
#   OLD=carry/old bash benchmarks/tp_speed.sh                    # 2 GPUs: fsdp2 before_tp2 tp2 tp2_async tp2_mb16
#   ITEMS="fsdp4 tp2_fsdp2 tp2_fsdp2_async" bash benchmarks/tp_speed.sh   # 4 GPUs: 2-D TP2 x FSDP2
# OLD holds the code before the change (a `git archive`). Each item is one `distlm bench` of gpt2-1.5b
# (20 heads of 80: the same parameters and FLOPs as 25 of 64, and a head count TP2 divides), global
# batch 64, compiled per block, model.loss_chunk=0, synthetic data:
#   fsdp2 / fsdp4     parallel.dp_shard=N, micro-batch 8 (the reference the TP target is measured against)
#   before_tp2        the code of OLD, parallel.tp=2, micro-batch 8
#   tp2               parallel.tp=2, micro-batch 8, profiled
#   tp2_async         + parallel.async_tp=true (micro-pipelined all-gather/reduce-scatter matmuls), profiled
#   tp2_mb16          parallel.tp=2, micro-batch 16: half the block calls per token (the profiles show TP2
#                     launch-bound: 42% of its step with no kernel running)
#   tp2_async_mb16    async TP with micro-batch 16
#   tp2_async_mb32    async TP with micro-batch 32
#   before_tp2_async_mb16  async TP at micro-batch 16 with the code of OLD (e.g. before the row-parallel
#                     bias moved after the reduction, which lets inductor fuse the forward reduce-scatters)
#   tp2_mb32          parallel.tp=2, micro-batch 32 (2 accumulation steps): TP2 halves the activations
#                     FSDP2 holds, so it fits a micro-batch FSDP2 cannot (planner: 68.5 of 79 GiB)
#   fsdp2_mb16        FSDP2 at micro-batch 16, the reference for tp2_mb16
#   tp2_mb32_reorder / tp2_mb32_overlap   TP2 at micro-batch 32 with inductor's compute/communication
#                     reordering (reorder_for_compute_comm_overlap) or its overlap scheduler
#                     (aten_distributed_optimizations.enable_overlap_scheduling), profiled
#   tp2_mb32_prof / tp2_async_mb32_prof   TP2 at micro-batch 32 without / with async TP, profiled (the
#                     profile's top kernels show whether inductor's fused all-gather/reduce-scatter
#                     matmuls ran, and how much of the step the collectives hold)
#   tp2_fsdp2[_async] parallel.tp=2 parallel.dp_shard=2 on 4 GPUs, micro-batch 8
# Writes $OUT/tp-speed${TAG:+-$TAG}.tgz (logs, bench JSON, profile summaries) and a summary on stdout.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONSAFEPATH=1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-tp
OUT=${OUT:-/tmp/out}; R=/tmp/tp-speed${TAG:+-$TAG}; OLD=${OLD:-carry/old}; BUDGET=${BUDGET:-560}
mkdir -p "$OUT" "$R"
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m
  python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
  # The device's copy of .git is not the session's (its commit line stayed 8bc2a17 through the twelfth
  # session): the sources' fingerprint is what identifies the code that ran. The same command on the
  # CPU box, at a commit, gives the same value.
  echo "commit $(git rev-parse --short HEAD 2>/dev/null) (may be stale), sources $(find distlm -name '*.py' | LC_ALL=C sort | xargs cat | sha1sum | cut -c1-12)"
  } > "$R/machine.txt" 2>&1
head -4 "$R/machine.txt"
M=(--config gpt2-1.5b model.n_head=20 model.vocab_size=50257 model.loss_chunk=0 data.source=synthetic
   train.on_nan=off train.compile=true train.compile_scope=block train.global_batch_size=64)
if [ "${DRY:-0}" = 1 ]; then  # a rehearsal on the CPU (gloo), tiny model, nothing measured
  M=(--config tiny model.n_layer=2 model.n_head=4 data.source=synthetic train.device=cpu train.compile=false
     train.global_batch_size=32)
  [ -x .venv/bin/python ] && export PATH=$PWD/.venv/bin:$PATH
fi
run() {  # run NAME NPROC PYTHONPATH [overrides and flags...]
  local name=$1 np=$2 path=$3; shift 3
  [ $((BUDGET - SECONDS)) -lt 100 ] && { echo "[$name] skipped: time"; return; }
  # INDUCTOR=k=v,...: inductor settings for this item (benchmarks/inductor_knobs.py)
  local entry=(-m distlm); [ -n "${INDUCTOR:-}" ] && entry=("$PWD/benchmarks/inductor_knobs.py")
  PYTHONPATH=$path timeout $((BUDGET - SECONDS)) torchrun --standalone --nproc_per_node "$np" "${entry[@]}" bench "${M[@]}" \
    "$@" --warmup 3 --steps 6 --no-comm-probe --json "$R/$name.json" > "$R/$name.log" 2>&1
  grep -E "tok/s|MFU|optimizer|step split|memory|profile|timeline" "$R/$name.log" | head -9 | sed "s/^/[$name] /"
  grep -m3 -E "Error|error:" "$R/$name.log" | sed "s/^/[$name] /"
  # traces are too big to come back; the profile's summary (profile.md) does
  tar -czf "$OUT/tp-speed${TAG:+-$TAG}.tgz" -C /tmp --exclude="*trace*" "$(basename "$R")"
}
for item in ${ITEMS:-fsdp2 before_tp2 tp2 tp2_async tp2_mb16}; do
  case $item in
    fsdp2) run fsdp2 2 "$PWD" parallel.dp_shard=2 train.micro_batch_size=8 ;;
    fsdp4) run fsdp4 4 "$PWD" parallel.dp_shard=4 train.micro_batch_size=8 ;;
    before_tp2) run before_tp2 2 "$PWD/$OLD" parallel.tp=2 train.micro_batch_size=8 ;;
    tp2) run tp2 2 "$PWD" parallel.tp=2 train.micro_batch_size=8 --profile "$R/prof-tp2" ;;
    tp2_async) run tp2_async 2 "$PWD" parallel.tp=2 parallel.async_tp=true train.micro_batch_size=8 --profile "$R/prof-tp2-async" ;;
    tp2_mb16) run tp2_mb16 2 "$PWD" parallel.tp=2 train.micro_batch_size=16 ;;
    tp2_mb32) run tp2_mb32 2 "$PWD" parallel.tp=2 train.micro_batch_size=32 ;;
    tp2_async_mb32) run tp2_async_mb32 2 "$PWD" parallel.tp=2 parallel.async_tp=true train.micro_batch_size=32 ;;
    before_tp2_async_mb16) run before_tp2_async_mb16 2 "$PWD/$OLD" parallel.tp=2 parallel.async_tp=true train.micro_batch_size=16 ;;
    tp2_async_mb16) run tp2_async_mb16 2 "$PWD" parallel.tp=2 parallel.async_tp=true train.micro_batch_size=16 ;;
    fsdp2_mb16) run fsdp2_mb16 2 "$PWD" parallel.dp_shard=2 train.micro_batch_size=16 ;;
    tp2_mb32_prof) run tp2_mb32_prof 2 "$PWD" parallel.tp=2 train.micro_batch_size=32 --profile "$R/prof-tp2-mb32" ;;
    tp2_async_mb32_prof) run tp2_async_mb32_prof 2 "$PWD" parallel.tp=2 parallel.async_tp=true train.micro_batch_size=32 \
      --profile "$R/prof-tp2-async-mb32" ;;
    tp2_mb32_reorder) INDUCTOR=reorder_for_compute_comm_overlap=true run tp2_mb32_reorder 2 "$PWD" parallel.tp=2 \
      train.micro_batch_size=32 --profile "$R/prof-tp2-mb32-reorder" ;;
    tp2_mb32_overlap) INDUCTOR=aten_distributed_optimizations.enable_overlap_scheduling=true run tp2_mb32_overlap 2 "$PWD" \
      parallel.tp=2 train.micro_batch_size=32 --profile "$R/prof-tp2-mb32-overlap" ;;
    tp2_fsdp2) run tp2_fsdp2 4 "$PWD" parallel.tp=2 parallel.dp_shard=2 train.micro_batch_size=8 ;;
    tp2_fsdp2_async) run tp2_fsdp2_async 4 "$PWD" parallel.tp=2 parallel.dp_shard=2 parallel.async_tp=true train.micro_batch_size=8 ;;
    *) echo "unknown item $item" >&2 ;;
  esac
done
python3 - "$R" <<'PY'
import json, sys, glob, os
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    try:
        r = json.load(open(f))
    except ValueError:
        continue
    print(f"{os.path.basename(f)}: {r['tokens_per_s']:,.0f} tok/s, MFU {100 * (r['mfu'] or 0):.1f}%, step "
          f"{1e3 * r['step_s']:.0f} ms, phases ms {{{', '.join(f'{k}: {1e3 * v:.1f}' for k, v in r['phases_s'].items())}}}, "
          + (f"peak {r['peak_mem_gb']:.1f} GiB" if r['peak_mem_gb'] is not None else "peak n/a") + (f", profile {r['profile']['categories_s']}" if r.get('profile') else ""))
PY
