// The engine's environment knobs (K3_PDL, K3_LINEAR_ROWS_MAX, K3_LINEAR_GROUP, K3_LINEAR_GROUP_ROWS_MAX,
// K3_LINEAR_TC_ROWS_MAX, K3_LINEAR_TC_WARPS, K3_LINEAR_GLU_TC, K3_LINEAR_PRELOAD, K3_MOE_WG, K3_MOE_TEAM,
// K3_MOE_SHARED_GROUP:
// A/B switches of the GPU kernels, docs/PERF.md), all read one way: an integer in [lo, hi], and where step > 1 one of lo, lo + step, ...
// Unset gives the fallback; a value that is not such an integer gives the fallback with one warning on
// stderr naming the variable, the value and what it takes, so that a mistyped A/B run does not silently
// measure the default. Callers read a knob once (a function-local static, or env_knob's slot when tests
// also set it) so a run sees one value throughout.
#pragma once

#include <atomic>
#include <cstdint>

namespace k3 {

int64_t env_int(const char* name, int64_t lo, int64_t hi, int64_t fallback, int64_t step = 1);

// A knob a test can also set: slot's value when it holds one (>= 0, set by the op's *_force function), else
// env_int(name, lo, hi, fallback) read now and kept in slot, so later calls see the same value. A force
// function storing -1 returns the knob to the environment (read again at the next call). lo >= 0.
int env_knob(std::atomic<int>& slot, const char* name, int lo, int hi, int fallback);

}  // namespace k3
