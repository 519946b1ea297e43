// CUDA short causal conv1d + SiLU over a step (see short_conv.h for the math).
//
// One thread per (request, channel): it reads the committed state of its
// channel (K-1 floats) once, keeps the K-wide window in registers, loops the
// request's q_len tokens in order, writes y and keeps each token's input x
// (F32) in the slot's rows of x_kept. Loads of x / stores of y are coalesced
// over channels; the committed state is never written: short_conv_commit
// shifts the accepted inputs into it later. FP32 arithmetic in the CPU's
// order, SiLU as z / (1 + e^-z).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "ops/short_conv.h"

namespace k3::ops::cuda {
namespace {

constexpr int kMaxK = 8;
constexpr int kThreads = 256;

__global__ void short_conv_silu_kernel(const __nv_bfloat16* __restrict__ x, int64_t x_ld, const float* __restrict__ w,
                                       const float* __restrict__ conv_pool, float* __restrict__ x_kept,
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
    if (x_kept != nullptr) x_kept[(slot * max_q + t) * C + c] = xv;
  }
}

__global__ void short_conv_commit_kernel(const float* __restrict__ x_kept, float* __restrict__ conv_pool,
                                         const int32_t* __restrict__ slots, const int32_t* __restrict__ accepted,
                                         int max_q, int64_t C, int K) {
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

int short_conv_silu(const bf16* x, int64_t x_ld, const float* w, const float* conv_pool, float* x_kept,
                    const int32_t* slots, bf16* y, int B, int q_len, int max_q, int64_t C, int K, CUstream_st* stream) {
  if (K < 1 || K > kMaxK || C <= 0 || x_ld < C || B < 0 || q_len < 0 || q_len > max_q) return cudaErrorInvalidValue;
  if (B == 0 || q_len == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((C + kThreads - 1) / kThreads), static_cast<unsigned>(B));
  short_conv_silu_kernel<<<grid, kThreads, 0, stream>>>(reinterpret_cast<const __nv_bfloat16*>(x), x_ld, w, conv_pool,
                                                        x_kept, slots, reinterpret_cast<__nv_bfloat16*>(y), q_len,
                                                        max_q, C, K);
  return cudaGetLastError();
}

int short_conv_commit(const float* x_kept, float* conv_pool, const int32_t* slots, const int32_t* accepted, int B,
                      int max_q, int64_t C, int K, CUstream_st* stream) {
  if (K < 1 || K > kMaxK || C <= 0 || B < 0 || max_q < 1) return cudaErrorInvalidValue;
  if (B == 0 || K == 1) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((C + kThreads - 1) / kThreads), static_cast<unsigned>(B));
  short_conv_commit_kernel<<<grid, kThreads, 0, stream>>>(x_kept, conv_pool, slots, accepted, max_q, C, K);
  return cudaGetLastError();
}

}  // namespace k3::ops::cuda
