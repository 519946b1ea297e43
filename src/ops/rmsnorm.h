// RMSNorm and LayerNorm on the CPU (the reference the CUDA kernels are tested against).
//
//   rmsnorm:   out[r, i] = w[i] * bf16(x[r, i] / sqrt(mean_j x[r, j]^2 + eps))
//              computed in FP32, out rounded to BF16 (kimi-k3.md section 2).
//   layernorm: out[r, i] = bf16(w[i] * (x[r, i] - mu) / sqrt(var + eps) + b[i])
//              mu, var the mean and (biased) variance of the row; FP32 (the DSA indexer's k_norm).
#pragma once

#include <cstdint>

#include "core/bf16.h"

namespace k3::ops {

// x [rows, dim] (may alias out), w [dim] BF16 or F32.
void rmsnorm(const float* x, const bf16* w, float* out, int64_t rows, int64_t dim, float eps);
void rmsnorm(const float* x, const float* w, float* out, int64_t rows, int64_t dim, float eps);

// x [rows, dim] (may alias out), w, b [dim] BF16.
void layernorm(const float* x, const bf16* w, const bf16* b, float* out, int64_t rows, int64_t dim, float eps);

}  // namespace k3::ops
