// MXFP4 (OCP microscaling FP4): two E2M1 values per byte, low nibble first;
// one E8M0 scale byte per 32 consecutive values along the input dimension.
// value = e2m1(nibble) * 2^(scale - 127).
// E2M1: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0:
// magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
#pragma once

#include <cmath>
#include <cstdint>

namespace k3 {

constexpr int kMxfp4Group = 32;

inline float e2m1_to_float(uint8_t nibble) {
  static constexpr float kMag[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  float m = kMag[nibble & 7];
  return (nibble & 8) ? -m : m;
}

inline float e8m0_to_float(uint8_t s) { return std::ldexp(1.0f, static_cast<int>(s) - 127); }

// Weight element (n, k) of a [N, K] MXFP4 matrix stored as packed [N, K/2] and scale [N, K/32].
inline float mxfp4_at(const uint8_t* packed, const uint8_t* scale, int64_t K, int64_t n, int64_t k) {
  uint8_t byte = packed[n * (K / 2) + k / 2];
  uint8_t nib = (k & 1) ? (byte >> 4) : (byte & 0xf);
  return e2m1_to_float(nib) * e8m0_to_float(scale[n * (K / kMxfp4Group) + k / kMxfp4Group]);
}

// Nearest E2M1 code of x (already divided by its group scale); ties to even code.
inline uint8_t float_to_e2m1(float x) {
  static constexpr float kMag[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  uint8_t sign = std::signbit(x) ? 8 : 0;
  float a = std::fabs(x);
  uint8_t best = 0;
  float err = INFINITY;
  for (uint8_t c = 0; c < 8; ++c) {
    float e = std::fabs(a - kMag[c]);
    if (e < err || (e == err && (c & 1) == 0)) {
      err = e;
      best = c;
    }
  }
  return static_cast<uint8_t>(sign | best);
}

}  // namespace k3
