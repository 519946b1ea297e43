// MoE router (kimi-k3.md section 2), FP32:
//   s = sigmoid(logits);  chosen = top-k of (s + bias) (the bias steers the choice only;
//   ties to the lower expert index; chosen listed by biased score descending)
//   w_i = s_i / (sum_{chosen} s + 1e-20) * scale   when renormalize, else s_i * scale
#pragma once

#include <cstdint>

#include "ops/cuda_context.h"

namespace k3::ops {

// logits [T, E] FP32; bias [E] F32; idx [T, k]; w [T, k].
void route(const float* logits, const float* bias, int64_t T, int E, int k, bool renormalize, float scale,
           int32_t* idx, float* w);

}  // namespace k3::ops

namespace k3::ops::cuda {

// logits [T, E] FP32, bias [E] F32 or null -> idx [T, k] int32, w [T, k] FP32: the CPU route exactly
// (selection by biased score desc, ties to the lower index, NaN as -inf; weights in selection order).
// One CTA per row; E <= kRouteMaxExperts.
constexpr int kRouteMaxExperts = 12032;  // the scores in 48 KiB of shared memory
int route(const float* logits, const float* bias, int64_t T, int E, int k, bool renormalize, float scale,
          int32_t* idx, float* w, CUstream_st* stream);

}  // namespace k3::ops::cuda
