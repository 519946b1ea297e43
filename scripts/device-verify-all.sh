#!/usr/bin/env bash
# The integration branch's kernels on one GPU machine (H200), in one call from the repository root: one build
# into build-gpu, then each branch's verify script (scripts/device-verify-*.sh: its GPU tests against the CPU
# references, a memcheck, its `bench --ops` section), each in $OUT/NAME, each bounded, the later ones running
# when an earlier one fails. The whole GPU suite and the rank slice are scripts/gpu-test.sh's (a call of its
# own). K3_VERIFY names the scripts (default: moe sampling dsa mla kda); a device call is at most 600 s, so
# run them in two calls, e.g. K3_VERIFY="moe sampling" then K3_VERIFY="dsa mla kda" (the second build is
# incremental). Exit 1 when any part failed; $OUT/summary.txt says which.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out/verify}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
summary="$out/summary.txt"
: >"$summary"
status=0
t0=$SECONDS
if ! timeout 300 bash -c 'cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null &&
    cmake --build build-gpu -j "$(nproc)" --target k3_gpu_tests k3decode' >"$out/build.log" 2>&1; then
  tail -30 "$out/build.log"
  echo "build: FAILED" | tee -a "$summary"
  exit 1
fi
echo "build: ok ($((SECONDS - t0)) s)" | tee -a "$summary"
for name in ${K3_VERIFY:-moe sampling dsa mla kda}; do
  script="scripts/device-verify-$name.sh"
  [ -x "$script" ] || { echo "$name: no $script" | tee -a "$summary"; continue; }
  t=$SECONDS
  rc=0
  OUT="$out/$name" K3_VERIFY_BUDGET_S=200 timeout --kill-after=10 240 "$script" >"$out/$name.log" 2>&1 || rc=$?
  if [ "$rc" -eq 0 ]; then
    echo "$name: ok ($((SECONDS - t)) s)" | tee -a "$summary"
  else
    echo "$name: FAILED (exit $rc; 124: timed out) ($((SECONDS - t)) s)" | tee -a "$summary"
    tail -15 "$out/$name.log"
    status=1
  fi
done
echo "all: $((SECONDS - t0)) s" | tee -a "$summary"
exit $status
