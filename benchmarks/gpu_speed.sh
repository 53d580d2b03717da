#!/usr/bin/env bash
# One device call on one GPU (issue 5): ceilings, profile, and the single-GPU speed levers, before and after.
#   SRC=/path/new OLD=/path/old bash benchmarks/gpu_speed.sh
# SRC and OLD are `git archive` snapshots (distlm/ + benchmarks/) of the code to measure and of the code
# before the change; OLD may be empty (the before-row is then skipped). Items, in priority order, each
# guarded by the time left (BUDGET seconds, default 540), selectable with ONLY="1 3":
#   1. ceilings: bf16 matmul TFLOP/s (8192^3, 16384^3) and copy bandwidth
#   2. gpt2-124m-1024, whole-model compile, micro 32: the OLD code (before), then the new code with --profile
#   3. new code + model.loss_chunk=8192 (logits never whole), micro 32 and micro 64
#   4. 200 steps on Gutenberg: the plain path (eager, separate q/k/v... as the old code) vs the optimized path;
#      losses compared step by step
#   5. per-block compile (FSDP2's scope) with --profile, micro 32
#   6. max-autotune-no-cudagraphs, per block
# Results: $OUT/speed.tgz (rewritten after each item) and a summary on stdout.
set -uo pipefail
# `python -m` puts the current directory ahead of PYTHONPATH: without this, a run from the repository root
# imports the checkout's distlm, not the snapshot's (it happened: benchmarks/RESULTS.md, third session)
export PYTHONSAFEPATH=1
NEW=${SRC:-$PWD}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/out}; R=/tmp/res-speed; rm -rf "$R"; mkdir -p "$OUT" "$R"
BUDGET=${BUDGET:-540}
PY=${PY:-python3}
X=()   # DRY=1: a tiny CPU model appended to every command, to check the plumbing here
if [ "${DRY:-0}" = 1 ]; then
  X=(model.n_layer=1 model.d_model=64 model.n_head=2 model.d_ff=128 model.block_size=32 train.device=cpu
     train.compile=false model.loss_chunk=0); PY=${PY_DRY:-.venv/bin/python}; fi
left() { echo $((BUDGET - SECONDS)); }
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
run() {  # run NAME CAP CMD...: under min(CAP, time left - 10) seconds, log in $R/NAME.log
  local name=$1 cap=$2; shift 2
  local t=$(($(left) - 10)); [ "$t" -lt "$cap" ] || t=$cap
  [ "$t" -gt 20 ] || { echo "[$name] skipped: no time left" | tee -a "$R/timeline.txt"; return 99; }
  local s=$SECONDS
  timeout -k 5 "$t" "$@" > "$R/$name.log" 2>&1; local rc=$?
  echo "[$name] rc $rc, wall $((SECONDS - s)) s" | tee -a "$R/timeline.txt"
  grep -E "tok/s|MFU|profile|peak memory|TFLOP/s|Error|error:" "$R/$name.log" | grep -v "^W" | head -8
  return $rc
}
pack() { tar -czf "$OUT/speed.tgz.tmp" -C /tmp res-speed && mv "$OUT/speed.tgz.tmp" "$OUT/speed.tgz"; }
bench() {  # bench NAME CODE_DIR CAP OVERRIDES... (extra flags after --)
  local name=$1 code=$2 cap=$3; shift 3
  run "$name" "$cap" env PYTHONPATH="$code" TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-$(basename "$code") \
    "$PY" -m distlm bench --config gpt2-124m-1024 data.source=synthetic train.compile=true train.on_nan=off \
    "${X[@]}" "$@" --json "$R/$name.json" --results "$R/results.md"
}

{ date -u; echo "new: $NEW (${COMMIT:-?}); old: ${OLD:-none} (${OLD_COMMIT:-?})"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
} > "$R/machine.txt" 2>&1
cat "$R/machine.txt"

if want 1; then
  run ceilings 90 env PYTHONPATH="$NEW" "$PY" -m distlm bench --ceilings --json "$R/ceilings.json"; pack
fi
if want 2; then
  [ -n "${OLD:-}" ] && bench old-model-m32 "$OLD" 150 train.compile_scope=model train.micro_batch_size=32 \
    --warmup 5 --steps 10 --no-comm-probe
  bench new-model-m32 "$NEW" 150 train.compile_scope=model train.micro_batch_size=32 --warmup 5 --steps 10 \
    --profile "$R/prof-new-model-m32"; pack
fi
if want 3; then
  bench new-model-m32-chunk "$NEW" 150 train.compile_scope=model train.micro_batch_size=32 model.loss_chunk=8192 \
    --warmup 5 --steps 10 --profile "$R/prof-new-model-m32-chunk"; pack
  bench new-model-m64-chunk "$NEW" 150 train.compile_scope=model train.micro_batch_size=64 \
    train.global_batch_size=128 model.loss_chunk=8192 --warmup 4 --steps 6; pack
fi
if want 4; then
  D=/tmp/data/gutenberg
  [ -d $D ] || PYTHONPATH="$NEW" "$PY" -m distlm prepare "$NEW/distlm/assets/gutenberg/gutenberg.tar.xz" --out $D --quiet \
    > "$R/prepare.log" 2>&1
  COMMON=(--config gpt2-124m-1024 data.dir=$D train.max_steps=200 train.global_batch_size=32
          train.micro_batch_size=16 train.eval_every=100 train.eval_batches=10 log.every=1 log.progress=false
          log.tensorboard=false log.root=$R/curves train.on_nan=off)
  # the plain path: the code before this change, eager (separate q/k/v, whole fp32 logits, no compile)
  run curve-plain 200 env PYTHONPATH="${OLD:-$NEW}" "$PY" -m distlm train "${COMMON[@]}" log.name=plain \
    train.compile=false "${X[@]}"
  run curve-fast 200 env PYTHONPATH="$NEW" TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-new "$PY" -m distlm train \
    "${COMMON[@]}" log.name=fast train.compile=true train.compile_scope=model model.loss_chunk=8192 "${X[@]}"
  PYTHONPATH="$NEW" "$PY" - "$R/curves" > "$R/curves.txt" 2>&1 <<'EOF'
import csv, sys
from pathlib import Path
root = Path(sys.argv[1])
def read(name):
    with open(root / name / "metrics.csv", newline="") as f:
        return {int(r["step"]): r for r in csv.DictReader(f)}
a, b = read("plain"), read("fast")
steps = sorted(s for s in a if s in b and a[s]["loss"] and b[s]["loss"])
d = [abs(float(a[s]["loss"]) - float(b[s]["loss"])) for s in steps]
print(f"{len(steps)} common steps; |loss(fast) - loss(plain)|: max {max(d):.4f}, mean {sum(d) / len(d):.4f}, "
      f"mean over the last 50 {sum(d[-50:]) / len(d[-50:]):.4f}")
for s in (1, 10, 50, 100, 150, 200):
    if s in a and s in b and a[s]["loss"]:
        print(f"step {s}: plain {float(a[s]['loss']):.4f} fast {float(b[s]['loss']):.4f}")
va = [float(r["val_loss"]) for r in a.values() if r.get("val_loss")]
vb = [float(r["val_loss"]) for r in b.values() if r.get("val_loss")]
print("val plain", va, "val fast", vb)
from distlm.train.plot import plot_runs
plot_runs([root / "plain", root / "fast"], root / "curves.png")
EOF
  cat "$R/curves.txt"; pack
fi
if want 5; then
  bench new-block-m32 "$NEW" 150 train.micro_batch_size=32 --warmup 5 --steps 10 --profile "$R/prof-new-block-m32"; pack
fi
if want 6; then
  bench new-block-m32-autotune "$NEW" 300 train.micro_batch_size=32 train.compile_mode=max-autotune-no-cudagraphs \
    --warmup 5 --steps 10; pack
fi
echo "== results"; cat "$R/results.md" 2>/dev/null; cat "$R/timeline.txt"
for p in "$R"/prof-*/profile.md; do [ -f "$p" ] && { echo "== $p"; sed -n 5,20p "$p"; }; done
pack
