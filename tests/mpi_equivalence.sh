#!/usr/bin/env bash
# The mpi backend end to end through the CLI: `mpirun -np N k3decode generate
# --comm mpi --tp G --dp P --dcp C` against the single rank (`--comm local`,
# tp 1), on both tiny variants, both forced steps and auto.
#
# Usage: mpi_equivalence.sh MPIEXEC PATH/TO/k3decode NP TP DP DCP
#
# Per variant and step, with --dump-logits (request 0: its prompt positions,
# then every generated token fed back) and --json:
#   1. mpi vs single rank: the logits of the 12 prompt positions and of every
#      later position whose input tokens agree, by the single-request form of
#      the tolerance rule of tests/test_parallel.cpp (per row r = max |diff| /
#      (max - min of the reference row): median <= 0.01, worst <= 0.03 (K3) /
#      0.15 (K3.1); the tiny preset has no router near-ties, the K3.1 worst
#      rows are DSA top-k near-ties that flip under BF16 summation-order noise
#      and carry into the request's later rows (test_parallel measured worst
#      0.0148 / 0.0883 over its layouts);
#      the first generated token of every request is the same (later ones may
#      diverge; the count is printed).
#   2. mpi vs the local backend on the same layout (ranks as threads): both
#      reduce in rank order with FP32 accumulation, so the logits and tokens
#      are bitwise identical.
#   3. control: the same rule against another model (--model-seed 1) must fail.
set -euo pipefail

MPIEXEC=${1:?usage: mpi_equivalence.sh MPIEXEC K3DECODE NP TP DP DCP}
BIN=${2:?usage: mpi_equivalence.sh MPIEXEC K3DECODE NP TP DP DCP}
NP=${3:?}
TP=${4:?}
DP=${5:?}
DCP=${6:?}
[[ -x "$BIN" ]] || { echo "mpi_equivalence: $BIN is not an executable" >&2; exit 1; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
TMP=$(mktemp -d "${TMPDIR:-/tmp}/k3_mpi_equivalence.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

TIMEOUT=()
command -v timeout >/dev/null && TIMEOUT=(timeout 120)

# A 12-token prompt for request 0 (the dumped one); with --dp > 1 more requests
# so that every replica has work (request i is served by replica i mod dp).
PROMPTS=(--prompt 5,17,200,3,99,41,7,250,12,60,61,62 --prompt 1,2,3,4,5 --prompt 90,80,70 --prompt 33)
MAX_NEW=6
COMMON=(generate "${PROMPTS[@]}" --max-new "$MAX_NEW" --ignore-eos --json)
LAYOUT=(--tp "$TP" --dp "$DP" --dcp "$DCP")

run() {  # NAME CMD...: must succeed
  local name=$1; shift
  echo "+ $*"
  if ! "$@" >"$TMP/$name.json" 2>"$TMP/$name.err"; then
    echo "mpi_equivalence: FAIL: $name exited non-zero:" >&2
    cat "$TMP/$name.err" >&2
    exit 1
  fi
}

CASES=()
for variant in k3 k3.1; do
  for step in auto stock hybrid; do
    tag=${variant}_${step}
    MODEL=(--variant "$variant" --step "$step")
    run "single_$tag" "$BIN" "${COMMON[@]}" "${MODEL[@]}" --comm local --dump-logits "$TMP/single_$tag.safetensors"
    run "mpi_$tag" "${TIMEOUT[@]}" "$MPIEXEC" --allow-run-as-root --oversubscribe -np "$NP" \
      "$BIN" "${COMMON[@]}" "${MODEL[@]}" --comm mpi "${LAYOUT[@]}" --dump-logits "$TMP/mpi_$tag.safetensors"
    run "local_$tag" "$BIN" "${COMMON[@]}" "${MODEL[@]}" --comm local "${LAYOUT[@]}" \
      --dump-logits "$TMP/local_$tag.safetensors"
    CASES+=("$tag")
  done
  # The control: another model through the single rank.
  run "other_$variant" "$BIN" "${COMMON[@]}" --variant "$variant" --model-seed 1 --comm local \
    --dump-logits "$TMP/other_$variant.safetensors"
done

python3 - "$TMP" "np$NP tp$TP dp$DP dcp$DCP" "${CASES[@]}" <<'EOF'
import array, json, math, struct, sys

tmp, layout, cases = sys.argv[1], sys.argv[2], sys.argv[3:]
PROMPT_LEN = 12
errors = []

def load(path):
    """logits [rows, V] (F32) of a safetensors file: u64 LE header size, JSON header, data."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    t = header["logits"]
    assert t["dtype"] == "F32", t
    rows, vocab = t["shape"]
    begin, end = t["data_offsets"]
    data = array.array("f")
    data.frombytes(blob[8 + n + begin:8 + n + end])
    if sys.byteorder != "little":
        data.byteswap()
    assert len(data) == rows * vocab, (path, len(data), rows, vocab)
    return rows, vocab, data

def tokens(name):
    with open(f"{tmp}/{name}.json") as f:
        j = json.load(f)
    return [r["tokens"] for r in j["requests"]]

def ratios(want, got, vocab, rows):
    out = []
    for r in range(rows):
        a = want[r * vocab:(r + 1) * vocab]
        b = got[r * vocab:(r + 1) * vocab]
        spread = max(a) - min(a)
        diff = max(abs(x - y) for x, y in zip(a, b))
        out.append(diff / spread if spread > 0 else (0.0 if diff == 0 else float("inf")))
    return out

def rule(rs, variant):
    s = sorted(rs)
    q = lambda f: s[math.ceil(f * (len(s) - 1))]
    stats = dict(median=q(0.5), p80=q(0.8), mean=sum(s) / len(s), worst=s[-1])
    ok = stats["median"] <= 0.01 and stats["worst"] <= (0.15 if variant == "k3.1" else 0.03)
    return ok, stats

def fmt(stats):
    return "  ".join(f"{k} {v:.4f}" for k, v in stats.items())

for case in cases:
    variant = case.split("_")[0]
    rows_s, V, single = load(f"{tmp}/single_{case}.safetensors")
    rows_m, V2, mpi = load(f"{tmp}/mpi_{case}.safetensors")
    rows_l, V3, local = load(f"{tmp}/local_{case}.safetensors")
    if not (rows_s == rows_m == rows_l and V == V2 == V3):
        errors.append(f"{case}: logits shapes single [{rows_s}, {V}] mpi [{rows_m}, {V2}] local [{rows_l}, {V3}]")
        continue
    t_single, t_mpi, t_local = tokens(f"single_{case}"), tokens(f"mpi_{case}"), tokens(f"local_{case}")
    # 1. mpi vs single rank.
    agree = 0
    while agree < len(t_mpi[0]) and agree < len(t_single[0]) and t_mpi[0][agree] == t_single[0][agree]:
        agree += 1
    cmp_rows = min(rows_s, PROMPT_LEN + agree)  # rows whose inputs are the same tokens
    ok, stats = rule(ratios(single, mpi, V, cmp_rows), variant)
    firsts = [(i, a[0], b[0]) for i, (a, b) in enumerate(zip(t_single, t_mpi)) if a[:1] != b[:1]]
    same = sum(x == y for a, b in zip(t_single, t_mpi) for x, y in zip(a, b))
    total = sum(len(a) for a in t_single)
    print(f"{layout} {case:12s} mpi vs single rank: {cmp_rows} rows  {fmt(stats)}  tokens agreeing {same}/{total}")
    if not ok:
        errors.append(f"{case}: mpi logits outside the tolerance rule ({fmt(stats)})")
    if firsts:
        errors.append(f"{case}: first generated token differs (request, single, mpi): {firsts}")
    if len(t_mpi) != len(t_single):
        errors.append(f"{case}: {len(t_mpi)} requests from mpi, {len(t_single)} from the single rank")
    # 2. mpi vs local threads on the same layout: bitwise.
    if mpi.tobytes() != local.tobytes():
        errors.append(f"{case}: mpi and local logits differ on the same layout (expected bitwise equal)")
    if t_mpi != t_local:
        errors.append(f"{case}: mpi tokens {t_mpi} != local tokens {t_local} on the same layout")
    # 3. control: another model fails the rule.
    if case.endswith("_auto"):
        rows_o, V4, other = load(f"{tmp}/other_{variant}.safetensors")
        ok_o, stats_o = rule(ratios(other, mpi, V, min(PROMPT_LEN, rows_o)), variant)
        print(f"{layout} {case:12s} control (model seed 1): {fmt(stats_o)}")
        if ok_o:
            errors.append(f"{case}: the rule did not report a different model ({fmt(stats_o)})")

for e in errors:
    print("mpi_equivalence: FAIL:", e, file=sys.stderr)
if errors:
    sys.exit(1)
print(f"mpi_equivalence: {layout}: ok ({len(cases)} cases)")
EOF
