// CUDA pack and combine of the fixed-capacity EP exchange (ops/ep.h).
//   pack, plan: one warp per destination rank scans the pairs in order (ballot +
//               popc give each of its pairs the slot the CPU order gives), then
//               marks its unused slots -1;
//   pack, rows: one CTA per pair copies z[r] into its slot (16-byte vectors when
//               L % 8 == 0 and aligned);
//   combine:    one thread per output element, the row's k pairs in order with
//               __fmul_rn / __fadd_rn (no contraction: the CPU sums exactly).
#include <algorithm>

#include "core/cuda.h"
#include "ops/cuda_bf16.cuh"
#include "ops/cuda_device.cuh"
#include "ops/ep.h"

namespace k3::ops::cuda {
namespace {

using detail::aligned16;
using detail::kWarp;

__global__ void ep_plan_kernel(const int32_t* __restrict__ idx, int64_t pairs, int experts_per_rank, int W,
                               int64_t cap, int32_t* __restrict__ slot, int32_t* __restrict__ send_ids) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  const int dest = blockIdx.x, lane = threadIdx.x;
  int64_t used = 0;
  for (int64_t base = 0; base < pairs; base += kWarp) {
    const int64_t i = base + lane;
    int d = -1;
    int32_t id = -1;
    if (i < pairs) {
      id = idx[i];
      d = id >= 0 ? id / experts_per_rank : -1;
      if (d >= W) d = -1;
      if (d < 0 && dest == 0) slot[i] = -1;
    }
    const unsigned mine = __ballot_sync(0xffffffffu, d == dest);
    if (d == dest) {
      const int64_t s = dest * cap + used + __popc(mine & ((1u << lane) - 1u));
      slot[i] = static_cast<int32_t>(s);
      send_ids[s] = id;
    }
    used += __popc(mine);
  }
  for (int64_t p = used + lane; p < cap; p += kWarp) send_ids[dest * cap + p] = -1;
}

template <int VEC>
__global__ void ep_rows_kernel(const bf16* __restrict__ z, const int32_t* __restrict__ slot, int k, int64_t L,
                               bf16* __restrict__ send) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  const int64_t i = blockIdx.x;
  const int32_t s = slot[i];
  if (s < 0) return;
  const bf16* src = z + (i / k) * L;
  bf16* dst = send + int64_t{s} * L;
  for (int64_t c = threadIdx.x; c < L / VEC; c += blockDim.x) {
    if constexpr (VEC == 8)
      reinterpret_cast<uint4*>(dst)[c] = reinterpret_cast<const uint4*>(src)[c];
    else
      dst[c] = src[c];
  }
}

__global__ void ep_combine_kernel(const bf16* __restrict__ back, const int32_t* __restrict__ slot,
                                  const float* __restrict__ w, int64_t rows, int k, int64_t L, bf16* __restrict__ y) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < rows * L; e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = e / L, c = e % L;
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) {
      const int32_t s = slot[r * k + j];
      if (s >= 0) acc = __fadd_rn(acc, __fmul_rn(w[r * k + j], detail::bf16_to_float(back[int64_t{s} * L + c])));
    }
    y[e] = detail::float_to_bf16(acc);
  }
}

}  // namespace

int ep_pack(const int32_t* idx, const bf16* z, int64_t rows, int k, int64_t L, int experts_per_rank, int W,
            int64_t cap, int32_t* slot, int32_t* send_ids, bf16* send, CUstream_st* stream) {
  if (rows < 0 || k < 1 || L < 1 || experts_per_rank < 1 || W < 1 || rows * k > cap || W * cap > 0x7fffffff ||
      rows * k > 0x7fffffff)
    return cudaErrorInvalidValue;
  if (cap == 0) return cudaSuccess;
  if (const cudaError_t e =
          detail::launch(ep_plan_kernel, W, kWarp, 0, stream, idx, rows * k, experts_per_rank, W, cap, slot, send_ids);
      e != cudaSuccess || rows == 0)
    return e;
  const bool vec = L % 8 == 0 && aligned16(z) && aligned16(send);
  const int64_t chunks = vec ? L / 8 : L;
  const auto threads = static_cast<unsigned>(std::clamp<int64_t>((chunks + kWarp - 1) / kWarp * kWarp, kWarp, 256));
  const auto grid = static_cast<unsigned>(rows * k);
  if (vec) return detail::launch(ep_rows_kernel<8>, grid, threads, 0, stream, z, slot, k, L, send);
  return detail::launch(ep_rows_kernel<1>, grid, threads, 0, stream, z, slot, k, L, send);
}

int ep_combine(const bf16* back, const int32_t* slot, const float* w, int64_t rows, int k, int64_t L, bf16* y,
               CUstream_st* stream) {
  if (rows < 0 || k < 1 || L < 1) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const auto grid = static_cast<unsigned>(std::min<int64_t>((rows * L + kThreads - 1) / kThreads, 8192));
  return detail::launch(ep_combine_kernel, grid, kThreads, 0, stream, back, slot, w, rows, k, L, y);
}

}  // namespace k3::ops::cuda
