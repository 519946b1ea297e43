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

namespace k3::ops {

// x [T, C], w [C, K] (the checkpoint's [C, 1, K]), state [C, K-1] (in/out), y [T, C].
void short_conv_silu(const float* x, const float* w, float* state, float* y, float* state_hist, int64_t T,
                     int64_t C, int K);

}  // namespace k3::ops
