// CUDA pack, assemble, return and combine of the fixed-capacity EP exchange (ops/ep.h).
//   pack, plan: one warp per destination rank scans the routed pairs in order (ballot +
//               popc give each of its pairs the slot the CPU order gives; match_any
//               groups the lanes of one owner, whose count carries over while the
//               owner does not change), then marks its unused slots -1;
//   pack, rows: one CTA per pair copies z[r] into its send slot (16-byte vectors
//               when the row length is a multiple of 8 and aligned);
//   assemble:   one CTA per received slot concatenates the members' slices;
//   return:     one CTA per received slot copies the expert output to its owner's row;
//   combine:    one thread per output element, the row's k pairs in order with
//               __fmul_rn / __fadd_rn (no contraction: the CPU sums exactly); with a
//               RowNorm, one CTA per row of 8-value chunks that then applies the
//               latent RMSNorm (rmsnorm.cuh).
#include <algorithm>

#include "core/cuda.h"
#include "ops/cuda_bf16.cuh"
#include "ops/cuda_device.cuh"
#include "ops/ep.h"
#include "ops/rmsnorm.cuh"

namespace k3::ops::cuda {
namespace {

using detail::aligned16;
using detail::kWarp;

// The shard's sizes as the kernels use them.
struct Plan {
  int64_t pairs, own0, own1;  // routed pairs; own pairs [own0, own1)
  int64_t cs, cap, scap, M, Ls, L;
  int k, experts_per_rank, W, Gs;
};

Plan plan_of(const EpShard& s) {
  return Plan{s.rows * s.k, s.own0() * s.k, (s.own0() + s.own()) * s.k, s.cs, s.cap, int64_t{s.Gs} * s.cap,
              s.meta(), s.Ls, int64_t{s.Gs} * s.Ls, s.k, s.experts_per_rank, s.W, s.Gs};
}

bool valid(const EpShard& s) {
  return s.rows >= 0 && s.k >= 1 && s.Ls >= 1 && s.experts_per_rank >= 1 && s.W >= 1 && s.cs >= 0 && s.cap >= 0 &&
         s.Gs >= 1 && s.W % s.Gs == 0 && s.t >= 0 && s.t < s.Gs && s.rows <= int64_t{s.Gs} * s.cs &&
         s.cs * s.k <= s.cap && int64_t{s.W} * s.meta() <= 0x7fffffff && s.rows * s.k <= 0x7fffffff;
}

__global__ void ep_plan_kernel(const int32_t* __restrict__ idx, Plan p, int32_t* __restrict__ slot,
                               int32_t* __restrict__ send_slot, int32_t* __restrict__ meta) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  const int dest = blockIdx.x, lane = threadIdx.x;
  const unsigned lower = (1u << lane) - 1u;
  int64_t used = 0, used_own = 0;
  int owner = 0;  // the owner of the last pair scanned
  for (int64_t base = 0; base < p.pairs; base += kWarp) {
    const int64_t i = base + lane;
    int d = -1, o = 0x7fffffff;
    int32_t id = -1;
    if (i < p.pairs) {
      id = idx[i];
      d = id >= 0 ? id / p.experts_per_rank : -1;
      if (d >= p.W) d = -1;
      o = static_cast<int>(i / p.k / p.cs);
      if (d < 0 && dest == 0) {
        send_slot[i] = -1;
        if (i >= p.own0 && i < p.own1) slot[i - p.own0] = -1;
      }
    }
    const unsigned mine = __ballot_sync(0xffffffffu, d == dest), same = __match_any_sync(0xffffffffu, o);
    if (d == dest) {
      const int64_t pos = used + __popc(mine & lower);
      const int64_t pos_own = (o == owner ? used_own : 0) + __popc(mine & lower & same);
      send_slot[i] = static_cast<int32_t>(dest * p.scap + pos);
      if (i >= p.own0 && i < p.own1) slot[i - p.own0] = static_cast<int32_t>(dest * p.cap + pos_own);
      meta[dest * p.M + pos] = id;
      if (p.Gs > 1) meta[dest * p.M + p.scap + pos] = static_cast<int32_t>(o * p.cap + pos_own);
    }
    used += __popc(mine);
    const int last = static_cast<int>(p.pairs - 1 - base < kWarp - 1 ? p.pairs - 1 - base : kWarp - 1);
    const int o_last = __shfl_sync(0xffffffffu, o, last);
    const unsigned same_last = __shfl_sync(0xffffffffu, same, last);
    used_own = (o_last == owner ? used_own : 0) + __popc(mine & same_last);
    owner = o_last;
  }
  for (int64_t q = used + lane; q < p.scap; q += kWarp) {
    meta[dest * p.M + q] = -1;
    if (p.Gs > 1) meta[dest * p.M + p.scap + q] = -1;
  }
}

// Copies n / VEC vectors.
template <int VEC>
__device__ __forceinline__ void copy_row(const bf16* __restrict__ src, bf16* __restrict__ dst, int64_t n) {
  for (int64_t c = threadIdx.x; c < n / VEC; c += blockDim.x) {
    if constexpr (VEC == 8)
      reinterpret_cast<uint4*>(dst)[c] = reinterpret_cast<const uint4*>(src)[c];
    else
      dst[c] = src[c];
  }
}

template <int VEC>
__global__ void ep_rows_kernel(const bf16* __restrict__ z, const int32_t* __restrict__ send_slot, Plan p,
                               bf16* __restrict__ send) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  const int64_t i = blockIdx.x;
  const int32_t s = send_slot[i];
  if (s >= 0) copy_row<VEC>(z + (i / p.k) * p.Ls, send + int64_t{s} * p.Ls, p.Ls);
}

template <int VEC>
__global__ void ep_assemble_kernel(const bf16* __restrict__ recv, const int32_t* __restrict__ recv_meta, Plan p,
                                   bf16* __restrict__ z, int32_t* __restrict__ ids, int32_t* __restrict__ codes) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  const int64_t q = blockIdx.x, g = q / p.scap, j = q % p.scap;
  const int32_t id = recv_meta[g * p.Gs * p.M + j];
  if (threadIdx.x == 0) {
    ids[q] = id;
    codes[q] = recv_meta[g * p.Gs * p.M + p.scap + j];
  }
  if (id < 0) return;
  const int64_t per = p.Ls / VEC;
  for (int64_t c = threadIdx.x; c < p.Gs * per; c += blockDim.x) {
    const int64_t t = c / per, cc = c % per;
    const bf16* src = recv + ((g * p.Gs + t) * p.scap + j) * p.Ls;
    bf16* dst = z + q * p.L + t * p.Ls;
    if constexpr (VEC == 8)
      reinterpret_cast<uint4*>(dst)[cc] = reinterpret_cast<const uint4*>(src)[cc];
    else
      dst[cc] = src[cc];
  }
}

template <int VEC>
__global__ void ep_return_kernel(const bf16* __restrict__ out, const int32_t* __restrict__ ids,
                                 const int32_t* __restrict__ codes, Plan p, bf16* __restrict__ back) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  const int64_t q = blockIdx.x;
  if (ids[q] < 0) return;
  const int64_t g = q / p.scap, code = codes[q];
  if (code < 0 || code >= p.scap) return;  // not a code ep_pack writes
  copy_row<VEC>(out + q * p.L, back + ((g * p.Gs + code / p.cap) * p.cap + code % p.cap) * p.L, p.L);
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

// ep_combine_kernel's sums, then RMSNorm (norm_w [L]): one CTA of norm_threads(L / 8) per row, each thread the
// 8-value chunks rmsnorm_kernel would give it, so the bits are those of the two kernels.
__global__ void __launch_bounds__(detail::kNormMaxThreads)
    ep_combine_norm_kernel(const bf16* __restrict__ back, const int32_t* __restrict__ slot,
                           const float* __restrict__ w, int k, int64_t L, bf16* y, const bf16* __restrict__ norm_w,
                           float eps) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  __shared__ float red[kWarp];
  const int64_t r = blockIdx.x;
  detail::rmsnorm_row_produced<8>(
      [&](int64_t c, float (&acc)[8]) {
#pragma unroll
        for (int u = 0; u < 8; ++u) acc[u] = 0.f;
        for (int j = 0; j < k; ++j) {
          const int32_t s = slot[r * k + j];
          if (s < 0) continue;
          const float wj = w[r * k + j];
          float v[8];
          detail::load_bf16<8>(back + int64_t{s} * L + c * 8, v);
#pragma unroll
          for (int u = 0; u < 8; ++u) acc[u] = __fadd_rn(acc[u], __fmul_rn(wj, v[u]));
        }
      },
      y + r * L, L, norm_w, eps, red);
}

// Threads for a row of `chunks` vectors: whole warps, 32..256.
unsigned row_threads(int64_t chunks) {
  return static_cast<unsigned>(std::clamp<int64_t>((chunks + kWarp - 1) / kWarp * kWarp, kWarp, 256));
}

}  // namespace

int ep_pack(const int32_t* idx, const bf16* z, const EpShard& s, int32_t* slot, int32_t* send_slot, int32_t* meta,
            bf16* send, CUstream_st* stream) {
  if (!valid(s)) return cudaErrorInvalidValue;
  if (s.cap == 0) return cudaSuccess;
  const Plan p = plan_of(s);
  if (const cudaError_t e = detail::launch(ep_plan_kernel, s.W, kWarp, 0, stream, idx, p, slot, send_slot, meta);
      e != cudaSuccess || p.pairs == 0)
    return e;
  const bool vec = s.Ls % 8 == 0 && aligned16(z) && aligned16(send);
  const auto grid = static_cast<unsigned>(p.pairs);
  if (vec) return detail::launch(ep_rows_kernel<8>, grid, row_threads(s.Ls / 8), 0, stream, z, send_slot, p, send);
  return detail::launch(ep_rows_kernel<1>, grid, row_threads(s.Ls), 0, stream, z, send_slot, p, send);
}

int ep_assemble(const bf16* recv, const int32_t* recv_meta, const EpShard& s, bf16* z, int32_t* ids, int32_t* codes,
                CUstream_st* stream) {
  if (!valid(s) || s.Gs == 1) return cudaErrorInvalidValue;
  if (s.cap == 0) return cudaSuccess;
  const Plan p = plan_of(s);
  const bool vec = s.Ls % 8 == 0 && aligned16(recv) && aligned16(z);
  const auto grid = static_cast<unsigned>(int64_t{s.W} * s.cap);
  if (vec)
    return detail::launch(ep_assemble_kernel<8>, grid, row_threads(p.L / 8), 0, stream, recv, recv_meta, p, z, ids,
                          codes);
  return detail::launch(ep_assemble_kernel<1>, grid, row_threads(p.L), 0, stream, recv, recv_meta, p, z, ids, codes);
}

int ep_return(const bf16* out, const int32_t* ids, const int32_t* codes, const EpShard& s, bf16* back,
              CUstream_st* stream) {
  if (!valid(s) || s.Gs == 1) return cudaErrorInvalidValue;
  if (s.cap == 0) return cudaSuccess;
  const Plan p = plan_of(s);
  const bool vec = p.L % 8 == 0 && aligned16(out) && aligned16(back);
  const auto grid = static_cast<unsigned>(int64_t{s.W} * s.cap);
  if (vec) return detail::launch(ep_return_kernel<8>, grid, row_threads(p.L / 8), 0, stream, out, ids, codes, p, back);
  return detail::launch(ep_return_kernel<1>, grid, row_threads(p.L), 0, stream, out, ids, codes, p, back);
}

int ep_combine(const bf16* back, const int32_t* slot, const float* w, int64_t rows, int k, int64_t L, bf16* y,
               CUstream_st* stream, const RowNorm& norm) {
  if (rows < 0 || k < 1 || L < 1 || rows > 0x7fffffff) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (norm.w != nullptr) {
    if (L % 8 == 0 && aligned16(back) && aligned16(y) && aligned16(norm.w))
      return detail::launch(ep_combine_norm_kernel, static_cast<unsigned>(rows), detail::norm_threads(L / 8), 0,
                            stream, back, slot, w, k, L, y, norm.w, norm.eps);
    // Rows that do not split into 16-byte chunks: the two kernels.
    if (const int e = ep_combine(back, slot, w, rows, k, L, y, stream); e != 0) return e;
    return rmsnorm(y, norm.w, y, rows, L, norm.eps, stream);
  }
  constexpr int kThreads = 256;
  const auto grid = static_cast<unsigned>(std::min<int64_t>((rows * L + kThreads - 1) / kThreads, 8192));
  return detail::launch(ep_combine_kernel, grid, kThreads, 0, stream, back, slot, w, rows, k, L, y);
}

}  // namespace k3::ops::cuda
