#!/usr/bin/env bash
# Configures and builds k3decode (Release) in build/, installing missing packages first.
# K3_BUILD_DIR and extra CMake arguments (e.g. -DK3_SANITIZE=ON) may be given.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
dir="${K3_BUILD_DIR:-build}"
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE="${K3_BUILD_TYPE:-Release}" "$@" >/dev/null
cmake --build "$dir"
