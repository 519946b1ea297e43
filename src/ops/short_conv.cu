// CUDA short causal conv1d + SiLU over a step (see short_conv.h for the math).
//
// One thread per (request, channel): it reads the committed state of its
// channel (K-1 floats) once, keeps the K-wide window in registers, loops the
// request's q_len tokens in order, writes y and the state after every token
// into the slot's history rows. Loads of x / stores of y are coalesced over
// channels; the committed state is never written (commit_state copies a
// history row later). FP32 arithmetic in the CPU's order, SiLU as z / (1 + e^-z).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "ops/short_conv.h"

namespace k3::ops::cuda {
namespace {

constexpr int kMaxK = 8;
constexpr int kThreads = 256;

__global__ void short_conv_silu_kernel(const __nv_bfloat16* __restrict__ x, int64_t x_ld, const float* __restrict__ w,
                                       const float* __restrict__ conv_pool, float* __restrict__ hist_pool,
                                       const int32_t* __restrict__ slots, __nv_bfloat16* __restrict__ y, int q_len,
                                       int max_q, int64_t C, int K) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= C) return;
  const int b = blockIdx.y;
  const int S = K - 1;
  const int64_t slot = slots[b];
  float wc[kMaxK];
  float win[kMaxK];
#pragma unroll
  for (int j = 0; j < kMaxK; ++j) {
    wc[j] = j < K ? w[c * K + j] : 0.f;
    win[j] = j < S ? conv_pool[(slot * C + c) * S + j] : 0.f;
  }
  for (int t = 0; t < q_len; ++t) {
    const int64_t row = static_cast<int64_t>(b) * q_len + t;
    const float xv = __bfloat162float(x[row * x_ld + c]);
#pragma unroll
    for (int j = 0; j < kMaxK; ++j)
      if (j == S) win[j] = xv;
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < kMaxK; ++j)
      if (j < K) acc += wc[j] * win[j];
    y[row * C + c] = __float2bfloat16_rn(acc / (1.0f + expf(-acc)));
#pragma unroll
    for (int j = 0; j + 1 < kMaxK; ++j)
      if (j < S) win[j] = win[j + 1];
    float* hc = hist_pool + ((slot * max_q + t) * C + c) * S;
#pragma unroll
    for (int j = 0; j < kMaxK; ++j)
      if (j < S) hc[j] = win[j];
  }
}

}  // namespace

int short_conv_silu(const bf16* x, int64_t x_ld, const float* w, const float* conv_pool, float* hist_pool,
                    const int32_t* slots, bf16* y, int B, int q_len, int max_q, int64_t C, int K, CUstream_st* stream) {
  if (K < 1 || K > kMaxK || C <= 0 || x_ld < C || B < 0 || q_len < 0 || q_len > max_q) return cudaErrorInvalidValue;
  if (B == 0 || q_len == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((C + kThreads - 1) / kThreads), static_cast<unsigned>(B));
  short_conv_silu_kernel<<<grid, kThreads, 0, stream>>>(reinterpret_cast<const __nv_bfloat16*>(x), x_ld, w, conv_pool,
                                                        hist_pool, slots, reinterpret_cast<__nv_bfloat16*>(y), q_len,
                                                        max_q, C, K);
  return cudaGetLastError();
}

}  // namespace k3::ops::cuda
