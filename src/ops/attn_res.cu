// CUDA attn_res (math in attn_res.h).
//
// Main path (sm_90+, the decode path): one thread-block cluster of cs CTAs per row (cs <= 8, chosen
// from rows and the SM count so that small row counts still spread over many SMs). CTA k of a cluster
// owns the k-th contiguous slice of the row's 16-byte chunks; every thread owns the same chunks of
// that slice in every pass, so what it writes (p, the block, the mix) it alone reads back later.
//   1. p = bf16(prefix + delta) -> prefix (and blocks[:, block_write_idx]), fused with
//   2. per source s: slice partial sums of V^2 and (norm_w * proj_w) . V (FP32, up to kGroup sources
//      loaded at once); CTA partials go to shared memory, the cluster barrier publishes them and
//      every CTA sums the cs partials over distributed shared memory in rank order (so every CTA of
//      the row gets bitwise the same totals and alphas); scores and softmax (exp in double, one thread
//      per source, the sum z in source order as the CPU);
//   3. mix = bf16(sum_s alpha_s V_s) (FP32, sources in order, unfused multiply-add as the CPU) -> out;
//   4. with out_norm_w: the slice sums of mix^2 are exchanged the same way; out = RMSNorm(mix),
//      re-reading the thread's own out.
// A CTA must not exit while another CTA of its cluster may still read its shared memory: the last
// remote read of each CTA is followed by a cluster barrier arrive, and every CTA waits on it last.
//
// Fallback (pre-sm_90 device, or rows * cs past the grid limit): the one-CTA-per-row kernel below.
// Both paths: 8 bf16 per chunk when dim % 8 == 0 and every pointer is 16-byte aligned, else one.
#include <cooperative_groups.h>

#include <algorithm>
#include <climits>

#include "ops/attn_res.h"
#include "ops/cuda_bf16.cuh"

namespace k3::ops::cuda {
namespace {

using detail::aligned16;
using detail::kWarp;

constexpr int kArThreads = 256;

using detail::round_bf16_dev;

template <int VEC>
__global__ void __launch_bounds__(kArThreads) attn_res_kernel(AttnResCudaArgs a) {
  __shared__ float red[kWarp];
  __shared__ float alpha[kAttnResMaxSources];
  __shared__ float score[kAttnResMaxSources];
  const int64_t dim = a.dim, chunks = dim / VEC;
  const int64_t r = blockIdx.x;
  bf16* p = a.prefix + r * dim;
  bf16* blocks_r = a.blocks != nullptr ? a.blocks + r * a.max_blocks * dim : nullptr;
  bf16* block_w = a.block_write_idx >= 0 ? blocks_r + a.block_write_idx * dim : nullptr;

  // 1. p = bf16(prefix + delta), stored to prefix and the block being written.
  if (a.delta != nullptr || block_w != nullptr) {
    const bf16* d = a.delta != nullptr ? a.delta + r * dim : nullptr;
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
      float v[VEC];
      detail::load_bf16<VEC>(p + c * VEC, v);
      if (d != nullptr) {
        float dv[VEC];
        detail::load_bf16<VEC>(d + c * VEC, dv);
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[i] = v[i] + dv[i];
        detail::store_bf16<VEC>(p + c * VEC, v);
      }
      if (block_w != nullptr) detail::store_bf16<VEC>(block_w + c * VEC, v);  // rounds exactly as p
    }
    __syncthreads();
  }

  // 2. Scores of the sources [blocks 0 .. num_blocks - 1, p].
  const int nsrc = a.num_blocks + 1;
  for (int s = 0; s < nsrc; ++s) {
    const bf16* V = s < a.num_blocks ? blocks_r + s * dim : p;
    float ss = 0.f, dot = 0.f;
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
      float v[VEC], nw[VEC], pw[VEC];
      detail::load_bf16<VEC>(V + c * VEC, v);
      detail::load_bf16<VEC>(a.norm_w + c * VEC, nw);
      detail::load_bf16<VEC>(a.proj_w + c * VEC, pw);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        ss = fmaf(v[i], v[i], ss);
        dot = fmaf(nw[i] * pw[i], v[i], dot);  // norm_w * proj_w is exact in FP32
      }
    }
    ss = detail::block_sum(ss, red);
    dot = detail::block_sum(dot, red);
    if (threadIdx.x == 0) score[s] = dot * (1.0f / sqrtf(ss / static_cast<float>(dim) + a.eps));
  }
  if (threadIdx.x == 0) {
    double smax = -INFINITY;
    for (int s = 0; s < nsrc; ++s) smax = fmax(smax, static_cast<double>(score[s]));
    double z = 0.0;
    for (int s = 0; s < nsrc; ++s) z += exp(static_cast<double>(score[s]) - smax);
    for (int s = 0; s < nsrc; ++s) alpha[s] = static_cast<float>(exp(static_cast<double>(score[s]) - smax) / z);
  }
  __syncthreads();

  // 3. mix = bf16(sum_s alpha_s V_s) -> out.
  bf16* o = a.out + r * dim;
  float ss = 0.f;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float m[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) m[i] = 0.f;
    for (int s = 0; s < nsrc; ++s) {
      const bf16* V = s < a.num_blocks ? blocks_r + s * dim : p;
      float v[VEC];
      detail::load_bf16<VEC>(V + c * VEC, v);
      const float al = alpha[s];
#pragma unroll
      for (int i = 0; i < VEC; ++i) m[i] = __fadd_rn(m[i], __fmul_rn(al, v[i]));
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      m[i] = round_bf16_dev(m[i]);
      ss = fmaf(m[i], m[i], ss);
    }
    detail::store_bf16<VEC>(o + c * VEC, m);
  }
  if (a.out_norm_w == nullptr) return;  // uniform over the block

  // 4. out = RMSNorm(mix; out_norm_w, out_eps).
  ss = detail::block_sum(ss, red);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(dim) + a.out_eps);
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float m[VEC], w[VEC];
    detail::load_bf16<VEC>(o + c * VEC, m);
    detail::load_bf16<VEC>(a.out_norm_w + c * VEC, w);
#pragma unroll
    for (int i = 0; i < VEC; ++i) m[i] = w[i] * round_bf16_dev(m[i] * inv);
    detail::store_bf16<VEC>(o + c * VEC, m);
  }
}


// ---------------------------------------------------------------------------------------------
// The cluster kernel.

constexpr int kArClusterThreads = 256;
constexpr int kArClusterWarps = kArClusterThreads / kWarp;
constexpr int kArMaxCluster = 8;  // the portable cluster size
constexpr int kGroup = 16;        // sources whose chunk loads are in flight together

template <int VEC>
struct RawChunk;
template <>
struct RawChunk<8> {
  uint4 v;
  __device__ __forceinline__ void load(const k3::bf16* p) { v = *reinterpret_cast<const uint4*>(p); }
  __device__ __forceinline__ void unpack(float (&f)[8]) const { detail::unpack_bf16x8(v, f); }
};
template <>
struct RawChunk<1> {
  uint16_t v;
  __device__ __forceinline__ void load(const k3::bf16* p) { v = p->bits; }
  __device__ __forceinline__ void unpack(float (&f)[1]) const { f[0] = detail::bf16_to_float(v); }
};

// grid.x = rows * cs, cluster (cs, 1, 1): cluster r is row r, its CTA k (= block rank) slice k.
template <int VEC>
__global__ void __launch_bounds__(kArClusterThreads) attn_res_cluster_kernel(AttnResCudaArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  __shared__ float part[kArClusterWarps][2 * kAttnResMaxSources];  // per warp: (sum V^2, dot) per source
  __shared__ float csum[2 * kAttnResMaxSources];                   // this CTA's partials, read by the cluster
  __shared__ float tot[2 * kAttnResMaxSources];                    // the row's totals
  __shared__ float score[kAttnResMaxSources];
  __shared__ double ex[kAttnResMaxSources];
  __shared__ float alpha[kAttnResMaxSources];
  __shared__ float red[kArClusterWarps];
  __shared__ float cnorm;  // this CTA's sum of mix^2, read by the cluster
  __shared__ float onorm;  // the row's sum of mix^2

  cg::cluster_group cluster = cg::this_cluster();
  const int cs = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t dim = a.dim, chunks = dim / VEC;
  const int64_t r = blockIdx.x / cs;
  const int64_t per = (chunks + cs - 1) / cs;
  const int64_t c0 = std::min<int64_t>(chunks, rank * per), c1 = std::min<int64_t>(chunks, c0 + per);
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;
  const int warps = (blockDim.x + kWarp - 1) / kWarp;
  const int nb = a.num_blocks, nsrc = nb + 1, wi = a.block_write_idx;

  bf16* p = a.prefix + r * dim;
  const bf16* d = a.delta != nullptr ? a.delta + r * dim : nullptr;
  bf16* blocks_r = a.blocks != nullptr ? a.blocks + r * a.max_blocks * dim : nullptr;
  bf16* block_w = wi >= 0 ? blocks_r + wi * dim : nullptr;

  // 1 + 2. p, and the slice partials of every source, kGroup sources at a time. The first group's
  // pass computes and stores p; later groups read p back (from prefix / blocks[wi], stored by this
  // thread in the first pass).
  for (int s0 = 0; s0 < nsrc; s0 += kGroup) {
    const bool first = s0 == 0;
    float ss[kGroup], dt[kGroup];
#pragma unroll
    for (int j = 0; j < kGroup; ++j) ss[j] = dt[j] = 0.f;
    for (int64_t c = c0 + tid; c < c1; c += blockDim.x) {
      const int64_t off = c * VEC;
      // The loads first, all in flight together: in the first pass they skip p and blocks[wi], the
      // only memory this kernel writes before reading, so they may go before the stores below.
      RawChunk<VEC> raw[kGroup];
#pragma unroll
      for (int j = 0; j < kGroup; ++j) {
        const int s = s0 + j;
        if (s < nsrc && !(first && (s == nb || s == wi))) raw[j].load((s < nb ? blocks_r + s * dim : p) + off);
      }
      float nw[VEC], pw[VEC];
      detail::load_bf16<VEC>(a.norm_w + off, nw);
      detail::load_bf16<VEC>(a.proj_w + off, pw);
      float pv[VEC];
      if (first) {
        detail::load_bf16<VEC>(p + off, pv);
        if (d != nullptr) {
          float dv[VEC];
          detail::load_bf16<VEC>(d + off, dv);
#pragma unroll
          for (int i = 0; i < VEC; ++i) pv[i] = round_bf16_dev(pv[i] + dv[i]);
          detail::store_bf16<VEC>(p + off, pv);
        }
        if (block_w != nullptr) detail::store_bf16<VEC>(block_w + off, pv);  // exact: pv is a bf16 value
      }
#pragma unroll
      for (int j = 0; j < kGroup; ++j) {
        const int s = s0 + j;
        if (s < nsrc) {
          float v[VEC];
          if (first && (s == nb || s == wi)) {
#pragma unroll
            for (int i = 0; i < VEC; ++i) v[i] = pv[i];
          } else {
            raw[j].unpack(v);
          }
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            ss[j] = fmaf(v[i], v[i], ss[j]);
            dt[j] = fmaf(nw[i] * pw[i], v[i], dt[j]);  // norm_w * proj_w is exact in FP32
          }
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      const int s = s0 + j;
      if (s < nsrc) {  // uniform over the block
        const float x = detail::warp_sum(ss[j]), y = detail::warp_sum(dt[j]);
        if (lane == 0) {
          part[warp][2 * s] = x;
          part[warp][2 * s + 1] = y;
        }
      }
    }
  }
  __syncthreads();
  for (int t = tid; t < 2 * nsrc; t += blockDim.x) {  // blockDim may be below 2 * nsrc (small dims)
    float x = 0.f;
    for (int w = 0; w < warps; ++w) x += part[w][t];
    csum[t] = x;
  }
  cluster.sync();  // every CTA's csum is written and visible to the cluster
  for (int t = tid; t < 2 * nsrc; t += blockDim.x) {
    float x = 0.f;
    for (int k = 0; k < cs; ++k) x += cluster.map_shared_rank(csum, k)[t];  // rank order: the same in every CTA
    tot[t] = x;
  }
  __syncthreads();
  const bool norm = a.out_norm_w != nullptr;
  if (!norm) cluster.barrier_arrive();  // this CTA's last remote read is done (waited on before exit)

  // Scores and softmax, as the CPU: smax and z over the sources in order, exp in double.
  for (int t = tid; t < nsrc; t += blockDim.x)
    score[t] = tot[2 * t + 1] * (1.0f / sqrtf(tot[2 * t] / static_cast<float>(dim) + a.eps));
  __syncthreads();
  for (int t = tid; t < nsrc; t += blockDim.x) {
    double smax = -INFINITY;
    for (int s = 0; s < nsrc; ++s) smax = fmax(smax, static_cast<double>(score[s]));
    ex[t] = exp(static_cast<double>(score[t]) - smax);
  }
  __syncthreads();
  for (int t = tid; t < nsrc; t += blockDim.x) {
    double z = 0.0;
    for (int s = 0; s < nsrc; ++s) z += ex[s];
    alpha[t] = static_cast<float>(ex[t] / z);
  }
  __syncthreads();

  // 3. mix = bf16(sum_s alpha_s V_s) -> out, sources in order.
  bf16* o = a.out + r * dim;
  float msq = 0.f;
  float m0[VEC], w0[VEC];  // the thread's first chunk: its mix and out_norm_w, kept for step 4
  for (int64_t c = c0 + tid; c < c1; c += blockDim.x) {
    const int64_t off = c * VEC;
    float m[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) m[i] = 0.f;
    for (int s0 = 0; s0 < nsrc; s0 += kGroup) {
      RawChunk<VEC> raw[kGroup];
#pragma unroll
      for (int j = 0; j < kGroup; ++j) {
        const int s = s0 + j;
        if (s < nsrc) raw[j].load((s < nb ? blocks_r + s * dim : p) + off);
      }
#pragma unroll
      for (int j = 0; j < kGroup; ++j) {
        const int s = s0 + j;
        if (s < nsrc) {
          float v[VEC];
          raw[j].unpack(v);
          const float al = alpha[s];
#pragma unroll
          for (int i = 0; i < VEC; ++i) m[i] = __fadd_rn(m[i], __fmul_rn(al, v[i]));
        }
      }
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      m[i] = round_bf16_dev(m[i]);
      msq = fmaf(m[i], m[i], msq);
    }
    detail::store_bf16<VEC>(o + off, m);
    if (norm && c == c0 + tid) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) m0[i] = m[i];
      detail::load_bf16<VEC>(a.out_norm_w + off, w0);
    }
  }

  if (norm) {
    // 4. out = RMSNorm(mix; out_norm_w, out_eps), the row's sum of mix^2 exchanged as the partials.
    msq = detail::warp_sum(msq);
    if (lane == 0) red[warp] = msq;
    __syncthreads();
    if (tid == 0) {
      float t = 0.f;
      for (int w = 0; w < warps; ++w) t += red[w];
      cnorm = t;
    }
    cluster.sync();  // every cnorm visible (and every remote read of csum done)
    if (tid == 0) {
      float t = 0.f;
      for (int k = 0; k < cs; ++k) t += *cluster.map_shared_rank(&cnorm, k);
      onorm = t;
    }
    __syncthreads();
    cluster.barrier_arrive();  // this CTA's last remote read is done
    const float inv = 1.0f / sqrtf(onorm / static_cast<float>(dim) + a.out_eps);
    for (int64_t c = c0 + tid; c < c1; c += blockDim.x) {
      const int64_t off = c * VEC;
      float m[VEC], w[VEC];
      if (c == c0 + tid) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          m[i] = m0[i];
          w[i] = w0[i];
        }
      } else {
        detail::load_bf16<VEC>(o + off, m);  // this thread's own store of step 3
        detail::load_bf16<VEC>(a.out_norm_w + off, w);
      }
#pragma unroll
      for (int i = 0; i < VEC; ++i) m[i] = w[i] * round_bf16_dev(m[i] * inv);
      detail::store_bf16<VEC>(o + off, m);
    }
  }
  cluster.barrier_wait();  // no CTA leaves while another may still read its shared memory
#else
  __trap();  // launched only on sm_90+ (checked by the launcher)
#endif
}

}  // namespace

int attn_res(const AttnResCudaArgs& a, CUstream_st* stream) {
  if (a.rows < 0 || a.dim <= 0 || a.rows > 0x7fffffff) return cudaErrorInvalidValue;
  if (a.prefix == nullptr || a.out == nullptr || a.norm_w == nullptr || a.proj_w == nullptr || a.out == a.prefix)
    return cudaErrorInvalidValue;
  if (a.num_blocks < 0 || a.num_blocks > a.max_blocks || a.num_blocks + 1 > kAttnResMaxSources) return cudaErrorInvalidValue;
  if (a.block_write_idx < -1 || a.block_write_idx >= a.max_blocks) return cudaErrorInvalidValue;
  if (a.blocks == nullptr && (a.num_blocks > 0 || a.block_write_idx >= 0)) return cudaErrorInvalidValue;
  if (a.rows == 0) return cudaSuccess;
  const bool vec = a.dim % 8 == 0 && aligned16(a.prefix) && aligned16(a.delta) && aligned16(a.blocks) &&
                   aligned16(a.norm_w) && aligned16(a.proj_w) && aligned16(a.out_norm_w) && aligned16(a.out);
  const int64_t chunks = vec ? a.dim / 8 : a.dim;

  // The cluster path: cs CTAs per row, about two CTAs per SM over the grid, at most 8 (the portable
  // cluster size) and at least 64 chunks per CTA.
  int dev = 0, sms = 0, major = 0;
  if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  if (cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev); e != cudaSuccess) return e;
  if (cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev); e != cudaSuccess) return e;
  int64_t cs = (2 * static_cast<int64_t>(std::max(sms, 1)) + a.rows - 1) / a.rows;
  cs = std::max<int64_t>(1, std::min<int64_t>({cs, kArMaxCluster, chunks / 64}));
  if (major >= 9 && a.rows * cs <= INT_MAX) {
    const int64_t per = (chunks + cs - 1) / cs;
    const int64_t cthreads = std::max<int64_t>(kWarp, std::min<int64_t>(kArClusterThreads, (per + kWarp - 1) / kWarp * kWarp));
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(static_cast<unsigned>(a.rows * cs), 1, 1);
    cfg.blockDim = dim3(static_cast<unsigned>(cthreads), 1, 1);
    cfg.dynamicSmemBytes = 0;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = static_cast<unsigned>(cs);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return vec ? cudaLaunchKernelEx(&cfg, attn_res_cluster_kernel<8>, a)
               : cudaLaunchKernelEx(&cfg, attn_res_cluster_kernel<1>, a);
  }

  const auto threads =
      static_cast<unsigned>(std::max<int64_t>(kWarp, std::min<int64_t>(kArThreads, (chunks + kWarp - 1) / kWarp * kWarp)));
  const auto grid = static_cast<unsigned>(a.rows);
  if (vec) {
    attn_res_kernel<8><<<grid, threads, 0, stream>>>(a);
  } else {
    attn_res_kernel<1><<<grid, threads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

}  // namespace k3::ops::cuda
