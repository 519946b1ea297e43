#!/usr/bin/env bash
# A/B of one environment knob over the rank-slice step on one lent GPU, in one call of at most ~480 s: the
# binaries of $K3_BIN (carried) or a build, then for each value of VAR the step bench of each step mode in
# its own process (as scripts/gpu-test.sh), the values taken in turn K3_AB_REPS times (default 1), and
# (K3_AB_OPS=section) `bench --ops --ops-only section` once per value; a summary of the medians side by
# side, each value against the first.
#
# usage: scripts/device-ab.sh VAR "V1 V2 ..." [bench args]   e.g.
#   K3_BIN=out/bin K3_AB_OPS=linear scripts/device-ab.sh K3_LINEAR_ROWS_MAX "1 4 8" --batches 1 8 --q 1 4
# bench args default to `--batches 1 8 64 --q 1 4`; K3_AB_STEPS (default "stock hybrid") the step modes,
# K3_AB_VARIANTS (default k3) the models, each in its own processes. Every step runs under `timeout`
# (scripts/device-lib.sh), so the
# script ends by K3_DEADLINE_S; a bench cut by its timeout keeps the points it wrote. Logs and JSON go to
# $OUT (default out/ab), then into $OUT/all.tgz; summary.txt and steps.txt stay beside it.
#
# VAR = BIN: an A/B of builds instead of a knob. The values are folders of carried binaries (each with its
# k3decode), run in turn with the environment as it is and labelled by their folder names (which must differ):
#   scripts/device-ab.sh BIN "out/bin-old out/bin-new" --batches 1 8 --q 1 4
#
# The issue's speedups: a baseline build (483d708's k3decode, carried) against this one, both variants,
# its hybrid step (the seed's) against this one's (TP-sharded shared experts) and stock against stock, then
# the table from the JSON in the archive's logs/ (labels: the folders' names):
#   K3_AB_VARIANTS="k3 k3.1" K3_AB_STEPS="hybrid stock" K3_DEADLINE_S=560 \
#     scripts/device-ab.sh BIN "out/bin-483d708 out/bin" --batches 1 8 32 64 --q 1 4
#   scripts/speedup.py --base logs/ab_*_bin-483d708_r*.json --new logs/ab_*_bin_r*.json
#
# VAR = --flag: an A/B of a bench flag, given to the step bench as "--flag V" (after the bench args; there
# is no ops section for a flag), e.g. the rank slice with and without layer weight copies:
#   K3_BIN=out/bin K3_AB_STEPS=hybrid scripts/device-ab.sh --layer-copies "0 2" --batches 1 8 --q 1 4
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
[ $# -ge 2 ] || { echo "usage: scripts/device-ab.sh VAR \"V1 V2 ...\" [bench args]" >&2; exit 2; }
var=$1
read -ra values <<<"$2"
shift 2
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--batches 1 8 64 --q 1 4)
# The values' labels (file names, the summary's columns): the values, or with BIN the folders' names.
labels=()
for v in "${values[@]}"; do
  if [ "$var" = BIN ]; then
    [ -x "$v/k3decode" ] || { echo "device-ab.sh BIN: no k3decode in '$v'" >&2; exit 2; }
    labels+=("$(basename "$v")")
  else
    labels+=("$v")
  fi
done
[ "$(printf '%s\n' "${labels[@]}" | sort -u | wc -l)" -eq ${#labels[@]} ] ||
  { echo "device-ab.sh: the values' labels repeat (${labels[*]})" >&2; exit 2; }
name=ab
source scripts/device-lib.sh
[ -n "${K3_BIN:-}" ] && bin=$K3_BIN && export LD_LIBRARY_PATH="$bin:$LD_LIBRARY_PATH"
# k3 I: the k3decode command of value I in k3cmd: the knob set in its environment, or (BIN) value I's binary;
# k3flag: what the step bench of value I takes after its args (a flag VAR and its value, else nothing);
# k3commit: the build its JSON names (BIN: the folder's name, e.g. bin-483d708; else $commit).
k3() {
  k3flag=()
  k3commit=$commit
  if [ "$var" = BIN ]; then
    k3cmd=("${values[$1]}/k3decode")
    k3commit=${labels[$1]}
  elif [[ "$var" == --* ]]; then
    k3cmd=("$bin/k3decode")
    k3flag=("$var" "${values[$1]}")
  else
    k3cmd=(env "$var=${values[$1]}" "$bin/k3decode")
  fi
}
read -ra modes <<<"${K3_AB_STEPS:-stock hybrid}"
read -ra variants <<<"${K3_AB_VARIANTS:-k3}"

{
  echo "commit $commit, $var in ${values[*]}, ${args[*]}"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader
} 2>&1 | tee "$out/machine.txt"

[ -z "${K3_BIN:-}" ] && [ "$var" != BIN ] && step build 300 bash -c "cmake -S . -B $bin -G Ninja -DCMAKE_BUILD_TYPE=Release && \
  cmake --build $bin -j $(nproc) --target k3decode"

if [ -n "${K3_AB_OPS:-}" ] && [[ "$var" == --* ]]; then
  echo "device-ab.sh: K3_AB_OPS ignored: $var is a flag of the step bench" | tee -a "$out/machine.txt"
elif [ -n "${K3_AB_OPS:-}" ]; then
  for i in "${!values[@]}"; do
    v=${labels[$i]}
    k3 "$i"
    step "ops_$v" 90 "${k3cmd[@]}" bench --ops --ops-only "$K3_AB_OPS" --commit "$k3commit" \
      --json "$logs/ops_$v.json"
  done
fi
for rep in $(seq 1 "${K3_AB_REPS:-1}"); do
  for i in "${!values[@]}"; do
    v=${labels[$i]}
    k3 "$i"
    for variant in "${variants[@]}"; do
      for m in "${modes[@]}"; do
        step "bench_${variant}_${m}_${v}_r$rep" 150 "${k3cmd[@]}" bench --preset k3-rank-slice \
          --variant "$variant" --tp 8 --dp 4 --rank 0 --context 8192 "${args[@]}" "${k3flag[@]}" --iters 50 \
          --steps "$m" --commit "$k3commit" --json "$logs/ab_${variant}_${m}_${v}_r$rep.json"
      done
    done
  done
done

python3 - "$logs" "${labels[@]}" >"$out/summary.txt" 2>&1 <<'EOF' || status=1
import glob, json, os, re, statistics, sys

d, values = sys.argv[1], sys.argv[2:]


def load(p):
    try:
        with open(p) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def cell(x):
    return f"{x:9.1f}" if x is not None else f"{'-':>9}"


print(f"step: median_us (the median over the runs of each value), each value against {values[0]}")
pts = {}
for p in glob.glob(os.path.join(d, "ab_*_r*.json")):
    v = re.match(r"ab_.+_(.+)_r\d+\.json", os.path.basename(p)).group(1)
    for x in load(p) or []:
        # (A build from before the TP-sharded shared experts writes no "shared_experts": its hybrid is the seed's.)
        key = (x.get("variant", "-"), x["step"], x.get("shared_experts", "-"), x["requests"], x["q"])
        pts.setdefault(key, {}).setdefault(v, []).append(x["median_us"])
print(f"{'variant':>7} {'step':>7} {'shared':>10} {'B':>3} {'q':>2} " + " ".join(f"{v:>9}" for v in values)
      + " " + " ".join(f"{v + ' vs':>9}" for v in values[1:]))
for key in sorted(pts):
    m = {v: statistics.median(pts[key][v]) if pts[key].get(v) else None for v in values}
    base = m[values[0]]
    deltas = " ".join(f"{100 * (m[v] / base - 1):+8.1f}%" if base and m[v] else f"{'-':>9}" for v in values[1:])
    print(f"{key[0]:>7} {key[1]:>7} {key[2]:>10} {key[3]:>3} {key[4]:>2} " + " ".join(cell(m[v]) for v in values)
          + " " + deltas)

ops = {v: load(os.path.join(d, f"ops_{v}.json")) for v in values}
if any(ops.values()):
    print("\nops alone (bench --ops): us per call of the auto path, each value against the first")
    us = {v: {(x["op"], x["shape"]): x["us"] for x in (ops[v] or [])} for v in values}
    keys = list(dict.fromkeys(k for v in values for k in us[v]))
    for k in keys:
        base = us[values[0]].get(k)
        cells = " ".join(cell(us[v].get(k)) for v in values)
        deltas = " ".join(f"{100 * (us[v][k] / base - 1):+8.1f}%" if base and us[v].get(k) else f"{'-':>9}"
                          for v in values[1:])
        print(f"{k[0]:>14} {k[1]:>24} {cells} {deltas}")
EOF
cat "$out/summary.txt"
finish "$out/summary.txt"
