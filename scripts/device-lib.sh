# Sourced by the scripts/device-*.sh drivers of one lent-GPU call (bash): the setup they share and step().
# Before sourcing, the caller sets name (its default output folder out/$name). After: start, deadline
# (start + K3_DEADLINE_S, default 470 s), until (= deadline; a driver may move it earlier for a phase),
# out, logs, bin (build-gpu), commit (K3_COMMIT, else git's short hash), status (0; 1 once a step fails).
start=$(date +%s)
deadline=$((start + ${K3_DEADLINE_S:-470}))
until=$deadline
out="${OUT:-out/$name}"
logs="$out/logs"
mkdir -p "$logs"
: >"$out/steps.txt"
[ -f .deps/env.sh ] && source .deps/env.sh  # headers and libraries unpacked for a machine without them
export PATH="$PATH:/usr/local/cuda/bin"  # compute-sanitizer, nvcc
bin=build-gpu
export LD_LIBRARY_PATH="$bin:${LD_LIBRARY_PATH:-}"
# K3_COMMIT names the build when the device copy has no git history (as scripts/gpu-test.sh).
commit="${K3_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
status=0

# step NAME CAP CMD...: CMD under timeout, CAP seconds or what is left before $until less 15 s (the
# archive), its output in $logs/NAME.log, its exit status in steps.txt.
step() {
  local name=$1 cap=$2
  shift 2
  local left=$((until - $(date +%s) - 15))
  if [ "$left" -lt 10 ]; then
    echo "$name: skipped (no time left)" | tee -a "$out/steps.txt"
    status=1
    return
  fi
  [ "$cap" -gt "$left" ] && cap=$left
  local t0
  t0=$(date +%s)
  timeout -k 10 "$cap" "$@" >"$logs/$name.log" 2>&1
  local rc=$?
  local note=""
  { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && note=", timed out"
  echo "$name: rc=$rc ($(($(date +%s) - t0)) s of $cap$note)" | tee -a "$out/steps.txt"
  [ "$rc" -eq 0 ] || status=1
}

# finish: steps.txt (and the caller's extra files, as arguments) into $logs, $logs into $out/all.tgz (a lent
# machine returns only a few files), the copies outside the archive removed; exits with $status.
finish() {
  echo "status $status, $(($(date +%s) - start)) s" | tee -a "$out/steps.txt"
  cp "$out/steps.txt" "$out/machine.txt" "$@" "$logs/" 2>/dev/null
  if tar czf "$out/all.tgz" -C "$out" logs; then
    rm -rf "$logs" "$out/machine.txt"
  else
    status=1
  fi
  exit $status
}
