// CPU reference of KDA's causal short convolution + SiLU and of the
// commit's state advance (ops/short_conv.h).
#include "ops/short_conv.h"

#include <cmath>
#include <vector>

#include "core/bf16.h"
#include "core/error.h"

namespace k3::ops {

void short_conv_silu(const float* x, const float* w, float* state, float* y, int64_t T, int64_t C, int K) {
  K3_CHECK(T >= 0 && C > 0 && K >= 1, "short_conv_silu: bad shape T {} C {} K {}", T, C, K);
  const int S = K - 1;  // state length per channel
  std::vector<float> win(static_cast<size_t>(K));
  for (int64_t c = 0; c < C; ++c) {
    const float* wc = w + c * K;
    float* sc = state + c * S;
    for (int j = 0; j < S; ++j) win[j] = sc[j];
    for (int64_t t = 0; t < T; ++t) {
      win[S] = x[t * C + c];
      float acc = 0.0f;
      for (int j = 0; j < K; ++j) acc += wc[j] * win[j];
      y[t * C + c] = round_bf16(acc / (1.0f + std::exp(-acc)));
      for (int j = 0; j < S; ++j) win[j] = win[j + 1];
    }
    for (int j = 0; j < S; ++j) sc[j] = win[j];
  }
}

void short_conv_advance(const float* x, float* state, int64_t n, int64_t C, int K) {
  K3_CHECK(n >= 0 && C > 0 && K >= 1, "short_conv_advance: bad shape n {} C {} K {}", n, C, K);
  const int S = K - 1;
  std::vector<float> win(static_cast<size_t>(S + n));
  for (int64_t c = 0; c < C; ++c) {
    float* sc = state + c * S;
    for (int j = 0; j < S; ++j) win[j] = sc[j];
    for (int64_t t = 0; t < n; ++t) win[S + t] = x[t * C + c];
    for (int j = 0; j < S; ++j) sc[j] = win[n + j];
  }
}

}  // namespace k3::ops
