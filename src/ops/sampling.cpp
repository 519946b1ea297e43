// sample_rows on the CPU (ops/sampling.h), written plainly: double sums, a full sort for the kept set.
#include "ops/sampling.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/error.h"

namespace k3::ops {

void check_sampling_params(float temperature, float top_p) {
  K3_CHECK(std::isfinite(temperature) && temperature >= 0.0f,
           "temperature {} must be a finite number >= 0 (0 = greedy)", temperature);
  K3_CHECK(std::isfinite(top_p) && top_p > 0.0f && top_p <= 1.0f, "top-p {} must be a finite number in (0, 1]",
           top_p);
}

void check_specs(const SampleSpec* spec, int64_t rows, int64_t vocab) {
  K3_CHECK(vocab > 0 && vocab <= 0x7fffffff, "sample_rows: vocab {} must be in 1..2^31-1", vocab);
  K3_CHECK(rows >= 0, "sample_rows: rows {} must be >= 0", rows);
  for (int64_t r = 0; r < rows; ++r) {
    const SampleSpec& s = spec[r];
    check_sampling_params(s.temperature, s.top_p);
    K3_CHECK(s.draft >= -1 && s.draft < vocab, "sample_rows: row {}: draft {} outside -1..{}", r, s.draft, vocab - 1);
    K3_CHECK(s.u_accept >= 0.0 && s.u_accept < 1.0 && s.u_draw >= 0.0 && s.u_draw < 1.0,
             "sample_rows: row {}: uniforms {} {} outside [0, 1)", r, s.u_accept, s.u_draw);
  }
}

SampleNeeds sample_needs(const SampleSpec* spec, int64_t rows) {
  SampleNeeds n{false, false, false};
  for (int64_t r = 0; r < rows; ++r) {
    const SampleSpec& s = spec[r];
    n.sampled = n.sampled || s.temperature > 0.0f;
    n.top_p = n.top_p || (s.temperature > 0.0f && s.top_p < 1.0f);
    n.logprob = n.logprob || s.logprob != 0;
  }
  return n;
}

namespace {

float clean(float v) { return std::isnan(v) ? -INFINITY : v == INFINITY ? FLT_MAX : v; }

// A row's values as the op reads them (NaN as -inf, +inf as the largest finite float).
std::vector<float> cleaned(const float* raw, int64_t V) {
  std::vector<float> l(static_cast<size_t>(V));
  for (int64_t i = 0; i < V; ++i) l[i] = clean(raw[i]);
  return l;
}

// The log-probabilities under softmax of the raw (cleaned) logits l, m their maximum: log p(t) =
// l[t] - m - log sum exp(l - m). One definition, so that sample_row's log-prob and top_logprobs' give a token
// the same bits; the sum is taken once per row.
struct LogProbs {
  const std::vector<float>& l;
  double m, log_z = 0.0;
  LogProbs(const std::vector<float>& logits, double max) : l(logits), m(max) {
    if (m == -INFINITY) return;
    double z1 = 0.0;
    for (float x : l) z1 += std::exp(x - m);
    log_z = std::log(z1);
  }
  float operator()(int64_t t) const { return m == -INFINITY ? -INFINITY : static_cast<float>(l[t] - m - log_z); }
};

SampleResult sample_row(const float* raw, int64_t V, const SampleSpec& s) {
  const std::vector<float> l = cleaned(raw, V);
  int64_t best = 0;
  for (int64_t i = 1; i < V; ++i)
    if (l[i] > l[best]) best = i;  // strict: ties keep the lower id
  const double m = l[best];
  SampleResult out;
  if (s.temperature == 0.0f || m == -INFINITY) {
    out.token = static_cast<int32_t>(best);
    out.accepted = s.draft == out.token;
  } else {
    const double T = s.temperature;
    std::vector<double> p(static_cast<size_t>(V));
    double z = 0.0;
    for (int64_t i = 0; i < V; ++i) z += p[i] = std::exp((l[i] - m) / T);
    std::vector<char> kept(static_cast<size_t>(V), 1);
    double kept_mass = z;
    if (s.top_p < 1.0f) {
      std::vector<int32_t> order(static_cast<size_t>(V));
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
      std::fill(kept.begin(), kept.end(), 0);
      const double need = static_cast<double>(s.top_p) * z;
      kept_mass = 0.0;
      for (int64_t k = 0; k < V && kept_mass < need; ++k) {
        kept[order[k]] = 1;
        kept_mass += p[order[k]];
      }
    }
    int32_t skip = -1;  // the rejected draft
    double mass = kept_mass;
    if (s.draft >= 0) {
      const double pd = kept[s.draft] ? p[s.draft] / kept_mass : 0.0;
      if (s.u_accept < pd) {
        out.token = s.draft;
        out.accepted = 1;
      } else {
        skip = s.draft;
        if (kept[s.draft]) mass -= p[s.draft];
      }
    }
    if (!out.accepted) {
      const double target = s.u_draw * mass;
      double cum = 0.0;
      int64_t pick = -1;
      for (int64_t i = 0; i < V; ++i) {
        if (!kept[i] || i == skip || p[i] <= 0.0) continue;
        cum += p[i];
        pick = i;  // the last kept one when rounding leaves target >= the final cumulative
        if (cum > target) break;
      }
      out.token = static_cast<int32_t>(pick >= 0 ? pick : best);
    }
  }
  if (s.logprob) out.logprob = LogProbs(l, m)(out.token);
  return out;
}

}  // namespace

std::vector<TokenLogprob> top_logprobs(const float* raw, int64_t V, int n) {
  K3_CHECK(V >= 1 && n >= 0 && n <= V, "top_logprobs: {} of a vocabulary of {}", n, V);
  const std::vector<float> l = cleaned(raw, V);
  const double m = *std::max_element(l.begin(), l.end());
  std::vector<int32_t> order(static_cast<size_t>(V));
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + n, order.end(),
                    [&](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
  const LogProbs log_p(l, m);
  std::vector<TokenLogprob> out(static_cast<size_t>(n));
  for (int k = 0; k < n; ++k) {
    const int32_t t = order[static_cast<size_t>(k)];
    out[static_cast<size_t>(k)] = {t, log_p(t)};
  }
  return out;
}

void sample_rows(const float* logits, int64_t rows, int64_t vocab, const SampleSpec* spec, SampleResult* out) {
  check_specs(spec, rows, vocab);
  for (int64_t r = 0; r < rows; ++r) out[r] = sample_row(logits + r * vocab, vocab, spec[r]);
}

}  // namespace k3::ops
