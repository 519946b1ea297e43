#!/usr/bin/env bash
# The warp-specialized wgmma routed-expert kernel (K3_MOE_WG=1, src/ops/moe_experts_wg.cu) on one H200, in
# one call of at most ~480 s: build (Ninja, Release, build-gpu: k3_gpu_tests and k3decode), the CudaMoe tests
# with and without K3_MOE_WG=1, compute-sanitizer memcheck and racecheck over its small case, then the A/B:
# `bench --ops --ops-only moe` and the K3 rank slice (hybrid step, B = 1 and 64, q = 1 and 4) with
# K3_MOE_WG=0 and 1.
#
# usage: scripts/device-moe-wg.sh
#
# Every step runs under `timeout`, capped so the whole script ends by K3_DEADLINE_S (default 470) seconds
# after it starts; a failed or skipped step does not stop later ones; $OUT/steps.txt lists each with its
# status. Logs and JSON go to $OUT (default out/moe-wg), then into $OUT/all.tgz (only a few files come back
# from a lent machine); the copies outside the archive are removed but steps.txt.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
name=moe-wg
source scripts/device-lib.sh

{
  echo "commit $commit"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader
} 2>&1 | tee "$out/machine.txt"

step build 240 bash -c "cmake -S . -B $bin -G Ninja -DCMAKE_BUILD_TYPE=Release && \
  cmake --build $bin -j $(nproc) --target k3_gpu_tests k3decode"

# Correctness: the CudaMoe tests (their Wg cases force the new kernel either way), then all of them with it.
for wg in 0 1; do
  step "moe_tests_wg$wg" 60 env K3_MOE_WG=$wg "$bin/k3_gpu_tests" --gtest_filter='CudaMoe.*'
  grep -E "^\[  (FAILED|PASSED|SKIPPED) |tests ran" "$logs/moe_tests_wg$wg.log" 2>/dev/null | tail -12
done
if command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    step "$tool" 60 env K3_MOE_WG=1 compute-sanitizer --tool $tool --error-exitcode 3 "$bin/k3_gpu_tests" \
      --gtest_filter='CudaMoe.MoeExpertsWgMatchesCpuSmall'
    [ -f "$logs/$tool.log" ] && echo "$tool: $(tail -1 "$logs/$tool.log")"
  done
else
  echo "compute-sanitizer: not found" | tee -a "$out/steps.txt"
  status=1
fi

# Speed: the routed experts alone, then the K3 rank slice's step; each process reads K3_MOE_WG once.
for wg in 0 1; do
  step "ops_moe_wg$wg" 45 env K3_MOE_WG=$wg "$bin/k3decode" bench --ops --ops-only moe --commit "$commit" \
    --json "$logs/ops_moe_wg$wg.json"
  grep -E "experts|pairs drawn" "$logs/ops_moe_wg$wg.log" 2>/dev/null
done
for wg in 0 1; do
  step "bench_wg$wg" 60 env K3_MOE_WG=$wg "$bin/k3decode" bench --preset k3-rank-slice --variant k3 \
    --tp 8 --dp 4 --rank 0 --context 8192 --batches 1 64 --q 1 4 --iters 30 --steps hybrid \
    --commit "$commit" --json "$logs/bench_wg$wg.json"
  tail -8 "$logs/bench_wg$wg.log" 2>/dev/null
done

finish
