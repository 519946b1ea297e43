#!/usr/bin/env bash
# One call on a GPU machine (H200) that checks the kda-fuse branch: kda_prep (the KDA layer's convs, l2
# norms, gate and beta in one kernel) and linear_ld (f_b reading f_a in place). From the repository root:
#
#   OUT=out/kda scripts/device-verify-kda.sh
#
# Steps, each under `timeout`, all within about 6 minutes (a step that would start past the deadline is
# skipped and reported): a Ninja build into build-gpu of the two binaries needed; the KDA op GPU tests and
# CudaLinear.StridedRowsMatchTheCompactedRows; GpuRankVsCpu and GpuGenerate (the engine against the CPU);
# compute-sanitizer memcheck on small KdaPrepCuda cases; `bench --ops --ops-only kda`; the K3 rank slice at
# B = 1, q = 1 (hybrid, shared experts TP), whose JSON holds the kernels and copies per step. Logs, JSON and
# summary.txt land in $OUT (default out/kda). Exit status 0 only when every step ran and passed.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out/kda}"
mkdir -p "$out"
bin=build-gpu
start=$(date +%s)
deadline=$((start + 355))
status=0
summary="$out/summary.txt"
: >"$summary"

note() { echo "$*" | tee -a "$summary"; }

# step NAME CAP_SECONDS LOG COMMAND...: runs COMMAND under timeout min(CAP, time left), output to LOG.
step() {
  local name=$1 cap=$2 log=$3
  shift 3
  local left=$((deadline - $(date +%s)))
  if [ "$left" -lt 10 ]; then
    note "$name: SKIPPED (out of time)"
    status=1
    return 0
  fi
  local t=$((cap < left ? cap : left))
  local t0 rc=0
  t0=$(date +%s)
  timeout "$t" "$@" >"$log" 2>&1 || rc=$?
  if [ "$rc" -eq 0 ]; then
    note "$name: ok ($(($(date +%s) - t0)) s)"
  else
    note "$name: FAILED rc=$rc ($(($(date +%s) - t0)) s, limit $t s; log $log)"
    status=1
  fi
  return 0
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$out/machine.txt" 2>&1 || true
note "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown) on $(head -1 "$out/machine.txt")"

launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
nvcc=/usr/local/cuda/bin/nvcc
command -v nvcc >/dev/null && nvcc=$(command -v nvcc)
step configure 60 "$out/configure.log" \
  cmake -S . -B "$bin" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER="$nvcc" "${launcher[@]}"
step build 240 "$out/build.log" cmake --build "$bin" -j "$(nproc)" --target k3_gpu_tests k3decode
if [ ! -x "$bin/k3_gpu_tests" ] || [ ! -x "$bin/k3decode" ]; then
  note "no binaries: stopping"
  exit 1
fi
export LD_LIBRARY_PATH="$bin:${LD_LIBRARY_PATH:-}"

kda_filter='*KdaPrepCuda*:*KdaGatedNormCuda*:*KdaRecurrenceCuda*:KdaCuda.*:CudaLinear.StridedRowsMatchTheCompactedRows'
step "gpu tests: KDA ops + linear_ld" 60 "$out/kda_ops_tests.log" \
  "$bin/k3_gpu_tests" --gtest_filter="$kda_filter"
step "gpu tests: GpuRankVsCpu + GpuGenerate" 120 "$out/engine_tests.log" \
  "$bin/k3_gpu_tests" --gtest_filter='*GpuRankVsCpu*:*GpuGenerate*'
for f in kda_ops_tests engine_tests; do
  if [ -f "$out/$f.log" ]; then
    grep -E "^\[  (FAILED|PASSED) +\]|^\[  SKIPPED \] [0-9]+ tests|tests? ran" "$out/$f.log" | sort -u |
      tee -a "$summary" || true
  fi
done

if command -v compute-sanitizer >/dev/null; then
  # kda_prep at B 1, q 1 (K3 shape and 3 x 7) and B 3, q 4 (3 x 7).
  p=Shapes/KdaPrepCuda.MatchesCpuKeepsInputsAndCommits
  step "memcheck kda_prep" 45 "$out/memcheck_kda.log" \
    compute-sanitizer --tool memcheck --error-exitcode 3 "$bin/k3_gpu_tests" --gtest_filter="$p/0:$p/1:$p/15"
  tail -2 "$out/memcheck_kda.log" | tee -a "$summary" || true
else
  note "memcheck: SKIPPED (no compute-sanitizer)"
fi

step "bench --ops --ops-only kda" 45 "$out/ops_kda.log" \
  "$bin/k3decode" bench --ops --ops-only kda --json "$out/ops_kda.json"
grep -E "KDA prep|^  B " "$out/ops_kda.log" | head -13 | tee -a "$summary" || true

step "rank slice k3 B 1 q 1" 120 "$out/rank_slice_b1.log" \
  "$bin/k3decode" bench --preset k3-rank-slice --variant k3 --tp 8 --dp 4 --rank 0 --context 8192 --batches 1 \
  --q 1 --iters 50 --steps hybrid --shared-experts tp --commit "$(git rev-parse --short HEAD 2>/dev/null || echo x)" \
  --json "$out/rank_slice_b1.json"
grep -E "graph:|hybrid" "$out/rank_slice_b1.log" | tee -a "$summary" || true
if [ -f "$out/rank_slice_b1.json" ] && command -v python3 >/dev/null; then
  python3 - "$out/rank_slice_b1.json" <<'PY' | tee -a "$summary" || true
import json, sys
for r in json.load(open(sys.argv[1])):
    print(f"{r['step']} B {r['requests']} q {r['q']}: median {r['median_us']:.0f} us, "
          f"{r['kernels_per_step']:.0f} kernels + {r['copies_per_step']:.0f} copies per step")
    for k in r["trace_kernels"]:
        if any(s in k["name"] for s in ("kda_prep", "short_conv", "l2norm", "kda_gate", "kda_beta")):
            print(f"  {k['calls']:.0f} x {k['name'][:60]}: {k['us']:.0f} us")
PY
fi

note "total $(($(date +%s) - start)) s; status $status"
exit "$status"
