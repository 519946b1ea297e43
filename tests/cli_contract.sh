#!/usr/bin/env bash
# The k3decode command-line contract, end to end through the binary.
# Usage: cli_contract.sh PATH/TO/k3decode
#
# The commands run first (bash: exit codes, one-line errors); the JSON and
# safetensors outputs they leave are then checked by one python3 run (python
# starts slowly, so it runs once) against a list of checks.
set -euo pipefail

BIN=${1:?usage: cli_contract.sh PATH/TO/k3decode}
[[ -x "$BIN" ]] || { echo "cli_contract: $BIN is not an executable" >&2; exit 1; }
BIN=$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN")
TMP=$(mktemp -d "${TMPDIR:-/tmp}/k3_cli_contract.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

CHECKS=$TMP/checks.txt  # one check per line, for the python pass at the end
: >"$CHECKS"
errors=0
fail() { echo "cli_contract: FAIL: $*" >&2; exit 1; }
run() {  # NAME OUTFILE CMD...: a command that must succeed
  local name=$1 out=$2; shift 2
  "$@" >"$out" 2>"$TMP/stderr.txt" || fail "$name: exit code $? ($(cat "$TMP/stderr.txt"))"
}
# An error: non-zero exit code and exactly one non-empty line on stderr.
expect_error() {  # NAME CMD...
  local name=$1; shift
  local rc=0
  "$@" >"$TMP/err.out" 2>"$TMP/err.txt" || rc=$?
  [[ $rc -ne 0 ]] || fail "$name: exit code 0 (stdout: $(cat "$TMP/err.out"))"
  local lines
  lines=$(wc -l <"$TMP/err.txt")
  [[ $lines -eq 1 ]] || fail "$name: expected a one-line message on stderr, got $lines lines: $(cat "$TMP/err.txt")"
  [[ -n $(tr -d '[:space:]' <"$TMP/err.txt") ]] || fail "$name: empty message"
  errors=$((errors + 1))
  echo "ok: $name (exit $rc): $(cat "$TMP/err.txt")"
}

# ---- generate --json: one object, "tokens" a list of 5 ints
run "generate --json" "$TMP/gen.json" "$BIN" generate --prompt 1,2,3 --max-new 5 --json
echo "tokens $TMP/gen.json 5" >>"$CHECKS"

# ---- the tiny preset's vocabulary, from a written config.json (not assumed)
run "make-model tiny k3" /dev/null "$BIN" make-model --preset tiny --variant k3 --seed 0 --out "$TMP/model-k3-0"
vocab=$(grep -o '"vocab_size": *[0-9]*' "$TMP/model-k3-0/config.json" | head -1 | grep -o '[0-9]*$')
[[ -n $vocab && $vocab -gt 0 ]] || fail "no vocab_size in $TMP/model-k3-0/config.json"

# ---- --dump-logits: exactly one tensor "logits" F32 [prompt + generated - 1, vocab], consistent with the tokens
run "--dump-logits --ignore-eos" "$TMP/d1.json" \
  "$BIN" generate --prompt 1,2,3 --max-new 5 --ignore-eos --json --dump-logits "$TMP/d1.safetensors"
echo "tokens $TMP/d1.json 5" >>"$CHECKS"
echo "logits $TMP/d1.safetensors $TMP/d1.json 3 7 $vocab" >>"$CHECKS"
run "--dump-logits" "$TMP/d2.json" "$BIN" generate --prompt 1,2,3 --max-new 5 --json --dump-logits "$TMP/d2.safetensors"
echo "logits $TMP/d2.safetensors $TMP/d2.json 3 auto $vocab" >>"$CHECKS"
run "--dump-logits, longer" "$TMP/d3.json" \
  "$BIN" generate --prompt 5,4,3,2,1,0,7 --max-new 9 --ignore-eos --json --dump-logits "$TMP/d3.safetensors"
echo "tokens $TMP/d3.json 9" >>"$CHECKS"
echo "logits $TMP/d3.safetensors $TMP/d3.json 7 15 $vocab" >>"$CHECKS"

# ---- make-model, then generate --model DIR equals the embedded model of the same preset / variant / seed
args=(generate --prompt 9,8,7,6,5 --max-new 8 --ignore-eos --json)
for variant in k3 k3.1; do
  for seed in 0 5; do
    dir="$TMP/model-$variant-$seed"
    run "make-model $variant $seed" /dev/null "$BIN" make-model --preset tiny --variant "$variant" --seed "$seed" --out "$dir"
    [[ -f $dir/config.json ]] || fail "make-model $variant: no config.json in $dir"
    run "generate --model ($variant, $seed)" "$TMP/disk-$variant-$seed.json" "$BIN" "${args[@]}" --model "$dir"
    run "generate embedded ($variant, $seed)" "$TMP/mem-$variant-$seed.json" \
      "$BIN" "${args[@]}" --preset tiny --variant "$variant" --model-seed "$seed"
    echo "tokens $TMP/disk-$variant-$seed.json 8" >>"$CHECKS"
    echo "same $TMP/disk-$variant-$seed.json $TMP/mem-$variant-$seed.json" >>"$CHECKS"
  done
done
# The comparison can fail: different seeds are different models.
echo "differ $TMP/model-k3-0/model.safetensors $TMP/model-k3-5/model.safetensors" >>"$CHECKS"
echo "differ $TMP/mem-k3-0.json $TMP/mem-k3-5.json" >>"$CHECKS"
# A sharded checkpoint (an index and several files) gives the same tokens.
run "make-model --shard-mb 0.3" /dev/null \
  "$BIN" make-model --preset tiny --variant k3.1 --seed 0 --shard-mb 0.3 --out "$TMP/sharded"
[[ -f $TMP/sharded/model.safetensors.index.json ]] || fail "make-model --shard-mb 0.3 wrote no index"
run "generate --model (sharded)" "$TMP/sharded.json" "$BIN" "${args[@]}" --model "$TMP/sharded"
echo "same $TMP/sharded.json $TMP/mem-k3.1-0.json" >>"$CHECKS"

# ---- errors: non-zero exit code, one line
expect_error "token id out of range" "$BIN" generate --prompt "1,$vocab,3" --max-new 2
expect_error "negative token id" "$BIN" generate --prompt 1,-4,3 --max-new 2
expect_error "malformed --prompt (letters)" "$BIN" generate --prompt 1,x,3 --max-new 2
expect_error "malformed --prompt (empty item)" "$BIN" generate --prompt 1,,3 --max-new 2
expect_error "malformed --prompt (trailing comma)" "$BIN" generate --prompt 1,2, --max-new 2
# Sampling parameters that are not numbers in range are refused (not silently greedy).
for bad in "--temperature nan" "--temperature inf" "--temperature -1" "--temperature 0.7 --top-p nan" \
           "--temperature 0.7 --top-p 0" "--temperature 0.7 --top-p 1.5" "--top-p inf"; do
  # shellcheck disable=SC2086
  expect_error "generate $bad" "$BIN" generate --prompt 1,2 --max-new 2 $bad
  rc=0; "$BIN" generate --prompt 1,2 --max-new 2 $bad >/dev/null 2>&1 || rc=$?
  [[ $rc -eq 1 ]] || fail "generate $bad: exit code $rc, expected 1"
  grep -qE 'temperature|top-p' "$TMP/err.txt" || fail "generate $bad: the message names no parameter: $(cat "$TMP/err.txt")"
done
expect_error "--step stock --shared-experts tp" "$BIN" generate --step stock --shared-experts tp --tp 2 --prompt 1,2 --max-new 2
grep -q -- "--shared-experts replicated" "$TMP/err.txt" || fail "stock + tp: the message names no fix: $(cat "$TMP/err.txt")"
expect_error "unknown --shared-experts" "$BIN" generate --shared-experts half --prompt 1,2 --max-new 2
expect_error "unknown --device" "$BIN" generate --device tpu --prompt 1,2 --max-new 2
expect_error "--device gpu --comm mpi" "$BIN" generate --device gpu --comm mpi --prompt 1,2 --max-new 2
expect_error "--comm nccl without --device gpu" "$BIN" generate --comm nccl --prompt 1,2 --max-new 2
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi >/dev/null 2>&1; then
  # No GPU here: a clear error (no CUDA device, or no CUDA backend in this build), never a crash.
  expect_error "--device gpu without a GPU" "$BIN" generate --device gpu --prompt 1,2 --max-new 2
fi
expect_error "--model on a nonexistent directory" "$BIN" generate --model "$TMP/no-such-dir" --max-new 2
if "$BIN" --help 2>&1 | grep -qE "^ +bench "; then  # CUDA builds: bench's arguments are refused before any GPU work
  expect_error "bench --layer-copies -1" "$BIN" bench --layer-copies -1
  expect_error "bench --layer-copies with --model" "$BIN" bench --model "$TMP/model-k3-0" --layer-copies 2
  expect_error "bench --layer-copies with --ops" "$BIN" bench --ops --layer-copies 2
  # Also where there is no GPU: the argument's message, not a CUDA error.
  expect_error "bench with a misspelt step" "$BIN" bench --steps stock hybird
  grep -q -- "--steps hybird: expected stock or hybrid" "$TMP/err.txt" || fail "bench --steps: $(cat "$TMP/err.txt")"
  expect_error "bench with a rank outside the deployment" "$BIN" bench --tp 8 --dp 4 --rank 32
  grep -q -- "--rank 32: expected 0..31" "$TMP/err.txt" || fail "bench --rank: $(cat "$TMP/err.txt")"
  expect_error "bench --ops-only without --ops" "$BIN" bench --ops-only moe
  grep -q -- "--ops-only moe needs --ops" "$TMP/err.txt" || fail "bench --ops-only: $(cat "$TMP/err.txt")"
fi
cp -r "$TMP/model-k3-0" "$TMP/truncated"
size=$(stat -c %s "$TMP/truncated/model.safetensors")
truncate -s $((size / 2)) "$TMP/truncated/model.safetensors"
expect_error "a truncated model.safetensors (half)" "$BIN" generate --model "$TMP/truncated" --max-new 2
cp -r "$TMP/model-k3-5" "$TMP/truncated2"
truncate -s $(($(stat -c %s "$TMP/truncated2/model.safetensors") - 1)) "$TMP/truncated2/model.safetensors"
expect_error "a truncated model.safetensors (one byte short)" "$BIN" generate --model "$TMP/truncated2" --max-new 2
truncate -s 5 "$TMP/truncated/model.safetensors"
expect_error "a truncated model.safetensors (5 bytes)" "$BIN" generate --model "$TMP/truncated" --max-new 2
expect_error "unknown preset" "$BIN" generate --preset huge --max-new 2
grep -q -- '--preset: unknown preset "huge"' "$TMP/err.txt" || fail "unknown preset: the message names neither the flag nor the value"
expect_error "unknown variant" "$BIN" generate --variant k4 --max-new 2
grep -q -- '--variant: unknown variant "k4"' "$TMP/err.txt" || fail "unknown variant: the message names neither the flag nor the value"
expect_error "make-model with an unknown preset" "$BIN" make-model --preset huge --out "$TMP/huge"
# serve: a port past 65535 (it would bind another port modulo 2^16 and print the one asked for).
expect_error "serve --port 70000" "$BIN" serve --port 70000
grep -q -- "--port 70000: expected 0 (any free port) to 65535" "$TMP/err.txt" || fail "serve --port: $(cat "$TMP/err.txt")"

# ---- the tokenizer: make-model --tokenizer writes one beside the checkpoint; generate --text uses it
run "make-model --tokenizer" /dev/null "$BIN" make-model --preset small --seed 0 --tokenizer --out "$TMP/small-tok"
[[ -f $TMP/small-tok/tiktoken.model && -f $TMP/small-tok/tokenizer_config.json ]] || fail "make-model --tokenizer wrote no tokenizer"
run "generate --text" "$TMP/text.json" "$BIN" generate --model "$TMP/small-tok" --text "Hello, world!" --max-new 3 --ignore-eos --json
grep -q '"text":' "$TMP/text.json" || fail "generate --text --json: no \"text\" key: $(cat "$TMP/text.json")"
echo "tokens $TMP/text.json 3" >>"$CHECKS"
expect_error "generate --text without a tokenizer" "$BIN" generate --text "Hello" --max-new 2
expect_error "generate --text on a model without a tokenizer" "$BIN" generate --model "$TMP/model-k3-0" --text "Hello" --max-new 2
expect_error "make-model --tokenizer on the tiny preset" "$BIN" make-model --preset tiny --tokenizer --out "$TMP/tiny-tok"

# ---- the outputs
python3 - "$CHECKS" <<'PY'
import json, struct, sys

def tokens_of(path, n=None):
    text = open(path).read()
    lines = [l for l in text.splitlines() if l.strip()]
    assert len(lines) == 1, f"{path}: expected one line of JSON, got {len(lines)}: {text!r}"
    obj = json.loads(lines[0])
    assert isinstance(obj, dict), f"{path}: not a JSON object: {obj!r}"
    toks = obj.get("tokens")
    assert isinstance(toks, list) and all(type(t) is int for t in toks), f"{path}: tokens is not a list of ints: {toks!r}"
    assert n is None or len(toks) == n, f"{path}: expected {n} tokens, got {len(toks)}: {toks}"
    return toks

def check_logits(path, json_path, plen, positions, vocab):
    toks = tokens_of(json_path)
    positions = plen + len(toks) - 1 if positions == "auto" else int(positions)
    assert positions == plen + len(toks) - 1, f"{path}: {positions} positions for {plen} + {len(toks)} tokens"
    data = open(path, "rb").read()
    assert len(data) >= 8, f"{path}: shorter than the 8-byte header length"
    (hlen,) = struct.unpack("<Q", data[:8])
    assert 8 + hlen <= len(data), f"{path}: header length {hlen} runs past the file ({len(data)} bytes)"
    header = json.loads(data[8:8 + hlen])
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    assert list(tensors) == ["logits"], f"{path}: expected exactly one tensor 'logits', got {list(tensors)}"
    t = tensors["logits"]
    assert t["dtype"] == "F32", f"{path}: dtype {t['dtype']}"
    assert t["shape"] == [positions, vocab], f"{path}: shape {t['shape']}, expected {[positions, vocab]}"
    begin, end = t["data_offsets"]
    assert end - begin == positions * vocab * 4, f"{path}: data_offsets {t['data_offsets']} do not hold [{positions}, {vocab}] F32"
    assert 8 + hlen + end == len(data), f"{path}: file size {len(data)} != 8 + {hlen} + {end}"
    body = data[8 + hlen + begin: 8 + hlen + end]
    rows = [struct.unpack_from(f"<{vocab}f", body, 4 * vocab * r) for r in range(positions)]
    assert all(x == x and abs(x) != float("inf") for r in rows for x in r), f"{path}: non-finite logit"
    # Greedy: generated token j is the argmax (lowest id on ties) of the row of position plen - 1 + j.
    for j, tok in enumerate(toks):
        row = rows[plen - 1 + j]
        best = max(range(vocab), key=lambda i: (row[i], -i))
        assert best == tok, f"{path}: argmax of row {plen - 1 + j} is {best}, but generated token {j} is {tok}"
    return f"logits F32 [{positions}, {vocab}], greedy tokens {toks} are the rows' argmax"

failures = 0
count = 0
for line in open(sys.argv[1]):
    kind, *a = line.split()
    count += 1
    try:
        if kind == "tokens":
            msg = f"{a[0]}: tokens {tokens_of(a[0], int(a[1]))}"
        elif kind == "logits":
            msg = f"{a[0]}: " + check_logits(a[0], a[1], int(a[2]), a[3], int(a[4]))
        elif kind == "same":
            x, y = tokens_of(a[0]), tokens_of(a[1])
            assert x == y, f"{a[0]} gives {x}, {a[1]} gives {y}"
            msg = f"{a[0]} == {a[1]}: {x}"
        elif kind == "differ":
            assert open(a[0], "rb").read() != open(a[1], "rb").read(), f"{a[0]} and {a[1]} are identical"
            msg = f"{a[0]} != {a[1]}"
        else:
            raise AssertionError(f"unknown check {kind}")
        print("ok:", msg)
    except Exception as e:
        failures += 1
        print(f"cli_contract: FAIL: {kind}: {e}", file=sys.stderr)
sys.exit(1 if failures or count == 0 else 0)
PY
echo "cli_contract: $errors error checks and $(wc -l <"$CHECKS") output checks passed"
