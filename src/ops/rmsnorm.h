// RMSNorm and LayerNorm on the CPU (the reference the CUDA kernels are tested against).
//
//   rmsnorm:   out[r, i] = w[i] * bf16(x[r, i] / sqrt(mean_j x[r, j]^2 + eps))
//              computed in FP32, out rounded to BF16 (kimi-k3.md section 2).
//   layernorm: out[r, i] = bf16(w[i] * (x[r, i] - mu) / sqrt(var + eps) + b[i])
//              mu, var the mean and (biased) variance of the row; FP32 (the DSA indexer's k_norm).
#pragma once

#include <cstdint>

#include "core/bf16.h"
#include "ops/cuda_context.h"

namespace k3::ops {

// x [rows, dim] (may alias out), w [dim] BF16 or F32.
void rmsnorm(const float* x, const bf16* w, float* out, int64_t rows, int64_t dim, float eps);
void rmsnorm(const float* x, const float* w, float* out, int64_t rows, int64_t dim, float eps);

// x [rows, dim] (may alias out), w, b [dim] BF16.
void layernorm(const float* x, const bf16* w, const bf16* b, float* out, int64_t rows, int64_t dim, float eps);

}  // namespace k3::ops

namespace k3::ops::cuda {

// An RMSNorm that a kernel producing rows applies before it stores them: out = rmsnorm(bf16 row; w, eps),
// the bits a separate rmsnorm call on the stored row would give. w == nullptr: no norm.
struct RowNorm {
  const bf16* w = nullptr;  // [dim] BF16
  float eps = 0.f;
};

// x, out [rows, dim] BF16 (out may alias x), w [dim] BF16: out = bf16(w * bf16(x / sqrt(mean(x^2) + eps))).
int rmsnorm(const bf16* x, const bf16* w, bf16* out, int64_t rows, int64_t dim, float eps, CUstream_st* stream);
// The same with w [dim] F32.
int rmsnorm(const bf16* x, const float* w, bf16* out, int64_t rows, int64_t dim, float eps, CUstream_st* stream);
// x, out [rows, dim] BF16 (out may alias x), w, b [dim] BF16: out = bf16(w * (x - mu) / sqrt(var + eps) + b).
int layernorm(const bf16* x, const bf16* w, const bf16* b, bf16* out, int64_t rows, int64_t dim, float eps,
              CUstream_st* stream);

}  // namespace k3::ops::cuda
