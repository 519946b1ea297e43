#!/usr/bin/env bash
# `k3decode serve --tp 2 --dp 2` with python's stdlib as the client, its ranks as threads (runtime/layout_decoder.h)
# or, given MPIEXEC, as the processes of an mpirun job (--comm mpi, --dcp 2: rank 0 serves, the others follow its
# commands, runtime/rank_channel.h): concurrent greedy token-id completions (drafting on, more requests than
# slots) equal `generate`'s tokens on the same layout; a token id outside the vocabulary gets a 400 and the
# server goes on serving; SIGTERM (to rank 0) while a request runs drains it: the request completes and every
# process exits 0. A bad --comm or world size is refused with a clear error.
# Usage: serve_layout_test.sh K3DECODE WORKDIR [MPIEXEC]
set -euo pipefail
k3=${1:?usage: serve_layout_test.sh K3DECODE WORKDIR [MPIEXEC]}
work=${2:?usage: serve_layout_test.sh K3DECODE WORKDIR [MPIEXEC]}
mpiexec=${3:-}
command -v python3 >/dev/null || { echo "serve_layout_test: python3 is not installed: SKIPPED"; exit 77; }
rm -rf "$work"
mkdir -p "$work"

refused() {  # refused PATTERN CMD...: a non-zero exit with PATTERN on stderr
  local pattern=$1 rc=0
  shift
  "$@" >/dev/null 2>"$work/refused.err" </dev/null || rc=$?
  [[ $rc != 0 ]] && grep -q "$pattern" "$work/refused.err" ||
    { echo "serve_layout_test: $*: exit $rc, stderr: $(cat "$work/refused.err")"; exit 1; }
}
refused "expected local | mpi | nccl" "$k3" serve --tp 2 --comm ucx --port 0
refused "with --device gpu" "$k3" serve --tp 2 --comm nccl --port 0
layout=(--tp 2 --dp 2)
if [[ -n $mpiexec ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  layout=(--tp 2 --dp 2 --dcp 2)
  refused "3 processes for a world of 4" "$mpiexec" --oversubscribe -np 3 "$k3" serve --comm mpi "${layout[@]}" --port 0
fi

prompts=(1,2,3 5,6,7,8,9,10,11,12,13 7 100,101,102,103,100,101,102,103,100,101 40,41,42,40,41,42,40 200,17,3,99,45)
args=()
for p in "${prompts[@]}"; do args+=(--prompt "$p"); done
"$k3" generate "${layout[@]}" --max-new 12 --max-context 256 --json "${args[@]}" >"$work/want.json"

serve=("$k3" serve --port 0 "${layout[@]}" --max-slots 2 --max-context 256 --draft 3)
[[ -n $mpiexec ]] && serve=("$mpiexec" --oversubscribe -np 4 "${serve[@]}" --comm mpi)
"${serve[@]}" >"$work/serve.out" 2>"$work/serve.log" </dev/null &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 300); do
  grep -q "listening on" "$work/serve.log" && break
  kill -0 $pid 2>/dev/null || { cat "$work/serve.log"; echo "serve_layout_test: the server exited"; exit 1; }
  sleep 0.1
done
url=$(grep -o 'http://[0-9.]*:[0-9]*' "$work/serve.log" | head -1)
grep -q "layout tp 2 dp 2" "$work/serve.log" || { cat "$work/serve.log"; echo "serve_layout_test: no layout"; exit 1; }
server_pid=$(grep -o '(pid [0-9]*' "$work/serve.log" | head -1 | cut -d' ' -f2)  # rank 0's under mpirun

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

# SIGTERM while a long request runs: it completes (the drain), then the server (every process) exits 0.
python3 - "$url" "$server_pid" <<'EOF'
import json, os, signal, sys, threading, time, urllib.request
url, pid = sys.argv[1], int(sys.argv[2])
out = {}
def long():
    body = {"prompt": [4, 5, 6], "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        out["body"] = json.load(r)
t = threading.Thread(target=long)
t.start()
for _ in range(500):  # until the request runs
    with urllib.request.urlopen(url + "/health", timeout=30) as r:
        if json.load(r)["running"] > 0: break
    time.sleep(0.02)
os.kill(pid, signal.SIGTERM)
t.join()
n = len(out["body"]["choices"][0]["token_ids"])
assert n == 200, f"the request in flight was cut at {n} tokens by the shutdown"
print("SIGTERM: the request in flight completed (200 tokens)")
EOF
rc=0
wait $pid || rc=$?
trap - EXIT
[[ $rc == 0 ]] || { cat "$work/serve.log"; echo "serve_layout_test: exit code $rc after SIGTERM"; exit 1; }
grep -q "stopped" "$work/serve.log" || { cat "$work/serve.log"; echo "serve_layout_test: no clean stop"; exit 1; }
# Followers idle between requests without spinning a core (runtime/rank_channel.h: broadcast_idle): a server of
# two processes that MPI tells never to yield (a blocking wait then spins at 100%), idle for 2 s: its follower
# under 40% of a core; then it serves a request and stops cleanly.
if [[ -n $mpiexec ]]; then
  "$mpiexec" --mca mpi_yield_when_idle 0 -np 2 "$k3" serve --port 0 --tp 2 --max-context 64 --comm mpi \
    >"$work/idle.out" 2>"$work/idle.log" </dev/null &
  pid=$!
  trap 'kill $pid 2>/dev/null || true' EXIT
  for _ in $(seq 300); do grep -q "listening on" "$work/idle.log" && break; sleep 0.1; done
  server_pid=$(grep -o '(pid [0-9]*' "$work/idle.log" | head -1 | cut -d' ' -f2)
  url=$(grep -o 'http://[0-9.]*:[0-9]*' "$work/idle.log" | head -1)
  follower=""  # mpirun's other child (read from /proc: no procps needed)
  for d in /proc/[0-9]*; do
    [[ $(awk '{print $4}' "$d/stat" 2>/dev/null) == "$pid" && ${d#/proc/} != "$server_pid" ]] && follower+="${d#/proc/}"$'\n'
  done
  follower=${follower%$'\n'}
  [[ $(echo "$follower" | grep -c .) == 1 ]] || { cat "$work/idle.log"; echo "serve_layout_test: follower '$follower'"; exit 1; }
  sleep 1
  t0=$(awk '{print $14 + $15}' "/proc/$follower/stat")
  sleep 2
  t1=$(awk '{print $14 + $15}' "/proc/$follower/stat")
  pct=$(( 100 * (t1 - t0) / $(getconf CLK_TCK) / 2 ))
  echo "idle follower: ${pct}% of a core"
  [[ $pct -lt 40 ]] || { echo "serve_layout_test: the follower spins while the server is idle"; exit 1; }
  python3 - "$url" <<'EOF'
import json, sys, urllib.request
req = urllib.request.Request(sys.argv[1] + "/v1/completions", json.dumps({"prompt": [1, 2, 3], "max_tokens": 4}).encode(),
                             {"content-type": "application/json"})
with urllib.request.urlopen(req, timeout=60) as r:
    assert len(json.load(r)["choices"][0]["token_ids"]) >= 1
EOF
  kill -TERM "$server_pid"
  rc=0
  wait $pid || rc=$?
  trap - EXIT
  [[ $rc == 0 ]] || { cat "$work/idle.log"; echo "serve_layout_test: exit code $rc after SIGTERM (idle server)"; exit 1; }
fi
echo "serve_layout_test: PASSED${mpiexec:+ (mpirun)}"
