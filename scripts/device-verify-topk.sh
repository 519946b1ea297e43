#!/usr/bin/env bash
# The column-order DSA top-k (src/ops/dsa_topk.cu) on a GPU, in one call from the repo root:
# build (build-gpu, Ninja, Release: k3_gpu_tests and k3decode only), the top-k GPU tests, the DSA model
# GPU tests (K3.1: GpuRankVsCpu, GpuGenerate, GpuParallel), compute-sanitizer memcheck and racecheck on the
# small top-k case, and `k3decode bench --ops --ops-only dsa`. Logs in $OUT (default out/topk), then
# $OUT.tar.gz of them. Keeps going after a failure; exits non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out/topk}"
mkdir -p "$out"
bin=build-gpu
status=0
step() {  # step NAME CMD...: runs CMD into $out/NAME.log, its time and status into $out/summary.txt
  local name="$1" t0 rc
  shift
  t0=$(date +%s)
  "$@" >"$out/$name.log" 2>&1
  rc=$?
  printf '%-22s rc %-3s %4ss\n' "$name" "$rc" "$(($(date +%s) - t0))" | tee -a "$out/summary.txt"
  [ "$rc" -eq 0 ] || status=1
  return "$rc"
}
: >"$out/summary.txt"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader >"$out/machine.txt" 2>&1
git log -1 --format='%H %s' >"$out/commit.txt" 2>&1
if step configure cmake -S . -B "$bin" -G Ninja -DCMAKE_BUILD_TYPE=Release &&
  step build cmake --build "$bin" -j "$(nproc)" --target k3_gpu_tests k3decode; then
  export LD_LIBRARY_PATH="$bin:${LD_LIBRARY_PATH:-}"
  step topk_tests "$bin/k3_gpu_tests" --gtest_filter='TopkCuda.*:TopkSplitCuda.*:Cases/DsaIndexerCuda.*'
  # K3.1 is the second variant of GpuRankVsCpu / GpuGenerate (/1); GpuParallel covers both variants per
  # layout: the layouts with DCP (the global top-k over shards) and one without.
  step dsa_model_tests "$bin/k3_gpu_tests" \
    --gtest_filter='Variants/GpuRankVsCpu.*/1:Variants/GpuGenerate.*/1:Layouts/GpuParallel.*/tp1_dp1_dcp1:Layouts/GpuParallel.*/tp2_dp1_dcp2:Layouts/GpuParallel.*/tp2_dp2_dcp2'
  if command -v compute-sanitizer >/dev/null; then
    step memcheck compute-sanitizer --tool memcheck --error-exitcode 3 "$bin/k3_gpu_tests" \
      --gtest_filter='TopkSplitCuda.SmallRowsForTheSanitizer'
    step racecheck compute-sanitizer --tool racecheck --error-exitcode 3 "$bin/k3_gpu_tests" \
      --gtest_filter='TopkSplitCuda.SmallRowsForTheSanitizer'
  else
    echo "compute-sanitizer: not found" | tee -a "$out/summary.txt"
    status=1
  fi
  step bench "$bin/k3decode" bench --ops --ops-only dsa --json "$out/bench_dsa.json"
  grep -E "^\[  (FAILED|PASSED|SKIPPED) |tests ran" "$out/topk_tests.log" "$out/dsa_model_tests.log" >>"$out/summary.txt"
  grep -E "ctx" "$out/bench.log" >>"$out/summary.txt"
fi
cat "$out/summary.txt"
tar -czf "$out.tar.gz" -C "$(dirname "$out")" "$(basename "$out")" && echo "logs: $out.tar.gz"
exit "$status"
