// Short causal depthwise conv1d + SiLU over a sequence of T tokens of one
// request, with conv state (KDA's q / k / v convs, kernel K = 4, no bias):
//
//   window_t(c) = [state(c, 0..K-2), x(0..t, c)] last K inputs (oldest first)
//   y[t, c] = bf16(silu(sum_j w[c, j] * window_t(c)[j]))     (FP32)
//   state(c) <- the last K-1 inputs after token T-1
//
// state_hist, when given, receives the state after each token t
// ([T, C, K-1]), so a verify step can commit any accepted prefix.
#pragma once

#include <cstdint>

#include "core/bf16.h"
#include "ops/cuda_context.h"

namespace k3::ops {

// x [T, C], w [C, K] (the checkpoint's [C, 1, K]), state [C, K-1] (in/out), y [T, C].
void short_conv_silu(const float* x, const float* w, float* state, float* y, float* state_hist, int64_t T,
                     int64_t C, int K);

}  // namespace k3::ops

// CUDA: a step of B requests x q_len tokens (request b's tokens are rows [b q_len, (b+1) q_len)).
// The committed conv state of slot slots[b] is read, never written; the state after each token t
// goes to history row t of the slot (commit later with ops::cuda::commit_state, kda.h).
namespace k3::ops::cuda {

// x BF16 [B*q_len, x_ld] (channels [0, C) of each row), w F32 [C, K], conv_pool F32 [num_slots, C, K-1] (read only),
// hist_pool F32 [num_slots, max_q, C, K-1], slots [B], y BF16 [B*q_len, C]; 1 <= K <= 8, q_len <= max_q.
int short_conv_silu(const bf16* x, int64_t x_ld, const float* w, const float* conv_pool, float* hist_pool,
                    const int32_t* slots, bf16* y, int B, int q_len, int max_q, int64_t C, int K, CUstream_st* stream);

}  // namespace k3::ops::cuda
