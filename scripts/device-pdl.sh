#!/usr/bin/env bash
# Programmatic dependent launch (K3_PDL, ops/cuda_device.cuh) on one H200, in one call of at most ~480 s: build, then with
# K3_PDL=1 the GPU tests, compute-sanitizer (memcheck and racecheck over the tiny-model run, memcheck over
# one multi-rank layout) and the tiny models' generate on the GPU beside the CPU; then the A/B of the
# step: the rank-slice bench as K3_PDL=0, 1, 0, 1 (alternating, to see the spread between runs) and the
# projection kernels alone (`bench --ops --ops-only linear`) as K3_PDL=0 and 1, with a summary of the
# medians side by side.
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
# machine): the copies outside the archive are removed but summary.txt and steps.txt.
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
  # The step: K3_PDL=0 and 1 alternating, twice; each process reads K3_PDL once. The bench rewrites its
  # JSON after every point, so a run cut by its timeout keeps what it measured.
  steps=()
  [ -n "${K3_AB_STEPS:-}" ] && read -ra steps <<<"--steps $K3_AB_STEPS"
  for rep in 1 2; do
    for p in 0 1; do
      step "bench_pdl${p}_r$rep" 120 env K3_PDL=$p "$bin/k3decode" bench --preset k3-rank-slice --variant k3 \
        --tp 8 --dp 4 --rank 0 --context 8192 --batches 1 8 64 --q 1 4 --iters 50 "${steps[@]}" \
        --commit "$commit" --json "$logs/ab_pdl${p}_r$rep.json"
    done
  done
  # The projections alone: CUDA graphs of 20 launches of one op, so PDL overlaps consecutive launches.
  for p in 0 1; do
    step "ops_linear_pdl$p" 60 env K3_PDL=$p "$bin/k3decode" bench --ops --ops-only linear --commit "$commit" \
      --json "$logs/ops_linear_pdl$p.json"
  done
  python3 - "$logs" >"$out/summary.txt" 2>&1 <<'EOF' || status=1
import json, os, statistics, sys

d = sys.argv[1]


def load(name):
    p = os.path.join(d, name)
    if not os.path.exists(p):
        return None
    try:
        with open(p) as f:
            return json.load(f)
    except ValueError:
        return None


def fmt(v):
    return f"{v:9.1f}" if v is not None else f"{'-':>9}"


print("step: median_us per run (K3_PDL=0 and 1, runs r1 r2), the median of each setting, 1 vs 0")
runs = {(p, r): load(f"ab_pdl{p}_r{r}.json") for p in (0, 1) for r in (1, 2)}
pts, gaps = {}, {}
for (p, r), recs in runs.items():
    for x in recs or []:
        key = (x["step"], x["requests"], x["q"])
        pts.setdefault(key, {})[(p, r)] = x["median_us"]
        if "trace_gap_us" in x:
            gaps.setdefault(key, {}).setdefault(p, []).append(x["trace_gap_us"])
print(f"{'step':>7} {'B':>3} {'q':>2} {'pdl0 r1':>9} {'pdl0 r2':>9} {'pdl1 r1':>9} {'pdl1 r2':>9}"
      f" {'pdl0':>9} {'pdl1':>9} {'1 vs 0':>7}")
for key in sorted(pts):
    v = pts[key]
    m = {}
    for p in (0, 1):
        xs = [v[(p, r)] for r in (1, 2) if (p, r) in v]
        m[p] = statistics.median(xs) if xs else None
    delta = f"{100 * (m[1] / m[0] - 1):+6.1f}%" if m[0] and m[1] else f"{'-':>7}"
    cells = " ".join(fmt(v.get((p, r))) for p in (0, 1) for r in (1, 2))
    print(f"{key[0]:>7} {key[1]:>3} {key[2]:>2} {cells} {fmt(m[0])} {fmt(m[1])} {delta}")

print("\nthe trace's uncovered time per step (trace_gap_us, CUPTI; median over the runs)")
print(f"{'step':>7} {'B':>3} {'q':>2} {'pdl0':>9} {'pdl1':>9}")
for key in sorted(gaps):
    g = [statistics.median(gaps[key][p]) if gaps[key].get(p) else None for p in (0, 1)]
    print(f"{key[0]:>7} {key[1]:>3} {key[2]:>2} {fmt(g[0])} {fmt(g[1])}")

print("\nprojections alone (bench --ops --ops-only linear, the auto path): us per call, 1 vs 0")
ops = [load(f"ops_linear_pdl{p}.json") for p in (0, 1)]
us = [{x["shape"]: x["us"] for x in (o or []) if x.get("op") == "linear"} for o in ops]
print(f"{'shape':>20} {'pdl0':>9} {'pdl1':>9} {'1 vs 0':>7}")
for shape in dict.fromkeys(list(us[0]) + list(us[1])):
    a, b = us[0].get(shape), us[1].get(shape)
    delta = f"{100 * (b / a - 1):+6.1f}%" if a and b else f"{'-':>7}"
    print(f"{shape:>20} {fmt(a)} {fmt(b)} {delta}")
EOF
  cat "$out/summary.txt"
fi

finish $([ -f "$out/summary.txt" ] && echo "$out/summary.txt")
