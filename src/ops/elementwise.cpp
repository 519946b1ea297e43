// CPU reference of the elementwise ops (ops/elementwise.h).
#include "ops/elementwise.h"

#include <cmath>

namespace k3::ops {

void gate_sigmoid(const float* o, const float* gate, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = round_bf16(o[i] * (1.0f / (1.0f + std::exp(-gate[i]))));
}

}  // namespace k3::ops
