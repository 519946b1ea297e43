// The accumulation of linear_rows_kernel's tile (linear.cu), shared with the kernels that end it in another
// epilogue (moe.cu's SiTU-GLU of the MLPs' gate and up): a CTA of kLinThreads threads, kLinOut weight rows
// and up to RT activation rows; its threads split the input dimension in chunks of VEC bf16 (16 bytes when
// VEC = 8), load each weight row's chunk once and apply it to the RT rows, accumulate in FP32, reduce with
// warp shuffles into red, then one fixed-order sum over the warps (red_sum). Every caller that takes the
// same weight rows and rows of x gets the same bits. C++17 (nvcc).
#pragma once

#include <cstdint>

#include "ops/cuda_bf16.cuh"
#include "ops/cuda_device.cuh"
#include "ops/linear.h"

namespace k3::ops::cuda::rows_detail {

constexpr int kLinThreads = 128;
constexpr int kLinOut = 4;  // weight rows (output features) per CTA

// VEC consecutive read-only bf16 -> floats (VEC = 8: one 16-byte load, needs 16-byte alignment).
template <int VEC>
__device__ __forceinline__ void load_ro(const bf16* p, float (&f)[VEC]) {
  if constexpr (VEC == 8) {
    detail::unpack_bf16x8(__ldg(reinterpret_cast<const uint4*>(p)), f);
  } else {
    f[0] = detail::bf16_to_float(__ldg(reinterpret_cast<const unsigned short*>(p)));
  }
}

// Chunks of each weight row a thread loads before the PDL wait (tile_sums with preload).
constexpr int kLinPreload = 2;

// acc[o][r] += the chunk's weights wv[o] times row r0 + r of x at chunk c, in the one order every path uses.
template <int RT, int VEC>
__device__ __forceinline__ void chunk_fma(const bf16* __restrict__ x, const float (&wv)[kLinOut][VEC], int64_t c,
                                          int64_t r0, int nr, int64_t x_ld, float (&acc)[kLinOut][RT]) {
#pragma unroll
  for (int r = 0; r < RT; ++r) {
    if (r < nr) {
      float xv[VEC];
      load_ro<VEC>(x + (r0 + r) * x_ld + c * VEC, xv);
#pragma unroll
      for (int o = 0; o < kLinOut; ++o) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[o][r] = fmaf(xv[i], wv[o][i], acc[o][r]);
      }
    }
  }
}

// red[warp][o RT + r] = warp `warp`'s partial of sum_i x[r0 + r, i] wrow[o][i] (r < nr; x's rows x_ld apart),
// then a barrier. in % VEC == 0.
// preload (the kernel has not yet waited; VEC = 8): each thread issues the loads of its first kLinPreload
// chunks of every weight row, then the PDL wait and trigger, then reads x. The weights are never written by
// a step, so under programmatic dependent launch their first bytes stream in while the previous kernel
// finishes. The chunks are summed in the same order either way: the same bits.
template <int RT, int VEC>
__device__ __forceinline__ void tile_sums(const bf16* __restrict__ x, const bf16* const (&wrow)[kLinOut], int64_t r0,
                                          int nr, int64_t in, int64_t x_ld,
                                          float (&red)[kLinThreads / detail::kWarp][kLinOut * RT],
                                          bool preload = false) {
  float acc[kLinOut][RT];
#pragma unroll
  for (int o = 0; o < kLinOut; ++o) {
#pragma unroll
    for (int r = 0; r < RT; ++r) acc[o][r] = 0.f;
  }

  const int64_t chunks = in / VEC;
  int64_t c = threadIdx.x;
  if constexpr (VEC == 8) {
    if (preload) {
      uint4 raw[kLinPreload][kLinOut];
#pragma unroll
      for (int k = 0; k < kLinPreload; ++k) {
        const int64_t ck = c + int64_t{k} * kLinThreads;
#pragma unroll
        for (int o = 0; o < kLinOut; ++o)
          raw[k][o] = ck < chunks ? __ldg(reinterpret_cast<const uint4*>(wrow[o] + ck * VEC)) : make_uint4(0, 0, 0, 0);
      }
      detail::pdl_wait();
      detail::pdl_launch_dependents();
#pragma unroll
      for (int k = 0; k < kLinPreload; ++k) {
        if (c < chunks) {
          float wv[kLinOut][VEC];
#pragma unroll
          for (int o = 0; o < kLinOut; ++o) detail::unpack_bf16x8(raw[k][o], wv[o]);
          chunk_fma<RT, VEC>(x, wv, c, r0, nr, x_ld, acc);
        }
        c += kLinThreads;
      }
    }
  } else if (preload) {  // (the launchers never ask: element-wise chunks load nothing early)
    detail::pdl_wait();
    detail::pdl_launch_dependents();
  }
#pragma unroll 2
  for (; c < chunks; c += kLinThreads) {
    float wv[kLinOut][VEC];
#pragma unroll
    for (int o = 0; o < kLinOut; ++o) load_ro<VEC>(wrow[o] + c * VEC, wv[o]);
    chunk_fma<RT, VEC>(x, wv, c, r0, nr, x_ld, acc);
  }

  const int lane = threadIdx.x % detail::kWarp, warp = threadIdx.x / detail::kWarp;
#pragma unroll
  for (int o = 0; o < kLinOut; ++o) {
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      const float v = detail::warp_sum(acc[o][r]);
      if (lane == 0) red[warp][o * RT + r] = v;
    }
  }
  __syncthreads();
}

// The projections of one grouped launch (linear_rows_group_kernel, linear_rows_tc_kernel): projection j owns
// blocks [begin[j], begin[j + 1]) of the grid.
struct GroupArgs {
  const bf16* w[kLinearGroupMax];
  void* y[kLinearGroupMax];
  int64_t out[kLinearGroupMax];
  int64_t begin[kLinearGroupMax + 1];
  bool y_f32[kLinearGroupMax];
  const bf16* w_up[kLinearGroupMax];  // GLU members (linear_rows_tc_kernel only), else null
  float glu_beta[kLinearGroupMax], glu_linear_beta[kLinearGroupMax];
  int n;
};

// The projections' pointers and sizes (begin[] left to set_begin).
inline GroupArgs group_args(const LinearOut* outs, int n) {
  GroupArgs g{};
  g.n = n;
  for (int j = 0; j < n; ++j) {
    g.w[j] = outs[j].w;
    g.y[j] = outs[j].y;
    g.out[j] = outs[j].out;
    g.y_f32[j] = outs[j].y_f32;
    g.w_up[j] = outs[j].w_up;
    g.glu_beta[j] = outs[j].glu_beta;
    g.glu_linear_beta[j] = outs[j].glu_linear_beta;
  }
  return g;
}

// begin[] from each projection's block count blocks(j); false when the grid is too large for one launch.
template <typename Blocks>
bool set_begin(GroupArgs& g, Blocks blocks) {
  g.begin[0] = 0;
  for (int j = 0; j < g.n; ++j) g.begin[j + 1] = g.begin[j] + blocks(j);
  for (int j = g.n + 1; j <= kLinearGroupMax; ++j) g.begin[j] = g.begin[g.n];
  return g.begin[g.n] <= 0x7fffffff;
}

// The projection block b belongs to.
__device__ __forceinline__ int group_member(const GroupArgs& g, int64_t b) {
  int j = 0;
#pragma unroll
  for (int k = 1; k < kLinearGroupMax; ++k)
    if (k < g.n && b >= g.begin[k]) j = k;
  return j;
}

// Whether the tile takes 16-byte chunks (VEC = 8) for (x, w): in % 8 == 0 and both 16-byte aligned.
inline bool rows_vec(const bf16* x, const bf16* w, int64_t in) {
  return in % 8 == 0 && detail::aligned16(x) && detail::aligned16(w);
}

// The sum of entry t over the warps, in warp order.
template <int RT>
__device__ __forceinline__ float red_sum(const float (&red)[kLinThreads / detail::kWarp][kLinOut * RT], int t) {
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kLinThreads / detail::kWarp; ++i) s += red[i][t];
  return s;
}

}  // namespace k3::ops::cuda::rows_detail
