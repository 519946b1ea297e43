// CPU reference of kda_prep (ops/kda_prep.h): the CPU ops composed in the order the layer runs them.
//
//   y_j = short_conv_silu(x_j), j = q, k, v;  q = l2norm(y_q) d^-1/2;  k = l2norm(y_k);  v = y_v;
//   g = kda_gate(u);  beta = sigmoid(b).
#include "ops/kda_prep.h"

#include <cmath>

#include "core/error.h"
#include "ops/kda.h"
#include "ops/short_conv.h"

namespace k3::ops {

void kda_prep(const float* const x[3], const float* u, const float* b, const KdaPrepWeights& w,
              float* const state[3], float* const y[3], float* g, float* beta, int64_t T, int H, int d, int K) {
  K3_CHECK(T >= 0 && H > 0 && d > 0 && K >= 1, "kda_prep: bad shape T {} H {} d {} K {}", T, H, d, K);
  const int64_t C = int64_t{H} * d;
  for (int j = 0; j < 3; ++j) short_conv_silu(x[j], w.conv[j], state[j], y[j], T, C, K);
  l2norm_heads(y[0], T, H, d, 1.0f / std::sqrt(static_cast<float>(d)));
  l2norm_heads(y[1], T, H, d, 1.0f);
  kda_gate(u, w.A_log, w.dt_bias, w.lower_bound, g, T, H, d);
  kda_beta(b, beta, T, H);
}

}  // namespace k3::ops
