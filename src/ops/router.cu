// CUDA MoE router (math in router.h), one CTA per row, two ways:
//
// k <= 32 and E <= 4096 (K3: E = 896, k = 16): route_topk_kernel, a sorting network instead of k
// dependent rounds. Every expert gets one 64-bit key: the biased score's bits mapped so that unsigned
// order is float order (NaN as -inf, -0 as +0, as the CPU's comparison sees them), over the complement
// of the expert index. Unsigned key order is then exactly the CPU's selection order (score desc, index
// asc) and a strict total order: the top k and their order are unique, whoever computes them.
//   1. W = ceil(E / 128) warps; each lane holds 4 keys in registers (padding slots hold key 0, below
//      every real key, which is never 0). Each warp sorts its 128 keys in groups of G = 16 (k <= 16) or
//      32 (bitonic network: compare-exchanges across registers or one xor shuffle), then halves the
//      groups: group a's i-th key against group b's (G-1-i)-th, keeping the larger, leaves a bitonic
//      sequence holding the top G of a and b, which a bitonic merge sorts again. After log2(128 / G)
//      halvings every group holds the warp's top G, sorted. No barrier so far; about 12 shuffle stages.
//   2. The W sorted lists go to shared memory; one __syncthreads. The global top k lies within them
//      (G >= k), and a candidate's rank among all W * G candidates (the number of keys above it, a
//      binary search per list) is its global rank when that is below k. Ranks are distinct, so each
//      of the first k places is written by exactly one thread: idx, and the unbiased s into shared
//      memory (its logit is loaded before the searches, hiding the latency).
//   3. One __syncthreads; warp 0 sums the k values of s in selection order (one serial sum, the CPU's
//      order, so the sum is bitwise the CPU's) and writes the weights with the CPU's expression.
// Latency at E = 896: 7 warps, 25 network stages (12 with shuffles) + 5 dependent shared loads + one
// serial k-sum, against the round-based kernel's 16 dependent rounds of two barriers each (below): a
// call's latency is its chain of dependent steps, not its work.
//
// Otherwise (k > 32 or E > 4096; not a K3 shape): route_rounds_kernel, k rounds over the row's scores
// in shared memory, each a strided scan, a warp-shuffle argmax and one across the warps (two barriers
// per round).
#include <cmath>
#include <cstdint>

#include "ops/cuda_device.cuh"
#include "ops/router.h"

namespace k3::ops::cuda {
namespace {

using detail::kWarp;

constexpr int kRouteThreads = 256;      // route_rounds_kernel
constexpr int kTopkItems = 4;           // keys per lane in route_topk_kernel
constexpr int kTopkMaxWarps = 32;
constexpr int kTopkMaxThreads = kTopkMaxWarps * kWarp;  // 1024: one CTA
constexpr int kTopkMaxExperts = kTopkMaxWarps * kWarp * kTopkItems;  // 4096
constexpr int kTopkMaxK = 32;

using detail::sigmoid;

// ---------------------------------------------------------------------------------------------
// route_topk_kernel (k <= 32)

// The 64-bit key of expert e with biased score b (see the top). Never 0: the low word is ~e, e < 2^31.
__device__ __forceinline__ uint64_t route_key(float b, int e) {
  uint32_t u = __float_as_uint(isnan(b) ? -INFINITY : b);
  if ((u << 1) == 0) u = 0;                         // -0 -> +0: equal scores, equal keys
  u = (u & 0x80000000u) != 0 ? ~u : u | 0x80000000u;  // float order -> unsigned order
  return (static_cast<uint64_t>(u) << 32) | static_cast<uint32_t>(~e);
}

// a, b <- (max, min) when desc, else (min, max).
__device__ __forceinline__ void compare_exchange(uint64_t& a, uint64_t& b, bool desc) {
  const bool gt = a > b;
  const uint64_t hi = gt ? a : b, lo = gt ? b : a;
  a = desc ? hi : lo;
  b = desc ? lo : hi;
}

// One stage of a bitonic network over the warp's 32 * P keys, key i = lane * P + r in v[r]: i and i ^ s
// compare-exchange, the larger to the lower index where the block of size Z holding i sorts descending
// (bit Z of i clear, or all_desc). s < P: within the thread; s >= P: one xor shuffle across lanes.
template <int P>
__device__ __forceinline__ void network_stage(uint64_t (&v)[P], int lane, int Z, int s, bool all_desc) {
  if (s < P) {
#pragma unroll
    for (int r = 0; r < P; ++r) {
      if ((r & s) == 0) compare_exchange(v[r], v[r | s], all_desc || ((lane * P + r) & Z) == 0);
    }
  } else {
    const int ls = s / P;
    const bool desc = all_desc || ((lane * P) & Z) == 0;  // Z > s >= P: bit Z of i is a lane bit
    const bool keep_max = ((lane & ls) == 0) == desc;
#pragma unroll
    for (int r = 0; r < P; ++r) {
      const uint64_t o = __shfl_xor_sync(0xffffffffu, v[r], ls);
      if ((o > v[r]) == keep_max) v[r] = o;  // o == v[r] (padding): either is right
    }
  }
}

// Sorts each aligned group of G keys of the warp descending (the bitonic sort, with the last merge
// descending everywhere).
template <int G, int P>
__device__ __forceinline__ void sort_groups(uint64_t (&v)[P], int lane) {
#pragma unroll
  for (int z = 2; z <= G; z *= 2) {
#pragma unroll
    for (int s = z / 2; s >= 1; s /= 2) network_stage<P>(v, lane, z, s, z == G);
  }
}

// Each group of G sorted keys -> the warp's top G, sorted descending, in every group. Halving h pairs
// group a with a ^ h: key i meets key i ^ (h * G + G - 1), the other group's mirror position.
template <int G, int P>
__device__ __forceinline__ void warp_top(uint64_t (&v)[P], int lane) {
  static_assert(P <= G && G <= kWarp * P, "a group spans whole lanes of one warp");
#pragma unroll
  for (int h = 1; h < kWarp * P / G; h *= 2) {
    const int m = h * G + G - 1, ml = m / P, mr = m % P;  // lane and register parts of the mask
#pragma unroll
    for (int r = 0; r < P; ++r) {
      if (r > (r ^ mr)) continue;  // each register pair once: both shuffles before either update
      const uint64_t o0 = __shfl_xor_sync(0xffffffffu, v[r ^ mr], ml);
      const uint64_t o1 = __shfl_xor_sync(0xffffffffu, v[r], ml);
      v[r] = o0 > v[r] ? o0 : v[r];
      v[r ^ mr] = o1 > v[r ^ mr] ? o1 : v[r ^ mr];
    }
#pragma unroll
    for (int s = G / 2; s >= 1; s /= 2) network_stage<P>(v, lane, G, s, true);
  }
}

// Keys above key in the sorted (descending) lists b0, b0 + stride, ... below W of cand ([W][G]), N lists
// at a time: N binary searches in lockstep, so their shared loads overlap (a list past W searches
// list b0 again and is not counted).
template <int G, int N>
__device__ __forceinline__ int count_above(const uint64_t* cand, int b0, int stride, int W, uint64_t key) {
  int total = 0;
  for (int b = b0; b < W; b += N * stride) {
    const uint64_t* L[N];
    int n[N];
#pragma unroll
    for (int j = 0; j < N; ++j) L[j] = cand + (b + j * stride < W ? b + j * stride : b0) * G, n[j] = 0;
#pragma unroll
    for (int s = G / 2; s >= 1; s /= 2) {
#pragma unroll
      for (int j = 0; j < N; ++j) n[j] += L[j][n[j] + s - 1] > key ? s : 0;  // n = min(count, G - 1)
    }
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const int count = n[j] + (L[j][n[j]] > key ? 1 : 0);  // the load unconditional, as the others
      total += b + j * stride < W ? count : 0;
    }
  }
  return total;
}

// Block: W = blockDim.x / 32 warps, W * 32 * kTopkItems >= E. G: the group (list) size, k <= G.
template <int G>
__global__ void __launch_bounds__(kTopkMaxThreads)
    route_topk_kernel(const float* __restrict__ logits, const float* __restrict__ bias, int E, int k, bool renormalize,
                      float scale, int32_t* __restrict__ idx, float* __restrict__ w) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  constexpr int P = kTopkItems;
  constexpr int kPerCand = kWarp / G;  // threads per candidate in step 2
  __shared__ uint64_t cand[kTopkMaxWarps * G];
  __shared__ float sel_s[G];
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp, nthreads = blockDim.x;
  const int64_t t = blockIdx.x;
  const float* lt = logits + t * E;

  // 1. Keys (expert e = r * nthreads + tid: coalesced loads; the network does not care where a key
  //    starts), then the warp's top G.
  uint64_t v[P];
#pragma unroll
  for (int r = 0; r < P; ++r) {
    const int e = r * nthreads + tid;
    v[r] = e < E ? route_key(sigmoid(lt[e]) + (bias != nullptr ? bias[e] : 0.f), e) : 0;
  }
  sort_groups<G, P>(v, lane);
  warp_top<G, P>(v, lane);
  if (lane < G / P) {
#pragma unroll
    for (int r = 0; r < P; ++r) cand[warp * G + lane * P + r] = v[r];
  }
  __syncthreads();

  // 2. Candidate c (kPerCand threads, each searching every kPerCand-th list): its rank is the number of
  //    candidates above it. Its own list alone puts it at c % G: one at or past k is not chosen, nor
  //    is padding (key 0).
  const int c = tid / kPerCand, part = tid % kPerCand;
  const uint64_t key = cand[c];
  const bool live = c % G < k && key != 0;
  int rank = 0, e = 0;
  float lv = 0.f;
  if (live) {
    e = static_cast<int>(~static_cast<uint32_t>(key));
    lv = lt[e];  // in flight during the searches
    rank = count_above<G, 8 / kPerCand>(cand, part, kPerCand, nthreads / kWarp, key);  // W <= 8: one pass
  }
  if constexpr (kPerCand > 1) {
#pragma unroll
    for (int o = 1; o < kPerCand; o *= 2) rank += __shfl_xor_sync(0xffffffffu, rank, o);
  }
  if (live && rank < k && part == 0) {
    idx[t * k + rank] = e;
    sel_s[rank] = sigmoid(lv);
  }
  __syncthreads();

  // 3. Weights: the sum in selection order (serial, as the CPU adds), the CPU's expression.
  if (warp == 0) {
    float sum = 0.f;
    if (renormalize) {
      for (int i = 0; i < k; ++i) sum += sel_s[i];
    }
    if (lane < k) {
      const float s = sel_s[lane];
      w[t * k + lane] = renormalize ? s / (sum + 1e-20f) * scale : s * scale;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// route_rounds_kernel (k > 32 or E > 4096)

// (v, e) before (bv, be) in the selection order; e < 0 means "no candidate".
__device__ __forceinline__ bool better(float v, int e, float bv, int be) {
  if (e < 0) return false;
  if (be < 0) return true;
  return v > bv || (v == bv && e < be);
}

// One CTA per row: the row's biased scores live in shared memory; each of the k rounds finds the best
// untaken expert with a strided scan per thread, a warp-shuffle argmax and one across the warps, under
// the CPU's order (score desc, index asc), and marks it taken (NaN). Thread 0 lists the experts in that
// order, sums their unbiased s in the same order and writes the weights with the CPU's expression.
__global__ void __launch_bounds__(kRouteThreads)
    route_rounds_kernel(const float* __restrict__ logits, const float* __restrict__ bias, int E, int k,
                        bool renormalize, float scale, int32_t* __restrict__ idx, float* __restrict__ w) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  extern __shared__ float key[];  // [E]
  __shared__ float wv[kRouteThreads / kWarp];
  __shared__ int we[kRouteThreads / kWarp];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t t = blockIdx.x;
  const float* lt = logits + t * E;
  for (int e = threadIdx.x; e < E; e += kRouteThreads) {
    const float b = sigmoid(lt[e]) + (bias != nullptr ? bias[e] : 0.f);
    key[e] = isnan(b) ? -INFINITY : b;
  }
  __syncthreads();
  int32_t* it = idx + t * k;
  float* wt = w + t * k;
  for (int i = 0; i < k; ++i) {
    float bv = -INFINITY;
    int be = -1;
    for (int e = threadIdx.x; e < E; e += kRouteThreads) {
      const float v = key[e];
      if (!isnan(v) && better(v, e, bv, be)) bv = v, be = e;  // NaN: taken in an earlier round
    }
#pragma unroll
    for (int o = kWarp / 2; o > 0; o /= 2) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oe = __shfl_xor_sync(0xffffffffu, be, o);
      if (better(ov, oe, bv, be)) bv = ov, be = oe;
    }
    if (lane == 0) wv[warp] = bv, we[warp] = be;
    __syncthreads();
    if (threadIdx.x == 0) {
      // A strict total order: the winner is unique, and k <= E guarantees one.
      for (int j = 1; j < kRouteThreads / kWarp; ++j)
        if (better(wv[j], we[j], bv, be)) bv = wv[j], be = we[j];
      key[be] = NAN;
      it[i] = be;
    }
    __syncthreads();
  }
  // The chosen experts' unbiased s, loaded in parallel into the scores' place (no longer needed); thread 0
  // sums them in selection order from shared memory.
  for (int i = threadIdx.x; i < k; i += kRouteThreads) key[i] = sigmoid(lt[it[i]]);
  __syncthreads();
  if (threadIdx.x == 0) {
    float sum = 0.f;
    for (int i = 0; i < k; ++i) sum += key[i];
    for (int i = 0; i < k; ++i) wt[i] = renormalize ? key[i] / (sum + 1e-20f) * scale : key[i] * scale;
  }
}

}  // namespace

int route(const float* logits, const float* bias, int64_t T, int E, int k, bool renormalize, float scale,
          int32_t* idx, float* w, CUstream_st* stream) {
  if (T < 0 || E <= 0 || k <= 0 || k > E || E > kRouteMaxExperts) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  if (T > 0x7fffffff) return cudaErrorInvalidValue;
  const auto rows = static_cast<unsigned>(T);
  if (k <= kTopkMaxK && E <= kTopkMaxExperts) {
    const int warps = (E + kWarp * kTopkItems - 1) / (kWarp * kTopkItems);  // 1 .. kTopkMaxWarps
    if (k <= 16)
      return detail::launch(route_topk_kernel<16>, rows, warps * kWarp, 0, stream, logits, bias, E, k, renormalize,
                            scale, idx, w);
    return detail::launch(route_topk_kernel<32>, rows, warps * kWarp, 0, stream, logits, bias, E, k, renormalize, scale,
                          idx, w);
  }
  const size_t smem = static_cast<size_t>(E) * sizeof(float);  // <= 48 KiB: E <= kRouteMaxExperts
  return detail::launch(route_rounds_kernel, rows, kRouteThreads, smem, stream, logits, bias, E, k, renormalize, scale,
                        idx, w);
}

}  // namespace k3::ops::cuda
