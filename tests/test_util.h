// Helpers shared by the op tests: random inputs that cannot pass by accident.
#pragma once

#include <vector>

#include "core/bf16.h"
#include "core/rng.h"

namespace k3::testing {

// Round-to-nearest BF16: |bf16(x) - x| <= half an ulp <= 2^-8 |x|.
constexpr double kBf16Rel = 1.0 / 256.0;

// Random BF16-representable activations, normal with deviation sd, never zero.
inline std::vector<float> rand_act(Rng& rng, size_t n, double sd = 1.0) {
  std::vector<float> v(n);
  for (auto& x : v) {
    do {
      x = round_bf16(static_cast<float>(rng.normal() * sd));
    } while (x == 0.f);
  }
  return v;
}

// Random FP32 values, normal around `mean` with deviation sd, never zero.
inline std::vector<float> rand_f32(Rng& rng, size_t n, double sd, double mean = 0.0) {
  std::vector<float> v(n);
  for (auto& x : v) {
    do {
      x = static_cast<float>(mean + rng.normal() * sd);
    } while (x == 0.f);
  }
  return v;
}

// x rounded to BF16, as a double (the references apply the spec's roundings with it).
inline double bf(double x) { return static_cast<double>(round_bf16(static_cast<float>(x))); }

}  // namespace k3::testing
