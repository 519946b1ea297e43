#!/usr/bin/env bash
# Builds k3decode and runs every test (ctest). GPU tests, when present, are
# labelled `gpu` and reported as skipped on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/check-layers.sh
scripts/build.sh "$@"
ctest --test-dir "${K3_BUILD_DIR:-build}" --output-on-failure -j "$(nproc)"
