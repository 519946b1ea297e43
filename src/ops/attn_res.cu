// CUDA attn_res (math in attn_res.h).
//
// Main path (sm_90+, dim % 8 == 0, 16-byte aligned pointers; the decode path): one thread-block
// cluster of cs CTAs per row (cs <= 8). CTA k of a cluster owns the k-th contiguous slice of the row's
// 16-byte chunks (8 bf16); each thread owns the same chunks of that slice in every pass below, so
// what it writes to shared memory it alone reads back (no barrier between the passes).
//   0. Thread 0 starts one TMA bulk copy (cp.async.bulk, one mbarrier) per input slice into shared
//      memory: every block source (except blocks[block_write_idx], overwritten here), prefix, delta,
//      norm_w, proj_w, out_norm_w. Every byte is read from global memory once, all requests in flight
//      at once, no registers held; the whole kernel then works from shared memory.
//   1. p = bf16(prefix + delta) -> the prefix slot, prefix and blocks[block_write_idx] (and that
//      block's slot when it is a source).
//   2. Per source, slice partial sums of V^2 and (norm_w * proj_w) . V (FP32), kArGroup sources per
//      pass: 16 per-thread sums reduced over the warp by one transposed butterfly (lane l ends with
//      the sum of value l / 2: 16 shuffles, not 16 x 5); per-warp results summed in warp order into
//      this CTA's partials. One cluster barrier publishes them; warp 0 reads all cs partials of every
//      source at once over distributed shared memory and sums them in rank order (every CTA of the
//      row gets bitwise the same totals), then computes scores and the softmax in its lanes (exp in
//      double; max and sum z by fixed butterflies), alpha to shared memory.
//   3. mix = bf16(sum_s alpha_s V_s) (FP32, sources in order, unfused multiply-add as the CPU), from
//      shared memory -> out, or with out_norm_w into the prefix slot (its p is no longer needed);
//   4. with out_norm_w: the CTA's sum of mix^2 is exchanged the same way (one more cluster barrier,
//      every warp sums the cs values in rank order); out = RMSNorm(mix) from shared memory.
// So one cluster barrier without out_norm_w, two with it, and one arrive/wait pair before exit: a CTA
// must not exit while another CTA of its cluster may still read its shared memory, so the last
// remote read of each CTA is followed by a cluster barrier arrive, and every CTA waits on it last.
// cs: about 8 CTAs per SM over the grid, ceil(8 SMs / rows) capped at 8 (decode rows are few and latency
// bound: more CTAs per row shorten each CTA's slice), raised
// until at least three CTAs' slices fit one SM's shared memory; at least 64 chunks per CTA.
//
// Fallback (pre-sm_90 device, dim % 8 != 0 or unaligned pointers, or slices too large for shared
// memory even at cs = 8): the one-CTA-per-row kernel below, reading the sources from global memory
// twice; 8 bf16 per chunk when dim % 8 == 0 and every pointer is 16-byte aligned, else one.
#include <cooperative_groups.h>

#include <algorithm>
#include <climits>

#include "ops/attn_res.h"
#include "ops/cuda_bf16.cuh"
#include "ops/cuda_device.cuh"

namespace k3::ops::cuda {
namespace {

using detail::aligned16;
using detail::kWarp;

constexpr int kArThreads = 256;

using detail::round_bf16_dev;

// ---------------------------------------------------------------------------------------------
// The fallback kernel: one CTA per row.

template <int VEC>
__global__ void __launch_bounds__(kArThreads) attn_res_kernel(AttnResCudaArgs a) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
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
// The cluster kernel (main path).

constexpr int kArMaxThreads = 512;  // per CTA; a slice of up to 512 chunks is one chunk per thread
constexpr int kArMaxWarps = kArMaxThreads / kWarp;
constexpr int kArMaxCluster = 8;    // the portable cluster size
constexpr int kArGroup = 8;         // sources per partial-sum pass: 2 x 8 sums per thread

// The shared-memory slots of a CTA, each one slice (per chunks of 16 bytes): blocks 0 .. nb - 1, then
// p (prefix), delta, norm_w, proj_w, out_norm_w (delta and out_norm_w only when given).
struct ArSlots {
  int p, d, nw, pw, ow, n;
};
__host__ __device__ inline ArSlots ar_slots(int nb, bool delta, bool out_norm) {
  ArSlots s;
  int k = nb;
  s.p = k++;
  s.d = delta ? k++ : -1;
  s.nw = k++;
  s.pw = k++;
  s.ow = out_norm ? k++ : -1;
  s.n = k;
  return s;
}

// Dynamic shared memory of a CTA: the slots, then the per-warp partial sums [warps][2 * nsrc].
inline int64_t ar_dyn_smem(const ArSlots& sl, int64_t per, int warps, int nsrc) {
  return sl.n * per * 16 + static_cast<int64_t>(warps) * 2 * nsrc * 4;
}

struct ArShared {
  unsigned long long bar;                // the mbarrier of the slice loads
  float csum[2 * kAttnResMaxSources];    // this CTA's partials (sum V^2, dot) per source, read by the cluster
  float alpha[kAttnResMaxSources];
  float red[kArMaxWarps];
  float cnorm;                           // this CTA's sum of mix^2, read by the cluster
};

using detail::smem_u32;
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes the mbarrier's initialization visible to the async proxy (the bulk copies complete on it).
__device__ __forceinline__ void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(ok)
      : "r"(bar), "r"(parity)
      : "memory");
  return ok != 0;
}
// bytes (a multiple of 16) global -> shared, both 16-byte aligned; completes on bar.
__device__ __forceinline__ void bulk_load(void* smem, const void* gmem, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_u32(smem)),
               "l"(gmem), "r"(bytes), "r"(bar)
               : "memory");
}

// One level of warp_sum16_transposed: lanes with bit 2 * HALF set keep values HALF .. 2 * HALF - 1 and
// send 0 .. HALF - 1 to their partner, the others the reverse; the kept values land in 0 .. HALF - 1.
template <int HALF>
__device__ __forceinline__ void transposed_level(float (&v)[16], int lane) {
  const bool up = (lane & (2 * HALF)) != 0;
#pragma unroll
  for (int i = 0; i < HALF; ++i) {
    const float send = up ? v[i] : v[i + HALF];
    const float keep = up ? v[i + HALF] : v[i];
    v[i] = keep + __shfl_xor_sync(0xffffffffu, send, 2 * HALF);
  }
}

// Warp sums of 16 values at once, transposed: every level sends half of the values still held and
// keeps the other half, so lane l ends with the warp's total of value l / 2 (both lanes of a pair
// bitwise the same). 8 + 4 + 2 + 1 + 1 shuffles, not 16 x 5; a fixed order, so deterministic.
__device__ __forceinline__ float warp_sum16_transposed(float (&v)[16], int lane) {
  transposed_level<8>(v, lane);
  transposed_level<4>(v, lane);
  transposed_level<2>(v, lane);
  transposed_level<1>(v, lane);
  return v[0] + __shfl_xor_sync(0xffffffffu, v[0], 1);
}

// grid.x = rows * cs, cluster (cs, 1, 1): cluster r is row r, its CTA k (= block rank) slice k.
// Dynamic shared memory: ar_dyn_smem(ar_slots(...), per, blockDim.x / 32, nsrc) bytes.
__global__ void __launch_bounds__(kArMaxThreads, 2) attn_res_cluster_kernel(AttnResCudaArgs a) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  extern __shared__ uint4 ar_dyn[];
  __shared__ ArShared sh;

  cg::cluster_group cluster = cg::this_cluster();
  const int cs = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t dim = a.dim, chunks = dim / 8;
  const int64_t r = blockIdx.x / cs;
  const int per = static_cast<int>((chunks + cs - 1) / cs);  // the slot size in chunks (fits shared memory)
  const int64_t c0 = std::min<int64_t>(chunks, static_cast<int64_t>(rank) * per);
  const int n = static_cast<int>(std::min<int64_t>(chunks, c0 + per) - c0);  // >= 1 (the launcher)
  const int64_t e0 = c0 * 8;  // the slice's first element
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;
  const int nthr = blockDim.x, warps = nthr / kWarp;  // blockDim.x is a multiple of 32
  const int nb = a.num_blocks, nsrc = nb + 1, wi = a.block_write_idx;
  const bool has_delta = a.delta != nullptr, norm = a.out_norm_w != nullptr;
  const bool wi_src = wi >= 0 && wi < nb;  // the block written is one of the mixed sources
  const ArSlots sl = ar_slots(nb, has_delta, norm);
  uint4* const stash = ar_dyn;  // slot k at stash + k * per
  float* const part = reinterpret_cast<float*>(ar_dyn + sl.n * per);
  const uint32_t bar = smem_u32(&sh.bar);

  bf16* p = a.prefix + r * dim;
  bf16* blocks_r = a.blocks != nullptr ? a.blocks + r * a.max_blocks * dim : nullptr;
  bf16* block_w = wi >= 0 ? blocks_r + wi * dim : nullptr;

  // 0. Every input slice -> shared memory, one bulk copy each, all in flight together.
  if (tid == 0) {
    mbar_init(bar, 1);
    fence_proxy_async_smem();
    const uint32_t bytes = static_cast<uint32_t>(n) * 16u;
    const int loads = sl.n - (wi_src ? 1 : 0);
    mbar_arrive_expect_tx(bar, static_cast<uint32_t>(loads) * bytes);
    bulk_load(stash + sl.p * per, p + e0, bytes, bar);
    if (has_delta) bulk_load(stash + sl.d * per, a.delta + r * dim + e0, bytes, bar);
    bulk_load(stash + sl.nw * per, a.norm_w + e0, bytes, bar);
    bulk_load(stash + sl.pw * per, a.proj_w + e0, bytes, bar);
    for (int s = 0; s < nb; ++s)
      if (s != wi) bulk_load(stash + s * per, blocks_r + s * dim + e0, bytes, bar);
    if (norm) bulk_load(stash + sl.ow * per, a.out_norm_w + e0, bytes, bar);
  }
  __syncthreads();  // the mbarrier is initialized before anyone waits on it
  while (!mbar_try_wait(bar, 0)) {
  }

  // 1. p = bf16(prefix + delta) -> the prefix slot, prefix, the block written (and its slot).
  if (has_delta || block_w != nullptr) {
    for (int u = tid; u < n; u += nthr) {
      uint4 pr = stash[sl.p * per + u];
      if (has_delta) {
        float pv[8], dv[8];
        detail::unpack_bf16x8(pr, pv);
        detail::unpack_bf16x8(stash[sl.d * per + u], dv);
#pragma unroll
        for (int i = 0; i < 8; ++i) pv[i] = pv[i] + dv[i];
        pr = detail::pack_bf16x8(pv);  // round to nearest even, as the CPU's round_bf16(p + d)
        stash[sl.p * per + u] = pr;
        *reinterpret_cast<uint4*>(p + e0 + u * 8) = pr;
      }
      if (block_w != nullptr) *reinterpret_cast<uint4*>(block_w + e0 + u * 8) = pr;
      if (wi_src) stash[wi * per + u] = pr;
    }
  }

  // 2. Slice partials per source (source s < nb: slot s; source nb = p: slot nb = sl.p).
  for (int g = 0; g < nsrc; g += kArGroup) {  // uniform over the block
    float acc[2 * kArGroup];
#pragma unroll
    for (int j = 0; j < 2 * kArGroup; ++j) acc[j] = 0.f;
    for (int u = tid; u < n; u += nthr) {
      float np[8], pw[8];
      detail::unpack_bf16x8(stash[sl.nw * per + u], np);
      detail::unpack_bf16x8(stash[sl.pw * per + u], pw);
#pragma unroll
      for (int i = 0; i < 8; ++i) np[i] *= pw[i];  // norm_w * proj_w is exact in FP32
#pragma unroll
      for (int j0 = 0; j0 < kArGroup; j0 += 4) {
        uint4 raw[4];  // four loads in flight together
#pragma unroll
        for (int j = 0; j < 4; ++j) raw[j] = g + j0 + j < nsrc ? stash[(g + j0 + j) * per + u] : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if (g + j0 + j < nsrc) {
            float v[8];
            detail::unpack_bf16x8(raw[j], v);
            float& ss = acc[2 * (j0 + j)];
            float& dt = acc[2 * (j0 + j) + 1];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
              ss = fmaf(v[i], v[i], ss);
              dt = fmaf(np[i], v[i], dt);
            }
          }
        }
      }
    }
    const float t = warp_sum16_transposed(acc, lane);  // lane l: value l / 2 = (source g + l / 4, l / 2 % 2)
    const int k = 2 * g + lane / 2;
    if (lane % 2 == 0 && k < 2 * nsrc) part[warp * 2 * nsrc + k] = t;
  }
  __syncthreads();
  for (int t = tid; t < 2 * nsrc; t += nthr) {
    float x[kArMaxWarps];
#pragma unroll
    for (int w = 0; w < kArMaxWarps; ++w) x[w] = w < warps ? part[w * 2 * nsrc + t] : 0.f;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kArMaxWarps; ++w)
      if (w < warps) s += x[w];  // warp order
    sh.csum[t] = s;
  }
  cluster.sync();  // every CTA's csum is written and visible to the cluster

  // Totals, scores and softmax in warp 0: lane l has sources l and l + 32.
  if (warp == 0) {
    float sc[2];
    float smax = -INFINITY;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int s = lane + h * kWarp;
      sc[h] = -INFINITY;
      if (s < nsrc) {
        float x[kArMaxCluster], y[kArMaxCluster];
#pragma unroll
        for (int k = 0; k < kArMaxCluster; ++k) {
          if (k < cs) {
            const float* rc = cluster.map_shared_rank(sh.csum, k);
            x[k] = rc[2 * s];
            y[k] = rc[2 * s + 1];
          }
        }
        float ss = 0.f, dot = 0.f;
#pragma unroll
        for (int k = 0; k < kArMaxCluster; ++k) {
          if (k < cs) {  // rank order: the same in every CTA
            ss += x[k];
            dot += y[k];
          }
        }
        sc[h] = dot * (1.0f / sqrtf(ss / static_cast<float>(dim) + a.eps));
        smax = fmaxf(smax, sc[h]);
      }
    }
#pragma unroll
    for (int o = kWarp / 2; o > 0; o /= 2) smax = fmaxf(smax, __shfl_xor_sync(0xffffffffu, smax, o));
    double ex[2], z = 0.0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      ex[h] = lane + h * kWarp < nsrc ? exp(static_cast<double>(sc[h]) - static_cast<double>(smax)) : 0.0;
      z += ex[h];
    }
    z = detail::warp_sum(z);  // the same in every lane
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (lane + h * kWarp < nsrc) sh.alpha[lane + h * kWarp] = static_cast<float>(ex[h] / z);
  }
  __syncthreads();
  if (!norm) cluster.barrier_arrive();  // this CTA's last remote read is done (waited on before exit)

  // 3. mix = bf16(sum_s alpha_s V_s), sources in order -> out (or the prefix slot, for step 4).
  bf16* o = a.out + r * dim + e0;
  float msq = 0.f;
  for (int u = tid; u < n; u += nthr) {
    float m[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) m[i] = 0.f;
#pragma unroll 4
    for (int s = 0; s < nsrc; ++s) {
      float v[8];
      detail::unpack_bf16x8(stash[s * per + u], v);
      const float al = sh.alpha[s];
#pragma unroll
      for (int i = 0; i < 8; ++i) m[i] = __fadd_rn(m[i], __fmul_rn(al, v[i]));
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      m[i] = round_bf16_dev(m[i]);
      msq = fmaf(m[i], m[i], msq);
    }
    const uint4 mr = detail::pack_bf16x8(m);  // exact: m holds bf16 values
    if (norm) {
      stash[sl.p * per + u] = mr;  // p at u was read above, by this thread only
    } else {
      *reinterpret_cast<uint4*>(o + u * 8) = mr;
    }
  }

  if (norm) {
    // 4. out = RMSNorm(mix; out_norm_w, out_eps), the row's sum of mix^2 exchanged as the partials.
    msq = detail::warp_sum(msq);
    if (lane == 0) sh.red[warp] = msq;
    __syncthreads();
    if (tid == 0) {
      float t = 0.f;
      for (int w = 0; w < warps; ++w) t += sh.red[w];
      sh.cnorm = t;
    }
    cluster.sync();  // every cnorm visible (and every remote read of csum done)
    const float mine = lane < cs ? *cluster.map_shared_rank(&sh.cnorm, lane) : 0.f;
    float tot = 0.f;
#pragma unroll
    for (int k = 0; k < kArMaxCluster; ++k) {
      const float x = __shfl_sync(0xffffffffu, mine, k);
      if (k < cs) tot += x;  // rank order, in every warp
    }
    cluster.barrier_arrive();  // this thread's last remote read is done
    const float inv = 1.0f / sqrtf(tot / static_cast<float>(dim) + a.out_eps);
    for (int u = tid; u < n; u += nthr) {
      float m[8], w[8];
      detail::unpack_bf16x8(stash[sl.p * per + u], m);
      detail::unpack_bf16x8(stash[sl.ow * per + u], w);
#pragma unroll
      for (int i = 0; i < 8; ++i) m[i] = w[i] * round_bf16_dev(m[i] * inv);
      *reinterpret_cast<uint4*>(o + u * 8) = detail::pack_bf16x8(m);
    }
  }
  cluster.barrier_wait();  // no CTA leaves while another may still read its shared memory
#else
  __trap();  // launched only on sm_90+ (checked by the launcher)
#endif
}

// The shared memory of the cluster kernel on device dev: limit, the largest dynamic size of a CTA (the
// kernel's limit is raised once per device by detail::allow_optin_smem), sm_bytes and cta_extra (static
// and reserved shared memory of a CTA) to count the CTAs an SM holds.
cudaError_t ar_smem_limits(int dev, int64_t& limit, int64_t& sm_bytes, int64_t& cta_extra) {
  int optin = 0, per_sm = 0, reserved = 0;
  if (cudaError_t e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev); e != cudaSuccess)
    return e;
  if (cudaError_t e = cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev); e != cudaSuccess)
    return e;
  if (cudaError_t e = cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev); e != cudaSuccess)
    return e;
  const int64_t stat = (static_cast<int64_t>(sizeof(ArShared)) + 127) / 128 * 128;  // the static layout, rounded up
  limit = optin - stat;
  sm_bytes = per_sm;
  cta_extra = stat + reserved;
  if (limit <= 0) return cudaSuccess;
  return detail::allow_optin_smem<attn_res_cluster_kernel>(/*max_carveout=*/true);
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

  int dev = 0, sms = 0, major = 0;
  if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  if (cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev); e != cudaSuccess) return e;
  if (major >= 9 && vec) {
    sms = detail::device_sm_count();
    int64_t limit = 0, sm_bytes = 0, cta_extra = 0;
    if (cudaError_t e = ar_smem_limits(dev, limit, sm_bytes, cta_extra); e != cudaSuccess) return e;
    const int nsrc = a.num_blocks + 1;
    const ArSlots sl = ar_slots(a.num_blocks, a.delta != nullptr, a.out_norm_w != nullptr);
    const int64_t chunks = a.dim / 8;
    // Threads: one chunk of the slice each, up to kArMaxThreads (then several, evenly).
    auto threads_for = [&](int64_t cs) {
      const int64_t per = (chunks + cs - 1) / cs, iters = (per + kArMaxThreads - 1) / kArMaxThreads;
      return static_cast<int>(((per + iters - 1) / iters + kWarp - 1) / kWarp * kWarp);
    };
    auto smem_for = [&](int64_t cs) {
      return ar_dyn_smem(sl, (chunks + cs - 1) / cs, threads_for(cs) / kWarp, nsrc);
    };
    // cs: about 8 CTAs per SM over the grid, at most 8 and at least 64 chunks per CTA; then raised
    // until three CTAs fit an SM's shared memory (so the loads of one overlap the exchanges of the
    // others), or failing that until one fits.
    const int64_t cap = std::max<int64_t>(1, std::min<int64_t>(kArMaxCluster, chunks / 64));
    int64_t cs = std::min<int64_t>(
        cap, std::max<int64_t>(1, (8 * static_cast<int64_t>(std::max(sms, 1)) + a.rows - 1) / a.rows));
    while (cs < cap && 3 * (smem_for(cs) + cta_extra) > sm_bytes) ++cs;
    while (cs < cap && smem_for(cs) > limit) ++cs;
    const int64_t smem = smem_for(cs);
    if (smem <= limit && a.rows * cs <= INT_MAX) {
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(static_cast<unsigned>(a.rows * cs), 1, 1);
      cfg.blockDim = dim3(static_cast<unsigned>(threads_for(cs)), 1, 1);
      cfg.dynamicSmemBytes = static_cast<size_t>(smem);
      cfg.stream = stream;
      cudaLaunchAttribute attr[2];
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = static_cast<unsigned>(cs);
      attr[0].val.clusterDim.y = 1;
      attr[0].val.clusterDim.z = 1;
      attr[1] = detail::pdl_attribute();  // as detail::launch's launches
      cfg.attrs = attr;
      cfg.numAttrs = 2;
      return cudaLaunchKernelEx(&cfg, attn_res_cluster_kernel, a);
    }
  }

  const int64_t chunks = vec ? a.dim / 8 : a.dim;
  const auto threads =
      static_cast<unsigned>(std::max<int64_t>(kWarp, std::min<int64_t>(kArThreads, (chunks + kWarp - 1) / kWarp * kWarp)));
  const auto grid = static_cast<unsigned>(a.rows);
  if (vec) return detail::launch(attn_res_kernel<8>, grid, threads, 0, stream, a);
  return detail::launch(attn_res_kernel<1>, grid, threads, 0, stream, a);
}

}  // namespace k3::ops::cuda
