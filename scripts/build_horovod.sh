#!/usr/bin/env bash
# Build Horovod 0.28.1 (the last release) into the venv, with gloo, and NCCL where CUDA is present.
#   make horovod        (or: VENV=.venv bash scripts/build_horovod.sh [SDIST.tar.gz])
# Why a script: 0.28.1 does not build against torch >= 2.1 as released (horovod/horovod#3996 and #4014).
# Two changes make it build: C++17 instead of 14 in its two CMakeLists.txt (the fix merged upstream
# after the release), and --no-build-isolation, so CMake finds the venv's torch.
# The built wheel is cached per (torch, python, gpu/cpu); a rebuild happens only when one changes.
set -euo pipefail
VENV=${VENV:-.venv}
PY=${PYTHON:-$VENV/bin/python}   # PYTHON=python3 on a machine without the venv (the GPU box)
OFFLINE=${OFFLINE:-0}            # 1: the sdist is given and the build dependencies are already there
SDIST=${1:-}
CACHE=${DISTLM_CACHE:-$HOME/.cache/distlm}/horovod
torch_ver=$("$PY" -c "import torch; print(torch.__version__)")
pyver=$("$PY" -c "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')")
gpu=cpu
if command -v nvcc >/dev/null 2>&1 && "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  gpu=nccl
fi
key="0.28.1-torch${torch_ver}-${pyver}-${gpu}"
wheel_dir="$CACHE/$key"
if "$PY" -c "import horovod.torch" 2>/dev/null && [ -f "$VENV/.horovod-$key" ]; then
  echo "horovod already built for $key"; exit 0
fi
if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  if [ -z "$SDIST" ]; then
    "$PY" -m pip download -q --no-deps --no-binary :all: horovod==0.28.1 -d "$work"
    SDIST=$(ls "$work"/horovod-0.28.1.tar.gz)
  fi
  tar -xzf "$SDIST" -C "$work"
  src="$work/horovod-0.28.1"
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
  grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt"
  [ "$OFFLINE" = 1 ] || "$PY" -m pip install -q packaging cloudpickle psutil pyyaml cffi wheel
  extra=()
  if [ "$gpu" = nccl ]; then
    # torch's wheels carry NCCL (nvidia-nccl-*): point Horovod's CMake at it
    nccl=$("$PY" -c "import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0])" 2>/dev/null || true)
    extra=(HOROVOD_GPU_OPERATIONS=NCCL ${nccl:+HOROVOD_NCCL_HOME=$nccl})
    so=$([ -n "$nccl" ] && find "$nccl" -name 'libnccl.so*' | head -1)
    if [ -n "$so" ] && [ ! -e "$(dirname "$so")/libnccl.so" ]; then
      # That package ships only libnccl.so.2; Horovod's FindNCCL looks for libnccl.so.
      mkdir -p "$work/nccl-lib"; ln -sf "$so" "$work/nccl-lib/libnccl.so"; ln -sf "$so" "$work/nccl-lib/libnccl.so.2"
      extra+=(HOROVOD_NCCL_LIB="$work/nccl-lib" HOROVOD_NCCL_INCLUDE="$(dirname "$(find "$nccl" -name nccl.h | head -1)")"
              HOROVOD_NCCL_LINK=SHARED)
    fi
  fi
  echo "building horovod 0.28.1 for $key (a few minutes) ..."
  mkdir -p "$wheel_dir"
  # CMAKE_POLICY_VERSION_MINIMUM: CMake 4 refuses the bundled gloo's cmake_minimum_required(< 3.5).
  # CXXFLAGS: GCC 13 no longer pulls <string>/<cstdint>/<stdexcept> in transitively; 0.28.1's headers relied on it.
  env CMAKE_POLICY_VERSION_MINIMUM=3.5 CXXFLAGS="${CXXFLAGS:-} -include cstdint -include string -include stdexcept" HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
      HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="${MAKEFLAGS:--j$(nproc)}" "${extra[@]}" \
      "$PY" -m pip wheel -q --no-build-isolation --no-deps "$src" -w "$wheel_dir"
fi
[ -n "${TARGET:-}" ] && { "$PY" -m pip install -q --no-deps --target "$TARGET" "$wheel_dir"/horovod-*.whl; exit 0; }
"$PY" -m pip install -q --no-deps "$wheel_dir"/horovod-*.whl
[ "$OFFLINE" = 1 ] || "$PY" -m pip install -q cloudpickle psutil pyyaml packaging cffi
touch "$VENV/.horovod-$key"
"$VENV/bin/horovodrun" --check-build | sed -n '1,20p'
