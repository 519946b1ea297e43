// CUDA kernels of the absorbed Gated MLA decode (see mla.h for the math).
//
//   mla_absorb_q: per (head, 128 columns of R, 16 tokens) CTA; q_nope of the tokens in
//     shared memory, each thread one column, W_uk read once per CTA (coalesced rows),
//     FP32 sums over dn in the CPU's order, rounded to BF16; q_pe copied through.
//   mla_attend_paged / mla_attend_indexed: flash decoding on tensor cores
//     (mma.sync m16n8k16, BF16 inputs, FP32 accumulation). A CTA (4 warps) owns 16 query
//     rows and one chunk of a context: dense rows are (token, head) pairs of one request,
//     whose q_len tokens share every cache entry; sparse rows are the heads of one token.
//     Entry tiles of 32 (R+P)-wide entries stream through shared memory (cp.async, double
//     buffered, gathered through the block table); S = scale Q E^T (warp w: entries
//     8w..8w+7), an online softmax in FP32 per row, then O += P E[:, :R] with P split into
//     BF16 hi + lo parts (two MMAs, ~16 mantissa bits: the FP32 weights of the CPU within
//     ~1e-5) and O's 512 columns split over the warps. Each chunk writes (o / l, m + log l),
//     and lse_merge combines the chunks exactly as it merges DCP partials.
//   lse_merge: one CTA per (token, head, 128 columns); weights exp(lse_i - max) / sum as the CPU.
//   mla_unabsorb: one warp per output row of W_uv, 8 tokens per CTA from shared memory.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "ops/cuda_bf16.cuh"
#include "ops/mla.h"

namespace k3::ops::cuda {
namespace {

using bf16raw = __nv_bfloat16;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// ---------------------------------------------------------------- absorb
constexpr int kAbsThreads = 128;  // one column of R per thread
constexpr int kAbsTokens = 16;    // tokens per CTA

__global__ void __launch_bounds__(kAbsThreads)
    mla_absorb_q_kernel(const bf16raw* __restrict__ q, const bf16raw* __restrict__ w, bf16raw* __restrict__ q_lat,
                        int64_t T, int H, int dn, int P, int dv, int R) {
  extern __shared__ __align__(16) float qs[];  // [kAbsTokens][dn4] q_nope as FP32, zero padded
  const int dn4 = (dn + 3) & ~3;
  const int h = blockIdx.y;
  const int64_t t0 = static_cast<int64_t>(blockIdx.z) * kAbsTokens;
  const int nt = static_cast<int>(min(static_cast<int64_t>(kAbsTokens), T - t0));
  const int64_t q_stride = dn + P, lat_stride = static_cast<int64_t>(R) + P;
  for (int i = threadIdx.x; i < kAbsTokens * dn4; i += kAbsThreads) {
    const int tt = i / dn4, j = i % dn4;
    qs[i] = (tt < nt && j < dn) ? __bfloat162float(q[((t0 + tt) * H + h) * q_stride + j]) : 0.f;
  }
  if (blockIdx.x == 0) {
    for (int i = threadIdx.x; i < nt * P; i += kAbsThreads) {
      const int tt = i / P, pp = i % P;
      q_lat[((t0 + tt) * H + h) * lat_stride + R + pp] = q[((t0 + tt) * H + h) * q_stride + dn + pp];
    }
  }
  __syncthreads();
  const int col = blockIdx.x * kAbsThreads + threadIdx.x;
  if (col >= R) return;
  const bf16raw* wc = w + static_cast<int64_t>(h) * (dn + dv) * R + col;  // W_uk_h[:, col]
  float acc[kAbsTokens];
#pragma unroll
  for (int tt = 0; tt < kAbsTokens; ++tt) acc[tt] = 0.f;
  for (int i = 0; i < dn4; i += 4) {
    float wv[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) wv[u] = i + u < dn ? __bfloat162float(wc[static_cast<int64_t>(i + u) * R]) : 0.f;
#pragma unroll
    for (int tt = 0; tt < kAbsTokens; ++tt) {
      const float4 qv = *reinterpret_cast<const float4*>(&qs[tt * dn4 + i]);
      acc[tt] += qv.x * wv[0];
      acc[tt] += qv.y * wv[1];
      acc[tt] += qv.z * wv[2];
      acc[tt] += qv.w * wv[3];
    }
  }
#pragma unroll
  for (int tt = 0; tt < kAbsTokens; ++tt)
    if (tt < nt) q_lat[((t0 + tt) * H + h) * lat_stride + col] = __float2bfloat16_rn(acc[tt]);
}

// ---------------------------------------------------------------- unabsorb
constexpr int kUnWarps = 8;   // output rows (of dv) per CTA, one per warp
constexpr int kUnTokens = 8;  // tokens per CTA

__global__ void __launch_bounds__(kUnWarps * 32)
    mla_unabsorb_kernel(const bf16raw* __restrict__ o_lat, const bf16raw* __restrict__ w, bf16raw* __restrict__ o,
                        int64_t T, int H, int dn, int dv, int R) {
  extern __shared__ __align__(16) float os[];  // [kUnTokens][R]
  const int h = blockIdx.y;
  const int64_t t0 = static_cast<int64_t>(blockIdx.z) * kUnTokens;
  const int nt = static_cast<int>(min(static_cast<int64_t>(kUnTokens), T - t0));
  for (int i = threadIdx.x; i < kUnTokens * R; i += kUnWarps * 32) {
    const int tt = i / R, r = i % R;
    os[i] = tt < nt ? __bfloat162float(o_lat[((t0 + tt) * H + h) * R + r]) : 0.f;
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int vrow = blockIdx.x * kUnWarps + warp;
  if (vrow >= dv) return;
  const bf16raw* wr = w + (static_cast<int64_t>(h) * (dn + dv) + dn + vrow) * R;  // W_uv_h[vrow, :]
  float acc[kUnTokens];
#pragma unroll
  for (int tt = 0; tt < kUnTokens; ++tt) acc[tt] = 0.f;
  for (int r = lane; r < R; r += 32) {
    const float wv = __bfloat162float(wr[r]);
#pragma unroll
    for (int tt = 0; tt < kUnTokens; ++tt) acc[tt] += os[tt * R + r] * wv;
  }
#pragma unroll
  for (int tt = 0; tt < kUnTokens; ++tt) {
    const float s = warp_sum(acc[tt]);
    if (lane == 0 && tt < nt) o[((t0 + tt) * H + h) * dv + vrow] = __float2bfloat16_rn(s);
  }
}

// ---------------------------------------------------------------- lse_merge
constexpr int kMergeThreads = 128;
constexpr int kMaxMergeParts = 4096;

// CTA (th, column block): the parts' lse go to shared memory in one parallel pass; every thread then
// forms the max and the sum over them in the CPU's order (from shared memory, fast) and merges its
// column of the block. A serial pass over global memory per thread was latency bound (~50 us at the
// 64 splits of one 8k context).
__global__ void __launch_bounds__(kMergeThreads)
    lse_merge_kernel(const float* __restrict__ o_parts, const float* __restrict__ lse_parts, int D, int64_t TH, int R,
                     float* __restrict__ o, float* __restrict__ lse) {
  extern __shared__ float mw[];  // [D] weights, [D] the parts' lse
  float* ls = mw + D;
  const int64_t th = blockIdx.x;  // t * H + h
  for (int d = threadIdx.x; d < D; d += kMergeThreads) ls[d] = lse_parts[d * TH + th];
  __syncthreads();
  float m = -INFINITY;
  bool any = false;
  for (int d = 0; d < D; ++d) {
    const float l = ls[d];
    if (l == -INFINITY) continue;
    any = true;
    if (l > m) m = l;  // a NaN lse never becomes m but poisons the sum below
  }
  float* oh = o + th * R;
  const int r = blockIdx.y * kMergeThreads + threadIdx.x;
  if (!any) {
    if (r < R) oh[r] = 0.f;
    if (blockIdx.y == 0 && threadIdx.x == 0) lse[th] = -INFINITY;
    return;
  }
  float sum = 0.f;
  for (int d = 0; d < D; ++d) {
    const float l = ls[d];
    if (l == -INFINITY) continue;
    sum += expf(l - m);
  }
  const float inv_sum = 1.f / sum;
  __syncthreads();  // every thread has read ls for the max and the sum
  for (int d = threadIdx.x; d < D; d += kMergeThreads) mw[d] = ls[d] == -INFINITY ? 0.f : expf(ls[d] - m) * inv_sum;
  __syncthreads();
  if (r < R) {
    float acc = 0.f;
    for (int d = 0; d < D; ++d) {
      if (ls[d] == -INFINITY) continue;  // skipped entirely, as the CPU does
      acc += mw[d] * o_parts[(d * TH + th) * R + r];
    }
    oh[r] = acc;
  }
  if (blockIdx.y == 0 && threadIdx.x == 0) lse[th] = m + logf(sum);
}

int launch_lse_merge(const float* o_parts, const float* lse_parts, int D, int64_t T, int H, int R, float* o, float* lse,
                     cudaStream_t stream) {
  if (D < 0 || D > kMaxMergeParts || T < 0 || H <= 0 || R <= 0) return cudaErrorInvalidValue;
  const int64_t TH = T * H;
  if (TH == 0) return cudaSuccess;
  if (TH > 0x7fffffffLL) return cudaErrorInvalidValue;
  const size_t smem = sizeof(float) * 2 * static_cast<size_t>(D);
  const dim3 grid(static_cast<unsigned>(TH), static_cast<unsigned>((R + kMergeThreads - 1) / kMergeThreads));
  lse_merge_kernel<<<grid, kMergeThreads, smem, stream>>>(o_parts, lse_parts, D, TH, R, o, lse);
  return cudaGetLastError();
}

// ---------------------------------------------------------------- attend
constexpr int kAttWarps = 4;
constexpr int kAttThreads = kAttWarps * 32;
constexpr int kBN = 32;       // cache entries per tile
constexpr int kMRows = 16;    // query rows per CTA (one MMA M tile)
constexpr int kPS = kBN + 8;  // row stride (elements) of the P tiles
constexpr int kSS = kBN + 4;  // row stride (floats) of the score tile
constexpr int kMaxNTW = 16;   // n8 tiles of R per warp: R <= 8 * 16 * 4 = 512
constexpr int kMaxR = 8 * kMaxNTW * kAttWarps;
constexpr int kMinChunkTiles = 4;     // a split covers at least 128 entries
constexpr int kTargetCtas = 2 * 132;  // ~2 waves on an H200 (heuristic only)

static_assert(kAttThreads == kMRows * 8, "softmax mapping: 8 threads per row, 4 columns each");
static_assert(kAttThreads == kBN * 4, "loader mapping: 4 threads per entry");
static_assert(kBN == 8 * kAttWarps, "QK mapping: one n8 tile of entries per warp");

__host__ __device__ inline int attend_ek16(int E) { return (E + 15) & ~15; }
__host__ __device__ inline int attend_ek(int E) { return attend_ek16(E) + 8; }  // +16 B: conflict-free fragments
inline size_t attend_smem_bytes(int E) {
  const size_t ek = static_cast<size_t>(attend_ek(E));
  return 2 * (kMRows * ek + 2 * kBN * ek + 2 * kMRows * kPS) + 4 * (kMRows * kSS + 3 * kMRows) + 4 * kMRows;
}

struct AttendParams {
  const bf16raw* q_lat;    // [T, H, E]
  const bf16raw* pool;     // [num_pages, page_size, E]
  const int32_t* tables;   // [B, max_pages]
  const int32_t* ctx_len;  // dense: [T]
  const int32_t* sel;      // sparse: [T, max_sel]
  const int32_t* sel_count;
  float* o_out;    // [splits, T, H, R]
  float* lse_out;  // [splits, T, H]
  int64_t T;
  int max_pages, page_size, max_sel, q_len, H, R, P;
  int max_len;  // upper bound of every row's length (max_ctx or max_sel)
  int chunk;    // entries per split (a multiple of kBN)
  float scale;
};

struct SplitPlan {
  int splits;
  int chunk;
};

SplitPlan plan_splits(int64_t ctas, int64_t max_len) {
  const int64_t tiles = (max_len + kBN - 1) / kBN;
  if (tiles <= 0) return {1, kBN};
  const int64_t want = (kTargetCtas + ctas - 1) / std::max<int64_t>(ctas, 1);
  const int64_t cap = std::max<int64_t>(1, tiles / kMinChunkTiles);
  const int64_t s0 = std::max<int64_t>(1, std::min(want, cap));
  const int64_t chunk_tiles = (tiles + s0 - 1) / s0;
  return {static_cast<int>((tiles + chunk_tiles - 1) / chunk_tiles), static_cast<int>(chunk_tiles * kBN)};
}

size_t partial_bytes(const SplitPlan& sp, int64_t T, int H, int R) {
  if (sp.splits <= 1) return 0;
  const size_t n = static_cast<size_t>(sp.splits) * static_cast<size_t>(T) * static_cast<size_t>(H);
  return (n * static_cast<size_t>(R) + n) * sizeof(float);
}

__device__ __forceinline__ uint32_t ld_u32(const bf16raw* p) { return *reinterpret_cast<const uint32_t*>(p); }
__device__ __forceinline__ uint32_t pack_u32(bf16raw lo, bf16raw hi) {
  return static_cast<uint32_t>(__bfloat16_as_ushort(lo)) | (static_cast<uint32_t>(__bfloat16_as_ushort(hi)) << 16);
}

using detail::cp_async16;
using detail::cp_async_commit;
using detail::mma_bf16_16816;

__device__ __forceinline__ void cp_async_wait_1() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }

template <bool INDEXED>
__global__ void __launch_bounds__(kAttThreads) mla_attend_kernel(const AttendParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int E = p.R + p.P;
  const int ek16 = attend_ek16(E), ek = attend_ek(E);
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
    cp_async_wait_1();  // the tile of this iteration has landed
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
            const uint32_t b0 = pack_u32(E0[col], E0[ek + col]);
            const uint32_t b1 = pack_u32(E0[8 * ek + col], E0[9 * ek + col]);
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

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <bool INDEXED>
int launch_attend(AttendParams p, int64_t groups, int rows_per_group, void* scratch, size_t scratch_bytes, float* o_lat,
                  float* lse, cudaStream_t stream) {
  const int E = p.R + p.P;
  if (p.H <= 0 || p.R <= 0 || p.R > kMaxR || p.P < 0 || E % 8 != 0 || p.page_size <= 0 || p.max_pages < 0 ||
      p.max_len < 0 || p.T < 0 || groups > 65535 || !aligned16(p.q_lat) || !aligned16(p.pool))
    return cudaErrorInvalidValue;
  if (p.T == 0) return cudaSuccess;
  const int mtiles = (rows_per_group + kMRows - 1) / kMRows;
  const SplitPlan sp = plan_splits(groups * mtiles, p.max_len);
  const size_t need = partial_bytes(sp, p.T, p.H, p.R);
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
  cudaError_t err = cudaFuncSetAttribute(mla_attend_kernel<INDEXED>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(mtiles), static_cast<unsigned>(sp.splits), static_cast<unsigned>(groups));
  mla_attend_kernel<INDEXED><<<grid, kAttThreads, smem, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess || sp.splits <= 1) return err;
  return launch_lse_merge(o_parts, lse_parts, sp.splits, p.T, p.H, p.R, o_lat, lse, stream);
}

}  // namespace

int mla_absorb_q(const bf16* q, const bf16* w_kvb, bf16* q_lat, int64_t T, int H, int dn, int P, int dv, int R,
                 CUstream_st* stream) {
  if (T < 0 || H <= 0 || dn <= 0 || P < 0 || dv <= 0 || R <= 0 || H > 65535) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  const int64_t tiles = (T + kAbsTokens - 1) / kAbsTokens;
  if (tiles > 65535) return cudaErrorInvalidValue;
  const size_t smem = sizeof(float) * kAbsTokens * static_cast<size_t>((dn + 3) & ~3);
  if (smem > 48 * 1024) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((R + kAbsThreads - 1) / kAbsThreads), static_cast<unsigned>(H),
                  static_cast<unsigned>(tiles));
  mla_absorb_q_kernel<<<grid, kAbsThreads, smem, stream>>>(reinterpret_cast<const bf16raw*>(q),
                                                           reinterpret_cast<const bf16raw*>(w_kvb),
                                                           reinterpret_cast<bf16raw*>(q_lat), T, H, dn, P, dv, R);
  return cudaGetLastError();
}

size_t mla_attend_paged_scratch_bytes(int B, int q_len, int H, int R, int max_ctx) {
  if (B <= 0 || q_len <= 0 || H <= 0 || R <= 0 || max_ctx <= 0) return 0;
  const int mtiles = (q_len * H + kMRows - 1) / kMRows;
  return partial_bytes(plan_splits(static_cast<int64_t>(B) * mtiles, max_ctx), static_cast<int64_t>(B) * q_len, H, R);
}

int mla_attend_paged(const bf16* q_lat, const bf16* kv_pool, const int32_t* block_tables, int max_pages, int page_size,
                     const int32_t* ctx_len, int B, int q_len, int max_ctx, int H, int R, int P, float scale,
                     float* o_lat, float* lse, void* scratch, size_t scratch_bytes, CUstream_st* stream) {
  if (B < 0 || q_len < 0) return cudaErrorInvalidValue;
  AttendParams p{};
  p.q_lat = reinterpret_cast<const bf16raw*>(q_lat);
  p.pool = reinterpret_cast<const bf16raw*>(kv_pool);
  p.tables = block_tables;
  p.ctx_len = ctx_len;
  p.T = static_cast<int64_t>(B) * q_len;
  p.max_pages = max_pages;
  p.page_size = page_size;
  p.q_len = q_len;
  p.H = H;
  p.R = R;
  p.P = P;
  p.max_len = max_ctx;
  p.scale = scale;
  return launch_attend<false>(p, B, q_len * H, scratch, scratch_bytes, o_lat, lse, stream);
}

size_t mla_attend_indexed_scratch_bytes(int64_t T, int H, int R, int max_sel) {
  if (T <= 0 || H <= 0 || R <= 0 || max_sel <= 0) return 0;
  const int mtiles = (H + kMRows - 1) / kMRows;
  return partial_bytes(plan_splits(T * mtiles, max_sel), T, H, R);
}

int mla_attend_indexed(const bf16* q_lat, const bf16* kv_pool, const int32_t* block_tables, int max_pages,
                       int page_size, const int32_t* sel, const int32_t* sel_count, int max_sel, int B, int q_len,
                       int H, int R, int P, float scale, float* o_lat, float* lse, void* scratch, size_t scratch_bytes,
                       CUstream_st* stream) {
  if (B < 0 || q_len <= 0) return B == 0 ? cudaSuccess : cudaErrorInvalidValue;
  AttendParams p{};
  p.q_lat = reinterpret_cast<const bf16raw*>(q_lat);
  p.pool = reinterpret_cast<const bf16raw*>(kv_pool);
  p.tables = block_tables;
  p.sel = sel;
  p.sel_count = sel_count;
  p.T = static_cast<int64_t>(B) * q_len;
  p.max_pages = max_pages;
  p.page_size = page_size;
  p.max_sel = max_sel;
  p.q_len = q_len;
  p.H = H;
  p.R = R;
  p.P = P;
  p.max_len = max_sel;
  p.scale = scale;
  return launch_attend<true>(p, p.T, H, scratch, scratch_bytes, o_lat, lse, stream);
}

int lse_merge(const float* o_parts, const float* lse_parts, int D, int64_t T, int H, int R, float* o, float* lse,
              CUstream_st* stream) {
  return launch_lse_merge(o_parts, lse_parts, D, T, H, R, o, lse, stream);
}

int mla_unabsorb(const bf16* o_lat, const bf16* w_kvb, bf16* o, int64_t T, int H, int dn, int dv, int R,
                 CUstream_st* stream) {
  if (T < 0 || H <= 0 || dn <= 0 || dv <= 0 || R <= 0 || H > 65535) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  const int64_t tiles = (T + kUnTokens - 1) / kUnTokens;
  const size_t smem = sizeof(float) * kUnTokens * static_cast<size_t>(R);
  if (tiles > 65535 || smem > 48 * 1024) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((dv + kUnWarps - 1) / kUnWarps), static_cast<unsigned>(H),
                  static_cast<unsigned>(tiles));
  mla_unabsorb_kernel<<<grid, kUnWarps * 32, smem, stream>>>(reinterpret_cast<const bf16raw*>(o_lat),
                                                             reinterpret_cast<const bf16raw*>(w_kvb),
                                                             reinterpret_cast<bf16raw*>(o), T, H, dn, dv, R);
  return cudaGetLastError();
}

}  // namespace k3::ops::cuda
