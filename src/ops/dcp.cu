// CUDA DSA DCP top-k steps (ops/dcp.h): candidates and local selection one warp
// per row (ballot + popc keep the order), the scatter one thread per element.
#include <algorithm>

#include "core/cuda.h"
#include "ops/cuda_device.cuh"
#include "ops/dcp.h"

namespace k3::ops::cuda {
namespace {

using detail::kWarp;

__global__ void candidates_kernel(const float* __restrict__ scores, int64_t ld, const int32_t* __restrict__ sel,
                                  const int32_t* __restrict__ n, int64_t T, int k, int D, int r,
                                  float* __restrict__ cand_score, int32_t* __restrict__ cand_pos) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < T * k; e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = e / k;
    const int j = static_cast<int>(e % k);
    if (j < n[t]) {
      cand_score[e] = scores[t * ld + sel[e]];
      cand_pos[e] = sel[e] * D + r;
    } else {
      cand_score[e] = -INFINITY;
      cand_pos[e] = -1;
    }
  }
}

__global__ void fill_kernel(float* __restrict__ x, int64_t count, float v) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < count; e += int64_t{gridDim.x} * blockDim.x)
    x[e] = v;
}

__global__ void scatter_kernel(const float* __restrict__ cand_score, const int32_t* __restrict__ cand_pos, int D,
                               int64_t T, int k, int64_t ld, float* __restrict__ dense) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < D * T * k;
       e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = (e / k) % T;
    const int32_t p = cand_pos[e];
    if (p >= 0 && p < ld) dense[t * ld + p] = cand_score[e];  // positions are distinct across ranks
  }
}

// One warp per row.
__global__ void local_selection_kernel(const int32_t* __restrict__ sel, const int32_t* __restrict__ n, int64_t T,
                                       int k, int D, int r, int32_t* __restrict__ out, int32_t* __restrict__ count) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  const int64_t t = blockIdx.x;
  const int lane = threadIdx.x;
  const int nt = n[t];
  int c = 0;
  for (int base = 0; base < nt; base += kWarp) {
    const int j = base + lane;
    const int32_t p = j < nt ? sel[t * k + j] : -1;
    const bool mine = p >= 0 && p % D == r;
    const unsigned ball = __ballot_sync(0xffffffffu, mine);
    if (mine) out[t * k + c + __popc(ball & ((1u << lane) - 1u))] = p / D;
    c += __popc(ball);
  }
  for (int j = c + lane; j < k; j += kWarp) out[t * k + j] = -1;
  if (lane == 0) count[t] = c;
}

unsigned grid_of(int64_t n, int threads) {
  return static_cast<unsigned>(std::clamp<int64_t>((n + threads - 1) / threads, 1, 8192));
}

}  // namespace

int dcp_topk_candidates(const float* scores, int64_t ld, const int32_t* sel, const int32_t* n, int64_t T, int k, int D,
                        int r, float* cand_score, int32_t* cand_pos, CUstream_st* stream) {
  if (T < 0 || k < 1 || D < 1 || r < 0 || r >= D || ld < 0) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  return detail::launch(candidates_kernel, grid_of(T * k, 256), 256, 0, stream, scores, ld, sel, n, T, k, D, r,
                        cand_score, cand_pos);
}

int dcp_scatter_candidates(const float* cand_score, const int32_t* cand_pos, int D, int64_t T, int k, int64_t ld,
                           float* dense, CUstream_st* stream) {
  if (T < 0 || k < 1 || D < 1 || ld < 0) return cudaErrorInvalidValue;
  if (T == 0 || ld == 0) return cudaSuccess;
  if (const cudaError_t e = detail::launch(fill_kernel, grid_of(T * ld, 256), 256, 0, stream, dense, T * ld, -INFINITY);
      e != cudaSuccess)
    return e;
  return detail::launch(scatter_kernel, grid_of(D * T * k, 256), 256, 0, stream, cand_score, cand_pos, D, T, k, ld,
                        dense);
}

int dcp_local_selection(const int32_t* sel, const int32_t* n, int64_t T, int k, int D, int r, int32_t* out,
                        int32_t* count, CUstream_st* stream) {
  if (T < 0 || k < 1 || D < 1 || r < 0 || r >= D || T > 0x7fffffff) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  return detail::launch(local_selection_kernel, static_cast<unsigned>(T), kWarp, 0, stream, sel, n, T, k, D, r, out,
                        count);
}

}  // namespace k3::ops::cuda
