// CUDA sample_rows_one_cta (ops/sampling.h): the sampling kernel before sample_rows split rows over CTAs
// (sampling.cu), kept as the reference the split kernel is compared with bit for bit (ids and flags) in the
// GPU tests, and timed beside it by `bench --ops`. One CTA of 1024 threads per row, any vocab, no sort, no
// allocation; a lone CTA reads its row up to six times at one SM's bandwidth.
//   1. One pass: the argmax (ties to the lower id) and, when a log-prob is asked, the temperature-1
//      normalizer by an online softmax sum (FP32); a fixed reduction order, so deterministic.
//   2. Sampled rows: each token's mass is an integer, w_i = round(exp((l_i - max) / T) * 2^40) (FP32 exp;
//      w <= 2^40, so a row's total fits 64 bits for any vocab under 2^23), summed exactly in integers:
//      the order of the additions does not matter, so the results are deterministic.
//   3. top_p < 1: the kept set by a mass-weighted radix select on the logits' order-preserving float bits
//      (p is monotone in the logit): up to three passes over the row (11, 11, 10 bits), each a histogram of
//      the masses (and counts) of the tokens still in the candidate range, the warp's lanes of one bin
//      combined first (__match_any_sync) so each bin gets one shared atomic per warp; then a block scan of
//      the bins from the top finds the bin where the mass from the top reaches need = top_p * total. A bin
//      of one token ends the select; after the last pass the bin is one logit value, whose tokens (equal
//      masses) are kept from the lowest id up to the count that reaches need (a prefix scan finds the cut).
//   4. The draft's acceptance (u_accept * kept_mass < w_d), then the draw: the first id whose cumulative
//      kept mass (in id order, the rejected draft left out) exceeds u_draw * mass, by a two-level prefix
//      scan: each warp sums a 1/32 of the row, then the whole block scans the one segment holding it.
// The masses are FP32 exps (relative error ~1e-6 against the CPU's double): the ids can differ from the
// CPU's only when u lands within that rounding of a cumulative boundary (or the top-p mass at the kept
// set's edge is within it of top_p). Masses below 2^-41 of the largest are 0 here.
#include <cfloat>
#include <cmath>

#include "ops/cuda_device.cuh"
#include "ops/sampling.h"

namespace k3::ops::cuda {
namespace {

using detail::aligned16;
using detail::kWarp;

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / kWarp;
constexpr int kBins = 2048;
constexpr int kUnroll = 4;  // float4 chunks in flight per thread
constexpr int64_t kNone = INT64_MAX;

struct Smem {
  unsigned long long hist_w[kBins];
  unsigned hist_c[kBins];
  unsigned long long scan[kWarps], wsum[kWarps];
  float red_v[kWarps], red_s[kWarps];
  long long red_i[kWarps];
  float m, z1;
  long long argmax, found;
  int fw;
  unsigned long long fbase, sel_above, sel_mass;
  unsigned sel_bin, sel_count;
};

__device__ __forceinline__ float clean(float v) { return isnan(v) ? -INFINITY : (v == INFINITY ? FLT_MAX : v); }

// Order-preserving bits of a cleaned logit (-0 as +0: equal logits, equal keys).
__device__ __forceinline__ uint32_t key_of(float v) {
  if (v == 0.f) v = 0.f;
  const uint32_t b = __float_as_uint(v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ unsigned long long weight(float v, float m, float T) {
  if (v == -INFINITY) return 0;
  return __float2ull_rn(expf((v - m) / T) * 0x1p40f);
}

// f(i, clean(l[i])) for every i of the row (and for padding i >= V with -inf), every thread of the block
// calling f the same number of times (warp-collective code may run inside).
template <class F>
__device__ __forceinline__ void for_each(const float* __restrict__ l, int64_t V, bool vec, F&& f) {
  const int64_t chunks = (V + 3) / 4;
  for (int64_t base = 0; base < chunks; base += int64_t{kThreads} * kUnroll) {
    float4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = base + int64_t{u} * kThreads + threadIdx.x;
      if (vec) {
        v[u] = c < chunks ? __ldg(reinterpret_cast<const float4*>(l) + c)
                          : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
      } else {
        const int64_t i = 4 * c;
        v[u].x = i < V ? __ldg(l + i) : -INFINITY;
        v[u].y = i + 1 < V ? __ldg(l + i + 1) : -INFINITY;
        v[u].z = i + 2 < V ? __ldg(l + i + 2) : -INFINITY;
        v[u].w = i + 3 < V ? __ldg(l + i + 3) : -INFINITY;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = 4 * (base + int64_t{u} * kThreads + threadIdx.x);
      f(i, clean(v[u].x));
      f(i + 1, clean(v[u].y));
      f(i + 2, clean(v[u].z));
      f(i + 3, clean(v[u].w));
    }
  }
}

__device__ __forceinline__ unsigned long long warp_sum_u64(unsigned long long v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Exclusive prefix sum of v over the block's threads in thread order; total: the sum of all. Every thread
// calls it; ends with a barrier.
__device__ __forceinline__ unsigned long long block_excl_scan(unsigned long long v, Smem& sh,
                                                              unsigned long long& total) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  unsigned long long incl = v;
#pragma unroll
  for (int o = 1; o < kWarp; o *= 2) {
    const unsigned long long n = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += n;
  }
  if (lane == kWarp - 1) sh.scan[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    unsigned long long x = sh.scan[lane];
#pragma unroll
    for (int o = 1; o < kWarp; o *= 2) {
      const unsigned long long n = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += n;
    }
    sh.scan[lane] = x;
  }
  __syncthreads();
  const unsigned long long out = (warp ? sh.scan[warp - 1] : 0ull) + incl - v;
  total = sh.scan[kWarps - 1];
  __syncthreads();
  return out;
}

// The first i whose cumulative value(i, clean(l[i])) (in id order) exceeds target; -1 if none. Every thread
// calls it. Level 1: warp w sums ids [w seg, (w + 1) seg); level 2: the block scans the segment holding the
// target, each thread a contiguous run of ids.
template <class F>
__device__ int64_t find_cum(const float* __restrict__ l, int64_t V, unsigned long long target, F&& value, Smem& sh) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t seg = (V + kWarps - 1) / kWarps;
  const int64_t lo = min(V, warp * seg), hi = min(V, lo + seg);
  unsigned long long s = 0;
#pragma unroll 8
  for (int64_t i = lo + lane; i < hi; i += kWarp) s += value(i, clean(__ldg(l + i)));
  s = warp_sum_u64(s);
  if (lane == 0) sh.wsum[warp] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long base = 0;
    sh.fw = -1;
    for (int w = 0; w < kWarps; ++w) {
      if (target < base + sh.wsum[w]) {
        sh.fw = w;
        sh.fbase = base;
        break;
      }
      base += sh.wsum[w];
    }
  }
  __syncthreads();
  const int fw = sh.fw;
  const unsigned long long fbase = sh.fbase;
  if (fw < 0) return -1;  // the same for every thread
  const int64_t slo = min(V, fw * seg), shi = min(V, slo + seg);
  const int64_t per = (shi - slo + kThreads - 1) / kThreads;
  const int64_t a = min(shi, slo + threadIdx.x * per), b = min(shi, a + per);
  unsigned long long ts = 0;
  for (int64_t i = a; i < b; ++i) ts += value(i, clean(__ldg(l + i)));
  unsigned long long total;
  const unsigned long long ex = fbase + block_excl_scan(ts, sh, total);
  if (ex <= target && target < ex + ts) {
    unsigned long long c = ex;
    for (int64_t i = a; i < b; ++i) {
      c += value(i, clean(__ldg(l + i)));
      if (c > target) {
        sh.found = i;
        break;
      }
    }
  }
  __syncthreads();
  const int64_t found = sh.found;
  __syncthreads();
  return found;
}

__device__ __forceinline__ void take(float v, int64_t i, float s, float& bv, int64_t& bi, float& bs) {
  // Merges (v, i, s) into (bv, bi, bs): the larger value (then the lower id) and the sum of exp(x - max).
  const float M = fmaxf(v, bv);
  const float sa = bv == -INFINITY ? 0.f : bs * expf(bv - M);
  const float sb = v == -INFINITY ? 0.f : s * expf(v - M);
  bs = sa + sb;
  if (v > bv || (v == bv && i < bi)) bv = v, bi = i;
}

__global__ void __launch_bounds__(kThreads)
    sample_kernel(const float* __restrict__ logits, int64_t V, bool vec, const SampleSpec* __restrict__ specs,
                  SampleResult* __restrict__ out) {
  __shared__ Smem sh;
  const float* l = logits + static_cast<int64_t>(blockIdx.x) * V;
  const SampleSpec spec = specs[blockIdx.x];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const bool want_lp = spec.logprob != 0;

  // 1. argmax and the temperature-1 normalizer.
  float bv = -INFINITY, bs = 0.f;
  int64_t bi = kNone;
  for_each(l, V, vec, [&](int64_t i, float v) {
    if (i >= V) return;
    if (want_lp) {
      if (v > bv) bs = bv == -INFINITY ? 0.f : bs * expf(bv - v);
      if (v > bv || (v == bv && i < bi)) bv = v, bi = i;
      if (v != -INFINITY) bs += expf(v - bv);
    } else if (v > bv || (v == bv && i < bi)) {
      bv = v, bi = i;
    }
  });
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
    const float os = __shfl_xor_sync(0xffffffffu, bs, o);
    take(ov, oi, os, bv, bi, bs);
  }
  if (lane == 0) sh.red_v[warp] = bv, sh.red_i[warp] = bi, sh.red_s[warp] = bs;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) take(sh.red_v[w], sh.red_i[w], sh.red_s[w], bv, bi, bs);
    sh.m = bv, sh.argmax = bi, sh.z1 = bs;
  }
  __syncthreads();
  const float m = sh.m;
  const int64_t argmax = sh.argmax;
  const float z1 = sh.z1;

  int64_t token = argmax;
  int accepted = 0;
  if (spec.temperature == 0.f || m == -INFINITY) {
    accepted = spec.draft == argmax;
  } else {
    const float T = spec.temperature;
    // 3. The kept set: key & mask > prefix, or == prefix with id <= cut.
    uint32_t prefix = 0, mask = 0;
    int64_t cut = kNone;
    unsigned long long kept_mass = 0;
    if (spec.top_p < 1.f) {
      unsigned long long above = 0, need = 0;
      for (int pass = 0; pass < 3; ++pass) {
        const int shift = pass == 0 ? 21 : pass == 1 ? 10 : 0;
        const unsigned nb = pass == 2 ? 1024u : 2048u;
        for (int b = threadIdx.x; b < kBins; b += kThreads) sh.hist_w[b] = 0, sh.hist_c[b] = 0;
        __syncthreads();
        for_each(l, V, vec, [&](int64_t, float v) {
          const uint32_t k = key_of(v);
          const unsigned long long w = weight(v, m, T);
          const bool q = w != 0 && (k & mask) == prefix;
          const unsigned act = __ballot_sync(0xffffffffu, q);
          if (q) {
            const unsigned bin = (k >> shift) & (nb - 1);
            const unsigned peers = __match_any_sync(act, bin);
            const unsigned hi = __reduce_add_sync(peers, static_cast<unsigned>(w >> 20));
            const unsigned lo = __reduce_add_sync(peers, static_cast<unsigned>(w & 0xfffffu));
            if (lane == __ffs(peers) - 1) {
              atomicAdd(&sh.hist_w[bin], (static_cast<unsigned long long>(hi) << 20) + lo);
              atomicAdd(&sh.hist_c[bin], static_cast<unsigned>(__popc(peers)));
            }
          }
        });
        __syncthreads();
        // Bins from the top: thread t holds bins nb-1-2t and nb-2-2t.
        const int j0 = 2 * threadIdx.x, j1 = j0 + 1;
        const unsigned long long a0 = j0 < static_cast<int>(nb) ? sh.hist_w[nb - 1 - j0] : 0ull;
        const unsigned long long a1 = j1 < static_cast<int>(nb) ? sh.hist_w[nb - 1 - j1] : 0ull;
        unsigned long long total;
        const unsigned long long ex = above + block_excl_scan(a0 + a1, sh, total);
        if (pass == 0) {
          need = static_cast<unsigned long long>(static_cast<double>(spec.top_p) * static_cast<double>(total));
          if (need == 0) need = 1;
        }
        if (ex < need && need <= ex + a0) {
          sh.sel_bin = nb - 1 - j0, sh.sel_above = ex, sh.sel_mass = a0, sh.sel_count = sh.hist_c[nb - 1 - j0];
        } else if (ex + a0 < need && need <= ex + a0 + a1) {
          sh.sel_bin = nb - 1 - j1, sh.sel_above = ex + a0, sh.sel_mass = a1, sh.sel_count = sh.hist_c[nb - 1 - j1];
        }
        __syncthreads();
        above = sh.sel_above;
        const unsigned long long mass = sh.sel_mass;
        const unsigned count = sh.sel_count;
        prefix |= sh.sel_bin << shift;
        mask |= (nb - 1) << shift;
        __syncthreads();
        if (count == 1) {
          kept_mass = above + mass;
          break;
        }
        if (pass == 2) {  // one logit value: its tokens are kept from the lowest id until need is reached
          const unsigned long long wk = mass / count;
          const unsigned long long k = (need - above + wk - 1) / wk;
          if (k >= count) {
            kept_mass = above + mass;
          } else {
            kept_mass = above + k * wk;
            cut = find_cum(l, V, k - 1, [&](int64_t, float v) -> unsigned long long {
              return key_of(v) == prefix && weight(v, m, T) != 0 ? 1ull : 0ull;
            }, sh);
          }
        }
      }
    } else {
      unsigned long long s = 0;
      for_each(l, V, vec, [&](int64_t, float v) { s += weight(v, m, T); });
      unsigned long long total;
      block_excl_scan(s, sh, total);
      kept_mass = total;
    }
    auto kept = [&](int64_t i, uint32_t k) {
      const uint32_t hk = k & mask;
      return hk > prefix || (hk == prefix && i <= cut);
    };
    // 4. The draft, then the draw.
    const int64_t d = spec.draft;
    unsigned long long wd = 0;
    if (d >= 0 && d < V) {
      const float vd = clean(l[d]);
      wd = kept(d, key_of(vd)) ? weight(vd, m, T) : 0ull;
      accepted = spec.u_accept * static_cast<double>(kept_mass) < static_cast<double>(wd);
    }
    if (accepted) {
      token = d;
    } else {
      const unsigned long long rest = kept_mass - wd;
      if (rest > 0) {
        unsigned long long t = static_cast<unsigned long long>(spec.u_draw * static_cast<double>(rest));
        if (t >= rest) t = rest - 1;
        const int64_t got = find_cum(l, V, t, [&](int64_t i, float v) -> unsigned long long {
          return i != d && kept(i, key_of(v)) ? weight(v, m, T) : 0ull;
        }, sh);
        if (got >= 0) token = got;
      }
    }
  }
  if (threadIdx.x == 0) {
    SampleResult r;
    r.token = static_cast<int32_t>(token);
    r.accepted = accepted;
    r.logprob = 0.f;
    if (want_lp) r.logprob = m == -INFINITY ? -INFINITY : (clean(l[token]) - m) - logf(z1);
    out[blockIdx.x] = r;
  }
}

}  // namespace

int sample_rows_one_cta(const float* logits, int64_t rows, int64_t vocab, const SampleSpec* spec, SampleResult* out,
                        CUstream_st* stream) {
  if (rows < 0 || vocab <= 0 || rows > 0x7fffffff || vocab > (int64_t{1} << 23)) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const bool vec = vocab % 4 == 0 && aligned16(logits);
  sample_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(logits, vocab, vec, spec, out);
  return cudaGetLastError();
}

}  // namespace k3::ops::cuda
