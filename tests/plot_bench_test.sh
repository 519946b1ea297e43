#!/usr/bin/env bash
# scripts/plot-bench.py on a recorded bench JSON: one panel per q, and a point per (step, rows) plus the
# floor's points, counted in the SVG against the records; a record without a needed key is an error.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
json="$root/docs/perf/rank_slice_k3.json"
python3 "$root/scripts/plot-bench.py" "$tmp/out.svg" "$json" | grep -q "24 records, 2 panels" || { echo "FAIL: summary"; exit 1; }
# 24 records (stock, hybrid, hybrid with TP-sharded shared experts x 4 row counts x 2 q) + one point per
# (q, rows) of each floor (replicated, tp) = 16.
points=$(grep -c "<circle" "$tmp/out.svg")
[ "$points" -eq 40 ] || { echo "FAIL: $points points, expected 40"; exit 1; }
lines=$(grep -c "<polyline" "$tmp/out.svg")
[ "$lines" -eq 10 ] || { echo "FAIL: $lines lines, expected 10 (stock, hybrid, hybrid-tp and two floors per panel)"; exit 1; }
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); del d[0]['floor_us']; json.dump(d, open(sys.argv[2],'w'))" \
  "$json" "$tmp/bad.json"
if python3 "$root/scripts/plot-bench.py" "$tmp/bad.svg" "$tmp/bad.json" 2>"$tmp/err.txt"; then
  echo "FAIL: a record without floor_us was accepted"; exit 1
fi
grep -q "floor_us" "$tmp/err.txt" || { echo "FAIL: the error does not name floor_us"; exit 1; }
echo "plot_bench: ok"
