#!/usr/bin/env bash
# Follow-up device call on a 4-GPU machine (issue 5), after gpu_x4.sh:
#   SRC=/path/new OLD=/path/old COMMIT=... OLD_COMMIT=... bash benchmarks/gpu_x4b.sh    (ONLY, BUDGET as usual)
# 1. gpt2-1.5b FSDP4 with more work per reduction: global 256 / micro 16, ZeRO-2 (reshard_after_forward=false)
# 2. gpt2-1.5b FSDP4, global 128 / micro 32, ZeRO-2 (needs the H200's memory)
# 3. Loss curves, 200 steps of gpt2-124m-1024 on Gutenberg, four runs at once, one per GPU: the code before
#    the speed work eager (the plain path) and compiled (its rounding noise), the new code compiled with the
#    chunked loss and without it. Step-by-step differences against the plain path.
# 4. DDP weak scaling with the best single-GPU settings (whole-model compile, micro 32, chunked loss): alone, DDP4
set -uo pipefail
# `python -m` puts the current directory ahead of PYTHONPATH: without this, a run from the repository root
# imports the checkout's distlm, not the snapshot's (it happened: benchmarks/RESULTS.md, third session)
export PYTHONSAFEPATH=1
NEW=${SRC:-$PWD}; OLDC=${OLD:-$NEW}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; R=/tmp/res-x4b; rm -rf "$R"; mkdir -p "$OUT" "$R"
BUDGET=${BUDGET:-480}; PY=${PY:-python3}; NP=${NP:-4}
X=()
if [ "${DRY:-0}" = 1 ]; then
  X=(model.n_layer=1 model.d_model=64 model.n_head=2 model.d_ff=128 model.block_size=32 train.device=cpu
     train.compile=false); PY=${PY_DRY:-.venv/bin/python}; NP=2; fi
left() { echo $((BUDGET - SECONDS)); }
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
cap() { local t=$(($(left) - 10)); [ "$t" -lt "$1" ] && echo "$t" || echo "$1"; }
pack() { tar -czf "$OUT/x4b.tgz.tmp" -C /tmp --exclude='checkpoints' res-x4b && mv "$OUT/x4b.tgz.tmp" "$OUT/x4b.tgz"; }
show() { grep -hE "tok/s|exposed|MFU|peak memory|Error|error" "$@" | grep -v "^W" | head -12; }
TR=("$PY" -m torch.distributed.run --standalone --nproc_per_node "$NP")
B=(-m distlm bench data.source=synthetic train.on_nan=off)
{ date -u; echo "new: ${COMMIT:-?}; old: ${OLD_COMMIT:-?}"; nvidia-smi --query-gpu=index,name,memory.total --format=csv
} > "$R/machine.txt" 2>&1; cat "$R/machine.txt"

G15=(--config gpt2-1.5b model.n_head=20 model.vocab_size=50257 train.compile=true model.loss_chunk=8192
     parallel.dp_shard=$NP parallel.reshard_after_forward=false)
if want 1; then
  t=$(cap 150); echo "== 1 gpt2-1.5b FSDP$NP ZeRO-2, global 256, micro 16 ($t s)" | tee -a "$R/timeline.txt"
  PYTHONPATH=$NEW TORCHINDUCTOR_CACHE_DIR=/tmp/ind-new timeout -k 5 "$t" "${TR[@]}" "${B[@]}" "${G15[@]}" \
    train.global_batch_size=256 train.micro_batch_size=16 "${X[@]}" --warmup 2 --steps 4 \
    --json "$R/1.json" --results "$R/results.md" > "$R/1.log" 2>&1
  show "$R/1.log"; pack
fi
if want 2; then
  t=$(cap 150); echo "== 2 gpt2-1.5b FSDP$NP ZeRO-2, global 128, micro 32 ($t s)" | tee -a "$R/timeline.txt"
  PYTHONPATH=$NEW TORCHINDUCTOR_CACHE_DIR=/tmp/ind-new timeout -k 5 "$t" "${TR[@]}" "${B[@]}" "${G15[@]}" \
    train.global_batch_size=128 train.micro_batch_size=32 "${X[@]}" --warmup 2 --steps 4 \
    --json "$R/2.json" --results "$R/results.md" > "$R/2.log" 2>&1
  show "$R/2.log"; pack
fi
if want 3; then
  D=/tmp/data/gutenberg
  PYTHONPATH=$NEW "$PY" -m distlm prepare "$NEW/distlm/assets/gutenberg/gutenberg.tar.xz" --out $D --quiet > "$R/prepare.log" 2>&1
  t=$(cap 200); echo "== 3 four loss curves at once ($t s)" | tee -a "$R/timeline.txt"
  C=(--config gpt2-124m-1024 data.dir=$D train.max_steps=200 train.global_batch_size=32 train.micro_batch_size=16
     train.eval_every=100 train.eval_batches=10 log.every=1 log.progress=false log.tensorboard=false
     log.root=$R/curves train.on_nan=off train.checkpoint_every=0)
  curve() { local gpu=$1 name=$2 code=$3; shift 3
    CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=$code TORCHINDUCTOR_CACHE_DIR=/tmp/ind-$name timeout -k 5 "$t" \
      "$PY" -m distlm train "${C[@]}" log.name=$name "$@" "${X[@]}" > "$R/curve-$name.log" 2>&1 & }
  curve 0 plain "$OLDC" train.compile=false
  curve 1 plain-compiled "$OLDC" train.compile=true train.compile_scope=model
  curve 2 fast "$NEW" train.compile=true train.compile_scope=model model.loss_chunk=8192
  curve $((3 % NP)) fast-whole "$NEW" train.compile=true train.compile_scope=model
  wait
  PYTHONPATH=$NEW "$PY" - "$R/curves" > "$R/curves.txt" 2>&1 <<'EOF'
import csv, sys
from pathlib import Path
root = Path(sys.argv[1])
def read(name):
    with open(root / name / "metrics.csv", newline="") as f:
        return {int(r["step"]): r for r in csv.DictReader(f) if r["loss"]}
ref = read("plain")
for name in ("plain-compiled", "fast", "fast-whole"):
    try:
        b = read(name)
    except OSError as e:
        print(name, "missing", e); continue
    steps = sorted(s for s in ref if s in b)
    d = [abs(float(ref[s]["loss"]) - float(b[s]["loss"])) for s in steps]
    print(f"{name} vs plain: {len(steps)} steps, |dloss| max {max(d):.4f} mean {sum(d)/len(d):.4f} "
          f"last-50 mean {sum(d[-50:])/len(d[-50:]):.4f}; loss at 200: {float(b[steps[-1]]['loss']):.4f} "
          f"vs {float(ref[steps[-1]]['loss']):.4f}; val {[r['val_loss'][:6] for r in b.values() if r.get('val_loss')]}")
print("plain val", [r["val_loss"][:6] for r in ref.values() if r.get("val_loss")])
from distlm.train.plot import plot_runs
plot_runs([root / n for n in ("plain", "plain-compiled", "fast", "fast-whole") if (root / n).exists()],
          root / "curves.png")
EOF
  cat "$R/curves.txt"; pack
fi
if want 4; then
  M=(--config gpt2-124m-1024 train.compile=true train.compile_scope=model train.micro_batch_size=32 model.loss_chunk=8192)
  t=$(cap 100); echo "== 4a one GPU, best settings ($t s)" | tee -a "$R/timeline.txt"
  CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$NEW TORCHINDUCTOR_CACHE_DIR=/tmp/ind-new timeout -k 5 "$t" "$PY" "${B[@]}" "${M[@]}" \
    train.global_batch_size=64 "${X[@]}" --warmup 5 --steps 10 --json "$R/4a.json" --results "$R/results.md" > "$R/4a.log" 2>&1
  show "$R/4a.log"
  t=$(cap 120); echo "== 4b DDP$NP, best settings ($t s)" | tee -a "$R/timeline.txt"
  PYTHONPATH=$NEW TORCHINDUCTOR_CACHE_DIR=/tmp/ind-new timeout -k 5 "$t" "${TR[@]}" "${B[@]}" "${M[@]}" \
    train.global_batch_size=$((64 * NP)) parallel.dp_replicate=$NP "${X[@]}" --warmup 5 --steps 10 \
    --json "$R/4b.json" --results "$R/results.md" > "$R/4b.log" 2>&1
  show "$R/4b.log"; pack
fi
echo "== results"; cat "$R/results.md" 2>/dev/null; cat "$R/timeline.txt"; pack
