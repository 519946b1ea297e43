// KDA's per-token inputs of the recurrence, from the in_proj and f_b projections (kimi-k3.md section 2):
// the ops between the projections and the recurrence, in one op.
//
//   y_j = short_conv_silu(x_j; conv_j, state_j)   j = q, k, v   (ops/short_conv.h: y BF16, state advanced)
//   q   = l2norm_heads(y_q, scale d^-1/2)                        (ops/kda.h: FP32 per head, sum of squares in double)
//   k   = l2norm_heads(y_k, scale 1)
//   v   = y_v                                                    (BF16)
//   g   = kda_gate(u = f_b f_a; A_log, dt_bias, lower_bound)     (FP32)
//   beta = kda_beta(b) = sigmoid(b)                              (FP32)
//
// The CPU kda_prep is exactly that composition of the CPU ops (each tested against float64); the CUDA
// kda_prep does the same FP32 operations in the same order per element, with the BF16 roundings at the
// same points, as the separate kernels of those ops did (short_conv_silu, l2norm_heads, kda_gate,
// kda_beta), in one launch.
#pragma once

#include <cstdint>

#include "core/bf16.h"
#include "ops/cuda_context.h"

namespace k3::ops {

struct KdaPrepWeights {
  const float* conv[3] = {};     // [C, K] each: the q, k, v convs (the checkpoint's [C, 1, K])
  const float* A_log = nullptr;  // [>= H] (the first H used)
  const float* dt_bias = nullptr;  // [C]
  float lower_bound = 0.0f;
};

// One request's T tokens, C = H d. x[j] [T, C] the pre-conv q, k, v; u [T, C] (f_b f_a, BF16 values);
// b [T, H]; state[j] [C, K-1] in/out (advanced by the T tokens). Out: y[0] the l2-normalized q scaled by
// d^-1/2, y[1] the l2-normalized k, y[2] v (BF16 values), each [T, C]; g [T, C]; beta [T, H] (may alias b).
void kda_prep(const float* const x[3], const float* u, const float* b, const KdaPrepWeights& w,
              float* const state[3], float* const y[3], float* g, float* beta, int64_t T, int H, int d, int K);

}  // namespace k3::ops

// CUDA: a step of B requests x q_len tokens (request b's tokens are rows [b q_len, (b+1) q_len)), as the
// step runs it: the committed conv states of slot slots[b] are read, never written; the step keeps its
// pre-conv inputs in the slot's rows of the kept pools (short_conv_commit advances the states by the
// accepted ones, ops/short_conv.h).
namespace k3::ops::cuda {

struct KdaPrep {
  // proj BF16 [rows, proj_ld]: x_q, x_k, x_v at columns [0, C), [C, 2C), [2C, 3C); b at [b_col, b_col + H).
  const bf16* proj = nullptr;
  int64_t proj_ld = 0;
  int64_t b_col = 0;
  const bf16* u = nullptr;               // [rows, C] f_b f_a
  const float* conv_w[3] = {};           // [C, K] each
  const float* conv_pool[3] = {};        // [num_slots, C, K-1] each: committed states (read only; null if K = 1)
  float* conv_kept[3] = {};              // [num_slots, max_q, C] each: the step's F32 pre-conv inputs (or null)
  const int32_t* slots = nullptr;        // [B]
  const float* A_log = nullptr;          // [>= H]
  const float* dt_bias = nullptr;        // [C]
  float lower_bound = 0.0f;
  float q_scale = 1.0f;                  // d^-1/2, computed by the caller as 1.0f / std::sqrt(float(d))
  // outputs
  float* q = nullptr;     // [rows, C] l2-normalized, scaled
  float* k = nullptr;     // [rows, C] l2-normalized
  bf16* v = nullptr;      // [rows, C]
  float* g = nullptr;     // [rows, C]
  float* beta = nullptr;  // [rows, H]
};

// 1 <= K <= 8, 1 <= d <= 256, q_len <= max_q; no output may alias an input.
int kda_prep(const KdaPrep& p, int B, int q_len, int max_q, int H, int d, int K, CUstream_st* stream);

}  // namespace k3::ops::cuda
