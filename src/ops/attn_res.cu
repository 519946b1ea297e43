// CUDA attn_res (math in attn_res.h), one CTA per row:
//   1. p = bf16(prefix + delta) -> prefix (and blocks[:, block_write_idx]);
//   2. per source s: sum V^2 and dot(norm_w * proj_w, V), FP32 block reductions;
//      score_s = dot * 1 / sqrt(mean(V^2) + eps); softmax in double by one thread (<= 64 sources);
//   3. mix = bf16(sum_s alpha_s V_s) (FP32, sources in order, unfused multiply-add as the CPU) -> out;
//   4. with out_norm_w: out = RMSNorm(mix), re-reading out.
// Every thread owns the same chunks of the row (8 bf16 when dim % 8 == 0 and every pointer is
// 16-byte aligned, else one element) in every pass, so the writes of pass 1 and 3 are its own reads later.
#include <algorithm>

#include "ops/attn_res.h"
#include "ops/cuda_bf16.cuh"

namespace k3::ops::cuda {
namespace {

using detail::aligned16;
using detail::kWarp;

constexpr int kArThreads = 256;

__device__ __forceinline__ float round_bf16_dev(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

template <int VEC>
__global__ void __launch_bounds__(kArThreads) attn_res_kernel(AttnResCudaArgs a) {
  __shared__ float red[kWarp];
  __shared__ float alpha[kAttnResMaxSources];
  __shared__ float score[kAttnResMaxSources];
  const int64_t dim = a.dim, chunks = dim / VEC;
  const int64_t r = blockIdx.x;
  bf16* p = a.prefix + r * dim;
  bf16* blocks_r = a.blocks != nullptr ? a.blocks + r * a.max_blocks * dim : nullptr;
  bf16* block_w = a.block_write_idx >= 0 ? blocks_r + a.block_write_idx * dim : nullptr;

  // 1. p = bf16(prefix + delta), stored to prefix and the block being written.
  if (a.delta != nullptr || block_w != nullptr) {
    const bf16* d = a.delta != nullptr ? a.delta + r * dim : nullptr;
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
      float v[VEC];
      detail::load_bf16<VEC>(p + c * VEC, v);
      if (d != nullptr) {
        float dv[VEC];
        detail::load_bf16<VEC>(d + c * VEC, dv);
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[i] = v[i] + dv[i];
        detail::store_bf16<VEC>(p + c * VEC, v);
      }
      if (block_w != nullptr) detail::store_bf16<VEC>(block_w + c * VEC, v);  // rounds exactly as p
    }
    __syncthreads();
  }

  // 2. Scores of the sources [blocks 0 .. num_blocks - 1, p].
  const int nsrc = a.num_blocks + 1;
  for (int s = 0; s < nsrc; ++s) {
    const bf16* V = s < a.num_blocks ? blocks_r + s * dim : p;
    float ss = 0.f, dot = 0.f;
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
      float v[VEC], nw[VEC], pw[VEC];
      detail::load_bf16<VEC>(V + c * VEC, v);
      detail::load_bf16<VEC>(a.norm_w + c * VEC, nw);
      detail::load_bf16<VEC>(a.proj_w + c * VEC, pw);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        ss = fmaf(v[i], v[i], ss);
        dot = fmaf(nw[i] * pw[i], v[i], dot);  // norm_w * proj_w is exact in FP32
      }
    }
    ss = detail::block_sum(ss, red);
    dot = detail::block_sum(dot, red);
    if (threadIdx.x == 0) score[s] = dot * (1.0f / sqrtf(ss / static_cast<float>(dim) + a.eps));
  }
  if (threadIdx.x == 0) {
    double smax = -INFINITY;
    for (int s = 0; s < nsrc; ++s) smax = fmax(smax, static_cast<double>(score[s]));
    double z = 0.0;
    for (int s = 0; s < nsrc; ++s) z += exp(static_cast<double>(score[s]) - smax);
    for (int s = 0; s < nsrc; ++s) alpha[s] = static_cast<float>(exp(static_cast<double>(score[s]) - smax) / z);
  }
  __syncthreads();

  // 3. mix = bf16(sum_s alpha_s V_s) -> out.
  bf16* o = a.out + r * dim;
  float ss = 0.f;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float m[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) m[i] = 0.f;
    for (int s = 0; s < nsrc; ++s) {
      const bf16* V = s < a.num_blocks ? blocks_r + s * dim : p;
      float v[VEC];
      detail::load_bf16<VEC>(V + c * VEC, v);
      const float al = alpha[s];
#pragma unroll
      for (int i = 0; i < VEC; ++i) m[i] = __fadd_rn(m[i], __fmul_rn(al, v[i]));
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      m[i] = round_bf16_dev(m[i]);
      ss = fmaf(m[i], m[i], ss);
    }
    detail::store_bf16<VEC>(o + c * VEC, m);
  }
  if (a.out_norm_w == nullptr) return;  // uniform over the block

  // 4. out = RMSNorm(mix; out_norm_w, out_eps).
  ss = detail::block_sum(ss, red);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(dim) + a.out_eps);
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float m[VEC], w[VEC];
    detail::load_bf16<VEC>(o + c * VEC, m);
    detail::load_bf16<VEC>(a.out_norm_w + c * VEC, w);
#pragma unroll
    for (int i = 0; i < VEC; ++i) m[i] = w[i] * round_bf16_dev(m[i] * inv);
    detail::store_bf16<VEC>(o + c * VEC, m);
  }
}

}  // namespace

int attn_res(const AttnResCudaArgs& a, CUstream_st* stream) {
  if (a.rows < 0 || a.dim <= 0 || a.rows > 0x7fffffff) return cudaErrorInvalidValue;
  if (a.prefix == nullptr || a.out == nullptr || a.norm_w == nullptr || a.proj_w == nullptr || a.out == a.prefix)
    return cudaErrorInvalidValue;
  if (a.num_blocks < 0 || a.num_blocks > a.max_blocks || a.num_blocks + 1 > kAttnResMaxSources) return cudaErrorInvalidValue;
  if (a.block_write_idx < -1 || a.block_write_idx >= a.max_blocks) return cudaErrorInvalidValue;
  if (a.blocks == nullptr && (a.num_blocks > 0 || a.block_write_idx >= 0)) return cudaErrorInvalidValue;
  if (a.rows == 0) return cudaSuccess;
  const bool vec = a.dim % 8 == 0 && aligned16(a.prefix) && aligned16(a.delta) && aligned16(a.blocks) &&
                   aligned16(a.norm_w) && aligned16(a.proj_w) && aligned16(a.out_norm_w) && aligned16(a.out);
  const int64_t chunks = vec ? a.dim / 8 : a.dim;
  const auto threads =
      static_cast<unsigned>(std::max<int64_t>(kWarp, std::min<int64_t>(kArThreads, (chunks + kWarp - 1) / kWarp * kWarp)));
  const auto grid = static_cast<unsigned>(a.rows);
  if (vec) {
    attn_res_kernel<8><<<grid, threads, 0, stream>>>(a);
  } else {
    attn_res_kernel<1><<<grid, threads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

}  // namespace k3::ops::cuda
