#!/usr/bin/env bash
# Builds k3decode and runs every test (ctest). GPU tests, when present, are
# labelled `gpu` and reported as skipped on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/check-layers.sh
scripts/build.sh "$@"
# The tokenizer tests compare against tiktoken from npm (tests/node), the serve
# test drives the server with the openai npm client: fetched when npm is here;
# without it those tests report SKIPPED.
if command -v npm >/dev/null && { [[ ! -f tests/node/node_modules/tiktoken/package.json ]] ||
                                  [[ ! -f tests/node/node_modules/openai/package.json ]]; }; then
  npm ci --prefix tests/node --no-audit --no-fund >/dev/null ||
    echo "test.sh: npm ci in tests/node failed: the tokenizer and serve tests will be skipped" >&2
fi
ctest --test-dir "${K3_BUILD_DIR:-build}" --output-on-failure -j "$(nproc)"
