#!/usr/bin/env bash
# Everything that needs a GPU, in one call: every CUDA op against its CPU
# reference, the tiny models on the GPU against the CPU engine (eager and
# graphed), the parallel-runtime matrix on one GPU (GpuParallel: every layout
# as ranks-as-threads with the local GPU comm), compute-sanitizer memcheck over
# the tiny-model run, one multi-rank layout and the decode kernels' small
# cases (racecheck on the top-k), the nccl backend through
# mpirun -np 1 (when built with K3_NCCL), (with
# --bench) the rank-slice benchmark of both variants in its three step modes, and (with --serve) the
# serving figures (scripts/serve-bench.sh: the small preset on the GPU). Logs and the bench JSON
# go to $OUT (or out/gpu), never into docs/. --history (implies --bench) also
# appends the bench points to docs/perf/history.csv (scripts/perf-history.py)
# and leaves a copy of that file in $OUT (on a lent machine only $OUT comes
# back). --bench-only skips the tests; K3_BENCH_VARIANTS (default "k3 k3.1")
# picks the variants benched, so that one variant's three processes fit one
# lent-machine call; K3_BENCH_MODES (default "stock hybrid hybrid-replicated")
# the step modes and their order (each mode for every variant, then the next);
# K3_BENCH_BATCHES (default "1 8 32 64") the requests per step (e.g. "1 8" on an
# 80 GB H100, where 32 and 64 do not fit beside the slice's weights);
# K3_BENCH_LAYER_COPIES (default 0: every layer its own weights) gives the
# bench --layer-copies, so that every point and mode fits an 80 GB GPU (its
# JSON records it; docs/PERF.md says when such a table stands for the real one);
# K3_BENCH_DEADLINE (seconds from the start of the bench, default none) skips a
# process that would start with less than a minute left and stops the one
# running at the deadline, so that a lent call ends with what it measured
# (tests/gpu_test_bench_test.sh). Copy the JSON over
# docs/perf/rank_slice_{k3,k3.1}.json by hand when the run becomes the current
# one (docs/PERF.md). Uses the binaries in $K3_BIN
# when given (carried from another machine, with the shared libraries they
# need beside them), else builds (cmake -G Ninja, all cores).
set -uo pipefail
cd "$(dirname "$0")/.."
bench=0 history=0 serve=0 tests=1
for a in "$@"; do
  case "$a" in
    --bench) bench=1 ;;
    --history) bench=1 history=1 ;;
    --bench-only) bench=1 tests=0 ;;
    --serve) serve=1 ;;
    *) echo "usage: scripts/gpu-test.sh [--bench] [--history] [--bench-only] [--serve]" >&2; exit 2 ;;
  esac
done
# The bench's batch sizes and step modes, checked before anything runs.
batches=(${K3_BENCH_BATCHES:-1 8 32 64})
for b in "${batches[@]}"; do
  [[ "$b" =~ ^[1-9][0-9]*$ ]] || { echo "K3_BENCH_BATCHES: '$b' is not a positive number of requests" >&2; exit 2; }
done
modes=(${K3_BENCH_MODES:-stock hybrid hybrid-replicated})
for mode in "${modes[@]}"; do
  case "$mode" in
    stock|hybrid|hybrid-replicated) ;;
    *) echo "K3_BENCH_MODES: unknown mode '$mode' (stock, hybrid, hybrid-replicated)" >&2; exit 2 ;;
  esac
done
if ! [[ "${K3_BENCH_LAYER_COPIES:-0}" =~ ^[0-9]+$ ]]; then
  echo "K3_BENCH_LAYER_COPIES: '$K3_BENCH_LAYER_COPIES' is not a number of weight copies (0: none)" >&2; exit 2
fi
copies=()
[ "${K3_BENCH_LAYER_COPIES:-0}" -gt 0 ] && copies=(--layer-copies "$K3_BENCH_LAYER_COPIES")
if ! [[ "${K3_BENCH_DEADLINE:-}" =~ ^[0-9]*$ ]]; then
  echo "K3_BENCH_DEADLINE: '$K3_BENCH_DEADLINE' is not a number of seconds" >&2; exit 2
fi
out="${OUT:-out/gpu}"
mkdir -p "$out"
bin="${K3_BIN:-}"
if [ -z "$bin" ]; then
  bin=build-gpu
  cmake -S . -B "$bin" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null && cmake --build "$bin" -j "$(nproc)" || exit 1
fi
export LD_LIBRARY_PATH="$bin:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader | tee "$out/machine.txt"
status=0
if [ "$tests" = 1 ]; then
# (PIPESTATUS is read in the same command list: after `|| true` it would hold true's status.)
"$bin/k3_gpu_tests" 2>&1 | tee "$out/gpu_tests.log" |
  grep -E "^\[  (FAILED|PASSED|SKIPPED) |\[ gpu( parallel)? \]|tests ran"; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
if [ -x "$bin/k3_comm_nccl_test" ] && command -v mpirun >/dev/null; then
  # The nccl backend, one process on the one GPU (more ranks need more GPUs: NCCL
  # refuses two ranks on one device).
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --allow-run-as-root -np 1 \
    "$bin/k3_comm_nccl_test" --tp 1 --dp 1 --dcp 1 2>&1 | tee "$out/comm_nccl.log" | tail -3
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
# sanitize LOG TOOL FILTER: compute-sanitizer TOOL over the GPU tests FILTER selects; its summary line shown.
sanitize() {
  compute-sanitizer --tool "$2" --error-exitcode 3 "$bin/k3_gpu_tests" --gtest_filter="$3" >"$out/$1.log" 2>&1 ||
    status=1
  tail -1 "$out/$1.log"
}
if command -v compute-sanitizer >/dev/null; then
  sanitize memcheck memcheck '*GpuRankVsCpu*'
  # The multi-rank step on one GPU (ranks as threads, local GPU comm): one layout with TP, DP and DCP.
  sanitize memcheck_parallel memcheck '*GpuParallel.MatchesCpuSingleRank/tp2_dp2_dcp2'
  # The decode kernels on small cases of their own: the split top-k (and its shared-memory races), wgmma MLA,
  # kda_prep, the split sampler.
  sanitize memcheck_kernels memcheck \
    'TopkSplitCuda.SmallRowsForTheSanitizer:K3/MlaAttendK3Cuda.*/3:Shapes/KdaPrepCuda.*/0:Shapes/KdaPrepCuda.*/1:CudaSampling.MatchesCpuOp'
  sanitize racecheck_topk racecheck 'TopkSplitCuda.SmallRowsForTheSanitizer'
fi
# The main job on the GPU: generate on the tiny model, beside the CPU's tokens.
for d in gpu cpu; do
  printf '%s: ' "$d"
  "$bin/k3decode" generate --device "$d" --variant k3.1 --prompt 5,6,7 --prompt 1,2 --max-new 8 --json || status=1
done | tee "$out/generate.log"
# --step on the GPU across layouts (ranks as threads): the tokens of both steps beside the CPU's.
for layout in "--tp 2 --dp 2 --dcp 2" "--tp 4 --dcp 2" "--tp 2 --dp 2"; do
  for step in stock hybrid; do
    args=(--variant k3.1 $layout --step "$step" --prompt 5,6,7 --prompt 1,2 --max-new 8 --json)
    g=$("$bin/k3decode" generate --device gpu "${args[@]}" 2>&1) || status=1
    c=$("$bin/k3decode" generate --device cpu "${args[@]}" 2>&1) || status=1
    same=no; [ "$g" = "$c" ] && same=yes
    printf '%s %s: gpu == cpu: %s\n  gpu: %s\n  cpu: %s\n' "$layout" "$step" "$same" "$g" "$c"
  done
done | tee "$out/generate_steps.log"
fi
if [ "$bench" = 1 ]; then
  # K3_COMMIT names the build when the binaries were carried (the device copy's git HEAD can be stale).
  commit="${K3_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  # One process per variant and step mode, as a deployment builds one rank (in one process the hybrid
  # rank was built after the stock one was freed, and its one-row points ran slower: docs/PERF.md).
  # The three modes of the table: stock, hybrid (its default, TP-sharded shared experts) and the seed's
  # hybrid step (replicated shared experts).
  variants=(${K3_BENCH_VARIANTS:-k3 k3.1})
  t0=$(date +%s)
  for v in "${variants[@]}"; do  # no earlier run's points in this run's JSON
    rm -f "$out/rank_slice_${v}_stock.json" "$out/rank_slice_${v}_hybrid.json" "$out/rank_slice_${v}_hybrid-replicated.json"
  done
  for mode in "${modes[@]}"; do
    for v in "${variants[@]}"; do
      limit=()
      if [ -n "${K3_BENCH_DEADLINE:-}" ]; then
        left=$((K3_BENCH_DEADLINE - $(date +%s) + t0))
        if [ "$left" -lt 60 ]; then echo "bench: $v $mode skipped (${left}s to the deadline)"; status=1; continue; fi
        limit=(timeout "$left")
      fi
      st=${mode%-replicated} shared=(); [ "$mode" = hybrid-replicated ] && shared=(--shared-experts replicated)
      "${limit[@]}" "$bin/k3decode" bench --preset k3-rank-slice --variant "$v" --tp 8 --dp 4 --rank 0 --context 8192 \
        --batches "${batches[@]}" --q 1 4 --iters 50 --steps "$st" "${shared[@]}" "${copies[@]}" --commit "$commit" \
        --json "$out/rank_slice_${v}_$mode.json" 2>&1 | tee "$out/bench_${v}_$mode.log" || status=1
    done
  done
  for v in "${variants[@]}"; do
    # The modes measured, in the table's order.
    python3 -c 'import json, os, sys; json.dump([r for f in sys.argv[2:] if os.path.exists(f) for r in json.load(open(f))], open(sys.argv[1], "w"), indent=1)' \
      "$out/rank_slice_$v.json" "$out/rank_slice_${v}_stock.json" "$out/rank_slice_${v}_hybrid.json" \
      "$out/rank_slice_${v}_hybrid-replicated.json" || status=1
  done
  if [ "$history" = 1 ]; then
    jsons=()
    for v in "${variants[@]}"; do jsons+=("$out/rank_slice_$v.json"); done
    python3 scripts/perf-history.py "${jsons[@]}" || status=1
    cp docs/perf/history.csv "$out/history.csv"
  fi
fi
if [ "$serve" = 1 ]; then
  scripts/serve-bench.sh "$bin/k3decode" "$out/serve" --device gpu --preset small || status=1
fi
exit $status
