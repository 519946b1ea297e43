// RMSNorm's row pass as a device helper (math in rmsnorm.h), shared by rmsnorm.cu and the kernels that
// end in the norm (the MoE combines, moe_experts.cu and ep.cu: y = RMSNorm(combine), the latent norm).
// One CTA per row of dim = VEC * chunks values with norm_threads(chunks) threads; thread t owns chunks
// t, t + blockDim, ... in every pass, so a producer that wrote the row's chunks with the same ownership
// and summed their squares (rounded to BF16, in chunk order, fmaf) gets the bits rmsnorm_kernel would.
#pragma once

#include <algorithm>
#include <cstdint>

#include "ops/cuda_bf16.cuh"
#include "ops/cuda_device.cuh"

namespace k3::ops::cuda::detail {

constexpr int kNormMaxThreads = 256;

// Threads per row: enough warps for the row's chunks, at most kNormMaxThreads.
inline unsigned norm_threads(int64_t chunks) {
  const int64_t t = std::min<int64_t>(kNormMaxThreads, (chunks + kWarp - 1) / kWarp * kWarp);
  return static_cast<unsigned>(std::max<int64_t>(t, kWarp));
}

// ss += v[i]^2 over one chunk, in order (the sum of squares rmsnorm takes).
template <int VEC>
__device__ __forceinline__ void norm_square_sum(const float (&v)[VEC], float& ss) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) ss = fmaf(v[i], v[i], ss);
}

// The second pass: ss is this thread's part of the row's sum of squares; yr[c] = w * bf16(xr[c] * inv)
// for the chunks this thread owns (xr may be yr). All threads of the CTA must call it.
template <typename W, int VEC>
__device__ __forceinline__ void rmsnorm_row_apply(const bf16* xr, const W* __restrict__ w, bf16* yr, int64_t dim,
                                                  float eps, float ss, float* red) {
  ss = block_sum(ss, red);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
  const int64_t chunks = dim / VEC;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float v[VEC], wv[VEC];
    load_bf16<VEC>(xr + c * VEC, v);
    if constexpr (sizeof(W) == 2) {
      load_bf16<VEC>(w + c * VEC, wv);
    } else if constexpr (VEC == 8) {
      const float4 a = *reinterpret_cast<const float4*>(w + c * VEC);
      const float4 b = *reinterpret_cast<const float4*>(w + c * VEC + 4);
      wv[0] = a.x, wv[1] = a.y, wv[2] = a.z, wv[3] = a.w, wv[4] = b.x, wv[5] = b.y, wv[6] = b.z, wv[7] = b.w;
    } else {
      wv[0] = w[c];
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] = wv[i] * round_bf16_dev(v[i] * inv);
    store_bf16<VEC>(yr + c * VEC, v);
  }
}

// A row that this CTA produces chunk by chunk, then normalizes: make(c, v) gives chunk c's FP32 values; each
// is rounded to BF16 and stored to yr, its squares summed (what rmsnorm's first pass would read back), then
// the row is RMS-normalized in place (w [dim] BF16): the bits of storing the row, then rmsnorm on it.
template <int VEC, typename Make>
__device__ __forceinline__ void rmsnorm_row_produced(Make make, bf16* yr, int64_t dim, const bf16* __restrict__ w,
                                                     float eps, float* red) {
  float ss = 0.f;
  for (int64_t c = threadIdx.x; c < dim / VEC; c += blockDim.x) {
    float v[VEC];
    make(c, v);
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] = round_bf16_dev(v[i]);
    store_bf16<VEC>(yr + c * VEC, v);
    norm_square_sum<VEC>(v, ss);
  }
  rmsnorm_row_apply<bf16, VEC>(yr, w, yr, dim, eps, ss, red);
}

}  // namespace k3::ops::cuda::detail
