// CUDA commit of the short conv states (see short_conv.h for the math; the step's conv + SiLU runs in
// kda_prep, ops/kda_prep.cu, which keeps the step's pre-conv inputs).
//
// One thread per (request, channel): the last K-1 of [state, the first n kept inputs] shifted into the
// slot's committed state, n = accepted[b].
#include <cuda_runtime.h>

#include "ops/cuda_device.cuh"
#include "ops/short_conv.h"

namespace k3::ops::cuda {
namespace {

constexpr int kMaxK = 8;
constexpr int kThreads = 256;

__global__ void short_conv_commit_kernel(const float* __restrict__ x_kept, float* __restrict__ conv_pool,
                                         const int32_t* __restrict__ slots, const int32_t* __restrict__ accepted,
                                         int max_q, int64_t C, int K) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= C) return;
  const int b = blockIdx.y;
  const int n = accepted[b];
  if (n < 1 || n > max_q) return;
  const int S = K - 1;
  const int64_t slot = slots[b];
  float* sc = conv_pool + (slot * C + c) * S;
  float win[kMaxK];  // the last S of [state, x_0 .. x_{n-1}]: at most S inputs matter
#pragma unroll
  for (int j = 0; j < kMaxK; ++j) win[j] = j < S ? sc[j] : 0.f;
  // Inputs n - S .. n - 1 (those >= 0) shift in after the state.
  const int first = n > S ? n - S : 0;
  for (int t = first; t < n; ++t) {
#pragma unroll
    for (int j = 0; j + 1 < kMaxK; ++j)
      if (j + 1 < S) win[j] = win[j + 1];
    if (S > 0) win[S - 1] = x_kept[(slot * max_q + t) * C + c];
  }
#pragma unroll
  for (int j = 0; j < kMaxK; ++j)
    if (j < S) sc[j] = win[j];
}

}  // namespace

int short_conv_commit(const float* x_kept, float* conv_pool, const int32_t* slots, const int32_t* accepted, int B,
                      int max_q, int64_t C, int K, CUstream_st* stream) {
  if (K < 1 || K > kMaxK || C <= 0 || B < 0 || max_q < 1) return cudaErrorInvalidValue;
  if (B == 0 || K == 1) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((C + kThreads - 1) / kThreads), static_cast<unsigned>(B));
  return detail::launch(short_conv_commit_kernel, grid, kThreads, 0, stream, x_kept, conv_pool, slots, accepted, max_q,
                        C, K);
}

}  // namespace k3::ops::cuda
