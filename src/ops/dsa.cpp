// CPU reference for the DSA lightning indexer scores and the top-k selection (see dsa.h).
#include "ops/dsa.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/error.h"
#include "ops/dot.h"

namespace k3::ops {
void dsa_index_scores(const float* q_idx, const float* w, const float* const* keys, int64_t n, int Hi, int Di,
                      float* scores) {
  K3_CHECK(n >= 0 && Hi > 0 && Di > 0, "dsa_index_scores: bad sizes n={} Hi={} Di={}", n, Hi, Di);
  for (int64_t s = 0; s < n; ++s) {
    const float* k = keys[s];
    float acc = 0.f;
    for (int h = 0; h < Hi; ++h) {
      const float d = dot(q_idx + static_cast<int64_t>(h) * Di, k, Di);
      acc += w[h] * (d > 0.f ? d : 0.f);
    }
    scores[s] = acc;
  }
}

int64_t topk_indices(const float* scores, int64_t n, int64_t k, int64_t* idx) {
  K3_CHECK(n >= 0 && k >= 0, "topk_indices: bad sizes n={} k={}", n, k);
  const int64_t m = std::min(k, n);
  if (m == 0) return 0;
  // Key: score, NaN treated as -inf, so that (key descending, index ascending) is a strict total order and the
  // m best are one set whatever the algorithm.
  auto key = [scores](int64_t i) {
    const float s = scores[i];
    return std::isnan(s) ? -INFINITY : s;
  };
  auto before = [&key](int64_t a, int64_t b) {
    const float ka = key(a), kb = key(b);
    if (ka != kb) return ka > kb;
    return a < b;
  };
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), int64_t{0});
  // The set first, then its order: by column (the attention over it is a softmax over a set; column order is
  // what the GPU's compaction produces without a sort).
  std::nth_element(order.begin(), order.begin() + (m - 1), order.end(), before);
  std::sort(order.begin(), order.begin() + m);
  std::copy(order.begin(), order.begin() + m, idx);
  return m;
}

}  // namespace k3::ops
