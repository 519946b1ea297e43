#!/usr/bin/env bash
# Installs the Debian packages k3decode needs, only those missing; extra package
# names may be given (.ci/run: nodejs npm, for the tokenizer's reference tests).
set -euo pipefail
pkgs=(cmake g++ ninja-build pkg-config libfmt-dev nlohmann-json3-dev libcli11-dev libgtest-dev python3 libopenmpi-dev openmpi-bin libpcre2-dev libcpp-httplib-dev "$@")
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}" >&2
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
