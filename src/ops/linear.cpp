// CPU reference of the BF16 linear layer, FP32 accumulation (ops/linear.h).
#include "ops/linear.h"

#include "core/error.h"

namespace k3::ops {
namespace {

// FP32 dot product of an activation row with a BF16 weight row, converting the
// weight as it is read. Sixteen independent accumulators let the compiler
// vectorize without reassociating (the summation order is fixed by this code).
inline float dot_bf16(const float* x, const bf16* w, int64_t n) {
  constexpr int kLanes = 16;
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] += x[i + j] * to_float(w[i + j]);
  }
  for (int j = 0; i < n; ++i, ++j) acc[j] += x[i] * to_float(w[i]);
  for (int s = kLanes / 2; s > 0; s /= 2) {
    for (int j = 0; j < s; ++j) acc[j] += acc[j + s];
  }
  return acc[0];
}

}  // namespace

void linear(const float* x, const bf16* w, float* y, int64_t rows, int64_t in, int64_t out, bool round_out) {
  K3_CHECK(rows >= 0 && in > 0 && out > 0, "linear: bad shape rows {} in {} out {}", rows, in, out);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * in;
    float* yr = y + r * out;
    for (int64_t o = 0; o < out; ++o) {
      const float v = dot_bf16(xr, w + o * in, in);
      yr[o] = round_out ? round_bf16(v) : v;
    }
  }
}

void linear_add(const float* x, const bf16* w, float* y, int64_t rows, int64_t in, int64_t out) {
  K3_CHECK(rows >= 0 && in > 0 && out > 0, "linear_add: bad shape rows {} in {} out {}", rows, in, out);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * in;
    float* yr = y + r * out;
    for (int64_t o = 0; o < out; ++o) yr[o] = round_bf16(dot_bf16(xr, w + o * in, in) + yr[o]);
  }
}

}  // namespace k3::ops
