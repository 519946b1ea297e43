// The MLA attend kernel of 16 query rows per CTA, with its split plan (see mla.h for the math; chosen
// by mla_attend.cu for many groups of at most 16 rows):
//   s_j = scale * (q_lat . entry_j);  o_lat = sum_j exp(s_j - lse) c_kv_j,  lse = log sum_j exp(s_j)
//
// The earlier kernel, kept for many groups of at most 16 rows (q = 1 decode of many requests, DSA over
// many tokens), where it is faster than the 48-row kernel: its small CTAs fit several per SM, so more
// entry streams are in flight. A CTA of 4 warps owns 16 query rows and one chunk of a context in
// 32-entry tiles (46 KiB of shared memory), S through shared memory, P.V fragments gathered
// element-wise. Same partial outputs and merge as the 48-row kernel (mla_attend_mt.cu).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "ops/cuda_cp_async.cuh"
#include "ops/cuda_device.cuh"
#include "ops/cuda_mma.cuh"
#include "ops/mla.h"
#include "ops/mla_attend.cuh"

namespace k3::ops::cuda::mla_detail::tile16 {
namespace {

using detail::allow_optin_smem;
using detail::cp_async16;
using detail::cp_async_commit;
using detail::cp_async_wait;
using detail::ld_u32;
using detail::mma_bf16_16816;

constexpr int kAttWarps = 4;
constexpr int kAttThreads = kAttWarps * 32;
constexpr int kBN = 32;       // cache entries per tile
constexpr int kMRows = 16;    // query rows per CTA (one MMA M tile)
constexpr int kPS = kBN + 8;  // row stride (elements) of the P tiles
constexpr int kSS = kBN + 4;  // row stride (floats) of the score tile
constexpr int kMaxNTW = 16;   // n8 tiles of R per warp: R <= 8 * 16 * 4 = 512
constexpr int kMinChunkTiles = 4;     // a split covers at least 128 entries

static_assert(kAttThreads == kMRows * 8, "softmax mapping: 8 threads per row, 4 columns each");
static_assert(kAttThreads == kBN * 4, "loader mapping: 4 threads per entry");
static_assert(kBN == 8 * kAttWarps, "QK mapping: one n8 tile of entries per warp");

inline size_t attend_smem_bytes(int E) {
  const size_t ek = static_cast<size_t>(attend_es(E));
  return 2 * (kMRows * ek + 2 * kBN * ek + 2 * kMRows * kPS) + 4 * (kMRows * kSS + 3 * kMRows) + 4 * kMRows;
}

struct SplitPlan {
  int splits;
  int chunk;
};

SplitPlan plan_splits(int64_t ctas, int64_t max_len) {
  const int64_t tiles = (max_len + kBN - 1) / kBN;
  if (tiles <= 0) return {1, kBN};
  const int64_t target = max_split_ctas();  // ~2 waves (heuristic only)
  const int64_t want = (target + ctas - 1) / std::max<int64_t>(ctas, 1);
  const int64_t cap = std::max<int64_t>(1, tiles / kMinChunkTiles);
  // At most max_split_ctas() CTAs with splits (so the partials stay inside partial_bound's scratch).
  const int64_t s0 = std::max<int64_t>(1, std::min({want, cap, target / std::max<int64_t>(ctas, 1)}));
  const int64_t chunk_tiles = (tiles + s0 - 1) / s0;
  return {static_cast<int>((tiles + chunk_tiles - 1) / chunk_tiles), static_cast<int>(chunk_tiles * kBN)};
}

using detail::ld_u32;

template <bool INDEXED>
__global__ void __launch_bounds__(kAttThreads) mla_attend16_kernel(const AttendParams p) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  extern __shared__ __align__(16) unsigned char smem[];
  const int E = p.R + p.P;
  const int ek16 = attend_ek16(E), ek = attend_es(E);
  bf16raw* Qs = reinterpret_cast<bf16raw*>(smem);            // [16][ek]
  bf16raw* Es = Qs + kMRows * ek;                            // [2][kBN][ek]
  bf16raw* Phi = Es + 2 * kBN * ek;                          // [16][kPS]
  bf16raw* Plo = Phi + kMRows * kPS;                         // [16][kPS]
  float* Ss = reinterpret_cast<float*>(Plo + kMRows * kPS);  // [16][kSS]
  float* corr_s = Ss + kMRows * kSS;
  float* m_s = corr_s + kMRows;
  float* l_s = m_s + kMRows;
  int* len_s = reinterpret_cast<int*>(l_s + kMRows);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const int H = p.H, R = p.R;
  const int G = INDEXED ? 1 : p.q_len;  // tokens sharing the entries of this CTA
  const int64_t grp = blockIdx.z;
  const int64_t b = INDEXED ? grp / p.q_len : grp;
  const int64_t t0 = INDEXED ? grp : grp * p.q_len;
  const int rows_total = G * H;
  const int mrow0 = blockIdx.x * kMRows;
  const int split = blockIdx.y;

  if (tid < kMRows) {
    const int rr = mrow0 + tid;
    int len = 0;
    if (rr < rows_total) {
      const int64_t tok = t0 + rr / H;
      len = INDEXED ? p.sel_count[tok] : p.ctx_len[tok];
      len = max(0, min(len, p.max_len));
    }
    len_s[tid] = len;
  }
  const int cpr = E / 8;  // 16-byte chunks per entry
  for (int i = tid; i < kMRows * (ek16 / 8); i += kAttThreads) {
    const int r = i / (ek16 / 8), c = i % (ek16 / 8);
    const int rr = mrow0 + r;
    uint4 val = make_uint4(0u, 0u, 0u, 0u);
    if (rr < rows_total && c < cpr) {
      const int64_t tok = t0 + rr / H;
      val = *reinterpret_cast<const uint4*>(p.q_lat + (tok * H + rr % H) * E + c * 8);
    }
    *reinterpret_cast<uint4*>(Qs + r * ek + c * 8) = val;
  }
  if (ek16 != E) {  // the K padding of the entry tiles (E % 8 == 0: one 16-byte chunk per row)
    for (int i = tid; i < 2 * kBN; i += kAttThreads)
      *reinterpret_cast<uint4*>(Es + i * ek + E) = make_uint4(0u, 0u, 0u, 0u);
  }
  __syncthreads();

  int L = 0;
#pragma unroll
  for (int r = 0; r < kMRows; ++r) L = max(L, len_s[r]);
  const int c0 = split * p.chunk;
  const int c1 = min(c0 + p.chunk, L);
  const int lim_g = min(len_s[g], c1), lim_g8 = min(len_s[g + 8], c1);

  // Loader: thread -> entry tid / 4 of the tile, 16-byte chunks tid % 4, +4, ...
  auto load_tile = [&](int j0, int buf) {
    const int n = tid >> 2, part0 = tid & 3;
    const int j = j0 + n;
    bool valid = j < c1;
    const bf16raw* src = p.pool;
    if (valid) {
      const int pos = INDEXED ? p.sel[t0 * p.max_sel + j] : j;
      const int pg = pos >= 0 ? pos / p.page_size : -1;
      valid = pos >= 0 && pg < p.max_pages;
      if (valid) {
        const int64_t page = p.tables[b * p.max_pages + pg];
        valid = page >= 0;
        if (valid) src = p.pool + (page * p.page_size + pos % p.page_size) * E;
      }
    }
    bf16raw* dst = Es + (buf * kBN + n) * ek;
    for (int c = part0; c < cpr; c += 4) cp_async16(dst + c * 8, valid ? src + c * 8 : p.pool, valid);
  };

  const int sr = tid >> 3, sub = tid & 7;  // softmax: row sr, columns 4 sub .. 4 sub + 3
  float m_run = -INFINITY, l_run = 0.f;
  const int NT = (R + 7) / 8;
  const int ntw = (NT + kAttWarps - 1) / kAttWarps;
  float acc[kMaxNTW][4];
#pragma unroll
  for (int i = 0; i < kMaxNTW; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

  if (c0 < c1) load_tile(c0, 0);
  cp_async_commit();
  int it = 0;
  for (int j0 = c0; j0 < c1; j0 += kBN, ++it) {
    const int buf = it & 1;
    if (j0 + kBN < c1) load_tile(j0 + kBN, buf ^ 1);
    cp_async_commit();
    cp_async_wait<1>();  // the tile of this iteration has landed
    __syncthreads();
    const bf16raw* Eb = Es + buf * kBN * ek;

    // S = scale Q E^T: warp w computes the 16 x 8 block of entries 8w .. 8w+7.
    {
      float sc[4] = {0.f, 0.f, 0.f, 0.f};
      const bf16raw* Ew = Eb + (warp * 8 + g) * ek + 2 * tq;
      const bf16raw* Qg = Qs + g * ek + 2 * tq;
      const bf16raw* Qg8 = Qs + (g + 8) * ek + 2 * tq;
      for (int kk = 0; kk < ek16; kk += 16) {
        mma_bf16_16816(sc, ld_u32(Qg + kk), ld_u32(Qg8 + kk), ld_u32(Qg + kk + 8), ld_u32(Qg8 + kk + 8),
                       ld_u32(Ew + kk), ld_u32(Ew + kk + 8));
      }
      const int col = warp * 8 + 2 * tq;
      const int j = j0 + col;
      Ss[g * kSS + col] = j < lim_g ? p.scale * sc[0] : -INFINITY;
      Ss[g * kSS + col + 1] = j + 1 < lim_g ? p.scale * sc[1] : -INFINITY;
      Ss[(g + 8) * kSS + col] = j < lim_g8 ? p.scale * sc[2] : -INFINITY;
      Ss[(g + 8) * kSS + col + 1] = j + 1 < lim_g8 ? p.scale * sc[3] : -INFINITY;
    }
    __syncthreads();

    // Online softmax, FP32: 8 threads per row.
    {
      const float4 s4 = *reinterpret_cast<const float4*>(Ss + sr * kSS + sub * 4);
      float tmax = fmaxf(fmaxf(s4.x, s4.y), fmaxf(s4.z, s4.w));
      tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
      tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
      tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 4));
      const float m_new = fmaxf(m_run, tmax);
      float corr = 1.f, pv[4] = {0.f, 0.f, 0.f, 0.f};
      if (m_new != -INFINITY) {
        corr = expf(m_run - m_new);
        pv[0] = expf(s4.x - m_new);
        pv[1] = expf(s4.y - m_new);
        pv[2] = expf(s4.z - m_new);
        pv[3] = expf(s4.w - m_new);
      }
      float psum = (pv[0] + pv[1]) + (pv[2] + pv[3]);
      psum += __shfl_xor_sync(0xffffffffu, psum, 1);
      psum += __shfl_xor_sync(0xffffffffu, psum, 2);
      psum += __shfl_xor_sync(0xffffffffu, psum, 4);
      l_run = l_run * corr + psum;
      m_run = m_new;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const bf16raw hi = __float2bfloat16_rn(pv[i]);
        Phi[sr * kPS + sub * 4 + i] = hi;
        Plo[sr * kPS + sub * 4 + i] = __float2bfloat16_rn(pv[i] - __bfloat162float(hi));
      }
      if (sub == 0) corr_s[sr] = corr;
    }
    __syncthreads();

    // O = corr O + P E[:, :R]: warp w owns n8 tiles [w ntw, (w+1) ntw) of R.
    {
      const float cg = corr_s[g], cg8 = corr_s[g + 8];
#pragma unroll
      for (int i = 0; i < kMaxNTW; ++i) {
        acc[i][0] *= cg;
        acc[i][1] *= cg;
        acc[i][2] *= cg8;
        acc[i][3] *= cg8;
      }
#pragma unroll
      for (int ks = 0; ks < kBN; ks += 16) {
        const bf16raw* Pg = Phi + g * kPS + ks + 2 * tq;
        const bf16raw* Pg8 = Phi + (g + 8) * kPS + ks + 2 * tq;
        const uint32_t h0 = ld_u32(Pg), h1 = ld_u32(Pg8), h2 = ld_u32(Pg + 8), h3 = ld_u32(Pg8 + 8);
        const bf16raw* Lg = Plo + g * kPS + ks + 2 * tq;
        const bf16raw* Lg8 = Plo + (g + 8) * kPS + ks + 2 * tq;
        const uint32_t l0 = ld_u32(Lg), l1 = ld_u32(Lg8), l2 = ld_u32(Lg + 8), l3 = ld_u32(Lg8 + 8);
        const bf16raw* E0 = Eb + (ks + 2 * tq) * ek;  // entry rows ks+2t, +1, +8, +9
#pragma unroll
        for (int i = 0; i < kMaxNTW; ++i) {
          const int nt = warp * ntw + i;
          if (i < ntw && nt < NT) {
            const int col = nt * 8 + g;
            const uint32_t b0 = pack_bf16(E0[col], E0[ek + col]);
            const uint32_t b1 = pack_bf16(E0[8 * ek + col], E0[9 * ek + col]);
            mma_bf16_16816(acc[i], h0, h1, h2, h3, b0, b1);
            mma_bf16_16816(acc[i], l0, l1, l2, l3, b0, b1);
          }
        }
      }
    }
    __syncthreads();  // the next iteration overwrites Ss, P and the other entry buffer
  }

  if (sub == 0) {
    m_s[sr] = m_run;
    l_s[sr] = l_run;
  }
  __syncthreads();

  const int64_t TH = p.T * H;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = g + 8 * half;
    const int rr = mrow0 + row;
    if (rr >= rows_total) continue;
    const int64_t tok = t0 + rr / H;
    const float l = l_s[row];
    const float inv = l > 0.f ? 1.f / l : 0.f;
    float* orow = p.o_out + (static_cast<int64_t>(split) * TH + tok * H + rr % H) * R;
#pragma unroll
    for (int i = 0; i < kMaxNTW; ++i) {
      const int nt = warp * ntw + i;
      if (i < ntw && nt < NT) {
        const int col = nt * 8 + 2 * tq;
        if (col < R) orow[col] = acc[i][2 * half] * inv;
        if (col + 1 < R) orow[col + 1] = acc[i][2 * half + 1] * inv;
      }
    }
  }
  if (tid < kMRows) {
    const int rr = mrow0 + tid;
    if (rr < rows_total) {
      const int64_t tok = t0 + rr / H;
      const float l = l_s[tid];
      p.lse_out[static_cast<int64_t>(split) * TH + tok * H + rr % H] = l > 0.f ? m_s[tid] + logf(l) : -INFINITY;
    }
  }
}

}  // namespace

template <bool INDEXED>
int launch(AttendParams p, int64_t groups, int rows_per_group, void* scratch, size_t scratch_bytes, float* o_lat,
           float* lse, cudaStream_t stream) {
  const int E = p.R + p.P;
  const int mtiles = (rows_per_group + kMRows - 1) / kMRows;
  const SplitPlan sp = plan_splits(groups * mtiles, p.max_len);
  const size_t need = partial_bytes(sp.splits, p.T, p.H, p.R);
  if (need > 0 && (scratch == nullptr || scratch_bytes < need)) return cudaErrorInvalidValue;
  float* o_parts = o_lat;
  float* lse_parts = lse;
  if (sp.splits > 1) {
    o_parts = static_cast<float*>(scratch);
    lse_parts = o_parts + static_cast<size_t>(sp.splits) * static_cast<size_t>(p.T) * p.H * p.R;
  }
  p.o_out = o_parts;
  p.lse_out = lse_parts;
  p.chunk = sp.chunk;
  const size_t smem = attend_smem_bytes(E);
  cudaError_t err = allow_optin_smem<mla_attend16_kernel<INDEXED>>();
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(mtiles), static_cast<unsigned>(sp.splits), static_cast<unsigned>(groups));
  err = detail::launch(mla_attend16_kernel<INDEXED>, grid, kAttThreads, smem, stream, p);
  if (err != cudaSuccess || sp.splits <= 1) return err;
  return lse_merge(o_parts, lse_parts, sp.splits, p.T, p.H, p.R, o_lat, lse, stream);
}

template int launch<false>(AttendParams, int64_t, int, void*, size_t, float*, float*, cudaStream_t);
template int launch<true>(AttendParams, int64_t, int, void*, size_t, float*, float*, cudaStream_t);

}  // namespace k3::ops::cuda::mla_detail::tile16
