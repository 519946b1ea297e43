// CUDA sample_rows (ops/sampling.h): each row's vocabulary split over several CTAs, no sort, no allocation.
//
// The math of the CPU op (ops/sampling.cpp), with integer masses where CTAs combine (the CPU sums in float64:
// the two pick the same ids except within rounding of a boundary): the argmax with ties to
// the lower id; each token's mass an integer, w_i = round(exp((l_i - max) / T) * 2^40) (w <= 2^40, so a
// row's total fits 64 bits for any vocab under 2^23); the kept set found by a mass-weighted radix select on
// the logits' order-preserving float bits (three passes of 11, 11, 10 bits, the edge bin chosen where the
// mass from the top reaches need = top_p * total); the draw, the first id whose cumulative kept mass (in id
// order, the rejected draft left out) exceeds u_draw * mass. Every quantity combined across CTAs is a max
// over a total order (value, then id) or a sum of integers, so the order in which CTAs combine does not
// matter, and neither does the split: the results are the same bits whatever the rows, the SM count or
// ctas_per_row (a request's draw does not depend on what it is batched with).
//
// The log-probability's normalizer is an integer sum too (z1 = sum of round(exp(l_i - max) * 2^40), which
// for T = 1 is the total mass). It drops terms under 2^-41 of the largest and rounds each to 2^-40 (at most
// V 2^-41 of z1 >= 1 in all, under 1e-7 at V = 163840): the log-prob is the float64 log-softmax's to ~1e-6
// relative.
//
// Layout: row r runs on CTAs r S .. r S + S - 1 (S = sample_split(rows, V).ctas = floor(2 SMs / rows): one
// wave of two CTAs per SM over all rows, while a chunk keeps >= 2048 ids; one CTA per row from SMs + 1 rows
// on). CTA j reads ids [j chunk, (j + 1) chunk) once per phase; warp w of it reads segment w of the chunk
// (chunk / 16 ids, contiguous), float4 loads when the row allows. The phases are separate kernels in stream
// order, each on the whole grid (a row whose state says it is past the phase, or done, leaves at once).
// Why kernels and not one kernel whose CTAs wait for each other between phases: a waiting CTA needs every
// CTA of its row resident (a cooperative launch), and could wait forever beside other ranks' kernels on the
// same GPU; a launch in stream order costs a microsecond or two, and the phases no row needs are not
// launched. The phases:
//   kMax:   per CTA the argmax (value, then id); the row's max and argmax. Greedy rows without a log-prob
//           end here: one read of the row and one launch.
//   kMass:  sampled rows: the masses (top_p < 1: histogram pass 0 of the mass by key bits 21..31; top_p = 1:
//           the masses' sums per segment, which are the draw's prefix); log-prob rows: z1.
//   kHist1, kHist2: the radix passes on bits 10..20 and 0..9, over the candidates of the edge bin only
//           (rows whose edge bin held one token skip them).
//   kCut:   the edge is one logit value held by several tokens of which the k lowest ids are kept: the id of
//           the k-th, from per-segment counts.
//   kDraw:  per segment the kept mass (the draft left out); the acceptance, then the draw.
// Within a phase the CTAs of a row hand off through a last-CTA-arrives counter (no CTA waits for another):
// each CTA writes its partials (per-segment u64 sums, or its argmax, or z1) to the row's scratch block,
// and histogram bins by atomics into the row's global histogram; __threadfence, atomicAdd on the row's
// counter; the CTA that arrives last (it resets the counter) combines them in id order and runs the
// row's serial step: the combine, the bin select (a block scan of the 2048 bins from the top), or a
// find (block scan over the row's S x 16 segment sums for the segment holding the target, then a block
// scan inside that one segment). It writes the row's state for the next phase, or the row's result.
// The launcher skips the phases no row needs (SampleNeeds, from the host specs: greedy rows without
// log-probs, one launch); a skipped launch would otherwise cost a few microseconds of an empty grid.
//
// Scratch (sample_rows_scratch_bytes): a block per row at a stride fixed by (vocab, ctas_per_row), so any
// call of up to max_rows rows finds its counters at the same places: counter, state, histogram (2048 u64
// masses and u32 counts), S partials. The counters must start at 0 (the caller zeroes the scratch once)
// and every phase's last CTA resets its row's; the histogram is zeroed by the kMax step of a row that uses
// it and after every pass that another follows. No host synchronization, no allocation, no memset: the
// launches can be captured in a CUDA graph and replayed.
#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>

#include "ops/cuda_device.cuh"
#include "ops/sampling.h"

namespace k3::ops::cuda {
namespace {

using detail::aligned16;
using detail::kWarp;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / kWarp;  // also the segments of a chunk: warp w reads segment w
constexpr int kBins = 2048;
constexpr int kUnroll = 4;                // float4 (or 4 scalar) loads in flight per lane
constexpr int64_t kMinChunk = 2048;       // ids per CTA at least (auto split)
constexpr int64_t kMinSegment = 4;        // ids per segment at least (forced split)
constexpr int kNoId = INT_MAX;
constexpr double kLn2x40 = 27.725887222397812;  // 40 ln 2: z1 is in units of 2^-40

enum Stage : int { kMax = 0, kMass, kHist1, kHist2, kCut, kDraw, kDone };

// A row's state between phases (written by the last CTA of a phase, read by the next phase's CTAs).
struct RowState {
  int stage;
  int argmax;
  int token, accepted;  // greedy rows waiting for z1
  int cut;              // kept: (key & mask) > prefix, or == prefix with id <= cut
  float m;
  unsigned prefix, mask;
  unsigned long long above, need, kept_mass, z1, cut_k;
};

// One CTA's partials of a phase.
struct Part {
  float v;  // kMax: the CTA's best value and id
  int id;
  unsigned long long z1;              // kMass: the CTA's share of z1
  unsigned long long seg[kWarps];     // kMass (top_p = 1), kCut, kDraw: per segment sums
};

// A row's block: [counter | state] [hist masses] [hist counts] [S partials].
constexpr size_t kStateOff = 16;
constexpr size_t kHistWOff = 128;
constexpr size_t kHistCOff = kHistWOff + kBins * sizeof(unsigned long long);
constexpr size_t kPartOff = kHistCOff + kBins * sizeof(unsigned);
static_assert(kStateOff + sizeof(RowState) <= kHistWOff, "RowState outgrew its slot");
static_assert(kPartOff % alignof(Part) == 0, "partials misaligned");

struct Params {
  const float* logits;
  const SampleSpec* spec;
  SampleResult* out;
  char* scratch;
  size_t row_bytes;
  int64_t V, seg;  // seg: ids per segment (a multiple of 4); a CTA's chunk is kWarps segments
  int S;           // CTAs per row
  bool vec;        // float4 loads: V % 4 == 0 and 16-byte aligned logits
};

struct Smem {
  unsigned long long hist_w[kBins];
  unsigned hist_c[kBins];
  unsigned long long scan[kWarps], red_u[kWarps];
  float red_v[kWarps];
  int red_i[kWarps];
  unsigned long long fbase, sel_above, sel_mass;
  long long found;
  int fg, last, best_i;
  float best_v;
  unsigned sel_bin, sel_count;
};

__device__ __forceinline__ char* row_block(const Params& p, int r) { return p.scratch + static_cast<size_t>(r) * p.row_bytes; }
__device__ __forceinline__ unsigned* counter_of(const Params& p, int r) { return reinterpret_cast<unsigned*>(row_block(p, r)); }
__device__ __forceinline__ RowState* state_of(const Params& p, int r) {
  return reinterpret_cast<RowState*>(row_block(p, r) + kStateOff);
}
__device__ __forceinline__ unsigned long long* hist_w_of(const Params& p, int r) {
  return reinterpret_cast<unsigned long long*>(row_block(p, r) + kHistWOff);
}
__device__ __forceinline__ unsigned* hist_c_of(const Params& p, int r) {
  return reinterpret_cast<unsigned*>(row_block(p, r) + kHistCOff);
}
__device__ __forceinline__ Part* parts_of(const Params& p, int r) { return reinterpret_cast<Part*>(row_block(p, r) + kPartOff); }

// The row's state as the previous phases left it (through L2: written by another CTA of an earlier kernel).
__device__ __forceinline__ RowState load_state(const RowState* s) {
  RowState o;
  o.stage = __ldcg(&s->stage);
  o.argmax = __ldcg(&s->argmax);
  o.token = __ldcg(&s->token);
  o.accepted = __ldcg(&s->accepted);
  o.cut = __ldcg(&s->cut);
  o.m = __ldcg(&s->m);
  o.prefix = __ldcg(&s->prefix);
  o.mask = __ldcg(&s->mask);
  o.above = __ldcg(&s->above);
  o.need = __ldcg(&s->need);
  o.kept_mass = __ldcg(&s->kept_mass);
  o.z1 = __ldcg(&s->z1);
  o.cut_k = __ldcg(&s->cut_k);
  return o;
}

__device__ __forceinline__ float clean(float v) { return isnan(v) ? -INFINITY : (v == INFINITY ? FLT_MAX : v); }

// Order-preserving bits of a cleaned logit (-0 as +0: equal logits, equal keys).
__device__ __forceinline__ uint32_t key_of(float v) {
  if (v == 0.f) v = 0.f;
  const uint32_t b = __float_as_uint(v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The integer mass of a token.
__device__ __forceinline__ unsigned long long weight(float v, float m, float T) {
  if (v == -INFINITY) return 0;
  return __float2ull_rn(expf((v - m) / T) * 0x1p40f);
}

__device__ __forceinline__ bool better(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }

__device__ __forceinline__ bool kept(const RowState& st, int64_t i, uint32_t k) {
  const uint32_t hk = k & st.mask;
  return hk > st.prefix || (hk == st.prefix && i <= st.cut);
}

__device__ __forceinline__ unsigned long long warp_sum_u64(unsigned long long v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// f(i, clean(l[i])) for the ids [lo, hi) of the calling warp (lo a multiple of 4), every lane calling f the
// same number of times (warp-collective code may run inside f): padding ids (i >= hi) come with -inf.
template <class F>
__device__ __forceinline__ void warp_segment(const float* __restrict__ l, int64_t lo, int64_t hi, bool vec, F&& f) {
  const int lane = threadIdx.x % kWarp;
  if (lo >= hi) return;
  if (vec) {
    const float4* l4 = reinterpret_cast<const float4*>(l);
    const int64_t qlo = lo / 4, qhi = (hi + 3) / 4;
    for (int64_t base = qlo; base < qhi; base += int64_t{kWarp} * kUnroll) {
      float4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t q = base + int64_t{u} * kWarp + lane;
        v[u] = q < qhi ? __ldg(l4 + q) : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = 4 * (base + int64_t{u} * kWarp + lane);
        f(i, clean(v[u].x));
        f(i + 1, clean(v[u].y));
        f(i + 2, clean(v[u].z));
        f(i + 3, clean(v[u].w));
      }
    }
  } else {
    constexpr int kPer = 4 * kUnroll;
    for (int64_t base = lo; base < hi; base += int64_t{kWarp} * kPer) {
      float v[kPer];
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        const int64_t i = base + int64_t{u} * kWarp + lane;
        v[u] = i < hi ? __ldg(l + i) : -INFINITY;
      }
#pragma unroll
      for (int u = 0; u < kPer; ++u) f(base + int64_t{u} * kWarp + lane, clean(v[u]));
    }
  }
}

// Adds token (key k, mass w) to the CTA's histogram of pass (shift, nb) when it is a candidate (w != 0 and
// k's bits above the pass match prefix). Warp-collective: the lanes of one bin combine first, so each bin
// gets one shared atomic per warp.
__device__ __forceinline__ void hist_add(Smem& sh, uint32_t k, unsigned long long w, uint32_t prefix, uint32_t mask,
                                         int shift, unsigned nb) {
  const int lane = threadIdx.x % kWarp;
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
    unsigned long long x = lane < kWarps ? sh.scan[lane] : 0ull;
#pragma unroll
    for (int o = 1; o < kWarp; o *= 2) {
      const unsigned long long n = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += n;
    }
    if (lane < kWarps) sh.scan[lane] = x;
  }
  __syncthreads();
  const unsigned long long out = (warp ? sh.scan[warp - 1] : 0ull) + incl - v;
  total = sh.scan[kWarps - 1];
  __syncthreads();
  return out;
}

__device__ __forceinline__ unsigned long long block_sum_u64(unsigned long long v, Smem& sh) {
  unsigned long long total;
  block_excl_scan(v, sh, total);
  return total;
}

// Whether this CTA is the last of its row's S to arrive (then it combines the row's partials). Every thread
// calls it after writing its partials; ends with a barrier.
__device__ __forceinline__ bool arrive(const Params& p, int r, Smem& sh) {
  if (p.S == 1) {  // the one CTA of its row
    __syncthreads();
    return true;
  }
  return detail::last_cta_arrives(counter_of(p, r), p.S, sh.last);
}

// The first id whose cumulative value(i, clean(l[i])) (in id order) exceeds target; -1 if none. The row's
// per-segment sums of the same values are in its partials (seg). Every thread of the last CTA calls it.
// Level 1: a block scan of the S x kWarps segment sums finds the segment; level 2: a block scan inside it.
template <class F>
__device__ int64_t find_id(const Params& p, int r, const float* __restrict__ l, unsigned long long target, F&& value,
                           Smem& sh) {
  const Part* parts = parts_of(p, r);
  if (threadIdx.x == 0) sh.fg = -1, sh.found = -1;
  const int nseg = p.S * kWarps;
  const int per = (nseg + kThreads - 1) / kThreads;
  const int a = min(nseg, static_cast<int>(threadIdx.x) * per), b = min(nseg, a + per);
  unsigned long long s = 0;
  for (int g = a; g < b; ++g) s += __ldcg(&parts[g / kWarps].seg[g % kWarps]);
  unsigned long long total;
  const unsigned long long ex = block_excl_scan(s, sh, total);
  if (ex <= target && target < ex + s) {
    unsigned long long c = ex;
    for (int g = a; g < b; ++g) {
      const unsigned long long v = __ldcg(&parts[g / kWarps].seg[g % kWarps]);
      if (target < c + v) {
        sh.fg = g;
        sh.fbase = c;
        break;
      }
      c += v;
    }
  }
  __syncthreads();
  const int fg = sh.fg;
  const unsigned long long fbase = sh.fbase;
  if (fg < 0) return -1;  // the same for every thread
  const int64_t lo = min(p.V, fg * p.seg), hi = min(p.V, lo + p.seg);
  const int64_t per2 = (hi - lo + kThreads - 1) / kThreads;
  const int64_t ia = min(hi, lo + static_cast<int64_t>(threadIdx.x) * per2), ib = min(hi, ia + per2);
  unsigned long long ts = 0;
  for (int64_t i = ia; i < ib; ++i) ts += value(i, clean(__ldg(l + i)));
  const unsigned long long ex2 = fbase + block_excl_scan(ts, sh, total);
  if (ex2 <= target && target < ex2 + ts) {
    unsigned long long c = ex2;
    for (int64_t i = ia; i < ib; ++i) {
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

// log p(token) under the softmax at temperature 1 from z1 (units of 2^-40).
__device__ __forceinline__ float logprob_of(const float* __restrict__ l, int token, float m, unsigned long long z1) {
  if (m == -INFINITY) return -INFINITY;
  return (clean(l[token]) - m) - static_cast<float>(log(static_cast<double>(z1)) - kLn2x40);
}

__device__ __forceinline__ void zero_hist(const Params& p, int r) {
  unsigned long long* gw = hist_w_of(p, r);
  unsigned* gc = hist_c_of(p, r);
  for (int b = threadIdx.x; b < kBins; b += kThreads) gw[b] = 0ull, gc[b] = 0u;
}

// The CTA's shared histogram into the row's (the bins it touched), after its pass.
__device__ __forceinline__ void merge_hist(const Params& p, int r, Smem& sh) {
  __syncthreads();
  unsigned long long* gw = hist_w_of(p, r);
  unsigned* gc = hist_c_of(p, r);
  for (int b = threadIdx.x; b < kBins; b += kThreads) {
    const unsigned c = sh.hist_c[b];
    if (c != 0) {
      atomicAdd(&gw[b], sh.hist_w[b]);
      atomicAdd(&gc[b], c);
    }
  }
}

__device__ __forceinline__ void clear_shared_hist(Smem& sh) {
  for (int b = threadIdx.x; b < kBins; b += kThreads) sh.hist_w[b] = 0ull, sh.hist_c[b] = 0u;
  __syncthreads();
}

constexpr int pass_shift(int pass) { return pass == 0 ? 21 : pass == 1 ? 10 : 0; }
constexpr unsigned pass_bins(int pass) { return pass == 2 ? 1024u : 2048u; }

// The last CTA of radix pass `pass`: the bin where the mass from the top reaches need (pass 0 sets need from
// the total), then the row's next phase. z1_total: the row's z1 is the total mass (pass 0, T = 1, log-prob).
__device__ void select_bin(const Params& p, int r, int pass, RowState st, const SampleSpec& s, bool z1_total,
                           Smem& sh) {
  const int shift = pass_shift(pass);
  const unsigned nb = pass_bins(pass);
  const unsigned long long* gw = hist_w_of(p, r);
  const unsigned* gc = hist_c_of(p, r);
  if (threadIdx.x == 0) sh.sel_bin = 0, sh.sel_above = st.above, sh.sel_mass = 0, sh.sel_count = 1;  // (never kept)
  // Bins from the top: thread t holds bins nb-1-4t .. nb-4-4t.
  unsigned long long a[4], sum = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const unsigned j = 4 * threadIdx.x + k;
    a[k] = j < nb ? __ldcg(gw + (nb - 1 - j)) : 0ull;
    sum += a[k];
  }
  unsigned long long total;
  const unsigned long long ex = st.above + block_excl_scan(sum, sh, total);
  unsigned long long need = st.need;
  if (pass == 0) {
    need = static_cast<unsigned long long>(static_cast<double>(s.top_p) * static_cast<double>(total));
    if (need == 0) need = 1;
  }
  unsigned long long cum = ex;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (cum < need && need <= cum + a[k]) {
      const unsigned bin = nb - 1 - (4 * threadIdx.x + k);
      sh.sel_bin = bin, sh.sel_above = cum, sh.sel_mass = a[k], sh.sel_count = __ldcg(gc + bin);
    }
    cum += a[k];
  }
  __syncthreads();
  const unsigned bin = sh.sel_bin, count = sh.sel_count;
  const unsigned long long above = sh.sel_above, mass = sh.sel_mass;
  st.need = need;
  st.above = above;
  st.prefix |= bin << shift;
  st.mask |= (nb - 1) << shift;
  if (pass == 0 && z1_total) st.z1 = total;
  if (count == 1) {
    st.kept_mass = above + mass;
    st.stage = kDraw;
  } else if (pass < 2) {
    st.stage = pass == 0 ? kHist1 : kHist2;
  } else {  // one logit value: its tokens (equal masses) are kept from the lowest id until need is reached
    const unsigned long long wk = mass / count;
    const unsigned long long k = (need - above + wk - 1) / wk;
    if (k >= count) {
      st.kept_mass = above + mass;
      st.stage = kDraw;
    } else {
      st.kept_mass = above + k * wk;
      st.cut_k = k - 1;
      st.stage = kCut;
    }
  }
  if (st.stage != kDraw && st.stage != kCut) zero_hist(p, r);  // the next pass starts from zero
  if (threadIdx.x == 0) *state_of(p, r) = st;
}

// The last CTA of the draw's phase: the draft's acceptance, then the draw over the kept set (the draft left
// out), whose per-segment masses are in the row's partials; writes the row's result.
__device__ void draw(const Params& p, int r, const float* __restrict__ l, RowState st, const SampleSpec& s,
                     Smem& sh) {
  const float T = s.temperature;
  const int d = s.draft;
  int token = st.argmax, accepted = 0;
  unsigned long long wd = 0;
  if (d >= 0 && d < p.V) {
    const float vd = clean(l[d]);
    wd = kept(st, d, key_of(vd)) ? weight(vd, st.m, T) : 0ull;
    accepted = s.u_accept * static_cast<double>(st.kept_mass) < static_cast<double>(wd);
  }
  if (accepted) {
    token = d;
  } else {
    const unsigned long long rest = st.kept_mass - wd;
    if (rest > 0) {
      unsigned long long t = static_cast<unsigned long long>(s.u_draw * static_cast<double>(rest));
      if (t >= rest) t = rest - 1;
      const int64_t got = find_id(p, r, l, t, [&](int64_t i, float v) -> unsigned long long {
        return i != d && kept(st, i, key_of(v)) ? weight(v, st.m, T) : 0ull;
      }, sh);
      if (got >= 0) token = static_cast<int>(got);
    }
  }
  if (threadIdx.x == 0) {
    SampleResult o;
    o.token = token;
    o.accepted = accepted;
    o.logprob = s.logprob ? logprob_of(l, token, st.m, st.z1) : 0.f;
    p.out[r] = o;
    state_of(p, r)->stage = kDone;
  }
}

template <int STAGE>
__global__ void __launch_bounds__(kThreads, 2) sample_stage(const Params p) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  __shared__ Smem sh;
  const int r = static_cast<int>(blockIdx.x / static_cast<unsigned>(p.S));
  const int j = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.S));
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const float* l = p.logits + static_cast<int64_t>(r) * p.V;
  const SampleSpec s = p.spec[r];
  const int64_t lo = min(p.V, (static_cast<int64_t>(j) * kWarps + warp) * p.seg), hi = min(p.V, lo + p.seg);
  Part* part = parts_of(p, r) + j;

  if constexpr (STAGE == kMax) {
    float bv = -INFINITY;
    int bi = kNoId;
    warp_segment(l, lo, hi, p.vec, [&](int64_t i, float v) {
      if (i < hi && better(v, static_cast<int>(i), bv, bi)) bv = v, bi = static_cast<int>(i);
    });
#pragma unroll
    for (int o = kWarp / 2; o > 0; o /= 2) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (better(ov, oi, bv, bi)) bv = ov, bi = oi;
    }
    if (lane == 0) sh.red_v[warp] = bv, sh.red_i[warp] = bi;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < kWarps; ++w)
        if (better(sh.red_v[w], sh.red_i[w], bv, bi)) bv = sh.red_v[w], bi = sh.red_i[w];
      part->v = bv;
      part->id = bi;
    }
    if (!arrive(p, r, sh)) return;
    // The row's max over the S partials.
    const Part* parts = parts_of(p, r);
    bv = -INFINITY, bi = kNoId;
    for (int k = threadIdx.x; k < p.S; k += kThreads) {
      const float v = __ldcg(&parts[k].v);
      const int i = __ldcg(&parts[k].id);
      if (better(v, i, bv, bi)) bv = v, bi = i;
    }
#pragma unroll
    for (int o = kWarp / 2; o > 0; o /= 2) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (better(ov, oi, bv, bi)) bv = ov, bi = oi;
    }
    __syncthreads();  // sh.red_* were read by thread 0 above
    if (lane == 0) sh.red_v[warp] = bv, sh.red_i[warp] = bi;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < kWarps; ++w)
        if (better(sh.red_v[w], sh.red_i[w], bv, bi)) bv = sh.red_v[w], bi = sh.red_i[w];
      sh.best_v = bv, sh.best_i = bi;
    }
    __syncthreads();
    const float m = sh.best_v;
    const int argmax = sh.best_i;
    const bool greedy = s.temperature == 0.f || m == -INFINITY;
    if (!greedy && s.top_p < 1.f) zero_hist(p, r);  // for pass 0
    if (threadIdx.x == 0) {
      RowState st{};
      st.m = m;
      st.argmax = argmax;
      st.token = argmax;
      st.accepted = s.draft == argmax;
      st.cut = kNoId;
      if (greedy && (!s.logprob || m == -INFINITY)) {
        SampleResult o;
        o.token = argmax;
        o.accepted = st.accepted;
        o.logprob = s.logprob ? -INFINITY : 0.f;
        p.out[r] = o;
        st.stage = kDone;
      } else {
        st.stage = kMass;
      }
      *state_of(p, r) = st;
    }
    return;
  } else {
    const RowState st = load_state(state_of(p, r));
    if (st.stage != STAGE) return;  // the same for the whole row
    const float m = st.m, T = s.temperature;
    const int d = s.draft;

    if constexpr (STAGE == kMass) {
      const bool greedy = T == 0.f, lp = s.logprob != 0;
      const bool own_z1 = lp && (greedy || T != 1.f);  // else z1 is the total mass
      const bool hist = !greedy && s.top_p < 1.f;
      if (hist) clear_shared_hist(sh);
      unsigned long long z = 0, acc = 0;
      warp_segment(l, lo, hi, p.vec, [&](int64_t i, float v) {
        if (own_z1) z += weight(v, m, 1.f);
        if (greedy) return;
        const unsigned long long w = weight(v, m, T);
        if (hist) {
          hist_add(sh, key_of(v), w, 0u, 0u, pass_shift(0), pass_bins(0));
        } else if (i != d) {
          acc += w;
        }
      });
      if (!greedy && !hist) {
        acc = warp_sum_u64(acc);
        if (lane == 0) part->seg[warp] = acc;
      }
      if (own_z1) {
        z = warp_sum_u64(z);
        if (lane == 0) sh.red_u[warp] = z;
        __syncthreads();
        if (threadIdx.x == 0) {
          unsigned long long t = 0;
          for (int w = 0; w < kWarps; ++w) t += sh.red_u[w];
          part->z1 = t;
        }
      }
      if (hist) merge_hist(p, r, sh);
      if (!arrive(p, r, sh)) return;
      RowState nx = st;
      if (own_z1) {
        unsigned long long t = 0;
        for (int k = threadIdx.x; k < p.S; k += kThreads) t += __ldcg(&parts_of(p, r)[k].z1);
        nx.z1 = block_sum_u64(t, sh);
      }
      if (greedy) {
        if (threadIdx.x == 0) {
          SampleResult o;
          o.token = st.token;
          o.accepted = st.accepted;
          o.logprob = logprob_of(l, st.token, m, nx.z1);
          p.out[r] = o;
          state_of(p, r)->stage = kDone;
        }
      } else if (hist) {
        select_bin(p, r, 0, nx, s, lp && !own_z1, sh);
      } else {  // top_p = 1: every token kept; the segment sums are the draw's prefix
        const Part* parts = parts_of(p, r);
        unsigned long long t = 0;
        for (int g = threadIdx.x; g < p.S * kWarps; g += kThreads) t += __ldcg(&parts[g / kWarps].seg[g % kWarps]);
        unsigned long long total = block_sum_u64(t, sh);
        if (d >= 0 && d < p.V) total += weight(clean(l[d]), m, T);
        nx.kept_mass = total;
        if (lp && !own_z1) nx.z1 = total;
        draw(p, r, l, nx, s, sh);
      }
    } else if constexpr (STAGE == kHist1 || STAGE == kHist2) {
      constexpr int pass = STAGE == kHist1 ? 1 : 2;
      clear_shared_hist(sh);
      warp_segment(l, lo, hi, p.vec, [&](int64_t, float v) {
        const uint32_t k = key_of(v);
        const unsigned long long w = (k & st.mask) == st.prefix ? weight(v, m, T) : 0ull;
        hist_add(sh, k, w, st.prefix, st.mask, pass_shift(pass), pass_bins(pass));
      });
      merge_hist(p, r, sh);
      if (!arrive(p, r, sh)) return;
      select_bin(p, r, pass, st, s, false, sh);
    } else if constexpr (STAGE == kCut || STAGE == kDraw) {
      auto value = [&](int64_t i, float v) -> unsigned long long {
        if constexpr (STAGE == kCut) {
          (void)i;
          return key_of(v) == st.prefix && weight(v, m, T) != 0 ? 1ull : 0ull;
        } else {
          return i != d && kept(st, i, key_of(v)) ? weight(v, m, T) : 0ull;
        }
      };
      unsigned long long acc = 0;
      warp_segment(l, lo, hi, p.vec, [&](int64_t i, float v) { acc += value(i, v); });
      acc = warp_sum_u64(acc);
      if (lane == 0) part->seg[warp] = acc;
      if (!arrive(p, r, sh)) return;
      if constexpr (STAGE == kCut) {
        const int64_t cut = find_id(p, r, l, st.cut_k, value, sh);
        if (threadIdx.x == 0) {
          RowState nx = st;
          nx.cut = static_cast<int>(cut);
          nx.stage = kDraw;
          *state_of(p, r) = nx;
        }
      } else {
        draw(p, r, l, st, s, sh);
      }
    }
  }
}

struct Geometry {
  int64_t S, seg;
};

Geometry geometry(int64_t rows, int64_t V, int64_t forced) {
  const int64_t most = forced > 0 ? (V + kMinSegment * kWarps - 1) / (kMinSegment * kWarps) : V / kMinChunk;
  // Auto: one wave of two 512-thread CTAs per SM over all rows (no ragged second wave).
  const int64_t want = forced > 0 ? forced : 2 * int64_t{detail::device_sm_count()} / std::max<int64_t>(rows, 1);
  const int64_t S = std::clamp<int64_t>(want, 1, std::max<int64_t>(most, 1));
  const int64_t seg = ((V + S * kWarps - 1) / (S * kWarps) + 3) / 4 * 4;
  return {(V + seg * kWarps - 1) / (seg * kWarps), seg};
}

// The stride of a row's block: room for the most CTAs any rows can get at this vocab.
size_t row_bytes(int64_t V, int64_t forced) {
  const int64_t most = forced > 0 ? std::min<int64_t>(forced, (V + kMinSegment * kWarps - 1) / (kMinSegment * kWarps))
                                  : V / kMinChunk;
  const size_t b = kPartOff + static_cast<size_t>(std::max<int64_t>(most, 1)) * sizeof(Part);
  return (b + 255) / 256 * 256;
}

template <int STAGE>
cudaError_t launch(const Params& p, int64_t rows, cudaStream_t stream) {
  return detail::launch(sample_stage<STAGE>, static_cast<unsigned>(rows * p.S), kThreads, 0, stream, p);
}

}  // namespace

SampleSplit sample_split(int64_t rows, int64_t vocab, int64_t ctas_per_row) {
  if (vocab <= 0) return {};
  const Geometry g = geometry(std::max<int64_t>(rows, 1), vocab, ctas_per_row);
  return {g.S, g.seg * kWarps, g.seg};
}

size_t sample_rows_scratch_bytes(int64_t max_rows, int64_t vocab, int64_t ctas_per_row) {
  if (max_rows <= 0 || vocab <= 0) return 0;
  return static_cast<size_t>(max_rows) * row_bytes(vocab, ctas_per_row);
}

int sample_rows(const float* logits, int64_t rows, int64_t vocab, const SampleSpec* spec, SampleResult* out,
                void* scratch, size_t scratch_bytes, CUstream_st* stream, SampleNeeds needs, int64_t ctas_per_row) {
  if (rows < 0 || vocab <= 0 || rows > 0x7fffffff || vocab > (int64_t{1} << 23) || ctas_per_row < 0)
    return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const Geometry g = geometry(rows, vocab, ctas_per_row);
  const size_t stride = row_bytes(vocab, ctas_per_row);
  if (scratch == nullptr || scratch_bytes < static_cast<size_t>(rows) * stride || rows * g.S > 0x7fffffff ||
      (reinterpret_cast<uintptr_t>(scratch) & 15u) != 0)
    return cudaErrorInvalidValue;
  Params p;
  p.logits = logits;
  p.spec = spec;
  p.out = out;
  p.scratch = static_cast<char*>(scratch);
  p.row_bytes = stride;
  p.V = vocab;
  p.seg = g.seg;
  p.S = static_cast<int>(g.S);
  p.vec = vocab % 4 == 0 && aligned16(logits);
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  cudaError_t e = launch<kMax>(p, rows, s);
  if (e == cudaSuccess && (needs.sampled || needs.logprob)) e = launch<kMass>(p, rows, s);
  if (e == cudaSuccess && needs.sampled && needs.top_p) {
    e = launch<kHist1>(p, rows, s);
    if (e == cudaSuccess) e = launch<kHist2>(p, rows, s);
    if (e == cudaSuccess) e = launch<kCut>(p, rows, s);
    if (e == cudaSuccess) e = launch<kDraw>(p, rows, s);
  }
  return e;
}

}  // namespace k3::ops::cuda
