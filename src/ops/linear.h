// BF16 linear with FP32 accumulation: y[r, o] = sum_i x[r, i] * W[o, i].
// W is [out, in] BF16 (checkpoint layout). y is rounded to BF16 unless
// round_out is false (router logits and lm_head logits stay FP32).
#pragma once

#include <cstdint>

#include "core/bf16.h"

namespace k3::ops {

// x [rows, in], w [out, in], y [rows, out] (y must not alias x).
void linear(const float* x, const bf16* w, float* y, int64_t rows, int64_t in, int64_t out, bool round_out = true);

}  // namespace k3::ops
