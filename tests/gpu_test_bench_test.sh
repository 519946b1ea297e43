#!/usr/bin/env bash
# scripts/gpu-test.sh --bench-only with a stand-in k3decode (no GPU): the step modes run in
# K3_BENCH_MODES's order, each for both variants before the next; the per-variant JSON holds the modes
# measured in the table's order and no earlier run's file; K3_BENCH_LAYER_COPIES reaches the bench as
# --layer-copies (and nothing when unset); K3_BENCH_DEADLINE skips what would start with
# under a minute left (exit status 1); an unknown mode or a malformed deadline is refused before anything
# runs (exit status 2).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/bin"
# The stand-in: one line per call to calls.txt, a one-record JSON naming its variant and mode.
cat >"$tmp/bin/k3decode" <<'STUB'
#!/usr/bin/env bash
v="" st="" shared=tp json="" batches="" copies=none
while [ $# -gt 0 ]; do
  case "$1" in
    --variant) v=$2; shift ;; --steps) st=$2; shift ;; --json) json=$2; shift ;;
    --shared-experts) shared=$2; shift ;; --layer-copies) copies=$2; shift ;;
    --batches) while [ $# -gt 1 ] && [[ "$2" =~ ^[0-9]+$ ]]; do batches="$batches $2"; shift; done ;;
  esac
  shift
done
echo "$v $st $shared" >>"$(dirname "$0")/calls.txt"
echo "$batches" >>"$(dirname "$0")/batches.txt"
echo "$copies" >>"$(dirname "$0")/copies.txt"
echo "[{\"variant\": \"$v\", \"step\": \"$st\", \"shared\": \"$shared\"}]" >"$json"
STUB
chmod +x "$tmp/bin/k3decode"
run() { OUT="$tmp/out" K3_BIN="$tmp/bin" K3_COMMIT=test "$root/scripts/gpu-test.sh" --bench-only >"$tmp/log" 2>&1; }
fail() { echo "FAIL: $*"; cat "$tmp/log"; exit 1; }

# 1. Order, merge, stale files.
mkdir -p "$tmp/out"
echo '[{"variant": "k3", "step": "stale"}]' >"$tmp/out/rank_slice_k3_hybrid-replicated.json"
K3_BENCH_MODES="hybrid stock" run || fail "the run failed"
printf 'k3 hybrid tp\nk3.1 hybrid tp\nk3 stock tp\nk3.1 stock tp\n' | diff - "$tmp/bin/calls.txt" >/dev/null ||
  fail "calls in the wrong order: $(cat "$tmp/bin/calls.txt")"
python3 - "$tmp/out" <<'PY'
import json, sys
for v in ("k3", "k3.1"):
    got = [(r["variant"], r["step"]) for r in json.load(open(f"{sys.argv[1]}/rank_slice_{v}.json"))]
    assert got == [(v, "stock"), (v, "hybrid")], f"{v}: {got}"
PY

[ "$(sort -u "$tmp/bin/batches.txt")" = " 1 8 32 64" ] || fail "default batches: $(cat "$tmp/bin/batches.txt")"

# 2. The seed's hybrid mode passes --shared-experts replicated; K3_BENCH_BATCHES picks the batches.
rm -f "$tmp/bin/batches.txt"
rm -f "$tmp/bin/calls.txt"
K3_BENCH_MODES="hybrid-replicated" K3_BENCH_VARIANTS=k3 K3_BENCH_BATCHES="1 8" run || fail "the replicated run failed"
[ "$(cat "$tmp/bin/calls.txt")" = "k3 hybrid replicated" ] || fail "replicated: $(cat "$tmp/bin/calls.txt")"
[ "$(cat "$tmp/bin/batches.txt")" = " 1 8" ] || fail "K3_BENCH_BATCHES=\"1 8\": $(cat "$tmp/bin/batches.txt")"

[ "$(sort -u "$tmp/bin/copies.txt")" = "none" ] || fail "copies without K3_BENCH_LAYER_COPIES: $(cat "$tmp/bin/copies.txt")"
rm -f "$tmp/bin/copies.txt"
K3_BENCH_MODES="stock" K3_BENCH_VARIANTS=k3 K3_BENCH_LAYER_COPIES=2 run || fail "the layer-copies run failed"
[ "$(cat "$tmp/bin/copies.txt")" = "2" ] || fail "K3_BENCH_LAYER_COPIES=2: $(cat "$tmp/bin/copies.txt")"

# 3. A deadline under a minute: nothing starts, status 1, empty JSON.
rm -f "$tmp/bin/calls.txt"
if K3_BENCH_MODES="hybrid" K3_BENCH_DEADLINE=30 run; then fail "a run past its deadline reported success"; fi
[ ! -e "$tmp/bin/calls.txt" ] || fail "a process started with under a minute left"
grep -q "skipped" "$tmp/log" || fail "no skip message"
[ "$(tr -d ' \n' <"$tmp/out/rank_slice_k3.json")" = "[]" ] || fail "JSON after skipping: $(cat "$tmp/out/rank_slice_k3.json")"

# 4. Bad input refused before anything runs.
for env in "K3_BENCH_MODES=hybrid-tp" "K3_BENCH_DEADLINE=5m" "K3_BENCH_BATCHES=0" "K3_BENCH_BATCHES=8x" \
  "K3_BENCH_LAYER_COPIES=-1" "K3_BENCH_LAYER_COPIES=two"; do
  set +e
  env "$env" OUT="$tmp/out" K3_BIN="$tmp/bin" K3_COMMIT=test "$root/scripts/gpu-test.sh" --bench-only >"$tmp/log" 2>&1
  rc=$?
  set -e
  [ "$rc" -eq 2 ] || fail "$env: exit status $rc, expected 2"
  grep -q "${env%%=*}" "$tmp/log" || fail "$env: the error does not name the variable"
done
[ ! -e "$tmp/bin/calls.txt" ] || fail "bad input still ran the bench"
echo "gpu-test bench ordering: ok"
