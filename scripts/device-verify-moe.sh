#!/usr/bin/env bash
# The routed experts' kernel (src/ops/moe_experts_ws.cu) on one GPU machine (H200), in one call from the
# repository root, under 8 minutes: build into build-gpu (Ninja, Release; only the GPU test binary and
# k3decode), the MoE GPU tests (CudaMoe.*: every expert case against the CPU reference, bit-for-bit
# repeatability, a row alone == the same row in a batch), the moe_experts cases again as two launches
# (K3_MOE_SPLIT_LAUNCH=1: up, then down; tells a fused-launch problem from a kernel problem),
# compute-sanitizer memcheck on the small moe_experts case, and `k3decode bench --ops --ops-only moe`
# (time against the HBM floor, JSON beside). Logs in $OUT (default out/moe); each step is bounded by
# `timeout` and a failed step does not stop the later ones (the build does); exit 1 if any step failed.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out/moe}"
mkdir -p "$out"
bin=build-gpu
status=0

# step NAME SECONDS CMD...: runs CMD under timeout, its output in $out/NAME.log, the tail on stdout.
step() {
  local name=$1 limit=$2 rc=0
  shift 2
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1 || rc=$?
  tail -n 6 "$out/$name.log"
  if [ "$rc" -ne 0 ]; then
    echo "== $name FAILED (exit $rc; 124: timed out)"
    status=1
  fi
  return 0
}

{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader || true; } |
  tee "$out/machine.txt"
git rev-parse --short HEAD 2>/dev/null | tee "$out/commit.txt" || true

step build 240 bash -c "cmake -S . -B $bin -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null &&
  cmake --build $bin -j \$(nproc) --target k3_gpu_tests k3decode"
[ "$status" -eq 0 ] || { echo "build failed: see $out/build.log"; exit 1; }
export LD_LIBRARY_PATH="$bin:${LD_LIBRARY_PATH:-}"

step gpu_tests_moe 110 "$bin/k3_gpu_tests" --gtest_filter='CudaMoe.*'
step gpu_tests_moe_split 40 env K3_MOE_SPLIT_LAUNCH=1 "$bin/k3_gpu_tests" \
  --gtest_filter='CudaMoe.MoeExpertsMatchesCpu*:CudaMoe.MoeExpertsOddShapesAndScales'
if command -v compute-sanitizer >/dev/null; then
  step memcheck_moe 40 compute-sanitizer --tool memcheck --error-exitcode 3 "$bin/k3_gpu_tests" \
    --gtest_filter='CudaMoe.MoeExpertsMatchesCpuSmall'
else
  echo "== memcheck_moe skipped: no compute-sanitizer" | tee "$out/memcheck_moe.log"
fi
step bench_moe 40 "$bin/k3decode" bench --ops --ops-only moe --json "$out/ops_moe.json"

grep -hE "^\[  (FAILED|PASSED) |tests ran" "$out"/gpu_tests_moe*.log || true
echo "logs in $out; status $status"
exit "$status"
