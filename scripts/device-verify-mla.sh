#!/usr/bin/env bash
# One device call that checks the Hopper MLA attend kernel (src/ops/mla_attend_wg.cu) on an H200, from the
# repository root: a Ninja build of the GPU test binary and k3decode into build-gpu, the MLA GPU tests
# (every attend kernel against the CPU reference, lse_merge, absorb / unabsorb), compute-sanitizer memcheck
# over two small K3-shape cases (TMA tiles, the cp.async tail, a split merge; 16-row TMA boxes), and
# `bench --ops --ops-only mla` (each MLA kernel beside its HBM floor). Logs and the bench JSON go to $OUT
# (default out/mla). Every step runs under `timeout`, all of them within 7 minutes together; a failed step
# is reported and the next one still runs; the exit status is 1 if any failed.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out/mla}"
mkdir -p "$out"
deadline=$((SECONDS + 415))  # 6 min 55 s for everything
status=0

# step NAME LIMIT_S CMD...: runs CMD with its output in $out/NAME.log, at most LIMIT_S seconds (less when
# the deadline is nearer), and prints the log's tail.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((deadline - SECONDS))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 5 ]; then
    echo "== $name: skipped (no time left)"
    status=1
    return
  fi
  echo "== $name (at most ${limit} s)"
  local rc=0
  timeout -k 5 "$limit" "$@" >"$out/$name.log" 2>&1 || rc=$?
  tail -n 8 "$out/$name.log" || true
  if [ "$rc" -ne 0 ]; then
    echo "== $name: FAILED (exit $rc$([ "$rc" -eq 124 ] && echo ', timed out'))"
    status=1
  fi
}

(nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader || true) |
  tee "$out/machine.txt"
git rev-parse --short HEAD >"$out/commit.txt" 2>/dev/null || true

launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
nvcc_bin=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
step build 250 bash -c "cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_COMPILER=$nvcc_bin ${launcher[*]} && cmake --build build-gpu -j \$(nproc) --target k3_gpu_tests k3decode"
if [ ! -x build-gpu/k3_gpu_tests ] || [ ! -x build-gpu/k3decode ]; then
  echo "no binaries: stopping"
  exit 1
fi
export LD_LIBRARY_PATH="build-gpu:${LD_LIBRARY_PATH:-}"

step gpu_tests 90 build-gpu/k3_gpu_tests --gtest_filter='*MlaAttend*:*LseMerge*:*MlaProj*'
grep -E "^\[  (FAILED|PASSED|SKIPPED) |tests ran" "$out/gpu_tests.log" || true

if command -v compute-sanitizer >/dev/null; then
  # K3 cases 3 (one request, 65 entries: a TMA tile, a cp.async tail, two splits merged) and 19 (page 16:
  # 16-row TMA boxes, q = 2, up to 8k).
  step memcheck 45 compute-sanitizer --tool memcheck --error-exitcode 3 build-gpu/k3_gpu_tests \
    --gtest_filter='K3/MlaAttendK3Cuda.*/3:K3/MlaAttendK3Cuda.*/19'
else
  echo "== memcheck: compute-sanitizer not found"
  status=1
fi

step bench 60 build-gpu/k3decode bench --ops --ops-only mla --json "$out/bench_mla.json"
grep -E "MLA|merge" "$out/bench.log" >"$out/bench_mla.txt" || true

echo "== done in ${SECONDS} s, status $status"
exit "$status"
