#!/usr/bin/env bash
# scripts/project-multi-gpu.py on the committed rank-slice JSON: a projected row per (variant, B, q, step
# mode), every projection >= its kernel part (collectives only add), a verdict per point, the copies it
# counts from the code equal to the trace's on the H200 (272c18a's tree) and H100 (the current tree) tables,
# and a record without the trace it needs is an error naming the key.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
k3="$root/docs/perf/rank_slice_k3.json"
k31="$root/docs/perf/rank_slice_k3.1.json"
python3 "$root/scripts/project-multi-gpu.py" --json "$tmp/p.json" "$k3" "$k31" >"$tmp/out.md"
grep -q "PROJECTION, not a measurement" "$tmp/out.md" || { echo "FAIL: the table is not marked a projection"; exit 1; }
python3 - "$tmp/p.json" "$k3" "$k31" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
recs = [r for f in sys.argv[2:] for r in json.load(open(f))]
mode = lambda r: "stock" if r["step"] == "stock" else ("hybrid-tp" if r.get("shared_experts") == "tp" else "hybrid")
want = sorted((r["variant"], r["requests"], r["q"], mode(r)) for r in recs)
got = sorted((x["variant"], x["B"], x["q"], x["mode"]) for x in p["rows"])
assert got == want, f"rows {len(got)} != records {len(want)}"
assert len(set(got)) == len(got) == 48, f"{len(got)} rows, expected 48 distinct (2 variants x 8 points x 3 modes)"
for x in p["rows"]:
    for t in ("nccl", "custom"):
        assert x[f"projected_{t}_ms"] >= x["kernel_ms"], f"{x} projected below its kernel part"
    assert 0 <= x["loopback_ms"] <= x["copies_traced_ms"] + 1e-9, f"{x}: loopback outside [0, traced copies]"
    assert x["kernel_ms"] <= x["measured_ms"]
    if x["copies_json"]:
        assert abs(x["copies"] - x["copies_json"]) <= 2, f"{x}: copies counted {x['copies']} vs traced {x['copies_json']}"
pts = {(v["variant"], v["B"], v["q"]) for v in p["points"]}
assert len(pts) == 16, f"{len(pts)} points"
for v in p["points"]:
    assert v["winner_nccl"] in ("stock", "hybrid", "hybrid-tp") and "auto_ok_nccl" in v
PY
# The H100 table (a tree after 453b43b and 519183b: the sliced dispatch, no combine copy): every record's
# copies counted from the code match the trace's.
python3 "$root/scripts/project-multi-gpu.py" --json "$tmp/h.json" "$root/docs/perf/rank_slice_h100.json" \
  >/dev/null 2>"$tmp/h_err.txt"
python3 - "$tmp/h.json" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
assert len(p["rows"]) == 48, f"{len(p['rows'])} rows"
for x in p["rows"]:
    assert x["copies_json"] and abs(x["copies"] - x["copies_json"]) <= 2, f"{x}: copies {x['copies']} vs {x['copies_json']}"
PY
! grep -q "warning" "$tmp/h_err.txt" || { echo "FAIL: $(cat "$tmp/h_err.txt")"; exit 1; }
rows=$(grep -cE "^\| [0-9]+ \| [0-9] \| [0-9]+ \| (stock|hybrid|hybrid-tp) \| [0-9.]+ \| [0-9.]+ \|" "$tmp/out.md")
[ "$rows" -eq 48 ] || { echo "FAIL: $rows table rows, expected 48"; exit 1; }
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); del d[3]['trace_busy_us']; json.dump(d, open(sys.argv[2],'w'))" \
  "$k3" "$tmp/bad.json"
if python3 "$root/scripts/project-multi-gpu.py" "$tmp/bad.json" >/dev/null 2>"$tmp/err.txt"; then
  echo "FAIL: a record without trace_busy_us was accepted"; exit 1
fi
grep -q "trace_busy_us" "$tmp/err.txt" || { echo "FAIL: the error does not name trace_busy_us"; exit 1; }
echo "project_multi_gpu: ok"
