// CPU reference for the MoE router (see router.h).
#include "ops/router.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/error.h"

namespace k3::ops {

void route(const float* logits, const float* bias, int64_t T, int E, int k, bool renormalize, float scale,
           int32_t* idx, float* w) {
  K3_CHECK(T >= 0 && E > 0 && k > 0 && k <= E, "route: bad sizes T={} E={} k={} (need 0 < k <= E)", T, E, k);
  std::vector<float> s(static_cast<size_t>(E));
  std::vector<float> biased(static_cast<size_t>(E));
  std::vector<int32_t> order(static_cast<size_t>(E));
  // (biased score descending, expert index ascending); a NaN score sorts as -inf so the order stays strict.
  auto key = [&biased](int32_t e) {
    const float v = biased[e];
    return std::isnan(v) ? -INFINITY : v;
  };
  auto before = [&key](int32_t a, int32_t b) {
    const float ka = key(a), kb = key(b);
    if (ka != kb) return ka > kb;
    return a < b;
  };
  for (int64_t t = 0; t < T; ++t) {
    const float* lt = logits + t * E;
    for (int e = 0; e < E; ++e) {
      s[e] = 1.f / (1.f + std::exp(-lt[e]));
      biased[e] = s[e] + (bias ? bias[e] : 0.f);
    }
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), before);
    int32_t* it = idx + t * k;
    float* wt = w + t * k;
    float sum = 0.f;
    for (int i = 0; i < k; ++i) {
      it[i] = order[i];
      sum += s[order[i]];
    }
    for (int i = 0; i < k; ++i) wt[i] = renormalize ? s[it[i]] / (sum + 1e-20f) * scale : s[it[i]] * scale;
  }
}

}  // namespace k3::ops
