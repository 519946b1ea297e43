// BF16 linear with FP32 accumulation: y[r, o] = sum_i x[r, i] * W[o, i].
// W is [out, in] BF16 (checkpoint layout). y is rounded to BF16 unless
// round_out is false (router logits and lm_head logits stay FP32).
#pragma once

#include <cstdint>

#include "core/bf16.h"
#include "ops/cuda_context.h"

namespace k3::ops {

// x [rows, in], w [out, in], y [rows, out] (y must not alias x).
void linear(const float* x, const bf16* w, float* y, int64_t rows, int64_t in, int64_t out, bool round_out = true);

}  // namespace k3::ops

namespace k3::ops::cuda {

// x [rows, in] BF16, w [out, in] BF16 -> y [rows, out], BF16 (rounded) or FP32 when y_f32; FP32 accumulation.
// rows <= kLinearKernelMaxRows: a hand-written kernel streaming W once; more rows: cuBLASLt on
// ctx.workspace (the kernel again if cuBLASLt has no algorithm). y must not alias x.
// Measured on the H200 (bench --ops, docs/perf/ops_6a5a50f.log): the kernel wins at 1 row on every
// K3 per-rank shape (6288 x 7168: 26.1 us against cuBLASLt's 27.0); at 2 rows the winner depends on the
// shape (within ~1 us on the small ones, cuBLASLt by 10 us on 7168 x 33792); from 4 rows cuBLASLt wins.
constexpr int64_t kLinearKernelMaxRows = 1;
int linear(const Context& ctx, const bf16* x, const bf16* w, void* y, bool y_f32, int64_t rows, int64_t in,
           int64_t out);
// The same with the path forced (benchmarks compare them): Kernel = the hand-written kernel at any row
// count; CublasLt = cuBLASLt (the kernel if cuBLASLt has no algorithm); Auto = linear().
enum class LinearPath { Auto, Kernel, CublasLt };
int linear_via(const Context& ctx, LinearPath path, const bf16* x, const bf16* w, void* y, bool y_f32, int64_t rows,
               int64_t in, int64_t out);

}  // namespace k3::ops::cuda
