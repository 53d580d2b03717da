#!/usr/bin/env bash
# Ninth session, first 4-GPU call: two jobs side by side, each on its own pair of GPUs.
#   OLD_TP=carry/old_tp9 OLD_MUON=carry/old_muon CORPUS=carry/corpus bash benchmarks/gpu_s9a.sh
# GPUs 0-1 (issue 19, tensor parallelism):
#   1. benchmarks/nccl_sizes.py under NCCL's default choice, NCCL_PROTO=Simple and NCCL_PROTO=LL128
#      (the profiles showed TP's 13-26 MB collectives on RING_LL at ~45 GB/s), NCCL's INFO log kept;
#   2. tp_speed.sh: tp2 (norm outputs cast to bf16 before the gather), before_tp2 (OLD_TP), fsdp2;
#   3. tp2 again under NCCL_PROTO=Simple.
# GPUs 2-3 (issue 16, time to quality on 2 GPUs):
#   4. distlm bench of speedrun-124m under DDP2: Muon's distributed path before (OLD_MUON) and after
#      the one-redistribution-per-bucket change;
#   5. speedrun.sh "speedrun@ddp2 baseline@ddp2".
# Everything comes back as $OUT/s9a.tgz (+ the two scripts' own archives); a summary on stdout.
set -uo pipefail
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; R=/tmp/s9a; rm -rf "$R"; mkdir -p "$OUT" "$R"
BUDGET=${BUDGET:-570}; OLD_TP=${OLD_TP:-carry/old_tp9}; OLD_MUON=${OLD_MUON:-carry/old_muon}
pack() { tar --warning=no-file-changed -czf "$OUT/s9a.tgz.tmp" -C /tmp s9a
  [ $? -le 1 ] && mv "$OUT/s9a.tgz.tmp" "$OUT/s9a.tgz"; }  # 1: a file changed while read (a run still writing)
{ date -u; nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv; nvidia-smi topo -m
  python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
  echo "commit $(git rev-parse --short HEAD 2>/dev/null)"; } > "$R/machine.txt" 2>&1
head -3 "$R/machine.txt"

tp_job() {
  export CUDA_VISIBLE_DEVICES=0,1
  for proto in default Simple LL128; do
    env_proto=(); [ $proto = default ] || env_proto=(NCCL_PROTO=$proto)
    dbg=(); [ $proto = default ] && dbg=(NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,GRAPH,TUNING,ENV)
    env "${env_proto[@]}" "${dbg[@]}" timeout 90 torchrun --standalone --nproc_per_node 2 benchmarks/nccl_sizes.py \
      --json "$R/nccl-$proto.json" > "$R/nccl-$proto.log" 2>&1
    grep -vE "NCCL INFO|^W|\*\*\*|OMP_NUM" "$R/nccl-$proto.log" | grep -E "26\.0|52\.0|world" | sed "s/^/[nccl $proto] /"
  done
  pack
  OUT=$R TAG=a OLD=$OLD_TP ITEMS="tp2 before_tp2 fsdp2" BUDGET=$((BUDGET - SECONDS - 100)) \
    bash benchmarks/tp_speed.sh 2>&1 | tail -4 | sed "s/^/[tp] /"
  pack
  OUT=$R TAG=simple ITEMS="tp2" NCCL_PROTO=Simple BUDGET=$((BUDGET - SECONDS)) \
    bash benchmarks/tp_speed.sh 2>&1 | tail -2 | sed "s/^/[tp Simple] /"
  pack
}

speedrun_job() {
  export CUDA_VISIBLE_DEVICES=2,3
  for v in old new; do
    code=$PWD; [ $v = old ] && code=$PWD/$OLD_MUON
    PYTHONPATH=$code TORCHINDUCTOR_CACHE_DIR=/tmp/ind-muon-$v timeout 150 torchrun --standalone --nproc_per_node 2 \
      -m distlm bench --config speedrun-124m data.source=synthetic parallel.dp_replicate=2 train.micro_batch_size=16 \
      --warmup 8 --steps 10 --no-comm-probe --json "$R/muon-$v.json" > "$R/muon-$v.log" 2>&1
    grep -E "tok/s|step split|optimizer" "$R/muon-$v.log" | head -3 | sed "s/^/[muon $v] /"
  done
  pack
  OUT=$R WORK=/tmp/speedrun-s9a TAG=x2 CORPUS=${CORPUS:-carry/corpus} \
    timeout $((BUDGET - SECONDS)) bash benchmarks/speedrun.sh "speedrun@ddp2 baseline@ddp2" 2>&1 | sed "s/^/[speedrun] /"
  pack
}

tp_job > "$R/tp-job.txt" 2>&1 &
speedrun_job > "$R/speedrun-job.txt" 2>&1 &
wait
cat "$R/tp-job.txt" "$R/speedrun-job.txt"
python3 - "$R" <<'PY'
import json, sys, glob, os
for f in sorted(glob.glob(os.path.join(sys.argv[1], "muon-*.json"))):
    r = json.load(open(f))
    print(f"{os.path.basename(f)}: {r['tokens_per_s']:,.0f} tok/s, step {1e3 * r['step_s']:.1f} ms, phases ms "
          f"{ {k: round(1e3 * v, 1) for k, v in r['phases_s'].items()} }")
PY
pack
