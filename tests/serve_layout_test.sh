#!/usr/bin/env bash
# `k3decode serve --tp 2 --dp 2` (ranks as threads behind runtime/layout_decoder.h) with python's stdlib as
# the client: concurrent greedy token-id completions (drafting on) equal `generate --tp 2 --dp 2`'s tokens; a
# token id outside the vocabulary gets a 400 and the server goes on serving; SIGTERM exits 0; `--comm mpi`
# is refused with a one-line error. Usage: serve_layout_test.sh K3DECODE WORKDIR
set -euo pipefail
k3=${1:?usage: serve_layout_test.sh K3DECODE WORKDIR}
work=${2:?usage: serve_layout_test.sh K3DECODE WORKDIR}
command -v python3 >/dev/null || { echo "serve_layout_test: python3 is not installed: SKIPPED"; exit 77; }
rm -rf "$work"
mkdir -p "$work"

# The refusal: one line, non-zero.
rc=0
"$k3" serve --tp 2 --comm mpi --port 0 >/dev/null 2>"$work/mpi.err" || rc=$?
[[ $rc != 0 && $(wc -l <"$work/mpi.err") == 1 ]] && grep -q "ranks as threads\|thread" "$work/mpi.err" ||
  { echo "serve_layout_test: --comm mpi: exit $rc, stderr: $(cat "$work/mpi.err")"; exit 1; }

prompts=(1,2,3 5,6,7,8,9,10,11,12,13 7 100,101,102,103,100,101,102,103,100,101 40,41,42,40,41,42,40 200,17,3,99,45)
args=()
for p in "${prompts[@]}"; do args+=(--prompt "$p"); done
"$k3" generate --tp 2 --dp 2 --max-new 12 --max-context 256 --json "${args[@]}" >"$work/want.json"

"$k3" serve --port 0 --tp 2 --dp 2 --max-slots 2 --max-context 256 --draft 3 >"$work/serve.out" 2>"$work/serve.log" \
  </dev/null &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 100); do
  grep -q "listening on" "$work/serve.log" && break
  kill -0 $pid 2>/dev/null || { cat "$work/serve.log"; echo "serve_layout_test: the server exited"; exit 1; }
  sleep 0.1
done
url=$(grep -o 'http://[0-9.]*:[0-9]*' "$work/serve.log" | head -1)
grep -q "layout tp 2 dp 2" "$work/serve.log" || { cat "$work/serve.log"; echo "serve_layout_test: no layout"; exit 1; }

python3 - "$url" "$work/want.json" "${prompts[@]}" <<'EOF'
import json, sys, threading, urllib.request, urllib.error
url, want_path, prompts = sys.argv[1], sys.argv[2], [[int(t) for t in p.split(",")] for p in sys.argv[3:]]
want = [r["tokens"] for r in json.load(open(want_path))["requests"]]
assert len(want) == len(prompts), (len(want), len(prompts))

def post(body):
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)

got = [None] * len(prompts)
def one(i):
    got[i] = post({"prompt": prompts[i], "max_tokens": 12, "temperature": 0})
threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
for t in threads: t.start()
status, err = post({"prompt": [1, 10**6], "max_tokens": 4, "temperature": 0})  # while the others run
for t in threads: t.join()
bad = 0
assert status == 400 and "error" in err, (status, err)
for i, (st, body) in enumerate(got):
    toks = body["choices"][0]["token_ids"] if st == 200 else body
    ok = st == 200 and toks == want[i]
    bad += not ok
    print(f"request {i}: {'ok' if ok else 'MISMATCH'} serve {toks} generate {want[i]}")
# After the refused request the server still serves.
st, body = post({"prompt": prompts[0], "max_tokens": 12, "temperature": 0})
assert st == 200 and body["choices"][0]["token_ids"] == want[0], (st, body)
sys.exit(1 if bad else 0)
EOF
kill -TERM $pid
rc=0
wait $pid || rc=$?
trap - EXIT
[[ $rc == 0 ]] || { cat "$work/serve.log"; echo "serve_layout_test: exit code $rc after SIGTERM"; exit 1; }
echo "serve_layout_test: PASSED"
