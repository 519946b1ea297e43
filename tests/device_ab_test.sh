#!/usr/bin/env bash
# scripts/device-ab.sh with stand-in k3decode binaries (no GPU): a knob's values and (VAR = BIN) two builds'
# folders run in turn, K3_AB_REPS times, each step mode and the ops section in their own processes; the
# summary gives each point's median per value and the change against the first; a bench flag's values go to
# the step bench as "--flag V" (no ops section); BIN refuses a folder
# without k3decode and folders whose names repeat (exit status 2) before anything runs.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; cat "$tmp/log" 2>/dev/null; exit 1; }
# stub DIR BASE [old]: a k3decode whose step points take BASE us (+ K3_X when set, + its --x flag, + 10 for
# --variant k3.1) and whose ops take BASE / 10, each call logged to $tmp/calls.txt as "DIR steps-or-ops";
# "old": its points have no "shared_experts", as a build from before that mode (483d708) writes them.
stub() {
  mkdir -p "$1"
  local shared='\"shared_experts\": \"tp\", '
  [ "${3:-}" = old ] && shared=""
  cat >"$1/k3decode" <<STUB
#!/usr/bin/env bash
st=ops json="" x=0 variant=k3 commit=none
while [ \$# -gt 0 ]; do
  case "\$1" in --steps) st=\$2; shift ;; --json) json=\$2; shift ;; --x) x=\$2; shift ;; --variant) variant=\$2; shift ;;
    --commit) commit=\$2; shift ;; esac
  shift
done
t=\$(( $2 + \${K3_X:-0} + x ))
[ "\$variant" = k3.1 ] && t=\$(( t + 10 ))
echo "$(basename "$1") \$st" >>"$tmp/calls.txt"
if [ "\$st" = ops ]; then
  echo "[{\"op\": \"moe_experts\", \"shape\": \"2 x 1\", \"us\": \$(( t / 10 ))}]" >"\$json"
else
  echo "[{\"commit\": \"\$commit\", \"variant\": \"\$variant\", \"step\": \"\$st\", $shared\"requests\": 1, \"q\": 1, \"median_us\": \$t}]" >"\$json"
fi
STUB
  chmod +x "$1/k3decode"
}
stub "$tmp/old" 1000
stub "$tmp/new" 900

# 1. Two builds, two repetitions, one step mode and the ops section.
K3_AB_REPS=2 K3_AB_STEPS=hybrid K3_AB_OPS=moe OUT="$tmp/out" K3_COMMIT=test \
  "$root/scripts/device-ab.sh" BIN "$tmp/old $tmp/new" --batches 1 --q 1 >"$tmp/log" 2>&1 || fail "BIN run failed"
printf 'old ops\nnew ops\nold hybrid\nnew hybrid\nold hybrid\nnew hybrid\n' | diff - "$tmp/calls.txt" >/dev/null ||
  fail "BIN calls: $(cat "$tmp/calls.txt")"
grep -Eq "hybrid +tp +1 +1 +1000.0 +900.0 +-10.0%" "$tmp/out/summary.txt" || fail "BIN step summary: $(cat "$tmp/out/summary.txt")"
grep -Eq "moe_experts +2 x 1 +100.0 +90.0 +-10.0%" "$tmp/out/summary.txt" || fail "BIN ops summary: $(cat "$tmp/out/summary.txt")"
[ -f "$tmp/out/all.tgz" ] || fail "no archive"

# 2. A knob's values over one binary (K3_BIN), in the environment of each process.
rm -rf "$tmp/calls.txt" "$tmp/out"
K3_BIN="$tmp/old" K3_AB_STEPS=hybrid OUT="$tmp/out" K3_COMMIT=test \
  "$root/scripts/device-ab.sh" K3_X "0 100" --batches 1 --q 1 >"$tmp/log" 2>&1 || fail "knob run failed"
grep -Eq "hybrid +tp +1 +1 +1000.0 +1100.0 +\+10.0%" "$tmp/out/summary.txt" || fail "knob summary: $(cat "$tmp/out/summary.txt")"

# 3. A bench flag's values, given to the step bench after its args; K3_AB_OPS has no section to run for a flag.
rm -rf "$tmp/calls.txt" "$tmp/out"
K3_BIN="$tmp/old" K3_AB_STEPS=hybrid K3_AB_OPS=moe OUT="$tmp/out" K3_COMMIT=test \
  "$root/scripts/device-ab.sh" --x "0 50" --batches 1 --q 1 >"$tmp/log" 2>&1 || fail "flag run failed"
printf 'old hybrid\nold hybrid\n' | diff - "$tmp/calls.txt" >/dev/null || fail "flag calls: $(cat "$tmp/calls.txt")"
grep -Eq "hybrid +tp +1 +1 +1000.0 +1050.0 +\+5.0%" "$tmp/out/summary.txt" || fail "flag summary: $(cat "$tmp/out/summary.txt")"

# 4. Two variants, each in its own processes and summary rows; a build whose points have no "shared_experts"
# (the issue's baseline, 483d708) is summarized with "-" there.
rm -rf "$tmp/calls.txt" "$tmp/out"
stub "$tmp/base" 1200 old
K3_AB_VARIANTS="k3 k3.1" K3_AB_STEPS=hybrid OUT="$tmp/out" K3_COMMIT=test \
  "$root/scripts/device-ab.sh" BIN "$tmp/base $tmp/new" --batches 1 --q 1 >"$tmp/log" 2>&1 || fail "variants run failed"
printf 'base hybrid\nbase hybrid\nnew hybrid\nnew hybrid\n' | diff - "$tmp/calls.txt" >/dev/null ||
  fail "variants calls: $(cat "$tmp/calls.txt")"
grep -Eq "k3 +hybrid +- +1 +1 +1200.0 +- +-" "$tmp/out/summary.txt" || fail "old build's row: $(cat "$tmp/out/summary.txt")"
grep -Eq "k3.1 +hybrid +tp +1 +1 +- +910.0 +-" "$tmp/out/summary.txt" || fail "k3.1 row: $(cat "$tmp/out/summary.txt")"
[ "$(tar tzf "$tmp/out/all.tgz" | grep -c 'ab_k3\(\.1\)\?_hybrid_.*_r1.json')" -eq 4 ] || fail "variants' JSON: $(tar tzf "$tmp/out/all.tgz")"
# Each build's JSON names it by its folder, and scripts/speedup.py pairs them (base 1200 / new 900 at K3).
tar xzf "$tmp/out/all.tgz" -C "$tmp/out"
grep -q '"commit": "base"' "$tmp/out/logs/ab_k3_hybrid_base_r1.json" || fail "base commit: $(cat "$tmp/out/logs/ab_k3_hybrid_base_r1.json")"
"$root/scripts/speedup.py" --hybrid-new tp --hybrid-base replicated --base "$tmp"/out/logs/ab_*_base_r1.json \
  --new "$tmp"/out/logs/ab_*_new_r1.json >"$tmp/log" 2>&1 || fail "speedup over the A/B's JSON"
grep -Fq "| K3 | 1 | 1 | 0.90 | 1.20 | **1.33** | - | - | - |" "$tmp/log" || fail "speedup row: $(cat "$tmp/log")"

# 5. Refused before anything runs: a folder without k3decode, two folders of one name.
rm -f "$tmp/calls.txt"
mkdir -p "$tmp/empty" "$tmp/a/new"
stub "$tmp/a/new" 800
for vals in "$tmp/old $tmp/empty" "$tmp/new $tmp/a/new"; do
  set +e
  OUT="$tmp/out2" "$root/scripts/device-ab.sh" BIN "$vals" >"$tmp/log" 2>&1
  rc=$?
  set -e
  [ "$rc" -eq 2 ] || fail "BIN \"$vals\": exit status $rc, expected 2"
done
[ ! -e "$tmp/calls.txt" ] || fail "a refused A/B still ran: $(cat "$tmp/calls.txt")"
echo "device-ab: ok"
