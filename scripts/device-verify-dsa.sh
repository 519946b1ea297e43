#!/usr/bin/env bash
# Verifies the split DSA top-k (ops::cuda::topk_indices, src/ops/dsa_topk.cu, branch dsa-topk) on a GPU
# machine in one call, from the repository root:
#   1. configure and build into build-gpu (Ninja, Release, all cores): the GPU tests and the CLI only (or,
#      with K3_BIN=DIR, use the binaries there);
#   2. the top-k GPU tests: TopkSplitCuda.* (against the CPU op and the one-CTA kernel, sizes around the
#      split's edges, 300 ragged rows, ties across CTAs, NaN / -inf, repeats and graph replays),
#      TopkCuda.* (crafted rows, both kernels) and DsaIndexerCuda.* (indexer scores + top-k);
#   3. the K3.1 tiny model on the device against the CPU (GpuRankVsCpu, GpuGenerate) and one DCP layout;
#   4. compute-sanitizer memcheck on TopkSplitCuda.SmallRowsForTheSanitizer;
#   5. `k3decode bench --ops --ops-only dsa` (split vs one-CTA kernel beside the HBM floor; JSON too);
#   6. compute-sanitizer racecheck on the same small test, if time is left.
# Logs go to $OUT (default out/dsa), one per step, and summary.txt. Each step runs under `timeout`, cut to
# what is left of a total budget of K3_VERIFY_BUDGET_S seconds (default 340: under 6 minutes); a failed
# step does not stop the later ones (a failed build does). Exits 1 when any step failed.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out/dsa}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
bin=build-gpu
deadline=$((SECONDS + ${K3_VERIFY_BUDGET_S:-340}))
status=0
summary="$out/summary.txt"
: >"$summary"

# run_step NAME LIMIT_S COMMAND...: COMMAND's output into $out/NAME.log, under the smaller of LIMIT_S and the
# budget left; ok / FAILED (with the log's tail) in the summary.
run_step() {
  local name=$1 limit=$2
  shift 2
  local left=$((deadline - SECONDS))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 5 ]; then
    echo "$name: SKIPPED (budget spent)" | tee -a "$summary"
    status=1
    return 0
  fi
  local t0=$SECONDS rc=0 note=""
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1 || rc=$?
  if [ "$rc" -eq 0 ]; then
    echo "$name: ok ($((SECONDS - t0)) s)" | tee -a "$summary"
  else
    { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && note=", timed out at $limit s"
    echo "$name: FAILED (rc $rc$note, $((SECONDS - t0)) s, $out/$name.log)" | tee -a "$summary"
    tail -n 25 "$out/$name.log" || true
    status=1
  fi
  return 0
}

{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader || true; } \
  >"$out/machine.txt" 2>&1
{ git rev-parse --short HEAD || echo unknown; } >"$out/commit.txt" 2>/dev/null

if [ -n "${K3_BIN:-}" ]; then  # binaries built elsewhere (k3_gpu_tests, k3decode and their libraries)
  bin=$K3_BIN
  echo "build: ok (K3_BIN=$bin, not rebuilt)" | tee -a "$summary"
else
  cuda_args=()
  if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
    cuda_args=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
  fi
  run_step configure 60 cmake -S . -B "$bin" -G Ninja -DCMAKE_BUILD_TYPE=Release "${cuda_args[@]}"
  run_step build 210 cmake --build "$bin" -j "$(nproc)" --target k3_gpu_tests k3decode
fi
if ! grep -q "^build: ok" "$summary" || [ ! -x "$bin/k3_gpu_tests" ]; then
  echo "build failed: nothing to run" | tee -a "$summary"
  cat "$summary"
  exit 1
fi
export LD_LIBRARY_PATH="$bin:${LD_LIBRARY_PATH:-}"

run_step topk_tests 90 "$bin/k3_gpu_tests" --gtest_filter='TopkSplitCuda.*:TopkCuda.*:Cases/DsaIndexerCuda.*'
grep -hE "^\[  (PASSED|FAILED) " "$out/topk_tests.log" >>"$summary" || true
# The K3.1 (DSA) model on the device against the CPU engine, through the runtime's scratch (value index 1 is
# k3.1), and one multi-rank layout with DCP (its global top-k calls topk_indices twice per layer).
run_step dsa_model 90 "$bin/k3_gpu_tests" \
  --gtest_filter='Variants/GpuRankVsCpu.*/1:Variants/GpuGenerate.MatchesCpuGenerate/1:*GpuParallel.MatchesCpuSingleRank/tp2_dp2_dcp2'
if command -v compute-sanitizer >/dev/null; then
  run_step memcheck 60 compute-sanitizer --tool memcheck --error-exitcode 3 "$bin/k3_gpu_tests" \
    --gtest_filter='TopkSplitCuda.SmallRowsForTheSanitizer'
  grep -hE "ERROR SUMMARY" "$out/memcheck.log" >>"$summary" || true
else
  echo "memcheck: SKIPPED (no compute-sanitizer)" | tee -a "$summary"
  status=1
fi
run_step bench_ops_dsa 60 "$bin/k3decode" bench --ops --ops-only dsa --json "$out/bench_ops_dsa.json"
grep -hE "^  ctx " "$out/bench_ops_dsa.log" >>"$summary" || true
if command -v compute-sanitizer >/dev/null; then  # shared-memory races of the sort and the histograms: last, optional
  run_step racecheck 45 compute-sanitizer --tool racecheck --error-exitcode 3 "$bin/k3_gpu_tests" \
    --gtest_filter='TopkSplitCuda.SmallRowsForTheSanitizer'
  grep -hE "RACECHECK SUMMARY|ERROR SUMMARY" "$out/racecheck.log" >>"$summary" || true
fi

echo "---"
cat "$summary"
exit "$status"
