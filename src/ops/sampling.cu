// CUDA greedy sampling: one CTA of 1024 threads per row scans the row (float4 loads when
// vocab % 4 == 0 and the logits are 16-byte aligned), keeping the best (logit, id) under
// "larger logit, then lower id" with NaN skipped; warp shuffles and one shared-memory step
// reduce it. The CPU keeps id 0 when logits[0] is NaN (nothing compares greater): so does this.
#include <cmath>

#include "ops/cuda_device.cuh"
#include "ops/sampling.h"

namespace k3::ops::cuda {
namespace {

using detail::aligned16;
using detail::kWarp;

constexpr int kGreedyThreads = 1024;

__device__ __forceinline__ void take(float v, int64_t i, float& bv, int64_t& bi) {
  if (!isnan(v) && (v > bv || (v == bv && i < bi))) bv = v, bi = i;
}

template <int VEC>
__global__ void __launch_bounds__(kGreedyThreads)
    greedy_kernel(const float* __restrict__ logits, int64_t vocab, int32_t* __restrict__ out) {
  __shared__ float red_v[kGreedyThreads / kWarp];
  __shared__ int64_t red_i[kGreedyThreads / kWarp];
  const float* l = logits + static_cast<int64_t>(blockIdx.x) * vocab;
  if (isnan(l[0])) {  // the same for every thread of the block
    if (threadIdx.x == 0) out[blockIdx.x] = 0;
    return;
  }
  float bv = -INFINITY;
  int64_t bi = vocab;  // "none": any real id, even at -inf, comes first
  const int64_t chunks = vocab / VEC;
  for (int64_t c = threadIdx.x; c < chunks; c += kGreedyThreads) {
    if constexpr (VEC == 4) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(l) + c);
      take(v.x, 4 * c, bv, bi);
      take(v.y, 4 * c + 1, bv, bi);
      take(v.z, 4 * c + 2, bv, bi);
      take(v.w, 4 * c + 3, bv, bi);
    } else {
      take(__ldg(l + c), c, bv, bi);
    }
  }
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
    take(ov, oi, bv, bi);
  }
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  if (lane == 0) red_v[warp] = bv, red_i[warp] = bi;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int i = 1; i < kGreedyThreads / kWarp; ++i) take(red_v[i], red_i[i], bv, bi);
    out[blockIdx.x] = static_cast<int32_t>(bi);
  }
}

}  // namespace

int sample_greedy(const float* logits, int64_t rows, int64_t vocab, int32_t* out, CUstream_st* stream) {
  if (rows < 0 || vocab <= 0 || rows > 0x7fffffff || vocab > 0x7fffffff) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const auto grid = static_cast<unsigned>(rows);
  if (vocab % 4 == 0 && aligned16(logits)) {
    greedy_kernel<4><<<grid, kGreedyThreads, 0, stream>>>(logits, vocab, out);
  } else {
    greedy_kernel<1><<<grid, kGreedyThreads, 0, stream>>>(logits, vocab, out);
  }
  return cudaGetLastError();
}

}  // namespace k3::ops::cuda
