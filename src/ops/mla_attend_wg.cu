// The Hopper MLA attend kernel (see mla.h for the math; chosen by mla_attend.cu for dense decode at the K3
// latent shape, R = 512, P = 64, and page sizes TMA can tile, see wg_supported):
//   s_j = scale * (q_lat . entry_j);  o_lat = sum_j exp(s_j - lse) c_kv_j,  lse = log sum_j exp(s_j)
//
// Transposed products, so that the few query rows of a request (q x H = 12..48) are the N side of wgmma
// and the 64 cache entries of a tile (QK) or the 512 latent values (P.V) the M side: no row padding to 64.
//   S^T [64 entries x N rows] = E [64 x 576] Q^T:    A = the entry tile (K-major), B = Q (K-major);
//   O^T [512 x N] += V^T [512 x 64] P^T [64 x N]:     A = the same tile read MN-major (the 64-column block
//                                                     mt of the entries is m tile mt), B = P (K-major).
// A CTA owns the N rows (16, 32 or 48: q x H rounded up, more rows take more CTAs) of one request and one
// context split (flash decoding; lse_merge combines the splits as in mla_attend.cu). 384 threads:
//   warp 8 of warpgroup 2, the producer (warps 9..11 leave at once): 64-entry tiles of the paged cache
//     into a 2-stage ring (73,728 B per stage: nine 128-byte-swizzled 64 x 64 blocks) by TMA (a box per
//     block and page run, the tensor map over the pool as [rows, 576]); the chunk's partial last tile (and
//     a tile with a missing page) by cp.async with zeros past the chunk, so that P.V never reads poison
//     (0 x NaN);
//   warpgroup 0 (warps 0..3): S^T by 36 wgmma m64nNk16 per tile, mask, online softmax in FP32 (column max
//     through shared memory, per-thread partial row sums), p split into BF16 hi + lo (the FP32 weights
//     within ~1e-5, as the mma.sync kernels) written as P (K-major, swizzled, double buffered) with the
//     correction factors, then O^T for latent values 0..255 (two wgmma per fragment: hi, lo);
//   warpgroup 1 (warps 4..7): O^T for latent values 256..511 once P is ready.
// mbarriers: full (TMA bytes or the cp.async arrival), empty (8 warp arrivals: both warpgroups' P.V done
// with the stage), P ready (4), P free (4). Per thread: O^T 4 m tiles x N / 2 FP32; S^T N / 2.
//
// ptxas (sm_90a, nvcc 13.0), each of N = 16, 32, 48: 168 registers at launch (384 threads), setmaxnreg to
// 240 in the consumer warpgroups and 24 in the producer's, no spills, no wgmma serialization. Dynamic shared
// memory (the ring, Q, P, the softmax exchange and 1 KiB of slack for the 1024-byte alignment of the swizzled
// tiles): N = 16: 176,256 B; N = 32: 203,968 B; N = 48: 231,680 B (of the 232,448 B a CTA may opt in to).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <mutex>

#include "ops/cuda_cp_async.cuh"
#include "ops/cuda_device.cuh"
#include "ops/cuda_wgmma.cuh"
#include "ops/mla_attend.cuh"

namespace k3::ops::cuda::mla_detail {
namespace {

using detail::allow_optin_smem;
using detail::fence_proxy_async;
using detail::mbar_arrive;
using detail::mbar_arrive_expect_tx;
using detail::mbar_init;
using detail::mbar_init_fence;
using detail::mbar_wait;
using detail::named_barrier;
using detail::smem_u32;
using detail::tma_load_2d;
using detail::wgmma_commit;
using detail::wgmma_desc_sw128;
using detail::wgmma_fence;
using detail::wgmma_fence_regs;
using detail::wgmma_wait;
using detail::Wgmma;

constexpr int kE = kWgR + kWgP;        // 576 values per cache entry
constexpr int kBlocks = kE / 64;       // 9 blocks of 64 values (128 bytes) per entry
constexpr int kTile = 64;              // entries per tile (= kBN of the split plan)
constexpr int kBlockBytes = kTile * 128;
constexpr int kStageBytes = kBlocks * kBlockBytes;  // 73,728
constexpr int kStages = 2;
constexpr int kThreads = 384;  // two consumer warpgroups and the producer warpgroup (one warp of it works)
constexpr int kProducerWarp = 8;
// setmaxnreg: the registers the producer warpgroup gives back are the ones the consumers take (168 x 384 at
// launch = 128 x 24 + 256 x 240).
constexpr int kProducerRegs = 24, kConsumerRegs = 240;

constexpr int kChunks = kE / 8;  // 16-byte chunks per entry
static_assert(kE % 64 == 0 && kWgR == 512, "the tile layout: 64-value blocks, 8 of them latent");
static_assert(kTile == kBN, "the split plan's tile");

// Byte offsets in the (1024-byte aligned) dynamic shared memory for N rows.
template <int N>
struct WgLayout {
  static constexpr int kv = 0;                              // [kStages][kBlocks][64 entries][128 B]
  static constexpr int q = kv + kStages * kStageBytes;      // [kBlocks][N][128 B]
  static constexpr int p = q + kBlocks * N * 128;           // [2 buffers][hi, lo][N][128 B]
  static constexpr int bars = p + 4 * N * 128;              // 8 mbarriers
  static constexpr int red = bars + 64;                     // f32 [2][4][N] column max per warp
  static constexpr int corr = red + 4 * 2 * 4 * N;          // f32 [2][N]
  static constexpr int lred = corr + 4 * 2 * N;             // f32 [4][N]
  static constexpr int mfin = lred + 4 * 4 * N;             // f32 [N]
  static constexpr int lfin = mfin + 4 * N;                 // f32 [N]
  static constexpr int len = lfin + 4 * N;                  // i32 [N]
  static constexpr int total = len + 4 * N;
  static constexpr int bytes = total + 1024;  // + the alignment slack
  static_assert(N % 16 == 0 && N <= kMaxRows, "N: 16, 32 or 48 rows");
  static_assert(q % 1024 == 0 && p % 1024 == 0 && (N * 128) % 1024 == 0, "swizzled tiles 1024-byte aligned");
};

__device__ __forceinline__ void cp_async16_u32(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void st_shared_u16(uint32_t addr, uint16_t v) {
  asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(addr), "h"(v) : "memory");
}
__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// The pool row of position pos of request b (-1: no page).
__device__ __forceinline__ long long pool_row(const AttendParams& p, int64_t b, int pos) {
  const int pg = pos / p.page_size;
  const int page = pg < p.max_pages ? p.tables[b * p.max_pages + pg] : -1;
  return page >= 0 ? static_cast<long long>(page) * p.page_size + pos % p.page_size : -1LL;
}

template <int N>
__global__ void __launch_bounds__(kThreads, 1)
    mla_attend_wg_kernel(const __grid_constant__ CUtensorMap tmap, const AttendParams p, const int boxr) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
#if K3_SM90A
  using L = WgLayout<N>;
  constexpr int NA = N / 2;  // accumulator floats per m64 tile and thread
  constexpr int NC = N / 4;  // columns (query rows) per thread: n = 8 (c / 2) + 2 (lane % 4) + c % 2
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* sm = smem_raw + (base - raw);
  float* red = reinterpret_cast<float*>(sm + L::red);
  float* corr_s = reinterpret_cast<float*>(sm + L::corr);
  float* lred = reinterpret_cast<float*>(sm + L::lred);
  float* mfin = reinterpret_cast<float*>(sm + L::mfin);
  float* lfin = reinterpret_cast<float*>(sm + L::lfin);
  int* len_s = reinterpret_cast<int*>(sm + L::len);
  const uint32_t kv_s = base + L::kv, q_s = base + L::q, p_s = base + L::p, bar_s = base + L::bars;
  auto full_bar = [&](int s) { return bar_s + 8u * s; };
  auto empty_bar = [&](int s) { return bar_s + 16u + 8u * s; };
  auto pready_bar = [&](int b) { return bar_s + 32u + 8u * b; };
  auto pfree_bar = [&](int b) { return bar_s + 48u + 8u * b; };

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int H = p.H;
  const int64_t b = blockIdx.z, t0 = b * p.q_len;
  const int rows_total = p.q_len * H;
  const int row0 = blockIdx.x * p.rows_per_cta;
  const int nrows = min(p.rows_per_cta, rows_total - row0);
  const int64_t th0 = t0 * H + row0;  // rows are token-major: row r is (token, head) th0 + r
  const int split = blockIdx.y, nsplit = gridDim.y;
  const int64_t TH = p.T * H;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full_bar(s), 1);
      mbar_init(empty_bar(s), 8);
      mbar_init(pready_bar(s), 4);
      mbar_init(pfree_bar(s), 4);
    }
    mbar_init_fence();
  }
  if (warp == kProducerWarp && lane == 0) detail::prefetch_tmap(&tmap);
  for (int r = tid; r < N; r += kThreads) {
    int len = 0;
    if (r < nrows) len = max(0, min(p.ctx_len[t0 + (row0 + r) / H], p.max_len));
    len_s[r] = len;
  }
  // Q (rows past nrows zero) into the K-major swizzled blocks, by the consumers.
  if (tid < 256) {
    for (int i = tid; i < N * kChunks; i += 256) {
      const int r = i / kChunks, c = i - r * kChunks;
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (r < nrows) v = *reinterpret_cast<const uint4*>(p.q_lat + (th0 + r) * kE + c * 8);
      st_shared_v4(q_s + (c >> 3) * (N * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4), v);
    }
    fence_proxy_async();
  }
  __syncthreads();

  int Lmax = 0;
#pragma unroll 4
  for (int r = 0; r < N; ++r) Lmax = max(Lmax, len_s[r]);
  Lmax = __shfl_sync(0xffffffffu, Lmax, 0);  // warp-uniform for ptxas: the tile loops hold wgmma
  // This split's entries [c0, c1): the rows' longest length in nsplit chunks of whole tiles.
  const int64_t chunk = (static_cast<int64_t>(Lmax) + nsplit - 1) / nsplit;
  const int64_t ct = (chunk + kTile - 1) / kTile * kTile;
  const int c0 = static_cast<int>(min(split * ct, static_cast<int64_t>(Lmax)));
  const int c1 = static_cast<int>(min(split * ct + ct, static_cast<int64_t>(Lmax)));
  if (c0 >= c1) {  // no entries: lse -inf; o zeros only where it is the final output (lse_merge skips it)
    for (int r = tid; r < nrows; r += kThreads) p.lse_out[split * TH + th0 + r] = -INFINITY;
    if (nsplit == 1)
      for (int i = tid; i < nrows * kWgR; i += kThreads) p.o_out[th0 * kWgR + i] = 0.f;
    return;
  }
  const int ntiles = (c1 - c0 + kTile - 1) / kTile;

  if (warp >= kProducerWarp) {
    // ------------------------------------------------------------ producer
    detail::setmaxnreg_dec<kProducerRegs>();
    if (warp != kProducerWarp) return;
    const int nbox = kTile / boxr;  // boxes (page runs) per tile
    for (int it = 0; it < ntiles; ++it) {
      const int s = it & 1;
      const uint32_t ph = (it >> 1) & 1;
      const int j0 = c0 + it * kTile, nvalid = min(kTile, c1 - j0);
      const uint32_t dst = kv_s + s * kStageBytes;
      mbar_wait(empty_bar(s), ph ^ 1u);  // both warpgroups are done with the tile 2 before
      if (nvalid == kTile) {
        const long long row = lane < nbox ? pool_row(p, b, j0 + lane * boxr) : 0LL;
        if (__all_sync(0xffffffffu, row >= 0)) {
          if (lane == 0) mbar_arrive_expect_tx(full_bar(s), kStageBytes);
          for (int u = 0; u < nbox; ++u) {
            const int r = static_cast<int>(__shfl_sync(0xffffffffu, row, u));
            if (lane == 0)
#pragma unroll 1
              for (int kb = 0; kb < kBlocks; ++kb)
                tma_load_2d(dst + kb * kBlockBytes + u * boxr * 128, &tmap, kb * 64, r, full_bar(s));
          }
          continue;
        }
      }
      // The partial last tile (or a missing page): 16-byte copies, zeros past the chunk's entries.
      for (int i = lane; i < kTile * kChunks; i += 32) {
        const int e = i / kChunks, c = i - e * kChunks;
        const long long row = e < nvalid ? pool_row(p, b, j0 + e) : -1LL;  // (the table reads hit L1)
        const bool valid = row >= 0;
        cp_async16_u32(dst + (c >> 3) * kBlockBytes + e * 128 + (((c & 7) ^ (e & 7)) << 4),
                       valid ? p.pool + row * kE + c * 8 : p.pool, valid);
      }
      detail::cp_async_wait_all();
      fence_proxy_async();
      __syncwarp();
      if (lane == 0) mbar_arrive(full_bar(s));
    }
    return;
  }

  // ---------------------------------------------------------------- consumers
  detail::setmaxnreg_inc<kConsumerRegs>();
  const int wg = __shfl_sync(0xffffffffu, warp >> 2, 0), wt = warp & 3, g = lane >> 2, tq = lane & 3;
  float o[4][NA];
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int i = 0; i < NA; ++i) o[mt][i] = 0.f;
#pragma unroll
  for (int mt = 0; mt < 4; ++mt) wgmma_fence_regs(o[mt]);  // defined before any wgmma is in flight
  float m_run[NC], l_run[NC];
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    m_run[c] = -INFINITY;
    l_run[c] = 0.f;
  }
  // P.V descriptors: A = the stage's block (4 wg + mt) read MN-major (LBO: the next 64-value block; SBO: the
  // next 8 entries), B = P K-major (SBO: the next 8 rows).
  auto pv_tile = [&](uint32_t kv, uint32_t phi, uint32_t plo) {
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const uint64_t da = wgmma_desc_sw128(kv + (4 * wg + mt) * kBlockBytes + kk * 2048, kBlockBytes, 1024);
        Wgmma<N>::template run<1>(o[mt], da, wgmma_desc_sw128(phi + kk * 32, 16, 1024), 1);
        Wgmma<N>::template run<1>(o[mt], da, wgmma_desc_sw128(plo + kk * 32, 16, 1024), 1);
      }
  };

  if (wg == 0) {
    int lim[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) lim[c] = min(len_s[8 * (c >> 1) + 2 * tq + (c & 1)], c1);
    float sacc[NA];
    for (int it = 0; it < ntiles; ++it) {
      const int s = it & 1;
      const uint32_t ph = (it >> 1) & 1;
      const int j0 = c0 + it * kTile;
      const uint32_t kv = kv_s + s * kStageBytes;
      mbar_wait(full_bar(s), ph);
      // S^T = E Q^T (K = 576: 9 blocks x 4 k steps); also completes the previous tile's P.V.
      wgmma_fence_regs(sacc);
      wgmma_fence();
#pragma unroll
      for (int kb = 0; kb < kBlocks; ++kb)
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          Wgmma<N>::template run<0>(sacc, wgmma_desc_sw128(kv + kb * kBlockBytes + kk * 32, 16, 1024),
                                    wgmma_desc_sw128(q_s + kb * (N * 128) + kk * 32, 16, 1024),
                                    (kb | kk) != 0 ? 1 : 0);
      wgmma_commit();
      wgmma_fence_regs(sacc);
      wgmma_wait<0>();
      wgmma_fence_regs(sacc);
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) wgmma_fence_regs(o[mt]);
      if (it > 0) {
        __syncwarp();
        if (lane == 0) mbar_arrive(empty_bar(s ^ 1));  // this warp's reads of the previous tile are done
      }
      // Scale and mask (entry j visible to row n iff j < min(len_n, c1)), column max over the 64 entries.
      const int e0 = j0 + 16 * wt + g;
      // (Scores and weights in their own registers: only wgmma defines the accumulator, or ptxas serializes.)
      float mx[NC], sv[NC][2];
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const int i = c >> 1, bb = c & 1;
        sv[c][0] = e0 < lim[c] ? p.scale * sacc[4 * i + bb] : -INFINITY;
        sv[c][1] = e0 + 8 < lim[c] ? p.scale * sacc[4 * i + 2 + bb] : -INFINITY;
        mx[c] = fmaxf(sv[c][0], sv[c][1]);
      }
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        mx[c] = fmaxf(mx[c], __shfl_xor_sync(0xffffffffu, mx[c], 4));
        mx[c] = fmaxf(mx[c], __shfl_xor_sync(0xffffffffu, mx[c], 8));
        mx[c] = fmaxf(mx[c], __shfl_xor_sync(0xffffffffu, mx[c], 16));
      }
      float* redp = red + s * 4 * N;
      if (g == 0)
#pragma unroll
        for (int c = 0; c < NC; ++c) redp[wt * N + 8 * (c >> 1) + 2 * tq + (c & 1)] = mx[c];
      named_barrier(1, 128);
      float corr[NC];
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const int n = 8 * (c >> 1) + 2 * tq + (c & 1);
        const float tmax = fmaxf(fmaxf(redp[n], redp[N + n]), fmaxf(redp[2 * N + n], redp[3 * N + n]));
        const float m_new = fmaxf(m_run[c], tmax);
        float cr = 1.f, p0 = 0.f, p1 = 0.f;
        if (m_new != -INFINITY) {
          cr = expf(m_run[c] - m_new);
          p0 = expf(sv[c][0] - m_new);
          p1 = expf(sv[c][1] - m_new);
        }
        m_run[c] = m_new;
        l_run[c] = l_run[c] * cr + (p0 + p1);
        corr[c] = cr;
        sv[c][0] = p0;
        sv[c][1] = p1;
      }
      // P (hi, lo) into buffer s once warpgroup 1 is done with the tile 2 before.
      mbar_wait(pfree_bar(s), ph ^ 1u);
      const uint32_t phi = p_s + (2 * s) * (N * 128), plo = phi + N * 128;
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const int n = 8 * (c >> 1) + 2 * tq + (c & 1);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float pv = sv[c][h];
          const __nv_bfloat16 hi = __float2bfloat16_rn(pv);
          const __nv_bfloat16 lo = __float2bfloat16_rn(pv - __bfloat162float(hi));
          const uint32_t off = n * 128 + (((2 * wt + h) ^ (n & 7)) << 4) + g * 2;
          st_shared_u16(phi + off, __bfloat16_as_ushort(hi));
          st_shared_u16(plo + off, __bfloat16_as_ushort(lo));
        }
        if (wt == 0 && g == 0) corr_s[s * N + n] = corr[c];
      }
      fence_proxy_async();
      __syncwarp();
      if (lane == 0) mbar_arrive(pready_bar(s));
      // O = corr O + P V for latent values 0..255.
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int c = 0; c < NC; ++c) {
          const int i = c >> 1, bb = c & 1;
          o[mt][4 * i + bb] *= corr[c];
          o[mt][4 * i + 2 + bb] *= corr[c];
        }
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) wgmma_fence_regs(o[mt]);
      wgmma_fence();
      pv_tile(kv, phi, plo);
      wgmma_commit();
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) wgmma_fence_regs(o[mt]);
    }
    wgmma_wait<0>();
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) wgmma_fence_regs(o[mt]);
    // l: the thread partials summed over the 8 entry lanes, then the 4 warps (a fixed order).
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      float l = l_run[c];
      l += __shfl_xor_sync(0xffffffffu, l, 4);
      l += __shfl_xor_sync(0xffffffffu, l, 8);
      l += __shfl_xor_sync(0xffffffffu, l, 16);
      if (g == 0) lred[wt * N + 8 * (c >> 1) + 2 * tq + (c & 1)] = l;
    }
    named_barrier(1, 128);
    if (wt == 0 && g == 0)
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const int n = 8 * (c >> 1) + 2 * tq + (c & 1);
        lfin[n] = (lred[n] + lred[N + n]) + (lred[2 * N + n] + lred[3 * N + n]);
        mfin[n] = m_run[c];
      }
  } else {
    for (int it = 0; it < ntiles; ++it) {
      const int s = it & 1;
      const uint32_t ph = (it >> 1) & 1;
      const uint32_t kv = kv_s + s * kStageBytes;
      mbar_wait(full_bar(s), ph);
      mbar_wait(pready_bar(s), ph);
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const int i = c >> 1, bb = c & 1;
        const float cr = corr_s[s * N + 8 * i + 2 * tq + bb];
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
          o[mt][4 * i + bb] *= cr;
          o[mt][4 * i + 2 + bb] *= cr;
        }
      }
      const uint32_t phi = p_s + (2 * s) * (N * 128), plo = phi + N * 128;
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) wgmma_fence_regs(o[mt]);
      wgmma_fence();
      pv_tile(kv, phi, plo);
      wgmma_commit();
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) wgmma_fence_regs(o[mt]);
      wgmma_wait<0>();
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) wgmma_fence_regs(o[mt]);
      __syncwarp();
      if (lane == 0) {
        mbar_arrive(empty_bar(s));
        mbar_arrive(pfree_bar(s));
      }
    }
  }
  named_barrier(2, 256);  // lfin, mfin

  // o = O / l (rows < nrows), lse = m + log l.
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int n = 8 * (c >> 1) + 2 * tq + (c & 1), i = c >> 1, bb = c & 1;
    if (n >= nrows) continue;
    const float l = lfin[n];
    const float inv = l > 0.f ? 1.f / l : 0.f;
    float* orow = p.o_out + (split * TH + th0 + n) * kWgR + 256 * wg + 16 * wt + g;
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
      orow[64 * mt] = o[mt][4 * i + bb] * inv;
      orow[64 * mt + 8] = o[mt][4 * i + 2 + bb] * inv;
    }
  }
  if (tid < nrows) {
    const float l = lfin[tid];
    p.lse_out[split * TH + th0 + tid] = l > 0.f ? mfin[tid] + logf(l) : -INFINITY;
  }
#else
  __trap();
#endif
}

// cuTensorMapEncodeTiled through the runtime's driver entry point (no link against libcuda).
PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) !=
            cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      f = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

struct DeviceFacts {
  int cc_major = 0;
  uint64_t max_rows = 0;  // pool rows a tensor map may span: the device's memory in 576-value entries
};

// Per device, queried once.
DeviceFacts device_facts() {
  static DeviceFacts facts[64];
  static std::once_flag once[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return {};
  std::call_once(once[dev], [dev] {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, dev) != cudaSuccess) return;
    facts[dev].cc_major = prop.major;
    const uint64_t rows = prop.totalGlobalMem / (kE * 2);
    facts[dev].max_rows = rows < (uint64_t{1} << 31) ? rows : (uint64_t{1} << 31) - 1;
  });
  return facts[dev];
}

template <int N>
cudaError_t launch_n(const CUtensorMap& tmap, const AttendParams& p, int boxr, dim3 grid, cudaStream_t stream) {
  cudaError_t err = allow_optin_smem<mla_attend_wg_kernel<N>>();
  if (err != cudaSuccess) return err;
  return detail::launch(mla_attend_wg_kernel<N>, grid, kThreads, WgLayout<N>::bytes, stream, tmap, p, boxr);
}

}  // namespace

bool wg_supported(const AttendParams& p) {
  const int ps = p.page_size;
  const bool tiles = ps > 0 && (ps % kTile == 0 || (ps >= 8 && kTile % ps == 0));
  return p.R == kWgR && p.P == kWgP && tiles && device_facts().cc_major == 9 && encode_tiled() != nullptr;
}

cudaError_t launch_attend_wg(const AttendParams& p, const AttendShape& sh, int splits, int64_t groups,
                             cudaStream_t stream) {
  const DeviceFacts f = device_facts();
  auto encode = encode_tiled();
  if (encode == nullptr || f.max_rows == 0) return cudaErrorNotSupported;
  const int boxr = p.page_size % kTile == 0 ? kTile : p.page_size;
  CUtensorMap tmap{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(kE), static_cast<cuuint64_t>(f.max_rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(kE) * 2};
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(boxr)};
  const cuuint32_t estr[2] = {1, 1};
  if (encode(&tmap, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<bf16raw*>(p.pool), dims, strides, box, estr,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
    return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(sh.mctas), static_cast<unsigned>(splits), static_cast<unsigned>(groups));
  switch (sh.mt) {
    case 1:
      return launch_n<16>(tmap, p, boxr, grid, stream);
    case 2:
      return launch_n<32>(tmap, p, boxr, grid, stream);
    case 3:
      return launch_n<48>(tmap, p, boxr, grid, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace k3::ops::cuda::mla_detail
