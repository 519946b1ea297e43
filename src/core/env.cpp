#include "core/env.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace k3 {

int64_t env_int(const char* name, int64_t lo, int64_t hi, int64_t fallback, int64_t step) {
  const char* v = std::getenv(name);
  if (v == nullptr) return fallback;
  char* end = nullptr;
  errno = 0;
  const long long n = std::strtoll(v, &end, 10);
  if (end != v && *end == '\0' && errno == 0 && n >= lo && n <= hi && (n - lo) % step == 0) return n;
  const std::string every = step > 1 ? fmt::format(" in steps of {} from {}", step, lo) : "";
  fmt::print(stderr, "k3decode: ignoring {}=\"{}\": expected an integer in [{}, {}]{}; using {}\n", name, v, lo, hi,
             every, fallback);
  return fallback;
}

int env_knob(std::atomic<int>& slot, const char* name, int lo, int hi, int fallback) {
  int v = slot.load(std::memory_order_relaxed);
  if (v < 0) {
    const int want = static_cast<int>(env_int(name, lo, hi, fallback));
    slot.compare_exchange_strong(v, want, std::memory_order_relaxed);
    v = slot.load(std::memory_order_relaxed);
  }
  return v;
}

}  // namespace k3
