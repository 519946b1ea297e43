#include "core/env.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>

namespace k3 {

int64_t env_int(const char* name, int64_t lo, int64_t hi, int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr) return fallback;
  char* end = nullptr;
  errno = 0;
  const long long n = std::strtoll(v, &end, 10);
  if (end != v && *end == '\0' && errno == 0 && n >= lo && n <= hi) return n;
  fmt::print(stderr, "k3decode: ignoring {}=\"{}\": expected an integer in [{}, {}]; using {}\n", name, v, lo, hi,
             fallback);
  return fallback;
}

}  // namespace k3
