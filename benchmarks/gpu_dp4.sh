#!/usr/bin/env bash
# One device call on a 4-GPU machine (nvidia-h100-x4 / nvidia-h200-x4), the successor of gpu_parallel.sh:
#   bash benchmarks/gpu_dp4.sh           (carry .whl: horovod-0.28.1.tar.gz + cloudpickle/psutil/cffi/pycparser wheels)
#   NP=2 bash benchmarks/gpu_dp4.sh      (the same study on a 2-GPU machine: sizes 1,2)
# In priority order, each guarded by the time left (BUDGET seconds in all, default 525):
#   1. the Horovod NCCL build, in the background in its own session (nice'd, on half the cores)
#   2. DDP weak scaling 1,2,4            (gpt2-124m-1024, synthetic, bf16, compile, on_nan=off)
#   3. FSDP2 weak scaling 1,2,4 (2,4 if time is short)
#   4. gpt2-1.5b FSDP2 dp_shard=4 + full activation checkpointing, global 64 / micro 16 (micro 8 if 16 fails)
#   5. Horovod (NCCL) vs torch DDP, 4 GPUs, 50 steps of `distlm train`
# Everything lands in $OUT/dp4.tgz (rewritten after each item, so a timeout keeps what finished) plus a
# summary on stdout. CPU dry run of every command with a tiny model, 2 processes, 1 step:
#   DRY=1 bash benchmarks/gpu_dp4.sh
# ONLY="4 5" runs only those items (the Horovod build, item 1, always starts); BEFORE_HOROVOD="CMD" runs CMD
# (other benchmarks) while the build goes on, before item 5.
# SRC=DIR runs the code in DIR (a `git archive COMMIT distlm scripts` snapshot) instead of the working tree,
# so edits made in the checkout while the call is prepared do not change what is measured; COMMIT names it.
set -uo pipefail
ROOT=$PWD
if [ -n "${SRC:-}" ]; then cd "$SRC" || exit 1; fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor}   # later launches reuse compiled kernels
OUT=${OUT:-/tmp/out}; R=/tmp/res-dp4; rm -rf "$R"; mkdir -p "$OUT" "$R"
BUDGET=${BUDGET:-525}
DRY=${DRY:-0}
if [ "$DRY" = 1 ]; then   # tiny model on the CPU, 2 processes: checks flags and plumbing only
  PY=${PY:-$ROOT/.venv/bin/python}; NP=2; SIZES=1,2; WU=1; ST=1; TRAIN_STEPS=2; LOGE=1
  TINY=(model.n_layer=1 model.d_model=64 model.n_head=2 model.d_ff=128 model.block_size=32 train.device=cpu
        train.compile=${DRY_COMPILE:-false})
  BIG_GB=8; BIG_MB=2; HVD_TRAIN_GB=8
else
  PY=python3; NP=${NP:-4}; SIZES=$(seq -s, 1 "$NP" | sed 's/,3//'); WU=6; ST=12; TRAIN_STEPS=50; LOGE=10; TINY=()
  BIG_GB=64; BIG_MB=16; HVD_TRAIN_GB=128
fi
TR=("$PY" -m torch.distributed.run --standalone --nproc_per_node "$NP")
left() { echo $((BUDGET - SECONDS)); }
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
lim() { local l=$(($(left) - $2)); echo $((l < $1 ? l : $1)); }   # lim CAP RESERVE: a hang cannot eat the rest
# run NAME SECONDS CMD...: under a time limit (timeout signals the whole process group), log to $R/NAME.log
run() {
  local name=$1 t=$2; shift 2
  [ "$t" -gt 5 ] || { echo "[$name] skipped: no time left" | tee "$R/$name.log"; return 99; }
  local s=$SECONDS
  timeout -k 5 "$t" "$@" > "$R/$name.log" 2>&1; local rc=$?
  echo "[$name] rc $rc, wall $((SECONDS - s)) s" | tee -a "$R/timeline.txt"
  return $rc
}
pack() { tar -czf "$OUT/dp4.tgz.tmp" -C /tmp res-dp4 && mv "$OUT/dp4.tgz.tmp" "$OUT/dp4.tgz"; }
rescue() {  # a --scaling run that was cut keeps each finished launch's JSON in /tmp/distlm-scaling-N-*/
  local dir=$1; mkdir -p "$dir"
  for j in /tmp/distlm-scaling-*/bench.json; do
    [ -f "$j" ] || continue; n=$(basename "$(dirname "$j")" | cut -d- -f3)
    cp "$j" "$dir/launch-$n-gpu.json"
  done
  rm -rf /tmp/distlm-scaling-*
}
quiet() { grep -vE "^W1|^\*{5}|OMP_NUM_THREADS|^$|^scaling:" ; }

{ date -u; echo "code: ${COMMIT:-working tree} in $PWD"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None)"
  echo "nproc $(nproc)"; command -v nvcc; nvcc --version | tail -1; gcc --version | head -1; cmake --version | head -1
} > "$R/machine.txt" 2>&1
head -3 "$R/machine.txt"; grep -E "^torch|^nproc" "$R/machine.txt"

# ---- 1. Horovod NCCL build, in its own session so it runs on while the benchmarks do --------------------
HVD_SITE=/tmp/site
if [ "$DRY" != 1 ] && [ -f "$ROOT/.whl/horovod-0.28.1.tar.gz" ]; then
  command -v nvcc >/dev/null || export PATH=$PATH:/usr/local/cuda/bin
  # The NCCL that torch's wheel carries has only libnccl.so.2: give CMake a libnccl.so to find (shared link).
  nccl=$(python3 -c "import nvidia.nccl as m; print(list(m.__path__)[0])" 2>/dev/null || true)
  if [ -n "$nccl" ]; then
    mkdir -p /tmp/nccl/lib
    h=$(find "$nccl" -name nccl.h | head -1); so=$(find "$nccl" -name 'libnccl.so*' | head -1)
    [ -n "$h" ] && export HOROVOD_NCCL_INCLUDE=$(dirname "$h")
    if [ -n "$so" ]; then
      ln -sf "$so" /tmp/nccl/lib/libnccl.so; ln -sf "$so" /tmp/nccl/lib/libnccl.so.2
      export HOROVOD_NCCL_LIB=/tmp/nccl/lib HOROVOD_NCCL_LINK=SHARED
    fi
    echo "nccl for horovod: header $h, lib $so" >> "$R/machine.txt"
  fi
  n=$(nproc); half=$((n / 2))
  pin=(); command -v taskset >/dev/null && [ "$n" -ge 8 ] && pin=(taskset -c "$half-$((n - 1))")  # nproc there = -j
  export HOROVOD_BUILD_CUDA_CC_LIST=90   # H100 and H200 are sm_90: one architecture instead of every one nvcc knows
  setsid nice -n 19 "${pin[@]}" bash -c "python3 -m pip install -q --no-index --no-deps --no-compile --target $HVD_SITE $ROOT/.whl/*.whl;
    PYTHONPATH=$HVD_SITE OFFLINE=1 PYTHON=python3 TARGET=$HVD_SITE DISTLM_CACHE=/tmp/hvdcache \
    bash scripts/build_horovod.sh $ROOT/.whl/horovod-0.28.1.tar.gz > /tmp/hvd-build.log 2>&1; echo exit \$? >> /tmp/hvd-build.log" \
    < /dev/null > /dev/null 2>&1 &
  echo "[horovod] build started at ${SECONDS}s (${pin[*]:-all cores}, nice 19)" | tee -a "$R/timeline.txt"
fi

B=(--config gpt2-124m-1024 data.source=synthetic train.compile=true train.on_nan=off "${TINY[@]}")

# ---- 2. DDP weak scaling 1,2,4 -------------------------------------------------------------------------
t2=$SECONDS
want 2 && run ddp_scaling $(lim 270 20) "$PY" -m distlm bench --scaling "$SIZES" --axis dp_replicate --mode weak "${B[@]}" \
  --warmup $WU --steps $ST --out-dir "$R/dp_replicate"
[ -f "$R/ddp_scaling.log" ] && quiet < "$R/ddp_scaling.log" | grep -E "^\||^weak" ; rescue "$R/dp_replicate"; pack
t_ddp=$((SECONDS - t2))

# ---- 3. FSDP2 weak scaling: 1,2,4 if there is room for items 4 and 5 after it, else 2,4 ----------------
if ! want 3; then
  :
elif [ "$(left)" -ge $((t_ddp + 200)) ] || [ "$DRY" = 1 ]; then
  run fsdp_scaling $(lim 270 20) "$PY" -m distlm bench --scaling "$SIZES" --axis dp_shard --mode weak "${B[@]}" \
    --warmup $WU --steps $ST --out-dir "$R/dp_shard"
else  # start at 2 GPUs with the same 64 sequences per GPU (weak mode scales the first size's global batch)
  run fsdp_scaling $(lim 270 20) "$PY" -m distlm bench --scaling 2,4 --axis dp_shard --mode weak "${B[@]}" \
    train.global_batch_size=128 --warmup $WU --steps $ST --out-dir "$R/dp_shard"
fi
[ -f "$R/fsdp_scaling.log" ] && quiet < "$R/fsdp_scaling.log" | grep -E "^\||^weak"; rescue "$R/dp_shard"; pack

# ---- 4. gpt2-1.5b, FSDP2 over 4 GPUs, full activation checkpointing -----------------------------------
big() {  # big MICRO
  run "fsdp_1.5b_m$1" $(lim 200 15) "${TR[@]}" -m distlm bench --config gpt2-1.5b data.source=synthetic \
    model.vocab_size=50257 train.compile=true train.on_nan=off parallel.dp_shard=$NP parallel.activation_checkpoint=full \
    train.global_batch_size=$BIG_GB train.micro_batch_size=$1 "${TINY[@]}" --warmup 3 --steps 6 \
    --results "$R/bench.md" --json "$R/fsdp-1.5b-m$1.json"
}
if ! want 4; then
  :
elif [ "$(left)" -ge 70 ]; then
  big $BIG_MB; rc=$?
  grep -E "tok/s|MFU|memory|exposed" "$R/fsdp_1.5b_m$BIG_MB.log" | grep -v "^W1" | sed "s/^/[1.5b m$BIG_MB] /"
  if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ "$(left)" -ge 90 ]; then
    grep -E "Error|error" "$R/fsdp_1.5b_m$BIG_MB.log" | tail -3
    big $((BIG_MB / 2))
    grep -E "tok/s|MFU|memory|exposed" "$R/fsdp_1.5b_m$((BIG_MB / 2)).log" | sed "s/^/[1.5b m$((BIG_MB / 2))] /"
  fi
else
  echo "[1.5b] skipped: $(left) s left"
fi
pack

if [ -n "${BEFORE_HOROVOD:-}" ]; then
  s0=$SECONDS; eval "$BEFORE_HOROVOD"; echo "[before horovod] rc $?, wall $((SECONDS - s0)) s" | tee -a "$R/timeline.txt"; pack
fi

# ---- 5. Horovod (NCCL) vs torch DDP, 50 steps of distlm train ------------------------------------------
T=(--config gpt2-124m-1024 data.source=synthetic train.compile=true train.on_nan=off train.max_steps=$TRAIN_STEPS
   log.every=$LOGE train.eval_every=0 train.eval_batches=2 log.samples=0 train.global_batch_size=$HVD_TRAIN_GB
   train.micro_batch_size=16 log.progress=false log.tensorboard=false log.root=/tmp/runs "${TINY[@]}")
[ "$DRY" = 1 ] && T+=(train.micro_batch_size=2)
rm -rf /tmp/runs
step_line() { grep -E "step +$TRAIN_STEPS\b|Error|error" "$1" | grep -v "^W1" | head -3; }
if [ "$(left)" -ge 60 ]; then
  run ddp_train $(($(left) - 10)) "${TR[@]}" -m distlm train "${T[@]}" parallel.dp_replicate=$NP log.name=ddp
  step_line "$R/ddp_train.log" | sed 's/^/[ddp] /'
else
  echo "[ddp train] skipped: $(left) s left"
fi
pack
if [ "$DRY" = 1 ]; then
  HVD=("$PY")
else
  while [ "$(left)" -ge 45 ] && ! grep -q '^exit' /tmp/hvd-build.log 2>/dev/null; do sleep 3; done
  echo "[horovod] build log at ${SECONDS}s:"; tail -c 3000 /tmp/hvd-build.log 2>/dev/null | tail -8
  cp /tmp/hvd-build.log "$R/" 2>/dev/null
  export PYTHONPATH=$HVD_SITE:$PYTHONPATH LD_LIBRARY_PATH=/tmp/nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  HVD=(python3)
fi
if "${HVD[@]}" -c "import horovod, horovod.torch as h; print('horovod', horovod.__version__, 'nccl_built', h.nccl_built(), 'gloo', h.gloo_built())" 2>&1 | tee "$R/horovod-check.txt"; then
  if [ "$(left)" -ge 40 ]; then
    run hvd_train $(($(left) - 8)) "${HVD[@]}" -m horovod.runner.launch -np $NP -H localhost:$NP --gloo \
      "${HVD[@]}" -m distlm train "${T[@]}" parallel.engine=horovod parallel.dp_replicate=$NP log.name=hvd
    step_line "$R/hvd_train.log" | sed 's/^/[horovod] /'
  else
    echo "[horovod train] skipped: $(left) s left"
  fi
else
  echo "[horovod] not importable; build log tail above"
fi
for d in /tmp/runs/*/; do [ -f "$d/metrics.csv" ] && cp "$d/metrics.csv" "$R/metrics-$(basename "$d").csv"; done
echo "[end] ${SECONDS}s" | tee -a "$R/timeline.txt"
pack
cat "$R/timeline.txt"
