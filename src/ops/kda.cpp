// Norm reductions accumulate in double; the recurrence is FP32 throughout,
// per head with the state kept in cache across tokens. kda_gated_norm rounds
// as written: RMSNorm's inner bf16 and its bf16 output, then bf16 after the gate.
#include "ops/kda.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "core/bf16.h"
#include "core/error.h"

namespace k3::ops {
namespace {

inline float sigmoidf(float z) { return 1.0f / (1.0f + std::exp(-z)); }

}  // namespace

void kda_gate(const float* u, const float* A_log, const float* dt_bias, float lower_bound, float* g, int64_t T, int H,
              int dk) {
  K3_CHECK(T >= 0 && H > 0 && dk > 0, "kda_gate: bad shape T {} H {} dk {}", T, H, dk);
  for (int64_t t = 0; t < T; ++t) {
    for (int h = 0; h < H; ++h) {
      const float a = std::exp(A_log[h]);
      const int64_t base = (t * H + h) * dk;
      const float* bias = dt_bias + static_cast<int64_t>(h) * dk;
      for (int j = 0; j < dk; ++j) g[base + j] = lower_bound * sigmoidf(a * (u[base + j] + bias[j]));
    }
  }
}

void kda_beta(const float* b, float* beta, int64_t T, int H) {
  K3_CHECK(T >= 0 && H > 0, "kda_beta: bad shape T {} H {}", T, H);
  for (int64_t i = 0; i < T * H; ++i) beta[i] = sigmoidf(b[i]);
}

void l2norm_heads(float* x, int64_t T, int H, int d, float scale) {
  K3_CHECK(T >= 0 && H > 0 && d > 0, "l2norm_heads: bad shape T {} H {} d {}", T, H, d);
  for (int64_t r = 0; r < T * H; ++r) {
    float* xr = x + r * d;
    double ss = 0.0;
    for (int j = 0; j < d; ++j) ss += static_cast<double>(xr[j]) * xr[j];
    const float f = scale / std::sqrt(static_cast<float>(ss) + 1e-6f);
    for (int j = 0; j < d; ++j) xr[j] *= f;
  }
}

namespace {

// The recurrence of kda_recurrence / kda_replay: one code path, so that a replay of the
// kept inputs yields bit for bit the state of the step (q, o null: no output).
void recur(const float* q, const float* k, const float* v, const float* g, const float* beta, float* S, float* o,
           int64_t T, int H, int dk, int dv) {
  const int64_t state = static_cast<int64_t>(dv) * dk;
  std::vector<float> alpha(static_cast<size_t>(dk));
  for (int h = 0; h < H; ++h) {
    float* Sh = S + h * state;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t kb = (t * H + h) * dk;
      const int64_t vb = (t * H + h) * dv;
      const float* kt = k + kb;
      const float b = beta[t * H + h];
      for (int j = 0; j < dk; ++j) alpha[j] = std::exp(g[kb + j]);
      for (int i = 0; i < dv; ++i) {
        float* row = Sh + static_cast<int64_t>(i) * dk;
        float pred = 0.0f;  // (S' k)_i
        for (int j = 0; j < dk; ++j) {
          row[j] *= alpha[j];
          pred += row[j] * kt[j];
        }
        const float delta = b * (v[vb + i] - pred);
        for (int j = 0; j < dk; ++j) row[j] += delta * kt[j];
        if (o != nullptr) {
          const float* qt = q + kb;
          float oi = 0.0f;  // (S q)_i
          for (int j = 0; j < dk; ++j) oi += row[j] * qt[j];
          o[vb + i] = oi;
        }
      }
    }
  }
}

}  // namespace

void kda_recurrence(const float* q, const float* k, const float* v, const float* g, const float* beta, float* S,
                    float* o, int64_t T, int H, int dk, int dv) {
  K3_CHECK(T >= 0 && H > 0 && dk > 0 && dv > 0, "kda_recurrence: bad shape T {} H {} dk {} dv {}", T, H, dk, dv);
  K3_CHECK(q != nullptr && o != nullptr, "kda_recurrence: q and o are required");
  recur(q, k, v, g, beta, S, o, T, H, dk, dv);
}

void kda_replay(const float* k, const float* v, const float* g, const float* beta, float* S, int64_t T, int H, int dk,
                int dv) {
  K3_CHECK(T >= 0 && H > 0 && dk > 0 && dv > 0, "kda_replay: bad shape T {} H {} dk {} dv {}", T, H, dk, dv);
  recur(nullptr, k, v, g, beta, S, nullptr, T, H, dk, dv);
}

void kda_gated_norm(const float* o, const float* gate, const float* o_norm_w, float eps, float* out, int64_t T, int H,
                    int dv) {
  K3_CHECK(T >= 0 && H > 0 && dv > 0, "kda_gated_norm: bad shape T {} H {} dv {}", T, H, dv);
  for (int64_t r = 0; r < T * H; ++r) {
    const float* orow = o + r * dv;
    const float* grow = gate + r * dv;
    float* yr = out + r * dv;
    double ss = 0.0;
    for (int j = 0; j < dv; ++j) ss += static_cast<double>(orow[j]) * orow[j];
    const float inv = 1.0f / std::sqrt(static_cast<float>(ss / dv) + eps);
    for (int j = 0; j < dv; ++j) {
      const float n = round_bf16(o_norm_w[j] * round_bf16(orow[j] * inv));
      yr[j] = round_bf16(n * sigmoidf(grow[j]));
    }
  }
}

}  // namespace k3::ops
