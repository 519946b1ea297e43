// Short causal depthwise conv1d + SiLU over a sequence of T tokens of one
// request, with conv state (KDA's q / k / v convs, kernel K = 4, no bias):
//
//   window_t(c) = [state(c, 0..K-2), x(0..t, c)] last K inputs (oldest first)
//   y[t, c] = bf16(silu(sum_j w[c, j] * window_t(c)[j]))     (FP32)
//   state(c) <- the last K-1 inputs after token T-1
//
// A verify step keeps its pre-conv inputs and commit(n) advances the state
// by the first n of them (short_conv_advance: the last K-1 of [state, x_0 ..
// x_{n-1}]).
#pragma once

#include <cstdint>

#include "ops/cuda_context.h"

namespace k3::ops {

// x [T, C], w [C, K] (the checkpoint's [C, 1, K]), state [C, K-1] (in/out), y [T, C].
void short_conv_silu(const float* x, const float* w, float* state, float* y, int64_t T, int64_t C, int K);

// x [n, C] pre-conv inputs; state [C, K-1] <- the last K-1 of [state, x_0 .. x_{n-1}] per channel.
void short_conv_advance(const float* x, float* state, int64_t n, int64_t C, int K);

}  // namespace k3::ops

// CUDA: the step's conv + SiLU runs in kda_prep (ops/kda_prep.h): it reads the committed conv state of
// slot slots[b], never writes it, and keeps the step's pre-conv inputs in the slot's rows of x_kept
// [num_slots, max_q, C]; short_conv_commit advances the state by the accepted ones.
namespace k3::ops::cuda {

// For each b with n = accepted[b] in [1, max_q]: conv_pool[slots[b]] <- the last K-1 of [state, x_kept rows
// 0 .. n-1 of the slot] (short_conv_advance); n = 0 (or out of range) keeps the state.
int short_conv_commit(const float* x_kept, float* conv_pool, const int32_t* slots, const int32_t* accepted, int B,
                      int max_q, int64_t C, int K, CUstream_st* stream);

}  // namespace k3::ops::cuda
