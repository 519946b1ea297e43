// MXFP4 experts and the SiTU-GLU MLPs (kimi-k3.md section 2).
//
//   situ_glu(a, b) = bf16(beta tanh(a / beta) sigmoid(a) * lbeta tanh(b / lbeta))   (FP32;
//                    beta = activation_situ_beta 4, lbeta = activation_situ_linear_beta 25)
//   mxfp4_linear:   y[r, n] = bf16(sum_k x[r, k] * W[n, k]), W = e2m1 * 2^(scale - 127)
//                   dequantized exactly, FP32 accumulation (packed [N, K/2] low nibble
//                   first, scale [N, K/32] E8M0)
//   expert_mlp:     h = situ_glu(W1 z, W3 z) (both BF16-rounded);  out = W2 h
//   mlp (dense layer 0 and the merged shared experts, BF16 weights):
//                   h = situ_glu(W_gate x, W_up x);  out = W_down h
#pragma once

#include <cstdint>

#include "core/bf16.h"

namespace k3::ops {

struct SituParams {
  float beta = 4.0f;
  float linear_beta = 25.0f;
};

// a, b, out [n] (out may alias a or b).
void situ_glu(const float* a, const float* b, float* out, int64_t n, SituParams p);

// x [rows, K]; packed [N, K/2] U8; scale [N, K/32] U8; y [rows, N].
void mxfp4_linear(const float* x, const uint8_t* packed, const uint8_t* scale, float* y, int64_t rows, int64_t K,
                  int64_t N);

struct Mxfp4Matrix {
  const uint8_t* packed = nullptr;  // [N, K/2]
  const uint8_t* scale = nullptr;   // [N, K/32]
};

// One routed expert: z [rows, D] -> out [rows, D]; w1, w3 [I, D]; w2 [D, I]. scratch >= 2 * rows * I floats.
void expert_mlp(const float* z, Mxfp4Matrix w1, Mxfp4Matrix w3, Mxfp4Matrix w2, float* out, int64_t rows, int64_t D,
                int64_t I, SituParams p, float* scratch);

// BF16 MLP: x [rows, D]; w_gate, w_up [I, D]; w_down [D, I]; out [rows, D]. scratch >= 2 * rows * I floats.
void mlp(const float* x, const bf16* w_gate, const bf16* w_up, const bf16* w_down, float* out, int64_t rows, int64_t D,
         int64_t I, SituParams p, float* scratch);

}  // namespace k3::ops
