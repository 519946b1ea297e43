#!/usr/bin/env bash
# Configures and builds k3decode (Release) in build/, installing missing packages first.
# K3_BUILD_DIR and extra CMake arguments (e.g. -DK3_SANITIZE=ON) may be given.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
dir="${K3_BUILD_DIR:-build}"
cuda=()
# The CUDA backend builds wherever nvcc is (it runs only where a GPU is).
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  cuda=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
fi
cmake -S . -B "$dir" -G Ninja "${cuda[@]}" -DCMAKE_BUILD_TYPE="${K3_BUILD_TYPE:-Release}" "$@" >/dev/null
cmake --build "$dir"
