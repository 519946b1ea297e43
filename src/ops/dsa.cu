// CUDA kernels of the DSA lightning indexer and its top-k (see dsa.h for the math).
//
//   dsa_index_scores_paged: a CTA (4 warps) owns one token and a chunk of 64 to 512 candidate
//     positions (fewer when the step has few tokens, so the CTAs cover the SMs). q_idx [Hi, Di]
//     and the per-head weights sit in shared memory; key tiles of
//     64 (gathered through the block table with cp.async) are multiplied on tensor cores
//     (mma.sync m16n8k16, BF16 inputs, FP32 accumulation; warp w: keys 16w .. 16w+15,
//     all heads as M tiles), then relu, weighted by w_h and summed over the heads in FP32
//     (in-thread, then over the 8 row groups of the warp with shuffles). Columns past the
//     token's context get -inf.
//   (the top-k, topk_indices: dsa_topk.cu)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "ops/cuda_cp_async.cuh"
#include "ops/cuda_device.cuh"
#include "ops/cuda_mma.cuh"
#include "ops/dsa.h"

namespace k3::ops::cuda {
namespace {

using bf16raw = __nv_bfloat16;

using detail::cp_async16;
using detail::cp_async_commit;
using detail::cp_async_wait;
using detail::ld_u32;
using detail::mma_bf16_16816;

// ---------------------------------------------------------------- indexer scores
constexpr int kIdxWarps = 4;
constexpr int kIdxThreads = kIdxWarps * 32;
constexpr int kKT = 16 * kIdxWarps;  // keys per tile: 16 per warp
constexpr int kIdxMaxChunkTiles = 8;  // candidate positions per CTA: 1 to 8 tiles, by the work (below)
constexpr int kMaxMT = 4;            // M tiles of heads: Hi <= 64

__host__ __device__ inline int idx_dk16(int Di) { return (Di + 15) & ~15; }
__host__ __device__ inline int idx_dk(int Di) { return idx_dk16(Di) + 8; }
inline size_t idx_smem_bytes(int Hi, int Di) {
  const size_t hp = static_cast<size_t>((Hi + 15) & ~15), dk = static_cast<size_t>(idx_dk(Di));
  return 2 * (hp * dk + kKT * dk) + 4 * hp;
}

struct IndexParams {
  const bf16raw* q_idx;    // [T, Hi, Di]
  const float* w;          // [T, Hi]
  const bf16raw* pool;     // [num_pages, page_size, Di]
  const int32_t* tables;   // [B, max_pages]
  const int32_t* ctx_len;  // [T]
  float* scores;           // [T, max_ctx]
  int max_pages, page_size, q_len, max_ctx, Hi, Di;
  int chunk;               // candidate positions per CTA, a multiple of kKT
};

__global__ void __launch_bounds__(kIdxThreads) dsa_index_scores_kernel(const IndexParams p) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  extern __shared__ __align__(16) unsigned char smem[];
  const int Di = p.Di, Hi = p.Hi;
  const int dk16 = idx_dk16(Di), dk = idx_dk(Di);
  const int HP = (Hi + 15) & ~15, MT = HP / 16;
  bf16raw* Qs = reinterpret_cast<bf16raw*>(smem);       // [HP][dk]
  bf16raw* Ks = Qs + HP * dk;                           // [kKT][dk]
  float* ws = reinterpret_cast<float*>(Ks + kKT * dk);  // [HP]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const int64_t t = blockIdx.y;
  const int64_t b = t / p.q_len;
  const int n = max(0, min(p.ctx_len[t], p.max_ctx));
  const int c0 = blockIdx.x * p.chunk;
  const int c_end = min(c0 + p.chunk, p.max_ctx);
  float* srow = p.scores + t * p.max_ctx;
  for (int col = max(c0, n) + tid; col < c_end; col += kIdxThreads) srow[col] = -INFINITY;
  const int c1 = min(c_end, n);
  if (c0 >= c1) return;  // CTA-uniform

  const int cpr = Di / 8;  // 16-byte chunks per key
  for (int i = tid; i < HP * (dk16 / 8); i += kIdxThreads) {
    const int h = i / (dk16 / 8), c = i % (dk16 / 8);
    uint4 val = make_uint4(0u, 0u, 0u, 0u);
    if (h < Hi && c < cpr) val = *reinterpret_cast<const uint4*>(p.q_idx + (t * Hi + h) * Di + c * 8);
    *reinterpret_cast<uint4*>(Qs + h * dk + c * 8) = val;
  }
  for (int h = tid; h < HP; h += kIdxThreads) ws[h] = h < Hi ? p.w[t * Hi + h] : 0.f;
  if (dk16 != Di) {  // K padding of the key tile (Di % 8 == 0: one 16-byte chunk per row)
    for (int i = tid; i < kKT; i += kIdxThreads)
      *reinterpret_cast<uint4*>(Ks + i * dk + Di) = make_uint4(0u, 0u, 0u, 0u);
  }

  for (int j0 = c0; j0 < c1; j0 += kKT) {
    {  // 2 threads per key
      const int kn = tid >> 1, part0 = tid & 1;
      const int pos = j0 + kn;
      bool valid = pos < c1;
      const bf16raw* src = p.pool;
      if (valid) {
        const int pg = pos / p.page_size;
        valid = pg < p.max_pages;
        if (valid) {
          const int64_t page = p.tables[b * p.max_pages + pg];
          valid = page >= 0;
          if (valid) src = p.pool + (page * p.page_size + pos % p.page_size) * Di;
        }
      }
      bf16raw* dst = Ks + kn * dk;
      for (int c = part0; c < cpr; c += 2) cp_async16(dst + c * 8, valid ? src + c * 8 : p.pool, valid);
      cp_async_commit();
      cp_async_wait<0>();
    }
    __syncthreads();

    float acc[kMaxMT][2][4];
#pragma unroll
    for (int mt = 0; mt < kMaxMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;
    const bf16raw* K0 = Ks + (warp * 16 + g) * dk + 2 * tq;
    const bf16raw* K1 = K0 + 8 * dk;
    for (int kk = 0; kk < dk16; kk += 16) {
      const uint32_t b00 = ld_u32(K0 + kk), b01 = ld_u32(K0 + kk + 8);
      const uint32_t b10 = ld_u32(K1 + kk), b11 = ld_u32(K1 + kk + 8);
#pragma unroll
      for (int mt = 0; mt < kMaxMT; ++mt) {
        if (mt < MT) {
          const bf16raw* Qg = Qs + (mt * 16 + g) * dk + 2 * tq + kk;
          const bf16raw* Qg8 = Qg + 8 * dk;
          const uint32_t a0 = ld_u32(Qg), a1 = ld_u32(Qg8), a2 = ld_u32(Qg + 8), a3 = ld_u32(Qg8 + 8);
          mma_bf16_16816(acc[mt][0], a0, a1, a2, a3, b00, b01);
          mma_bf16_16816(acc[mt][1], a0, a1, a2, a3, b10, b11);
        }
      }
    }
    // score = sum_h w_h relu(q_h . k): this thread's rows g, g+8 of each M tile, then over g.
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      float s0 = 0.f, s1 = 0.f;
#pragma unroll
      for (int mt = 0; mt < kMaxMT; ++mt) {
        if (mt < MT) {
          const float w0 = ws[mt * 16 + g], w1 = ws[mt * 16 + g + 8];
          s0 += w0 * fmaxf(acc[mt][nt][0], 0.f) + w1 * fmaxf(acc[mt][nt][2], 0.f);
          s1 += w0 * fmaxf(acc[mt][nt][1], 0.f) + w1 * fmaxf(acc[mt][nt][3], 0.f);
        }
      }
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) {
        s0 += __shfl_xor_sync(0xffffffffu, s0, off);
        s1 += __shfl_xor_sync(0xffffffffu, s1, off);
      }
      if (g == 0) {
        const int col = j0 + warp * 16 + nt * 8 + 2 * tq;
        if (col < c1) srow[col] = s0;
        if (col + 1 < c1) srow[col + 1] = s1;
      }
    }
    __syncthreads();  // the next tile overwrites Ks
  }
}

}  // namespace

int dsa_index_scores_paged(const bf16* q_idx, const float* w, const bf16* key_pool, const int32_t* block_tables,
                           int max_pages, int page_size, const int32_t* ctx_len, int B, int q_len, int max_ctx, int Hi,
                           int Di, float* scores, CUstream_st* stream) {
  if (B < 0 || q_len < 0 || max_ctx < 0 || Hi <= 0 || Hi > 16 * kMaxMT || Di <= 0 || Di % 8 != 0 || page_size <= 0 ||
      max_pages < 0 || (reinterpret_cast<uintptr_t>(q_idx) & 15u) != 0 ||
      (reinterpret_cast<uintptr_t>(key_pool) & 15u) != 0)
    return cudaErrorInvalidValue;
  const int64_t T = static_cast<int64_t>(B) * q_len;
  if (T == 0 || max_ctx == 0) return cudaSuccess;
  if (T > 65535) return cudaErrorInvalidValue;
  IndexParams p{};
  p.q_idx = reinterpret_cast<const bf16raw*>(q_idx);
  p.w = w;
  p.pool = reinterpret_cast<const bf16raw*>(key_pool);
  p.tables = block_tables;
  p.ctx_len = ctx_len;
  p.scores = scores;
  p.max_pages = max_pages;
  p.page_size = page_size;
  p.q_len = q_len;
  p.max_ctx = max_ctx;
  p.Hi = Hi;
  p.Di = Di;
  const size_t smem = idx_smem_bytes(Hi, Di);
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(dsa_index_scores_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  // Each CTA's tiles run one after another (a round trip to memory each): few tokens take one tile per
  // CTA to spread over the SMs (a few CTAs of many tiles each would serialise their round trips on a
  // few SMs), many take up to kIdxMaxChunkTiles per CTA, so the query tile staged per CTA stays a small share of the traffic.
  const int64_t tiles = T * ((max_ctx + kKT - 1) / kKT), want_ctas = 4 * int64_t{detail::device_sm_count()};
  p.chunk = kKT * static_cast<int>(std::clamp<int64_t>((tiles + want_ctas - 1) / want_ctas, 1, kIdxMaxChunkTiles));
  const dim3 grid(static_cast<unsigned>((max_ctx + p.chunk - 1) / p.chunk), static_cast<unsigned>(T));
  return detail::launch(dsa_index_scores_kernel, grid, kIdxThreads, smem, stream, p);
}

}  // namespace k3::ops::cuda
