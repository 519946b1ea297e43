// Kimi Delta Attention on the CPU, per request, token by token (kimi-k3.md section 2):
//
//   gate:  g[t, h, j] = lower * sigmoid(exp(A_log[h]) * (u[t, h, j] + dt_bias[h, j]))   (FP32, in (lower, 0))
//          u = W_fb (W_fa x) (BF16 linears); alpha = exp(g)
//   beta:  beta[t, h] = sigmoid(b[t, h])                                              (FP32)
//   l2norm_heads: x_h <- x_h / sqrt(|x_h|^2 + 1e-6) * scale                          (FP32, per head)
//   recurrence, per head h, state S [dv, dk] FP32:
//          S' = S diag(alpha_t);  delta = beta_t (v_t - S' k_t);  S = S' + delta k_t^T;  o_t = S q_t
//   gated output norm: out[t, h] = bf16(RMSNorm(o[t, h]; o_norm, eps) * sigmoid(gate[t, h]))
#pragma once

#include <cstdint>

namespace k3::ops {

// u, g [T, H * dk]; A_log [H] (the first H stored values); dt_bias [H * dk].
void kda_gate(const float* u, const float* A_log, const float* dt_bias, float lower_bound, float* g, int64_t T, int H,
              int dk);

// b, beta [T, H] (may alias).
void kda_beta(const float* b, float* beta, int64_t T, int H);

// x [T, H * d] in place.
void l2norm_heads(float* x, int64_t T, int H, int d, float scale);

// q, k, g [T, H * dk]; v [T, H * dv]; beta [T, H]; S [H, dv, dk] in/out;
// o [T, H * dv] FP32; S_hist [T, H, dv, dk] or null: the state after each token.
void kda_recurrence(const float* q, const float* k, const float* v, const float* g, const float* beta, float* S,
                    float* o, float* S_hist, int64_t T, int H, int dk, int dv);

// o, gate [T, H * dv]; o_norm_w [dv] F32 shared by all heads; out [T, H * dv].
void kda_gated_norm(const float* o, const float* gate, const float* o_norm_w, float eps, float* out, int64_t T, int H,
                    int dv);

}  // namespace k3::ops
