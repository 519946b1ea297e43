// CUDA MoE router (math in router.h): one CTA per row (route_kernel below). One warp per row was
// latency bound (k serial rounds over E / 32 keys per lane: about 40 us per call for K3's 896 experts).
#include <cmath>

#include "ops/cuda_bf16.cuh"
#include "ops/router.h"

namespace k3::ops::cuda {
namespace {

using detail::kWarp;

constexpr int kRouteThreads = 256;

__device__ __forceinline__ float sigmoid_ref(float x) { return 1.f / (1.f + expf(-x)); }

// (v, e) before (bv, be) in the selection order; e < 0 means "no candidate".
__device__ __forceinline__ bool better(float v, int e, float bv, int be) {
  if (e < 0) return false;
  if (be < 0) return true;
  return v > bv || (v == bv && e < be);
}

// One CTA per row: the row's biased scores live in shared memory; each of the k rounds finds the best
// untaken expert with a strided scan per thread, a warp-shuffle argmax and one across the warps, under
// the CPU's order (score desc, index asc), and marks it taken (NaN). Thread 0 lists the experts in that
// order, sums their unbiased s in the same order and writes the weights with the CPU's expression.
__global__ void __launch_bounds__(kRouteThreads)
    route_kernel(const float* __restrict__ logits, const float* __restrict__ bias, int E, int k, bool renormalize,
                 float scale, int32_t* __restrict__ idx, float* __restrict__ w) {
  extern __shared__ float key[];  // [E]
  __shared__ float wv[kRouteThreads / kWarp];
  __shared__ int we[kRouteThreads / kWarp];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t t = blockIdx.x;
  const float* lt = logits + t * E;
  for (int e = threadIdx.x; e < E; e += kRouteThreads) {
    const float b = sigmoid_ref(lt[e]) + (bias != nullptr ? bias[e] : 0.f);
    key[e] = isnan(b) ? -INFINITY : b;
  }
  __syncthreads();
  int32_t* it = idx + t * k;
  float* wt = w + t * k;
  for (int i = 0; i < k; ++i) {
    float bv = -INFINITY;
    int be = -1;
    for (int e = threadIdx.x; e < E; e += kRouteThreads) {
      const float v = key[e];
      if (!isnan(v) && better(v, e, bv, be)) bv = v, be = e;  // NaN: taken in an earlier round
    }
#pragma unroll
    for (int o = kWarp / 2; o > 0; o /= 2) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oe = __shfl_xor_sync(0xffffffffu, be, o);
      if (better(ov, oe, bv, be)) bv = ov, be = oe;
    }
    if (lane == 0) wv[warp] = bv, we[warp] = be;
    __syncthreads();
    if (threadIdx.x == 0) {
      // A strict total order: the winner is unique, and k <= E guarantees one.
      for (int j = 1; j < kRouteThreads / kWarp; ++j)
        if (better(wv[j], we[j], bv, be)) bv = wv[j], be = we[j];
      key[be] = NAN;
      it[i] = be;
    }
    __syncthreads();
  }
  // The chosen experts' unbiased s, loaded in parallel into the scores' place (no longer needed); thread 0
  // sums them in selection order from shared memory.
  for (int i = threadIdx.x; i < k; i += kRouteThreads) key[i] = sigmoid_ref(lt[it[i]]);
  __syncthreads();
  if (threadIdx.x == 0) {
    float sum = 0.f;
    for (int i = 0; i < k; ++i) sum += key[i];
    for (int i = 0; i < k; ++i) wt[i] = renormalize ? key[i] / (sum + 1e-20f) * scale : key[i] * scale;
  }
}

}  // namespace

int route(const float* logits, const float* bias, int64_t T, int E, int k, bool renormalize, float scale,
          int32_t* idx, float* w, CUstream_st* stream) {
  if (T < 0 || E <= 0 || k <= 0 || k > E || E > kRouteMaxExperts) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  if (T > 0x7fffffff) return cudaErrorInvalidValue;
  const size_t smem = static_cast<size_t>(E) * sizeof(float);  // <= 48 KiB: E <= kRouteMaxExperts
  route_kernel<<<static_cast<unsigned>(T), kRouteThreads, smem, stream>>>(logits, bias, E, k, renormalize, scale, idx,
                                                                          w);
  return cudaGetLastError();
}

}  // namespace k3::ops::cuda
