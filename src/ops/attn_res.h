// Attention Residuals, the fused form (kimi-k3.md section 2, the seed's attn_res):
//
//   p = delta ? bf16(prefix + delta) : prefix;  prefix <- p
//   if block_write_idx >= 0: blocks[:, block_write_idx] <- p
//   sources V = [blocks[:, 0], ..., blocks[:, num_blocks - 1], p]
//   score_s = dot(norm_w * V_s / sqrt(mean(V_s^2) + eps), proj_w)   (FP32)
//   alpha = softmax_s(score);  mix = bf16(sum_s alpha_s * V_s)       (raw sources)
//   out = out_norm_w ? RMSNorm(mix; out_norm_w, out_eps) : mix
#pragma once

#include <cstdint>

#include "core/bf16.h"
#include "ops/cuda_context.h"

namespace k3::ops {

struct AttnResArgs {
  float* prefix = nullptr;       // [rows, dim] the partial sum P (in/out)
  const float* delta = nullptr;  // [rows, dim] added to P first, or null
  float* blocks = nullptr;       // [rows, max_blocks, dim] completed block snapshots R
  int max_blocks = 0;
  const bf16* norm_w = nullptr;  // [dim] *_res_norm.weight
  const bf16* proj_w = nullptr;  // [dim] the single row of *_res_proj.weight
  const bf16* out_norm_w = nullptr;  // [dim] or null
  int num_blocks = 0;            // blocks mixed (before p)
  int block_write_idx = -1;
  float eps = 1e-5f;             // the source norm's eps
  float out_eps = 1e-5f;         // the output RMSNorm's eps
  float* out = nullptr;          // [rows, dim]
  int64_t rows = 0;
  int64_t dim = 0;
};

void attn_res(const AttnResArgs& a);

}  // namespace k3::ops

namespace k3::ops::cuda {

// AttnResArgs on the device: every tensor BF16 (p, the blocks and the mix are BF16 values on the CPU too).
struct AttnResCudaArgs {
  bf16* prefix = nullptr;            // [rows, dim] the partial sum P (in/out)
  const bf16* delta = nullptr;       // [rows, dim] added to P first, or null
  bf16* blocks = nullptr;            // [rows, max_blocks, dim] completed block snapshots R
  int max_blocks = 0;
  const bf16* norm_w = nullptr;      // [dim] *_res_norm.weight
  const bf16* proj_w = nullptr;      // [dim] the single row of *_res_proj.weight
  const bf16* out_norm_w = nullptr;  // [dim] or null
  int num_blocks = 0;                // blocks mixed (before p); num_blocks + 1 <= kAttnResMaxSources
  int block_write_idx = -1;
  float eps = 1e-5f;                 // the source norm's eps
  float out_eps = 1e-5f;             // the output RMSNorm's eps
  bf16* out = nullptr;               // [rows, dim] (must not alias prefix or blocks)
  int64_t rows = 0;
  int64_t dim = 0;
};
constexpr int kAttnResMaxSources = 64;

// The fused attn_res of the CPU op: each row split over a cluster of up to 8 CTAs (sm_90), one launch.
int attn_res(const AttnResCudaArgs& a, CUstream_st* stream);

}  // namespace k3::ops::cuda
