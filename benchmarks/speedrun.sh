#!/usr/bin/env bash
# Time to quality on one GPU (issue 16): the nanoGPT recipe against the speedrun-124m recipe,
# same data, same call, same card, each timed from its own process start.
#
#   CORPUS=../shared/data/corpus bash benchmarks/speedrun.sh [RUN ...]
#
# RUNs (default: "baseline speedrun"): baseline, speedrun, or speedrun-NAME for an ablation
# listed in ABLATIONS below; NAME@ddpN or NAME@fsdpN runs it on N GPUs (torchrun; the global batch
# stays, split evenly). RUN+warm runs RUN again with the compile cache RUN's run left (a repeated
# run on the same machine); every other run starts from an empty cache. The corpus (Gutenberg + State of the Union + GCIDE, ~21M GPT-2
# tokens) is laid out and prepared here, on the machine that runs it: GCIDE is GPL and is never
# vendored. Validation is over the whole val split (train.eval_batches=0) in every run.
# Results: $OUT/${TAG}/speedrun-table.md and the two plots; each run's log and metrics.csv in $OUT/runs-${TAG}.tgz.
set -uo pipefail
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export PYTHONPATH=${PYTHONPATH:-$PWD}   # PYTHONSAFEPATH keeps the current folder off sys.path
PY=${PY:-python3}
[ "${DRY:-0}" = 1 ] && [ -x .venv/bin/python ] && export PATH=$PWD/.venv/bin:$PATH  # DRY (below): the CPU box's venv
OUT=${OUT:-/tmp/out}; WORK=${WORK:-/tmp/speedrun}; LOGS=$WORK/logs; mkdir -p "$OUT" "$LOGS"
CORPUS=${CORPUS:?set CORPUS to the folder holding gutenberg/ sotu/ gcide/}
DATA=$WORK/data
if [ ! -f "$DATA/manifest.json" ]; then
  $PY scripts/build_speedrun_corpus.py "$CORPUS" "$WORK/text" || exit 1
  $PY -m distlm prepare "$WORK/text" --out "$DATA" --quiet || exit 1
fi

# nanoGPT's recipe through the gpt2-124m-1024 preset: 64 x 1024 tokens per step, AdamW (0.9, 0.95),
# weight decay 0.1, lr 6e-4, 100 warm-up steps, cosine to 6e-5, 1,500 steps, clip 1.0, bf16.
BASELINE=(--config gpt2-124m-1024 train.max_steps=1500 train.global_batch_size=64 train.micro_batch_size=64
          train.lr=6e-4 train.min_lr=6e-5 train.warmup_steps=100 train.decay=cosine train.weight_decay=0.1
          train.grad_clip=1.0 train.beta1=0.9 train.beta2=0.95 train.dtype=bf16 train.compile=true
          train.compile_scope=model model.loss_chunk=8192 train.eval_every=250)
SPEEDRUN=(--config speedrun-124m)
# Each ablation changes one piece of the recipe; EXTRA (e.g. "train.max_steps=300") applies to
# every speedrun-* run, before the ablation's own overrides.
declare -A ABLATIONS=(
  [warm]=""                                                 # the recipe again: a warm compile cache
  [adamw]="train.optimizer=adamw train.lr=1.5e-3 train.beta1=0.9"   # Muon off (AdamW, the llama-124m lr)
  [plainblock]="model.qk_norm=false model.mlp=gelu model.zero_init_proj=false model.logit_softcap=0"
  [cosine]="train.decay=cosine"                             # no WSD cooldown
  [docmask]="model.attn_mask=doc"                           # document-masked attention (FlexAttention)
  [b64]="train.global_batch_size=64 train.micro_batch_size=64"      # twice the tokens per step (halve max_steps to match tokens)
  [valemb]="model.value_embeds=3 model.skip_connections=true"     # 3 value-embedding tables (6 blocks), U-net skips
  [embedlr]="train.embed_lr=0.3"                            # the embedding table at 50x AdamW's rate
  [embedlr1]="train.embed_lr=0.1"                           # ... at 17x
  [embedlr6]="train.embed_lr=0.6"                           # ... at 100x
  [block]="train.compile_scope=block"                       # one block compiled and reused: less compile time
  [model]="train.compile_scope=model"                       # the whole model as one graph: faster steps, slower compile
  [s500]="train.max_steps=500"                              # a shorter schedule
  [s540]="train.max_steps=540"
  [s600]="train.max_steps=600"
  [evalcompiled]="train.eval_compile=true"                  # compile the evaluation graph too
  [novalemb]="model.value_embeds=0 model.skip_connections=false"
  [noembedlr]="train.embed_lr=0"
  [ve6]="model.value_embeds=6"                              # a table for every block: one compiled block graph
  [b16]="train.global_batch_size=16 train.micro_batch_size=16 train.max_steps=1200 train.eval_every=600"  # half the tokens a step, twice the steps (for a 600-step EXTRA)
  [seqwarm]="train.seq_warmup_steps=150 train.seq_warmup_start=256" # rows of 256, then 512 tokens first
  [b64s300]="train.global_batch_size=64 train.micro_batch_size=64 train.max_steps=300 train.eval_every=150"  # 19.7M tokens, as the 1-GPU recipe
  [b64s300eager]="train.global_batch_size=64 train.micro_batch_size=64 train.max_steps=300 train.eval_every=150 train.compile=false"  # no compilation: its start-up against its slower steps
  [b64s300bf16]="train.global_batch_size=64 train.micro_batch_size=64 train.max_steps=300 train.eval_every=150 parallel.grad_reduce_dtype=bf16"  # gradients averaged in bf16
  [b64s350]="train.global_batch_size=64 train.micro_batch_size=64 train.max_steps=350 train.eval_every=175"  # for 4 GPUs: 16 sequences each
  [b64s450]="train.global_batch_size=64 train.micro_batch_size=64 train.max_steps=450 train.eval_every=150"
  [valemb-embedlr]="model.value_embeds=3 model.skip_connections=true train.embed_lr=0.3"
)
EXTRA=${EXTRA:-}
# DRY=1: every run on the CPU with a tiny model for 4 steps, a rehearsal of the script before a device
# call (it measures nothing; the corpus is still prepared in full).
DRYX=()
if [ "${DRY:-0}" = 1 ]; then
  DRYX=(model.n_layer=6 model.d_model=64 model.n_head=2 model.d_ff=128 model.block_size=64 train.device=cpu
        train.compile=false train.max_steps=4 train.eval_every=2 train.warmup_steps=1 train.global_batch_size=8
        train.micro_batch_size=8)
fi
# (DRY evaluates 8 batches: the whole val split of a tiny model takes minutes on a shared CPU)
COMMON=(data.dir="$DATA" train.eval_batches=$([ "${DRY:-0}" = 1 ] && echo 8 || echo 0) train.checkpoint_every=0 log.root="$WORK/runs" log.progress=false
        log.tensorboard=false log.samples=0)

specs=()
for run in "${@:-baseline speedrun}"; do
  for name in $run; do
    # NAME@ddpN / NAME@fsdpN: the same recipe on N GPUs of this machine (the global batch stays).
    cold=${name%+warm}   # NAME+warm: NAME again, on the compile cache NAME's run filled
    recipe=${cold%@*}; layout=${cold#"$recipe"}; launcher=($PY -m distlm); par=()
    case $recipe in
      baseline) args=("${BASELINE[@]}") ;;
      speedrun) args=("${SPEEDRUN[@]}" $EXTRA) ;;
      speedrun-*) args=("${SPEEDRUN[@]}" $EXTRA ${ABLATIONS[${recipe#speedrun-}]}) ;;
      *) echo "unknown run $name" >&2; exit 2 ;;
    esac
    args+=("${DRYX[@]}")
    # The global batch stays; each GPU takes its share in one micro-batch (no accumulation).
    global=$(printf '%s\n' "${args[@]}" | sed -n 's/^train.global_batch_size=//p' | tail -1)
    global=${global:-$([ "$recipe" = baseline ] && echo 64 || echo 32)}
    case $layout in
      @ddp*) n=${layout#@ddp}; launcher=(torchrun --standalone --nproc_per_node "$n" -m distlm)
             par=(parallel.dp_replicate="$n" train.micro_batch_size=$((global / n))) ;;
      @fsdp*) n=${layout#@fsdp}; launcher=(torchrun --standalone --nproc_per_node "$n" -m distlm)
              par=(parallel.dp_shard="$n" train.micro_batch_size=$((global / n)) train.compile_scope=block) ;;
    esac
    # Each run compiles from an empty cache (inductor's, which holds Triton's too), so the timings
    # include compilation; a +warm run reuses its cold run's. WARM=1: the machine's own cache.
    if [ "${WARM:-0}" != 1 ]; then
      export TORCHINDUCTOR_CACHE_DIR="$WORK/inductor-$cold"
      [ "$name" = "$cold" ] && rm -rf "$TORCHINDUCTOR_CACHE_DIR"
    fi
    rm -rf "$WORK/runs/$name"
    launch=$(date +%s.%N)
    "${launcher[@]}" train "${args[@]}" "${par[@]}" "${COMMON[@]}" log.name="$name" > "$LOGS/$name.log" 2>&1
    rc=$?
    echo "[$name] rc $rc in $($PY -c "import time; print(round(time.time() - $launch, 1))") s: $(grep -E '^done|error' "$LOGS/$name.log" | tail -1)"
    cp "$WORK/runs/$name/metrics.csv" "$LOGS/$name-metrics.csv" 2>/dev/null
    specs+=("$WORK/runs/$name=$launch")
    echo "$name $launch" >> "$LOGS/launch-times.txt"  # the report can be rebuilt from the CSVs with these
    # The device returns at most 8 files: logs and CSVs travel as one archive, rewritten after
    # each run so that a run cut short by the call's time limit still leaves the earlier ones.
    tar -czf "$OUT/runs${TAG:+-$TAG}.tgz" -C "$WORK" logs
  done
done
OUT_REPORT=${TAG:+$OUT/$TAG}; mkdir -p "${OUT_REPORT:-$OUT}"
$PY benchmarks/speedrun_report.py "${OUT_REPORT:-$OUT}" "${specs[@]}" || echo "report failed: rebuild it from runs.tgz"
