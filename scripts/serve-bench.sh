#!/usr/bin/env bash
# The serving figures of docs/PERF.md ("Serving on the GPU"): `k3decode serve` under scripts/serve-load.py,
# greedy and sampled (temperature 0.8, top-p 1) at several concurrencies, then n-gram drafting against none on
# a repetitive workload (prompts repeating a passage; and 256-token greedy outputs, which cycle). Every server is stopped by SIGTERM and given 60 s to drain, then killed: the script
# never waits on a server without a bound.
#
# usage: scripts/serve-bench.sh K3DECODE OUT [--device gpu|cpu] [--preset small] [--concurrency "1 8 32 64"]
#                                             [--requests 64] [--max-tokens 64] [--seconds 240]
# --seconds bounds each load run (timeout). Writes OUT/serve_*.json and logs; exit 1 when a run failed or
# lost a request.
set -uo pipefail
k3=${1:?usage: serve-bench.sh K3DECODE OUT [options]}
out=${2:?usage: serve-bench.sh K3DECODE OUT [options]}
shift 2
device=gpu preset=small conc="1 8 32 64" requests=64 max_tokens=64 seconds=240
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device=$2; shift 2 ;;
    --preset) preset=$2; shift 2 ;;
    --concurrency) conc=$2; shift 2 ;;
    --requests) requests=$2; shift 2 ;;
    --max-tokens) max_tokens=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    *) echo "serve-bench: unknown argument $1" >&2; exit 2 ;;
  esac
done
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
status=0
pid=
stop() {  # SIGTERM, a bounded drain, then SIGKILL
  [ -n "$pid" ] || return 0
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 600); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then
    echo "serve-bench: the server did not drain in 60 s: killed" | tee -a "$out/serve_bench.log"
    kill -KILL "$pid" 2>/dev/null
    status=1
  fi
  wait "$pid" 2>/dev/null
  pid=
}
trap stop EXIT
start() {  # start NAME ARGS...: a server on a free port; sets url
  local name=$1
  shift
  "$k3" serve --device "$device" --preset "$preset" --port 0 "$@" >"$out/$name.out" 2>"$out/$name.log" </dev/null &
  pid=$!
  url=
  for _ in $(seq 600); do
    grep -q "listening on" "$out/$name.log" 2>/dev/null && break
    kill -0 "$pid" 2>/dev/null || { cat "$out/$name.log"; echo "serve-bench: $name exited"; pid=; return 1; }
    sleep 0.1
  done
  url=$(grep -o 'http://[0-9.]*:[0-9]*' "$out/$name.log" | head -1)
  [ -n "$url" ] || { echo "serve-bench: $name never listened"; stop; return 1; }
}
load() {  # load NAME ARGS...: one bounded serve-load run against $url
  local name=$1
  shift
  timeout "$seconds" python3 "$here/serve-load.py" --url "$url" "$@" --json "$out/$name.json" >"$out/$name.txt" 2>&1
  local rc=$?
  echo "$name: rc $rc" | tee -a "$out/serve_bench.log"
  [ $rc -eq 0 ] || status=1
}
vocab=$("$k3" inspect --preset "$preset" 2>/dev/null | grep -o 'vocab [0-9]*' | head -1 | cut -d' ' -f2)
vocab=${vocab:-1024}
# shellcheck disable=SC2086
if start serve_main --max-slots 64 --max-context 512; then
  load serve_greedy --concurrency $conc --requests "$requests" --max-tokens "$max_tokens" --prompt-len 32 --vocab "$vocab"
  load serve_sampled --concurrency $conc --requests "$requests" --max-tokens "$max_tokens" --prompt-len 32 \
    --vocab "$vocab" --temperature 0.8
  stop
else
  status=1
fi
for draft in 0 4; do
  if start "serve_draft$draft" --max-slots 64 --max-context 512 --draft "$draft"; then
    load "serve_repetitive_draft$draft" --concurrency 1 8 --requests 16 --max-tokens "$max_tokens" --prompt-len 32 \
      --vocab "$vocab" --repetitive
    # Long greedy outputs: a synthetic model's greedy continuation falls into cycles, so it repeats its own
    # context (the case prompt lookup is for) without a trained model.
    load "serve_long_draft$draft" --concurrency 1 8 --requests 16 --max-tokens 256 --prompt-len 32 \
      --vocab "$vocab" --repetitive
    stop
  else
    status=1
  fi
done
exit $status
