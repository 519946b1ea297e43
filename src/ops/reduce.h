// Rank-order sums of the collectives (every comm backend sums this way, so
// every rank of a group gets bitwise the same result):
//
//   reduce_sum: out[i] = sum_{p = 0 .. n-1} parts[p][i], accumulated in FP32
//               starting from +0 in p order (rank order), then for BF16
//               rounded once to nearest even (F32: no rounding).
//
// The CPU reference (reduce.cpp) is what the host backends (local, mpi) call;
// the CUDA kernel (reduce.cu) is what the device backends (local_gpu, nccl)
// call on device pointers, peers' buffers read directly.
#pragma once

#include <cstdint>

#include "core/bf16.h"
#include "ops/cuda_context.h"

namespace k3::ops {

// parts: n pointers to [count] values; out [count] (may alias a part).
void reduce_sum_f32(const float* const* parts, int n, float* out, int64_t count);
void reduce_sum_bf16(const bf16* const* parts, int n, bf16* out, int64_t count);

}  // namespace k3::ops

namespace k3::ops::cuda {

// The most parts one launch sums (the pointers travel by value in the kernel's parameters).
constexpr int kReduceMaxParts = 64;

// parts: a host array of n device pointers to [count] values (1 <= n <= kReduceMaxParts); out [count] device
// (may alias a part only when every part is read at the same index it is written: out[i] depends on parts[.][i]).
int reduce_sum_f32(const float* const* parts, int n, float* out, int64_t count, CUstream_st* stream);
int reduce_sum_bf16(const bf16* const* parts, int n, bf16* out, int64_t count, CUstream_st* stream);

}  // namespace k3::ops::cuda
