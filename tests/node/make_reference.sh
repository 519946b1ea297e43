#!/usr/bin/env bash
# Writes the tiktoken reference of tests/test_tokenizer.cpp into OUTDIR (the
# ctest fixture `tokenizer_reference`). Without node or the npm package it
# writes OUTDIR/UNAVAILABLE with the reason and succeeds: the tests then report
# SKIPPED, or FAILED under K3_REQUIRE_TOKENIZER_REFERENCE=1 (CI).
set -euo pipefail
out=${1:?usage: make_reference.sh OUTDIR}
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$out"
mkdir -p "$out"
if ! command -v node >/dev/null; then
  echo "node is not installed (apt-get install nodejs npm; npm install --prefix tests/node)" >"$out/UNAVAILABLE"
  exit 0
fi
if [[ ! -f $here/node_modules/tiktoken/package.json ]]; then
  echo "the npm package tiktoken is not installed (npm install --prefix tests/node)" >"$out/UNAVAILABLE"
  exit 0
fi
node "$here/reference.cjs" "$out"
