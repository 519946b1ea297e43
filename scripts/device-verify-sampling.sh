#!/usr/bin/env bash
# Verifies the split sampling kernel (ops::cuda::sample_rows, branch sampling-mc) on a GPU machine in one call,
# run from the repository root:
#   1. build into build-gpu (cmake -G Ninja, Release, all cores): the GPU tests and the CLI only;
#   2. the CudaSampling GPU tests (against the one-CTA kernel bit for bit, the CPU op, graph replay, the
#      timings: their lines also land in $OUT/sampling_timing.txt);
#   3. the GpuGenerate tests (seeded sampling on the device against the host op, on the tiny models);
#   4. compute-sanitizer memcheck on CudaSampling.MatchesCpuOp;
#   5. `k3decode bench --ops --ops-only sampling` (split and one-CTA kernels against the HBM floor; JSON too).
# Logs go to $OUT (default out/sampling), one per step, and summary.txt. Every step runs under `timeout`, cut to
# what is left of a total budget of K3_VERIFY_BUDGET_S seconds (default 450); a failed step does not stop the
# later ones (a failed build does). Exits 1 when any step failed.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out/sampling}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
export OUT="$out"  # the tests append their timing lines to $OUT/sampling_timing.txt
bin=build-gpu
deadline=$((SECONDS + ${K3_VERIFY_BUDGET_S:-450}))
status=0
summary="$out/summary.txt"
: >"$summary"

# step NAME LIMIT_S COMMAND...: runs COMMAND with its output in $out/NAME.log, under the smaller of LIMIT_S and the
# time left; records ok / FAILED in the summary.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((deadline - SECONDS))
  if [ "$left" -lt "$limit" ]; then limit=$left; fi
  if [ "$limit" -lt 5 ]; then
    echo "$name: SKIPPED (no time left)" | tee -a "$summary"
    status=1
    return 0
  fi
  local t0=$SECONDS rc=0 why=""
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1 || rc=$?
  if [ "$rc" -eq 0 ]; then
    echo "$name: ok ($((SECONDS - t0)) s)" | tee -a "$summary"
  else
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then why=", timed out after $limit s"; fi
    echo "$name: FAILED (rc $rc$why, $((SECONDS - t0)) s, log $out/$name.log)" | tee -a "$summary"
    tail -n 30 "$out/$name.log" || true
    status=1
  fi
  return 0
}

{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader || true; } \
  >"$out/machine.txt" 2>&1
git rev-parse --short HEAD >"$out/commit.txt" 2>/dev/null || echo unknown >"$out/commit.txt"

nvcc_arg=()
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  nvcc_arg=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
fi
step configure 60 cmake -S . -B "$bin" -G Ninja -DCMAKE_BUILD_TYPE=Release "${nvcc_arg[@]}"
step build 300 cmake --build "$bin" -j "$(nproc)" --target k3_gpu_tests k3decode
if ! grep -q "^build: ok" "$summary" || [ ! -x "$bin/k3_gpu_tests" ]; then
  echo "build failed: nothing to run" | tee -a "$summary"
  exit 1
fi
export LD_LIBRARY_PATH="$bin:${LD_LIBRARY_PATH:-}"

step cuda_sampling 150 "$bin/k3_gpu_tests" --gtest_filter='CudaSampling.*'
grep -hE "^\[ gpu \] sample_rows" "$out/cuda_sampling.log" >>"$summary" || true
step gpu_generate 120 "$bin/k3_gpu_tests" --gtest_filter='*GpuGenerate.*'
if command -v compute-sanitizer >/dev/null; then
  step memcheck 180 compute-sanitizer --tool memcheck --error-exitcode 3 "$bin/k3_gpu_tests" \
    --gtest_filter='CudaSampling.MatchesCpuOp'
  grep -hE "ERROR SUMMARY" "$out/memcheck.log" >>"$summary" || true
else
  echo "memcheck: SKIPPED (no compute-sanitizer)" | tee -a "$summary"
  status=1
fi
step bench_ops_sampling 90 "$bin/k3decode" bench --ops --ops-only sampling --json "$out/bench_ops_sampling.json"
grep -hE "^  rows " "$out/bench_ops_sampling.log" >>"$summary" || true

echo "---"
cat "$summary"
exit "$status"
