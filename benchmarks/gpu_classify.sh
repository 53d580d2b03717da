#!/usr/bin/env bash
# Classification scaling study (issue 6) in one device-tool call on a 4-GPU machine (H100/H200 x4):
#   bash benchmarks/gpu_classify.sh
# The seed system's two models (2 layers x 128 wide, 4 layers x 256 wide) on the vendored 4-topic
# 20 Newsgroups set, DDP weak scaling at 1, 2 and 4 GPUs (per-GPU batch fixed, as the seed's
# DistributedSampler did), then what turns negative scaling positive on the small model: a bigger
# per-GPU batch, gradient accumulation, a bigger DDP bucket. Last, one real 4-GPU DDP training run
# for the accuracy. Each `bench --scaling` is three torchrun launches (~10 s each, mostly start-up);
# the whole script takes about 3-4 minutes and skips what is left past 200 s so it ends in time.
# Everything (JSON, markdown, PNG, logs) lands in $OUT/classify.tgz; a compact summary goes to stdout.
# WARMUP, STEPS and TRAIN_STEPS (defaults 5, 20, 300) shrink it for a dry run of the script itself.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; R=/tmp/res-classify; D=/tmp/data/20news4-L128; mkdir -p "$OUT" "$R"
START=$SECONDS; WARMUP=${WARMUP:-5}; STEPS=${STEPS:-20}; TRAIN_STEPS=${TRAIN_STEPS:-300}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m;
  python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"; } > "$R/machine.txt" 2>&1
head -6 "$R/machine.txt"
NGPU=$(nvidia-smi -L | wc -l)
SIZES=1,2,4; [ "$NGPU" -lt 4 ] && SIZES=1,2 && echo "only $NGPU GPUs: scaling at $SIZES"

# First, the classifier's CUDA check (masked bf16 attention under the Trainer's kernel order).
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_classify.py 2>&1 | tail -3 | tee "$R/gpu-test.log"
python3 -m distlm prepare --task classify distlm/assets/20news4/20news4.jsonl.xz --out "$D" --max-len 128 2>&1 | tee "$R/prepare.log"

C=(--config classify "data.dir=$D" train.on_nan=off log.root=/tmp/runs-classify log.tensorboard=false)
SMALL=(model.n_layer=2 model.d_model=128 model.n_head=4 model.d_ff=512)
LARGE=(model.n_layer=4 model.d_model=256 model.n_head=4 model.d_ff=1024)
# name | model | per-GPU global batch / micro batch | extra
RUNS=(
  "small-b32|SMALL|32|32|"
  "large-b32|LARGE|32|32|"
  "small-b256|SMALL|256|256|"
  "small-accum4|SMALL|128|32|"
  "small-bucket100|SMALL|32|32|parallel.ddp_bucket_mb=100"
)
for spec in "${RUNS[@]}"; do
  IFS='|' read -r name model gbs micro extra <<< "$spec"
  if [ $((SECONDS - START)) -gt 200 ]; then echo "[$name] skipped: past 200 s"; continue; fi
  if [ "$model" = SMALL ]; then M=("${SMALL[@]}"); else M=("${LARGE[@]}"); fi
  echo "== $name ($model, per-GPU batch $gbs, micro $micro ${extra:+, $extra}) =="
  python3 -m distlm bench --scaling $SIZES --axis dp_replicate --mode weak "${C[@]}" "${M[@]}" \
    train.global_batch_size=$gbs train.micro_batch_size=$micro $extra \
    --warmup "$WARMUP" --steps "$STEPS" --out-dir "$R/$name" > "$R/$name.log" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then echo "[$name] failed ($rc):"; tail -15 "$R/$name.log"; fi
  [ -f "$R/$name/scaling-weak.md" ] && grep -E "^\| [0-9]|^weak|Advisor|^- " "$R/$name/scaling-weak.md" | cut -c1-400
done

# The accuracy a real run reaches under DDP on all GPUs (300 steps of 32 x NGPU posts; evaluation at the end).
if [ $((SECONDS - START)) -lt 215 ]; then
  torchrun --standalone --nproc_per_node "$NGPU" -m distlm train "${C[@]}" parallel.dp_replicate="$NGPU" \
    train.global_batch_size=$((32 * NGPU)) train.micro_batch_size=32 train.max_steps="$TRAIN_STEPS" train.eval_every=0 \
    log.progress=false log.name=ddp-train > "$R/ddp-train.log" 2>&1
  grep -E "^eval|^done|error" "$R/ddp-train.log" | sed 's/^/[ddp-train] /'
  cp /tmp/runs-classify/ddp-train/{eval.json,confusion.png,metrics.csv} "$R/" 2>/dev/null
else
  echo "[ddp-train] skipped: past 215 s"
fi
# One table and one plot over every run: time per epoch, speedup, efficiency, exposed comm, R.
python3 - "$R" <<'PY' 2>&1 | tee "$R/summary.md"
import json, sys
from pathlib import Path
try:
    import matplotlib; matplotlib.use("Agg"); import matplotlib.pyplot as plt
except ImportError:
    plt = None
R = Path(sys.argv[1]); runs = sorted(R.glob("*/scaling-weak.json"), key=lambda p: p.stat().st_mtime)
print("| run | GPUs | global/micro | step ms | epoch s | speedup | weak eff | exposed comm ms | R |")
print("|---|---|---|---|---|---|---|---|---|")
fig, ax = plt.subplots(figsize=(6.5, 4), dpi=110) if plt else (None, None)
for path in runs:
    rows = json.loads(path.read_text())["rows"]
    for r in rows:
        f = lambda v, s: "n/a" if v is None else format(v, s)
        print(f"| {path.parent.name} | {r['gpus']} | {r['global_batch']}/{r['micro']} | {r['step_ms']:.1f} | "
              f"{f(r.get('epoch_s'), '.2f')} | {r['speedup']:.2f} | {100 * r['weak_eff']:.0f}% | "
              f"{f(r['exposed_ms'], '.1f')} | {'inf (all hidden)' if r['exposed_ms'] == 0 else f(r['R'], '.2f')} |")
    if ax is not None:
        ax.plot([r["gpus"] for r in rows], [r["epoch_s"] for r in rows], "o-", label=path.parent.name)
if ax is not None:
    ax.set(xlabel="GPUs", ylabel="time per epoch (s)", title="classification, DDP weak scaling", xticks=[1, 2, 4])
    ax.grid(alpha=0.3); ax.legend(fontsize=8); fig.tight_layout(); fig.savefig(R / "epoch-time.png")
PY
echo "total $((SECONDS - START)) s"
tar -czf "$OUT/classify.tgz" -C /tmp res-classify
