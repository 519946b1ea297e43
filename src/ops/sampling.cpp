// top_p computes the softmax in double and orders by (probability desc, id asc);
// exactly one rng.uniform() is drawn per call. NaN or +inf logits are an Error
// (-inf masks a token).
#include "ops/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/error.h"

namespace k3::ops {

int32_t sample_greedy(const float* logits, int64_t vocab) {
  K3_CHECK(vocab > 0, "sample_greedy: vocab {} must be positive", vocab);
  int64_t best = 0;
  for (int64_t i = 1; i < vocab; ++i) {
    if (logits[i] > logits[best]) best = i;  // strict: ties keep the lower id
  }
  return static_cast<int32_t>(best);
}

void check_sampling_params(float temperature, float top_p) {
  K3_CHECK(std::isfinite(temperature) && temperature >= 0.0f,
           "temperature {} must be a finite number >= 0 (0 = greedy)", temperature);
  K3_CHECK(std::isfinite(top_p) && top_p > 0.0f && top_p <= 1.0f, "top-p {} must be a finite number in (0, 1]",
           top_p);
}

int32_t sample_top_p(const float* logits, int64_t vocab, float temperature, float top_p, Rng& rng) {
  K3_CHECK(vocab > 0, "sample_top_p: vocab {} must be positive", vocab);
  check_sampling_params(temperature, top_p);
  K3_CHECK(temperature > 0.0f, "sample_top_p: temperature {} must be > 0", temperature);

  for (int64_t i = 0; i < vocab; ++i) {
    K3_CHECK(!std::isnan(logits[i]) && logits[i] != INFINITY, "sample_top_p: logit of token {} is {}", i, logits[i]);
  }
  const double m = logits[sample_greedy(logits, vocab)];
  K3_CHECK(m != -INFINITY, "sample_top_p: every logit is -inf");
  std::vector<double> p(static_cast<size_t>(vocab));
  double z = 0.0;
  for (int64_t i = 0; i < vocab; ++i) {
    p[i] = std::exp((static_cast<double>(logits[i]) - m) / temperature);
    z += p[i];
  }
  // Order (probability desc, id asc) is total, so sorting only a top-n prefix gives the
  // same prefix as a full sort; n grows until the prefix reaches top_p.
  std::vector<int32_t> order(static_cast<size_t>(vocab));
  std::iota(order.begin(), order.end(), 0);
  const auto before = [&](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); };
  const double need = static_cast<double>(top_p) * z;
  int64_t keep = 0;  // the smallest prefix of the sorted tokens whose probability reaches top_p
  double kept = 0.0;
  for (int64_t sorted = 0, n = std::min<int64_t>(vocab, 256); keep < vocab; n = std::min(vocab, n * 8)) {
    if (n < vocab) std::nth_element(order.begin() + sorted, order.begin() + n, order.end(), before);
    std::sort(order.begin() + sorted, order.begin() + n, before);
    sorted = n;
    while (keep < sorted && kept < need) kept += p[order[keep++]];
    if (kept >= need) break;
  }

  const double target = rng.uniform() * kept;
  double cum = 0.0;
  for (int64_t i = 0; i < keep; ++i) {
    cum += p[order[i]];
    if (target < cum) return order[i];
  }
  return order[keep - 1];
}

}  // namespace k3::ops
