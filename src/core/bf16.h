// bfloat16 storage and rounding. Activations on the CPU path live in float
// arrays whose values are always bf16-representable at op boundaries
// (round_bf16 applied to every op output that the GPU path stores as BF16).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace k3 {

struct bf16 {
  uint16_t bits;
};
static_assert(sizeof(bf16) == 2);

inline float to_float(bf16 v) {
  uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even; NaN stays NaN (quiet), infinities stay infinite.
inline bf16 to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
    return bf16{static_cast<uint16_t>((u >> 16) | 0x0040u)};
  }
  uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;
  return bf16{static_cast<uint16_t>(u >> 16)};
}

inline float round_bf16(float f) { return to_float(to_bf16(f)); }

inline void round_bf16_inplace(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = round_bf16(x[i]);
}

}  // namespace k3
