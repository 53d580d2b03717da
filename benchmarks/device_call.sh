# Sourced by a device-call script (benchmarks/gpu_s12.sh and later), after it sets NAME:
#   NAME=s12; source benchmarks/device_call.sh
# What every such call needs: the environment (NVLink multicast off, as the device README asks),
# the results folder /tmp/$NAME packed into $OUT/$NAME.tgz (the device returns a few files), the
# machine's description, a way to end what a phase leaves running, and DRY=1 for a rehearsal on
# the CPU box with its venv.
set -uo pipefail
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; R=/tmp/$NAME; rm -rf "$R"; mkdir -p "$OUT" "$R"
[ "${DRY:-0}" = 1 ] && [ -x .venv/bin/python ] && export PATH=$PWD/.venv/bin:$PATH

# Checkpoints, prepared data, compile caches and traces stay behind: too large to come back.
pack() {
  tar --warning=no-file-changed -czf "$OUT/$NAME.tgz.tmp" -C /tmp --exclude='*.distcp' --exclude='*.pt' \
    --exclude='data' --exclude='text' --exclude='inductor-*' --exclude='checkpoints' --exclude='*trace*' "$NAME"
  [ $? -le 1 ] && mv "$OUT/$NAME.tgz.tmp" "$OUT/$NAME.tgz"  # 1: a file changed while read (a run still writing)
}

# `timeout` stops a script, not the runs it started (and a trainer given SIGTERM first finishes its
# step): what a phase leaves running is killed before the next phase takes the GPUs.
# Not under DRY=1: on a shared box it also killed the test suite's trainers (three tests of a
# `make test` running beside a rehearsal ended with -9).
leftovers() {
  [ "${DRY:-0}" = 1 ] && return
  pkill -9 -f "distlm (train|bench)" 2>/dev/null; pkill -9 -f torch.distributed.run 2>/dev/null
  pkill -9 -f "bin/torchrun" 2>/dev/null; sleep 2
}

{ date -u; nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
  # The device's copy of .git is not the session's (its commit line stayed 8bc2a17 through the twelfth
  # session): the sources' fingerprint is what identifies the code that ran. The same command on the
  # CPU box, at a commit, gives the same value.
  echo "commit $(git rev-parse --short HEAD 2>/dev/null) (may be stale), sources $(find distlm -name '*.py' | LC_ALL=C sort | xargs cat | sha1sum | cut -c1-12)"
  } > "$R/machine.txt" 2>&1
head -3 "$R/machine.txt"

# The speedrun corpus laid out and prepared under $R/sr, in the background (~10 s); `wait` before
# the first run that reads it.
corpus_in_background() {
  mkdir -p "$R/sr"
  ( export PYTHONPATH=$PWD; python3 scripts/build_speedrun_corpus.py "$1" "$R/sr/text" && python3 -m distlm prepare \
      "$R/sr/text" --out "$R/sr/data" --quiet ) > "$R/prepare.log" 2>&1 &
}

# speedrun_runs "RUN ..." END_S: benchmarks/speedrun.sh on all GPUs until END_S seconds into the call,
# its table on stdout.
speedrun_runs() {
  OUT=$R/sr WORK=$R/sr TAG=x4 CORPUS=$CORPUS timeout -k 10 "$(($2 - SECONDS))" bash benchmarks/speedrun.sh "$1" \
    > "$R/x4.txt" 2>&1
  sed "s/^/[4 GPUs] /" "$R/x4.txt" | grep -v "^\[4 GPUs\] *$" | tail -8
}

