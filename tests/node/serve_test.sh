#!/usr/bin/env bash
# `k3decode serve` against the official openai npm client (tests/node/serve_client.mjs):
# a small synthetic model with a tokenizer (text, chat, drafting on) and the
# embedded tiny model (ids only). Without node or the package the test reports
# SKIPPED (exit 77), or fails under K3_REQUIRE_NODE_TESTS=1 /
# K3_REQUIRE_TOKENIZER_REFERENCE=1 (CI).
set -euo pipefail
k3=${1:?usage: serve_test.sh K3DECODE WORKDIR}
work=${2:?usage: serve_test.sh K3DECODE WORKDIR}
here=$(cd "$(dirname "$0")" && pwd)
require=0
[[ ${K3_REQUIRE_NODE_TESTS:-0} == 1 || ${K3_REQUIRE_TOKENIZER_REFERENCE:-0} == 1 ]] && require=1
missing=""
command -v node >/dev/null || missing="node is not installed (apt-get install nodejs npm)"
[[ -z $missing && ! -f $here/node_modules/openai/package.json ]] &&
  missing="the npm package openai is not installed (npm ci --prefix tests/node)"
if [[ -n $missing ]]; then
  echo "serve_test: $missing"
  if [[ $require == 1 ]]; then echo "serve_test: FAILED (required in CI)"; exit 1; fi
  echo "serve_test: SKIPPED"
  exit 77
fi
rm -rf "$work"
mkdir -p "$work"
"$k3" make-model --preset small --tokenizer --seed 5 --out "$work/small"

cleanup() { for f in "$work"/*.pid; do if [[ -f $f ]]; then kill "$(cat "$f")" 2>/dev/null || true; fi; done; }
trap cleanup EXIT
start() {  # start LOG ARGS...: a server on a free port; its URL goes to LOG.url
  local log=$1
  shift
  "$k3" serve --port 0 "$@" >"$log.out" 2>"$log" </dev/null &
  echo $! >"$log.pid"
  for _ in $(seq 100); do
    grep -q "listening on" "$log" && break
    kill -0 "$(cat "$log.pid")" 2>/dev/null || { cat "$log"; echo "serve_test: the server exited"; exit 1; }
    sleep 0.1
  done
  grep -o 'http://[0-9.]*:[0-9]*' "$log" | head -1 >"$log.url"
}
start "$work/small.log" --model "$work/small" --max-slots 8 --max-queue 64 --draft 4
start "$work/tiny.log" --max-slots 4 --max-context 256 --kv-pages 40 --page-size 16 --max-queue 8
small_url=$(cat "$work/small.log.url")
tiny_url=$(cat "$work/tiny.log.url")
echo "small: $small_url  tiny: $tiny_url"
small_pid=$(cat "$work/small.log.pid")
tiny_pid=$(cat "$work/tiny.log.pid")
node "$here/serve_client.mjs" "$small_url" "$tiny_url" "$k3" "$work/small" "$small_pid"
# The client sent SIGTERM to the small server mid-stream: it drained and must exit 0.
rc=0
wait "$small_pid" || rc=$?
cat "$work/small.log"
echo "small server exit code $rc (expected 0)"
[[ $rc == 0 ]]
# SIGINT drains like SIGTERM (the small server got SIGTERM), here to a background job of a
# non-interactive shell.
kill -INT "$tiny_pid"
rc=0
for _ in $(seq 100); do kill -0 "$tiny_pid" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$tiny_pid" 2>/dev/null; then echo "serve_test: the tiny server ignored SIGINT"; kill -KILL "$tiny_pid"; fi
wait "$tiny_pid" || rc=$?
echo "tiny server exit code $rc (expected 0, after SIGINT)"
[[ $rc == 0 ]]
grep -q "stopped" "$work/small.log"
echo "serve_test: PASSED"
