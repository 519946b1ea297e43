// CPU reference of the rank-order sums (ops/reduce.h).
#include "ops/reduce.h"

namespace k3::ops {

void reduce_sum_f32(const float* const* parts, int n, float* out, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    float s = 0;
    for (int p = 0; p < n; ++p) s += parts[p][i];
    out[i] = s;
  }
}

void reduce_sum_bf16(const bf16* const* parts, int n, bf16* out, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    float s = 0;
    for (int p = 0; p < n; ++p) s += to_float(parts[p][i]);
    out[i] = to_bf16(s);
  }
}

}  // namespace k3::ops
