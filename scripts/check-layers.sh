#!/usr/bin/env bash
# The layers look only down: core <- config <- io <- ops <- comm <- model <- runtime <- cli.
# Fails when a file includes a header from a layer above its own.
set -euo pipefail
cd "$(dirname "$0")/../src"
layers=(core config io ops comm model runtime bench cli)
bad=0
for i in "${!layers[@]}"; do
  for j in "${!layers[@]}"; do
    [ "$j" -le "$i" ] && continue
    hits=$(grep -rlE "#include \"${layers[$j]}/" "${layers[$i]}" 2>/dev/null || true)
    if [ -n "$hits" ]; then
      echo "layering: ${layers[$i]} includes from ${layers[$j]}: $hits" >&2
      bad=1
    fi
  done
done
exit $bad
