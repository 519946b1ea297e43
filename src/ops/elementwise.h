// Small elementwise ops between the big ones (CPU reference + CUDA):
//   gate_sigmoid: out = bf16(o * sigmoid(gate))                 (MLA output gate)
//   to_bf16:      out = bf16(x) of FP32 x                        (DCP-merged MLA latent)
//   scale:        x *= s (FP32)                                  (DSA indexer weights)
//   cache_write:  rows of x [rows, ld] (first `width` columns) into a paged pool
//                 [pages, page_size, width] at the row's position; the first
//                 `norm_cols` columns RMSNorm'ed with norm_w first (the MLA c_kv)
#pragma once

#include <cstdint>

#include "core/bf16.h"
#include "ops/cuda_context.h"

namespace k3::ops {

void gate_sigmoid(const float* o, const float* gate, float* out, int64_t n);

}  // namespace k3::ops

namespace k3::ops::cuda {

// o, gate, out BF16 [n] (out may alias o).
int gate_sigmoid(const bf16* o, const bf16* gate, bf16* out, int64_t n, CUstream_st* stream);
// x F32 [n] -> out BF16 [n].
int to_bf16(const float* x, bf16* out, int64_t n, CUstream_st* stream);
// x F32 [n] in place.
int scale(float* x, float s, int64_t n, CUstream_st* stream);
// x BF16 [B*q_len, ld]; row r of request b = r / q_len at position pos0[b] + r % q_len goes to
// pool[block_tables[b, p / page_size], p % page_size, :width] with p = that position (rows whose
// position is not held here, (pos % dcp_size) != dcp_rank, are skipped; local index pos / dcp_size).
// norm_w BF16 [norm_cols] or null.
int cache_write(const bf16* x, int64_t ld, int64_t width, const bf16* norm_w, int64_t norm_cols, float eps,
                const int32_t* pos0, int B, int q_len, const int32_t* block_tables, int max_pages, int page_size,
                int dcp_size, int dcp_rank, bf16* pool, CUstream_st* stream);

}  // namespace k3::ops::cuda

namespace k3::ops::cuda {
// Benchmark routing (GpuRank loopback): idx[i] <- begin + idx[i] mod count, every pair to a local expert.
int remap_experts(int32_t* idx, int64_t n, int begin, int count, CUstream_st* stream);
}  // namespace k3::ops::cuda
