// CUDA MoE router (math in router.h). One warp per row: the lanes write the row's biased scores
// (s + bias, NaN as -inf) to shared memory, then k rounds each pick the best untaken expert with
// a strided scan and a warp-shuffle argmax under the CPU's order (score desc, index asc), marking
// it taken (NaN). Lane 0 lists the experts in that order, sums their unbiased s in the same order
// and writes the weights with the CPU's expression.
#include <algorithm>
#include <cmath>

#include "ops/cuda_bf16.cuh"
#include "ops/router.h"

namespace k3::ops::cuda {
namespace {

using detail::kWarp;

constexpr int kRouteMaxWarps = 4;
constexpr int kRouteSmemBytes = 48 * 1024;

__device__ __forceinline__ float sigmoid_ref(float x) { return 1.f / (1.f + expf(-x)); }

// (v, e) before (bv, be) in the selection order; e < 0 means "no candidate".
__device__ __forceinline__ bool better(float v, int e, float bv, int be) {
  if (e < 0) return false;
  if (be < 0) return true;
  return v > bv || (v == bv && e < be);
}

__global__ void __launch_bounds__(kRouteMaxWarps * kWarp)
    route_kernel(const float* __restrict__ logits, const float* __restrict__ bias, int64_t T, int E, int k,
                 bool renormalize, float scale, int32_t* __restrict__ idx, float* __restrict__ w) {
  extern __shared__ float keys_all[];  // [warps][E]
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + warp;
  if (t >= T) return;  // whole warps; no block-wide barrier below
  float* key = keys_all + static_cast<int64_t>(warp) * E;
  const float* lt = logits + t * E;
  for (int e = lane; e < E; e += kWarp) {
    const float b = sigmoid_ref(lt[e]) + (bias != nullptr ? bias[e] : 0.f);
    key[e] = isnan(b) ? -INFINITY : b;
  }
  __syncwarp();

  int32_t* it = idx + t * k;
  float* wt = w + t * k;
  float sum = 0.f;
  for (int i = 0; i < k; ++i) {
    float bv = -INFINITY;
    int be = -1;
    for (int e = lane; e < E; e += kWarp) {
      const float v = key[e];
      if (!isnan(v) && better(v, e, bv, be)) bv = v, be = e;  // NaN: taken in an earlier round
    }
#pragma unroll
    for (int o = kWarp / 2; o > 0; o /= 2) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oe = __shfl_xor_sync(0xffffffffu, be, o);
      if (better(ov, oe, bv, be)) bv = ov, be = oe;
    }
    // A strict total order: every lane holds the same winner, and k <= E guarantees one.
    if (lane == 0) {
      key[be] = NAN;
      const float s = sigmoid_ref(lt[be]);
      it[i] = be;
      wt[i] = s;
      sum += s;
    }
    __syncwarp();
  }
  if (lane == 0) {
    for (int i = 0; i < k; ++i) wt[i] = renormalize ? wt[i] / (sum + 1e-20f) * scale : wt[i] * scale;
  }
}

}  // namespace

int route(const float* logits, const float* bias, int64_t T, int E, int k, bool renormalize, float scale,
          int32_t* idx, float* w, CUstream_st* stream) {
  if (T < 0 || E <= 0 || k <= 0 || k > E || E > kRouteMaxExperts) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  const int warps = std::clamp(kRouteSmemBytes / (E * static_cast<int>(sizeof(float))), 1, kRouteMaxWarps);
  const int64_t blocks = (T + warps - 1) / warps;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  const size_t smem = static_cast<size_t>(warps) * E * sizeof(float);
  route_kernel<<<static_cast<unsigned>(blocks), warps * kWarp, smem, stream>>>(logits, bias, T, E, k, renormalize,
                                                                               scale, idx, w);
  return cudaGetLastError();
}

}  // namespace k3::ops::cuda
