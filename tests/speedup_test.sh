#!/usr/bin/env bash
# scripts/speedup.py: the baseline's seed hybrid step against the new build's TP-sharded one and stock against
# stock, repeated runs as the median of their medians, the bars counted, one-sided points left out, a file of
# several commits split by --base-commit / --new-commit (the committed H100 comparison gives PERF.md's
# speedups), warnings for unlike runs, and clear errors for bad input.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; cat "$tmp/log" 2>/dev/null; exit 1; }
sp="$root/scripts/speedup.py"

# pt VARIANT STEP SHARED B Q MEDIAN_US [extra JSON fields]: one bench point (SHARED "" for none).
pt() {
  local shared=""
  [ -n "$3" ] && shared="\"shared_experts\": \"$3\", "
  echo "{\"variant\": \"$1\", \"step\": \"$2\", $shared\"requests\": $4, \"q\": $5, \"median_us\": $6${7:+, $7}}"
}
# The baseline (no shared_experts field: its hybrid is the seed's) at two points.
{
  echo "["
  pt k3 hybrid "" 1 1 30000 '"ratio": 1.70, "hbm_gbps": 4500, "commit": "old"'; echo ","
  pt k3 stock "" 1 1 25000 '"hbm_gbps": 4500, "commit": "old"'; echo ","
  pt k3 hybrid "" 8 1 30000 '"hbm_gbps": 4500, "commit": "old"'; echo ","
  pt k3 stock "" 8 1 30000 '"hbm_gbps": 4500, "commit": "old"'; echo ","
  pt k3 stock "" 64 4 90000 '"hbm_gbps": 4500, "commit": "old"'
  echo "]"
} >"$tmp/base.json"
# The new build: two runs of the TP-sharded hybrid at B = 1 (19 and 21 ms: median 20), its seed hybrid (not
# compared by default), stock; B = 64 only on the baseline's side.
{
  echo "["
  pt k3 hybrid tp 1 1 19000 '"ratio": 2.00, "hbm_gbps": 4480, "commit": "new"'; echo ","
  pt k3 hybrid tp 1 1 21000 '"ratio": 2.20, "hbm_gbps": 4480, "commit": "new"'; echo ","
  pt k3 hybrid replicated 1 1 28000 '"hbm_gbps": 4480, "commit": "new"'; echo ","
  pt k3 stock replicated 1 1 20000 '"hbm_gbps": 4480, "commit": "new"'; echo ","
  pt k3 hybrid tp 8 1 25000 '"hbm_gbps": 4480, "commit": "new"'; echo ","
  pt k3 stock replicated 8 1 28000 '"hbm_gbps": 4480, "commit": "new"'
  echo "]"
} >"$tmp/new.json"

# 1. The default pairing: 30 / 20 = 1.50 (met), 30 / 25 = 1.20; stock 25 / 20 = 1.25 (met), 30 / 28 = 1.07.
"$sp" --base "$tmp/base.json" --new "$tmp/new.json" --json "$tmp/out.json" >"$tmp/log" 2>&1 || fail "default run"
grep -Fq "| K3 | 1 | 1 | 20.00 (2.10) | 30.00 (1.70) | **1.50** | 20.00 | 25.00 | **1.25** |" "$tmp/log" ||
  fail "B = 1 row"
grep -Fq "| K3 | 8 | 1 | 25.00 | 30.00 | **1.20** | 28.00 | 30.00 | **1.07** |" "$tmp/log" || fail "B = 8 row"
grep -Fq "hybrid: 1.20-1.50x faster; the 1.5x bar met at 1 of 2 points" "$tmp/log" || fail "hybrid summary"
grep -Fq "stock: 1.07-1.25x faster; the 1.25x bar met at 1 of 2 points" "$tmp/log" || fail "stock summary"
grep -Fq "(1 points on one side only, left out)" "$tmp/log" || fail "one-sided point"
! grep -q warning "$tmp/log" || fail "a warning for like runs"
python3 - "$tmp/out.json" <<'EOF' || fail "JSON records"
import json, sys
r = {(x["step"], x["requests"]): x for x in json.load(open(sys.argv[1]))}
assert len(r) == 4, r
h = r[("hybrid", 1)]
assert (h["base_us"], h["new_us"], h["new_runs"], h["met"]) == (30000, 20000, 2, True), h
assert r[("hybrid", 8)]["met"] is False and r[("stock", 1)]["met"] is True
EOF

# 2. The new build's seed hybrid step instead: 30 / 28.
"$sp" --base "$tmp/base.json" --new "$tmp/new.json" --hybrid-new replicated >"$tmp/log" 2>&1 || fail "replicated run"
grep -Fq "| K3 | 1 | 1 | 28.00 | 30.00 (1.70) | **1.07** |" "$tmp/log" || fail "replicated row"

# 3. One file of several commits, split by commit: the committed H100 comparison reproduces PERF.md's table
# ("Speedup over 483d708": K3 B = 1, q = 1 hybrid 1.68, stock 1.11; K3.1 B = 64, q = 4 hybrid 1.19, stock 1.07).
h100="$root/docs/perf/speedup_483d708_h100.json"
"$sp" --base "$h100" --base-commit 483d708 --new "$h100" --new-commit 18e38aa >"$tmp/log" 2>&1 || fail "H100 run"
grep -Eq "^\| K3 \| 1 \| 1 \| .* \| \*\*1\.68\*\* \| .* \| \*\*1\.11\*\* \|$" "$tmp/log" || fail "H100 K3 B = 1"
grep -Eq "^\| K3\.1 \| 64 \| 4 \| .* \| \*\*1\.19\*\* \| .* \| \*\*1\.07\*\* \|$" "$tmp/log" || fail "H100 K3.1 B = 64"
grep -Fq "the 1.5x bar met at 2 of 16 points" "$tmp/log" || fail "H100 hybrid bar"

# 4. Unlike runs are flagged: another GPU class, other layer copies.
sed 's/"hbm_gbps": 4480/"hbm_gbps": 3170, "layer_copies": 8/' "$tmp/new.json" >"$tmp/h100.json"
"$sp" --base "$tmp/base.json" --new "$tmp/h100.json" >"$tmp/log" 2>&1 || fail "unlike run"
grep -q "warning: HBM read bandwidth 4500 (base) vs 3170 GB/s" "$tmp/log" || fail "bandwidth warning"
sed 's/"hbm_gbps": 4500/"hbm_gbps": 4500, "layer_copies": 0/' "$tmp/base.json" >"$tmp/base0.json"
"$sp" --base "$tmp/base0.json" --new "$tmp/h100.json" >"$tmp/log" 2>&1 || fail "copies run"
grep -q "warning: layer_copies differs: base 0, new 8" "$tmp/log" || fail "copies warning"

# 5. Bad input: a missing file, a point without its median, no shared point, no point of the named commit.
expect() {  # expect STATUS MESSAGE ARGS...: the exit status and the message on stderr
  local want=$1 msg=$2
  shift 2
  set +e
  "$sp" "$@" >"$tmp/log" 2>&1
  local rc=$?
  set -e
  [ "$rc" -eq "$want" ] || fail "$* : exit status $rc, expected $want"
  grep -Fq "$msg" "$tmp/log" || fail "$* : no '$msg'"
}
expect 1 "base file $tmp/none.json" --base "$tmp/none.json" --new "$tmp/new.json"
echo '[{"variant": "k3", "step": "stock", "requests": 1, "q": 1}]' >"$tmp/nomedian.json"
expect 1 "point 0 has no median_us" --base "$tmp/nomedian.json" --new "$tmp/new.json"
echo '{"variant": "k3"}' >"$tmp/object.json"
expect 1 "expected a list of bench points" --base "$tmp/object.json" --new "$tmp/new.json"
echo "[$(pt k3.1 stock "" 1 1 25000)]" >"$tmp/other.json"
expect 2 "share no (variant, step, B, q) point" --base "$tmp/other.json" --new "$tmp/new.json"
expect 2 "no points of commit nope" --base "$tmp/base.json" --base-commit nope --new "$tmp/new.json"
echo "speedup: ok"
