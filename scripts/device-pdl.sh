#!/usr/bin/env bash
# Programmatic dependent launch (K3_PDL, ops/cuda_device.cuh) on one H200, in one call of at most ~480 s: build, then with
# K3_PDL=1 the GPU tests, compute-sanitizer (memcheck and racecheck over the tiny-model run, memcheck over
# one multi-rank layout) and the tiny models' generate on the GPU beside the CPU; then the A/B of the
# step through scripts/device-ab.sh: the rank-slice bench as K3_PDL=0, 1, 0, 1 (alternating, to see the
# spread between runs; each step mode in its own process) and the projection kernels alone (`bench --ops
# --ops-only linear`) as K3_PDL=0 and 1, with a summary of the medians side by side.
#
# usage: scripts/device-pdl.sh [all|check|ab]   (all: both; check: build and the checks; ab: build and the A/B)
#
# Every step runs under `timeout`, capped so the whole script ends by K3_DEADLINE_S (default 470) seconds
# after it starts; in `all`, the checks stop early enough to leave the A/B K3_AB_RESERVE_S (default 260)
# seconds. A failed or skipped step does not stop later ones; $OUT/steps.txt lists each with its status.
# A cold build and the four bench runs (12 points each: stock and hybrid) may not all fit one call: the
# runs go K3_PDL=0, 1, 0, 1, so a cut one still has a run of each; `check`, then `ab` in a second call on
# the warm machine (build-gpu is kept) runs everything. K3_AB_STEPS=stock limits the A/B to one step kind.
# Logs and JSON go to $OUT (default out/pdl), then into $OUT/all.tgz (only a few files come back from a lent
# machine), the A/B's into $OUT/ab/all.tgz with $OUT/ab/summary.txt beside it; steps.txt stays too.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
phase=${1:-all}
case "$phase" in
  all | check | ab) ;;
  *) echo "usage: scripts/device-pdl.sh [all|check|ab]" >&2; exit 2 ;;
esac
name=pdl
source scripts/device-lib.sh
ab_reserve=${K3_AB_RESERVE_S:-260}

{
  echo "commit $commit, phase $phase"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader
} 2>&1 | tee "$out/machine.txt"

step build 300 bash -c "cmake -S . -B $bin -G Ninja -DCMAKE_BUILD_TYPE=Release && \
  cmake --build $bin -j $(nproc) --target k3_gpu_tests k3decode"

if [ "$phase" != ab ]; then
  [ "$phase" = all ] && until=$((deadline - ab_reserve))
  export K3_PDL=1
  step gpu_tests 150 "$bin/k3_gpu_tests"
  grep -E "^\[  (FAILED|PASSED|SKIPPED) |tests ran" "$logs/gpu_tests.log" 2>/dev/null | tail -20
  if command -v compute-sanitizer >/dev/null; then
    step memcheck 90 compute-sanitizer --tool memcheck --error-exitcode 3 "$bin/k3_gpu_tests" \
      --gtest_filter='*GpuRankVsCpu*'
    step racecheck 90 compute-sanitizer --tool racecheck --error-exitcode 3 "$bin/k3_gpu_tests" \
      --gtest_filter='*GpuRankVsCpu*'
    step memcheck_parallel 90 compute-sanitizer --tool memcheck --error-exitcode 3 "$bin/k3_gpu_tests" \
      --gtest_filter='*GpuParallel.MatchesCpuSingleRank/tp2_dp2_dcp2'
    for s in memcheck racecheck memcheck_parallel; do
      [ -f "$logs/$s.log" ] && echo "$s: $(tail -1 "$logs/$s.log")"
    done
  else
    echo "compute-sanitizer: not found" | tee -a "$out/steps.txt"
    status=1
  fi
  # The tiny models' tokens on the GPU beside the CPU's (scripts/gpu-test.sh): one rank, then --step across
  # layouts (ranks as threads). Fails when any pair differs.
  step generate 90 bash -c '
    bin=$1 fail=0
    for layout in "" "--tp 2 --dp 2 --dcp 2" "--tp 4 --dcp 2" "--tp 2 --dp 2"; do
      for step in stock hybrid; do
        [ -z "$layout" ] && [ "$step" = hybrid ] && continue
        args=(--variant k3.1 $layout --prompt 5,6,7 --prompt 1,2 --max-new 8 --json)
        [ -n "$layout" ] && args+=(--step "$step")
        g=$("$bin/k3decode" generate --device gpu "${args[@]}" 2>&1) || fail=1
        c=$("$bin/k3decode" generate --device cpu "${args[@]}" 2>&1) || fail=1
        same=no name="${layout:-one rank}"
        [ "$g" = "$c" ] && same=yes
        [ "$same" = yes ] || fail=1
        [ -n "$layout" ] && name+=" $step"
        printf "%s: gpu == cpu: %s\n  gpu: %s\n  cpu: %s\n" "$name" "$same" "$g" "$c"
      done
    done
    exit $fail' _ "$bin"
  grep "gpu == cpu" "$logs/generate.log" 2>/dev/null
  until=$deadline
fi

if [ "$phase" != check ]; then
  # The step and the projections alone as K3_PDL=0 and 1 in turn, twice (scripts/device-ab.sh, on this
  # build, in what is left of the deadline); its summary and archive land in $out/ab.
  K3_BIN=$bin K3_COMMIT=$commit K3_AB_REPS=2 K3_AB_OPS=linear \
    K3_DEADLINE_S=$((deadline - $(date +%s) - 20)) OUT="$out/ab" \
    scripts/device-ab.sh K3_PDL "0 1" --batches 1 8 64 --q 1 4 || status=1
fi

finish
