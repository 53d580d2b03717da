#!/usr/bin/env bash
# Device-tool calls on a 2-GPU machine (H100/H200 x2), in two parts so each stays under 10 minutes:
#   bash benchmarks/gpu_parallel.sh A   # 1-GPU speed variants; DDP and FSDP2 weak scaling 1->2; starts the Horovod build
#   bash benchmarks/gpu_parallel.sh B   # gpt2-1.5b FSDP2+AC on 2 GPUs; Horovod (NCCL) vs torch DDP, 50 steps
# Everything lands in $OUT/<part>.tgz plus a summary on stdout.
set -uo pipefail
part=${1:-A}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
OUT=${OUT:-/tmp/out}; R=/tmp/res-$part; mkdir -p "$OUT" "$R"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m;
  python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"; } > "$R/machine.txt" 2>&1
head -4 "$R/machine.txt"
B=(--config gpt2-124m-1024 data.source=synthetic train.compile=true)
if [ "$part" = A ]; then
  if [ -d .whl ] && [ ! -f /tmp/site/horovod/__init__.py ]; then  # build in its own session: it outlives this call
    setsid bash -c "python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl;
      PYTHONPATH=/tmp/site OFFLINE=1 PYTHON=python3 TARGET=/tmp/site DISTLM_CACHE=/tmp/hvdcache \
      bash scripts/build_horovod.sh .whl/horovod-0.28.1.tar.gz > /tmp/hvd-build.log 2>&1; echo exit \$? >> /tmp/hvd-build.log" &
  fi
  for v in "base:" "nosync:train.on_nan=off" "micro32:train.on_nan=off train.micro_batch_size=32"; do
    name=${v%%:*}; extra=${v#*:}
    python3 -m distlm bench "${B[@]}" $extra --warmup 8 --steps 20 --results "$R/bench.md" --json "$R/$name.json" 2>&1 \
      | grep -E "tok/s|MFU|memory" | sed "s/^/[$name] /"
  done
  for axis in dp_replicate dp_shard; do
    python3 -m distlm bench --scaling 1,2 --axis $axis --mode weak "${B[@]}" train.on_nan=off \
      --warmup 8 --steps 20 --out-dir "$R/$axis" 2>&1 | grep -vE "^scaling:|^$"
  done
else
  torchrun --standalone --nproc_per_node 2 -m distlm bench --config gpt2-1.5b data.source=synthetic model.vocab_size=50257 \
    train.compile=true train.on_nan=off parallel.dp_shard=2 parallel.activation_checkpoint=full \
    train.global_batch_size=32 train.micro_batch_size=16 --warmup 4 --steps 8 --results "$R/bench.md" --json "$R/fsdp-1.5b.json" 2>&1 \
    | grep -E "tok/s|MFU|memory|Error|error" | head -20
  T=(--config gpt2-124m-1024 data.source=synthetic train.compile=true train.max_steps=50 log.every=10 train.eval_every=0
     train.global_batch_size=128 train.micro_batch_size=16 log.progress=false log.tensorboard=false log.root=/tmp/runs)
  torchrun --standalone --nproc_per_node 2 -m distlm train "${T[@]}" parallel.dp_replicate=2 log.name=ddp 2>&1 | grep -E "step +50|error" | sed 's/^/[ddp] /'
  for i in $(seq 60); do grep -q '^exit' /tmp/hvd-build.log 2>/dev/null && break; sleep 5; done
  tail -3 /tmp/hvd-build.log; cp /tmp/hvd-build.log "$R/"
  if PYTHONPATH=/tmp/site:$PYTHONPATH python3 -c "import horovod, horovod.torch as h; print('horovod', horovod.__version__, 'nccl', h.nccl_built())"; then
    PYTHONPATH=/tmp/site:$PYTHONPATH python3 -m horovod.runner.launch -np 2 -H localhost:2 --gloo \
      python3 -m distlm train "${T[@]}" parallel.engine=horovod log.name=hvd 2>&1 | grep -E "step +50|rror" | head -5 | sed 's/^/[horovod] /'
    PYTHONPATH=/tmp/site:$PYTHONPATH python3 -m horovod.runner.launch -np 2 -H localhost:2 --gloo \
      python3 -m distlm train "${T[@]}" parallel.engine=horovod parallel.fp16_compression=true log.name=hvd16 2>&1 | grep -E "step +50|rror" | head -5 | sed 's/^/[horovod-fp16] /'
    cp /tmp/runs/*/metrics.csv "$R/" 2>/dev/null; for d in /tmp/runs/*; do cp $d/metrics.csv "$R/metrics-$(basename $d).csv"; done
  fi
fi
tar -czf "$OUT/$part.tgz" -C /tmp "res-$part"
