// Errors: one exception type for every user-facing failure, with a one-line
// message naming the input at fault ("tensor X: shape [a, b] expected [c, d]").
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace k3 {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

template <typename... Args>
[[noreturn]] inline void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace k3

// Host-side contract check at a boundary: throws k3::Error with a formatted message.
#define K3_CHECK(cond, ...)                  \
  do {                                       \
    if (!(cond)) ::k3::fail(__VA_ARGS__);    \
  } while (0)
