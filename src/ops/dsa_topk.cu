// CUDA topk_indices (ops/dsa.h): the DSA top-k, each row's scores on one CTA or split over several.
//
// The order: every candidate i of a row becomes the 64-bit pair (key(s_i) << 32) | (2^32 - 1 - i), key the
// order-preserving bits of the score (NaN as -inf, -0 as +0). Pairs are distinct, and pair order is exactly
// the CPU's (score descending, ties to the lower index), so the answer is the set of the m = min(k, n)
// largest pairs, which is the set of pairs >= T for T the m-th largest. It is written in column order: no
// sort anywhere. The result is a function of the row alone, never of the split or of the order in which
// CTAs run.
//
// Radix select over the pair's bits, top down, passes of (pair bit, width): key bits 20..31 (52, 12), 10..19
// (42, 10), 0..9 (32, 10), then the index bits that can differ, 12 at a time (only rows whose threshold is an
// exact tie of more than ~2048 scores get there). A pass histograms the candidates (pair bits above the pass
// equal to the row's prefix) and picks the bin where the count from the top reaches `need`. As soon as the
// pairs at or above the prefix number at most kCap = 4096 (the chosen bin, plus fewer than k above it), the
// row gathers them IN COLUMN ORDER: each CTA compacts its chunk's (each thread flags 8 consecutive columns,
// a block scan of the counts places them), and the row's segments are laid end to end in CTA order. One CTA then finishes the
// row in shared memory: 8-bit radix passes over the gathered pairs find T exactly (stopping as soon as a
// chosen bin is taken whole: T is then the lowest pair of that bin), and an ordered compaction (a block scan
// of the flags pair >= T) writes the columns. Rows with n <= kCap gather at once (no histogram); common rows
// at 64k take one histogram pass and the gather (two reads of the row), and two or three shared passes.
//
// One CTA per row (S = 1): one launch runs every pass and the gather in a loop. Split rows (S > 1): row r
// on CTAs r S .. r S + S - 1, CTA j over columns [j chunk, (j + 1) chunk). Each phase is one launch of the
// same kernel over the whole grid; a row's state in scratch says what its CTAs do in that launch: a
// histogram pass, the gather, or nothing (done). Within a launch the CTAs of a row hand off through a
// last-arrives counter (no CTA ever waits for another): each adds its shared histogram into the row's
// global one (integer counts: the sum does not depend on the order) or appends its gathered segment to the
// row's buffer (an atomic offset) and records (offset, count) in its slot, __threadfence, atomicAdd on the
// counter; the CTA that arrives last resets the counter, reads the global histogram (zeroing it) and writes
// the next state, or reads the segments in CTA order (the records' scan says where each lands), resets the
// fill and finishes the row. The launcher enqueues the first launch and, for split rows, one launch per
// later pass plus the gather (the worst case); a launch finding its row done exits at once.
//
// Scratch (topk_indices_scratch_bytes): a block of kRowBytes per row: arrival counter, buffer fill, the
// row's state, histogram [4096] u32, buffer [kCap] u64, segment records [kMaxSplit] x (offset, count) u32.
// Counter, fill and histogram must be zero before a call (zeroed once by the caller) and are zero again
// after every call; state, buffer and records need no reset (every CTA of a gather writes its record).
//
// ptxas (sm_90a, -Xptxas -v): topk_split_kernel 64 registers (the cap of 2 CTAs of 512 per SM), 4 bytes
// spilled, 38008 bytes shared (static).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "ops/cuda_device.cuh"
#include "ops/dsa.h"

namespace k3::ops::cuda {
namespace {

using detail::kWarp;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / kWarp;
constexpr int kMaxK = 2048;
constexpr int kCap = 4096;             // pairs a row gathers at most, finished by one CTA
constexpr int kPer = kCap / kThreads;  // gathered pairs per thread in the finish
constexpr int kMaxBins = 4096;         // the widest pass: 12 bits
constexpr int kUnroll = 4;             // float4 loads (or 4 scalar loads) in flight per thread
constexpr int kContig = 8;             // consecutive columns per thread in the ordered gather
constexpr int kDigit = 8;              // bits per radix pass of the finish, in shared memory
constexpr int kMaxSplit = kThreads;    // CTAs per row at most (the finish scans one record per thread)
constexpr int64_t kMinChunk = 2048;    // columns per CTA at least (auto split)
// Auto: rows of at most this many columns, or at least one row per SM, take one CTA per row. A split row
// pays a fixed count of launches (one per possible pass, most of them finding the row done); one CTA pays
// two reads of its row at one CTA's bandwidth, which only long rows make larger, and when the rows alone
// cover the SMs the split has nothing to spread.
constexpr int64_t kSplitColumnsPerRow = 16384;
constexpr int kMaxPasses = 8;          // 3 key passes + at most 2 index passes (ld < 2^31)
static_assert(kPer * kThreads == kCap, "the finish holds kCap pairs, kPer per thread");
static_assert(kContig <= 32, "a thread's gather flags fit one 32-bit mask");
static_assert(kMaxK <= kCap / 2 + 1, "a gathered bin plus the pairs above it must fit kCap");

enum Stage : int { kHist = 0, kGather = 1, kDone = 2 };

// A row between launches: the pairs kept so far are those with (pair & mask) > prefix (gt of them); of those
// equal to prefix under mask, need more are to be taken. pass: the next histogram pass (stage kHist).
struct RowState {
  unsigned long long prefix, mask;
  int stage, pass, gt, need;
};

// A row's block: [counter u32 | fill u32 | state] [histogram u32 x 4096] [buffer u64 x kCap]
// [record offsets u32 x kMaxSplit] [record counts u32 x kMaxSplit].
constexpr size_t kFillOff = 4;
constexpr size_t kStateOff = 16;
constexpr size_t kHistOff = 256;
constexpr size_t kBufOff = kHistOff + kMaxBins * sizeof(unsigned);
constexpr size_t kRecOff = kBufOff + kCap * sizeof(unsigned long long);
constexpr size_t kRowBytes = kRecOff + 2 * kMaxSplit * sizeof(unsigned);
static_assert(kStateOff + sizeof(RowState) <= kHistOff, "RowState outgrew its slot");
static_assert(kRowBytes % 256 == 0, "row blocks keep 256-byte alignment");

struct Params {
  const float* scores;
  int64_t ld;
  const int32_t* n;
  int32_t* idx;
  int32_t* count;
  char* scratch;
  int64_t chunk;  // columns per CTA, a multiple of 4
  int S;          // CTAs per row
  int k;
  int passes;
  int vec;        // float4 loads: ld % 4 == 0 and 16-byte aligned scores
  unsigned long long gap;  // pair bits b .. 31: all ones in 2^32 - 1 - i for every column i < 2^b
  int shift[kMaxPasses], bits[kMaxPasses];
};

struct Smem {
  union {
    unsigned hist[kMaxBins];
    unsigned long long buf[kCap];
  } u;
  unsigned digit[1 << kDigit];
  unsigned dest[kMaxSplit], rbase[kMaxSplit];  // the finish of a split row: where each CTA's segment lands / lies
  unsigned scan[kWarps];
  RowState next;  // the state a histogram pass chose (one CTA per row: the next pass reads it)
  unsigned base, sel_bin, sel_above, sel_count;
  int last;
};

// Order-preserving key: a > b as floats (NaN as -inf, -0 as +0) <=> key(a) > key(b).
__device__ __forceinline__ uint32_t float_key(float s) {
  uint32_t u = __float_as_uint(s);
  if (s != s) u = 0xff800000u;   // NaN ranks as -inf
  if (u == 0x80000000u) u = 0u;  // -0 ties with +0
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ unsigned long long pair_of(uint32_t key, int64_t i) {
  return (static_cast<unsigned long long>(key) << 32) | (0xffffffffu - static_cast<uint32_t>(i));
}

__device__ __forceinline__ char* row_block(const Params& p, int64_t r) {
  return p.scratch + static_cast<size_t>(r) * kRowBytes;
}
__device__ __forceinline__ unsigned* counter_of(const Params& p, int64_t r) {
  return reinterpret_cast<unsigned*>(row_block(p, r));
}
__device__ __forceinline__ unsigned* fill_of(const Params& p, int64_t r) {
  return reinterpret_cast<unsigned*>(row_block(p, r) + kFillOff);
}
__device__ __forceinline__ RowState* state_of(const Params& p, int64_t r) {
  return reinterpret_cast<RowState*>(row_block(p, r) + kStateOff);
}
__device__ __forceinline__ unsigned* hist_of(const Params& p, int64_t r) {
  return reinterpret_cast<unsigned*>(row_block(p, r) + kHistOff);
}
__device__ __forceinline__ unsigned long long* buf_of(const Params& p, int64_t r) {
  return reinterpret_cast<unsigned long long*>(row_block(p, r) + kBufOff);
}
__device__ __forceinline__ unsigned* rec_of(const Params& p, int64_t r) {
  return reinterpret_cast<unsigned*>(row_block(p, r) + kRecOff);
}

// The state an earlier launch's last CTA wrote (through L2).
__device__ __forceinline__ RowState load_state(const RowState* s) {
  RowState o;
  o.prefix = __ldcg(&s->prefix);
  o.mask = __ldcg(&s->mask);
  o.stage = __ldcg(&s->stage);
  o.pass = __ldcg(&s->pass);
  o.gt = __ldcg(&s->gt);
  o.need = __ldcg(&s->need);
  return o;
}

// f(i, key(row[i]), valid) over the columns [lo, end) (lo a multiple of 4 when vec), called the same number
// of times by every thread of the block (f may hold warp-collective code); padding calls come with valid false.
template <class F>
__device__ __forceinline__ void visit(const float* __restrict__ row, int64_t lo, int64_t end, bool vec, F&& f) {
  const int tid = threadIdx.x;
  if (vec) {
    const float4* row4 = reinterpret_cast<const float4*>(row);
    for (int64_t base = lo; base < end; base += int64_t{4} * kThreads * kUnroll) {
      float4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i0 = base + 4 * (int64_t{u} * kThreads + tid);
        v[u] = i0 < end ? __ldg(row4 + i0 / 4) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i0 = base + 4 * (int64_t{u} * kThreads + tid);
        f(i0, float_key(v[u].x), i0 < end);
        f(i0 + 1, float_key(v[u].y), i0 + 1 < end);
        f(i0 + 2, float_key(v[u].z), i0 + 2 < end);
        f(i0 + 3, float_key(v[u].w), i0 + 3 < end);
      }
    }
  } else {
    constexpr int kLoads = 4 * kUnroll;
    for (int64_t base = lo; base < end; base += int64_t{kThreads} * kLoads) {
      float v[kLoads];
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int64_t i = base + int64_t{u} * kThreads + tid;
        v[u] = i < end ? __ldg(row + i) : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int64_t i = base + int64_t{u} * kThreads + tid;
        f(i, float_key(v[u]), i < end);
      }
    }
  }
}

// Counts bin once for each lane that takes it. Warp-collective; a warp whose takers share one bin (runs of
// equal scores) adds them with one shared atomic.
__device__ __forceinline__ void hist_add(unsigned* hist, bool take, unsigned bin) {
  const unsigned act = __ballot_sync(0xffffffffu, take);
  if (take) {
    const int leader = __ffs(act) - 1;
    const unsigned b0 = __shfl_sync(act, bin, leader);
    if (__all_sync(act, bin == b0)) {
      if (static_cast<int>(threadIdx.x % kWarp) == leader) atomicAdd(&hist[bin], static_cast<unsigned>(__popc(act)));
    } else {
      atomicAdd(&hist[bin], 1u);
    }
  }
}

// Exclusive prefix sum of v over the block in thread order; total: the sum of all. Every thread calls it;
// ends with a barrier.
__device__ __forceinline__ unsigned block_excl_scan(unsigned v, Smem& sh, unsigned& total) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  unsigned incl = v;
#pragma unroll
  for (int o = 1; o < kWarp; o *= 2) {
    const unsigned x = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += x;
  }
  if (lane == kWarp - 1) sh.scan[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    unsigned x = lane < kWarps ? sh.scan[lane] : 0u;
#pragma unroll
    for (int o = 1; o < kWarp; o *= 2) {
      const unsigned y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    if (lane < kWarps) sh.scan[lane] = x;
  }
  __syncthreads();
  const unsigned out = (warp ? sh.scan[warp - 1] : 0u) + incl - v;
  total = sh.scan[kWarps - 1];
  __syncthreads();
  return out;
}

// Whether this CTA is the last of its row's S to arrive (S > 1). Every thread calls it after its writes to
// the row's scratch; ends with a barrier.
__device__ __forceinline__ bool arrive(const Params& p, int64_t r, Smem& sh) {
  return detail::last_cta_arrives(counter_of(p, r), p.S, sh.last);
}

// One histogram pass of the row over this CTA's columns; the last CTA (every CTA of an unsplit row) picks
// the bin and leaves the next state in sh.next (and, split, in the row's scratch).
__device__ void hist_pass(const Params& p, int64_t r, const float* __restrict__ row, int64_t lo, int64_t end,
                          const RowState& st, Smem& sh) {
  const int ps = st.pass, shift = p.shift[ps];
  const unsigned nb = 1u << p.bits[ps];
  for (unsigned b = threadIdx.x; b < nb; b += kThreads) sh.u.hist[b] = 0u;
  __syncthreads();
  visit(row, lo, end, p.vec != 0, [&](int64_t i, uint32_t key, bool valid) {
    const unsigned long long pair = pair_of(key, i);
    const bool take = valid && (pair & st.mask) == st.prefix;
    hist_add(sh.u.hist, take, static_cast<unsigned>(pair >> shift) & (nb - 1u));
  });
  __syncthreads();
  if (p.S > 1) {
    unsigned* gh = hist_of(p, r);
    for (unsigned b = threadIdx.x; b < nb; b += kThreads) {
      const unsigned c = sh.u.hist[b];
      if (c != 0u) atomicAdd(&gh[b], c);
    }
    if (!arrive(p, r, sh)) return;
    for (unsigned b = threadIdx.x; b < nb; b += kThreads) {
      sh.u.hist[b] = __ldcg(&gh[b]);
      gh[b] = 0u;  // zero again for the next pass or call
    }
    __syncthreads();
  }
  // The bin where the count from the top reaches need: thread t holds the bins nb-1-t per .. nb-(t+1) per.
  const unsigned per = (nb + kThreads - 1) / kThreads;
  unsigned local = 0u;
  for (unsigned e = 0; e < per; ++e) {
    const unsigned q = threadIdx.x * per + e;
    if (q < nb) local += sh.u.hist[nb - 1u - q];
  }
  if (threadIdx.x == 0) sh.sel_bin = 0u, sh.sel_above = 0u, sh.sel_count = 0u;  // (always overwritten below)
  unsigned total;
  const unsigned excl = block_excl_scan(local, sh, total);
  const unsigned need = static_cast<unsigned>(st.need);
  if (excl < need && need <= excl + local) {
    unsigned run = excl;
    for (unsigned e = 0; e < per; ++e) {
      const unsigned q = threadIdx.x * per + e;
      if (q >= nb) break;
      const unsigned c = sh.u.hist[nb - 1u - q];
      if (run + c >= need) {
        sh.sel_bin = nb - 1u - q;
        sh.sel_above = run;
        sh.sel_count = c;
        break;
      }
      run += c;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    RowState o = st;
    o.prefix |= static_cast<unsigned long long>(sh.sel_bin) << shift;
    o.mask |= static_cast<unsigned long long>(nb - 1u) << shift;
    o.gt += static_cast<int>(sh.sel_above);
    o.need -= static_cast<int>(sh.sel_above);
    // The launcher's pass list ends where a bin holds at most 2^11 pairs, so the last pass always gathers.
    if (int64_t{o.gt} + sh.sel_count <= kCap || ps + 1 >= p.passes) {
      o.stage = kGather;
    } else {
      o.stage = kHist;
      o.pass = ps + 1;
    }
    sh.next = o;
    if (p.S > 1) *state_of(p, r) = o;
  }
  __syncthreads();
}

// This CTA's candidates of columns [lo, end) (pairs with (pair & mask) >= prefix) into sh.u.buf, in column
// order (thread t takes 8 consecutive columns a step; a block scan of the counts places them); returns
// their count (<= kCap: the row's candidates are at most kCap). Every thread calls it; ends with a barrier.
__device__ unsigned collect(const float* __restrict__ row, int64_t lo, int64_t end, bool vec, const RowState& st,
                            Smem& sh) {
  const int64_t first = lo + int64_t{kContig} * threadIdx.x;
  unsigned fill = 0u;
  for (int64_t base = lo; base < end; base += int64_t{kContig} * kThreads) {
    const int64_t i0 = base - lo + first;
    float v[kContig];
    if (vec) {  // lo and i0 are multiples of 4, and ld % 4 == 0: a float4 at i0 < end stays in the row
      const float4* row4 = reinterpret_cast<const float4*>(row);
#pragma unroll
      for (int u = 0; u < kContig / 4; ++u) {
        const int64_t i = i0 + 4 * u;
        const float4 x = i < end ? __ldg(row4 + i / 4) : make_float4(0.f, 0.f, 0.f, 0.f);
        v[4 * u] = x.x;
        v[4 * u + 1] = x.y;
        v[4 * u + 2] = x.z;
        v[4 * u + 3] = x.w;
      }
    } else {
#pragma unroll
      for (int e = 0; e < kContig; ++e) v[e] = i0 + e < end ? __ldg(row + i0 + e) : 0.f;
    }
    unsigned flags = 0u;
#pragma unroll
    for (int e = 0; e < kContig; ++e) {
      const bool take = i0 + e < end && (pair_of(float_key(v[e]), i0 + e) & st.mask) >= st.prefix;
      flags |= static_cast<unsigned>(take) << e;
    }
    unsigned total;
    unsigned at = fill + block_excl_scan(static_cast<unsigned>(__popc(flags)), sh, total);
#pragma unroll
    for (int e = 0; e < kContig; ++e) {
      if ((flags >> e) & 1u) {
        if (at < static_cast<unsigned>(kCap)) sh.u.buf[at] = pair_of(float_key(v[e]), i0 + e);
        ++at;
      }
    }
    fill += total;
  }
  __syncthreads();
  return min(fill, static_cast<unsigned>(kCap));
}

// The row's gathered pairs, sh.u.buf [0, total) in column order, hold its m best: those > prefix under mask
// (all in) and need more of those equal to it. Radix passes of 8 bits find T, the m-th largest pair; the
// pairs >= T are written in column order, then -1 to k, the count, and (split) the state done.
__device__ void finish(const Params& p, int64_t r, unsigned total, const RowState& st, int m, Smem& sh) {
  const unsigned base = threadIdx.x * kPer;
  unsigned long long v[kPer];
#pragma unroll
  for (int e = 0; e < kPer; ++e) v[e] = base + e < total ? sh.u.buf[base + e] : 0ull;
  unsigned long long thr = ~0ull;  // m == 0: nothing is taken (no pair reaches ~0: NaN keys are -inf's)
  if (m > 0) {
    unsigned long long prefix = st.prefix, mask = st.mask;
    unsigned need = static_cast<unsigned>(st.need);
    constexpr unsigned kBins = 1u << kDigit;
    for (int shift = 64 - kDigit; shift >= 0; shift -= kDigit) {
      if (((mask >> shift) & (kBins - 1u)) == kBins - 1u) continue;  // bits the histogram passes fixed
      if (threadIdx.x < kBins) sh.digit[threadIdx.x] = 0u;
      __syncthreads();
#pragma unroll
      for (int e = 0; e < kPer; ++e)
        if (base + e < total && (v[e] & mask) == prefix)
          atomicAdd(&sh.digit[static_cast<unsigned>(v[e] >> shift) & (kBins - 1u)], 1u);
      __syncthreads();
      // Thread t holds bin kBins - 1 - t: the scan counts from the top.
      const unsigned c = threadIdx.x < kBins ? sh.digit[kBins - 1u - threadIdx.x] : 0u;
      unsigned all;
      const unsigned excl = block_excl_scan(c, sh, all);
      if (excl < need && need <= excl + c) {
        sh.sel_bin = kBins - 1u - threadIdx.x;
        sh.sel_above = excl;
        sh.sel_count = c;
      }
      __syncthreads();
      prefix |= static_cast<unsigned long long>(sh.sel_bin) << shift;
      mask |= static_cast<unsigned long long>(kBins - 1u) << shift;
      need -= sh.sel_above;
      const bool whole = sh.sel_count == need;
      __syncthreads();  // sel_* read by every thread before a next pass writes them
      // Taken whole: every pair with the prefix is in. T = the prefix (its bits below the pass are zero, or
      // the column gap's ones, which every pair has): the bin's lowest possible pair.
      if (whole) break;
    }
    thr = prefix;  // after the last pass the prefix fixes every bit: the one pair left
  }
  unsigned flags = 0u;
#pragma unroll
  for (int e = 0; e < kPer; ++e) flags |= static_cast<unsigned>(base + e < total && v[e] >= thr) << e;
  unsigned taken;
  unsigned at = block_excl_scan(static_cast<unsigned>(__popc(flags)), sh, taken);
  int32_t* out = p.idx + r * p.k;
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    if ((flags >> e) & 1u) {
      if (at < static_cast<unsigned>(m)) out[at] = static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(v[e]));
      ++at;
    }
  }
  for (int j = m + static_cast<int>(threadIdx.x); j < p.k; j += kThreads) out[j] = -1;
  if (threadIdx.x == 0) {
    p.count[r] = m;
    if (p.S > 1) state_of(p, r)->stage = kDone;
  }
}

// The gather: this CTA's candidates in column order; split, its segment into the row's buffer and its record,
// and the last CTA lays the segments end to end in CTA order (= column order) before the finish.
__device__ void gather(const Params& p, int64_t r, const float* __restrict__ row, int64_t lo, int64_t end,
                       const RowState& st, int m, Smem& sh) {
  unsigned total = m > 0 ? collect(row, lo, end, p.vec != 0, st, sh) : 0u;
  if (p.S > 1) {
    const int j = static_cast<int>(blockIdx.x % p.S);
    unsigned* gfill = fill_of(p, r);
    unsigned* rec = rec_of(p, r);
    unsigned long long* gbuf = buf_of(p, r);
    if (threadIdx.x == 0) {
      sh.base = total ? atomicAdd(gfill, total) : 0u;
      rec[j] = sh.base;
      rec[kMaxSplit + j] = total;
    }
    __syncthreads();
    const unsigned at = sh.base;
    for (unsigned i = threadIdx.x; i < total; i += kThreads)
      if (at + i < static_cast<unsigned>(kCap)) gbuf[at + i] = sh.u.buf[i];
    if (!arrive(p, r, sh)) return;
    unsigned c = 0u;
    if (static_cast<int>(threadIdx.x) < p.S) {
      c = __ldcg(&rec[kMaxSplit + threadIdx.x]);
      sh.rbase[threadIdx.x] = __ldcg(&rec[threadIdx.x]);
    }
    unsigned all;
    const unsigned excl = block_excl_scan(c, sh, all);
    if (static_cast<int>(threadIdx.x) < p.S) sh.dest[threadIdx.x] = excl;
    __syncthreads();
    total = min(all, static_cast<unsigned>(kCap));
    for (unsigned q = threadIdx.x; q < total; q += kThreads) {
      // The segment holding q: the last CTA whose segment starts at or before q (empty ones share a start).
      int a = 0, b = p.S - 1;
      while (a < b) {
        const int mid = (a + b + 1) / 2;
        if (sh.dest[mid] <= q)
          a = mid;
        else
          b = mid - 1;
      }
      const unsigned from = sh.rbase[a] + (q - sh.dest[a]);
      sh.u.buf[q] = from < static_cast<unsigned>(kCap) ? __ldcg(&gbuf[from]) : 0ull;
    }
    if (threadIdx.x == 0) *gfill = 0u;  // every CTA of the row has added to it: zero for the next call
    __syncthreads();
  }
  finish(p, r, total, st, m, sh);
}

// One phase of every row: first = 1 starts each row (a histogram pass 0, or the gather of a short row); later
// launches run what the row's state says. An unsplit row runs all of its phases in its first launch.
__global__ void __launch_bounds__(kThreads, 2) topk_split_kernel(const Params p, const int first) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  __shared__ Smem sh;
  const int64_t r = blockIdx.x / p.S;
  const int64_t j = blockIdx.x % p.S;
  const int64_t n = max(int64_t{0}, min(static_cast<int64_t>(p.n[r]), p.ld));
  const int m = static_cast<int>(min(static_cast<int64_t>(p.k), n));
  const int64_t lo = j * p.chunk, end = min(lo + p.chunk, n);
  const float* row = p.scores + r * p.ld;
  RowState st;
  if (first) {
    st.gt = 0;
    st.need = m;
    st.pass = 0;
    if (n <= kCap || m == 0) {  // every candidate at once (or none)
      st.stage = kGather;
      st.prefix = st.mask = 0ull;
    } else {
      st.stage = kHist;
      st.prefix = st.mask = p.gap;
    }
  } else {
    st = load_state(state_of(p, r));
    if (st.stage == kDone) return;
  }
  if (p.S == 1) {
    while (st.stage == kHist) {
      hist_pass(p, r, row, lo, end, st, sh);
      st = sh.next;
    }
    gather(p, r, row, lo, end, st, m, sh);
  } else if (st.stage == kHist) {
    hist_pass(p, r, row, lo, end, st, sh);
  } else {
    gather(p, r, row, lo, end, st, m, sh);
  }
}

}  // namespace

size_t topk_indices_scratch_bytes(int64_t max_rows) {
  return static_cast<size_t>(std::max<int64_t>(max_rows, 1)) * kRowBytes;
}

int topk_indices(const float* scores, int64_t ld, const int32_t* n, int64_t T, int k, int32_t* idx, int32_t* count,
                 void* scratch, size_t scratch_bytes, CUstream_st* stream, int64_t ctas_per_row) {
  if (T < 0 || ld < 0 || ld > 0x7fffffffLL || k < 0 || k > kMaxK || ctas_per_row < 0) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  if (scratch == nullptr || !detail::aligned16(scratch) || scratch_bytes < topk_indices_scratch_bytes(T))
    return cudaErrorInvalidValue;
  Params p{};
  p.scores = scores;
  p.ld = ld;
  p.n = n;
  p.idx = idx;
  p.count = count;
  p.scratch = static_cast<char*>(scratch);
  p.k = k;
  p.vec = detail::aligned16(scores) && ld % 4 == 0;
  // The split (kSplitColumnsPerRow says when): ~2 CTAs per SM over all rows, chunks of >= kMinChunk columns.
  int64_t S = ctas_per_row;
  if (S == 0) {
    const int64_t sms = detail::device_sm_count();
    S = ld <= kSplitColumnsPerRow || T >= sms ? 1 : std::clamp<int64_t>(2 * sms / T, 1, (ld + kMinChunk - 1) / kMinChunk);
  }
  S = std::clamp<int64_t>(S, 1, std::min<int64_t>(kMaxSplit, std::max<int64_t>(1, (ld + 3) / 4)));
  p.chunk = std::max<int64_t>(4, ((ld + S - 1) / S + 3) / 4 * 4);
  S = std::max<int64_t>(1, (ld + p.chunk - 1) / p.chunk);
  if (T > 0x7fffffffLL / S) return cudaErrorInvalidValue;
  p.S = static_cast<int>(S);
  // The passes: key bits 20..31, 10..19, 0..9, then the index bits a column can set (b = bit width of
  // ld - 1), 12 at a time, until at most 11 remain (a bin of <= 2048 pairs, which always gathers).
  const int widths[3][2] = {{52, 12}, {42, 10}, {32, 10}};
  int np = 0;
  for (const auto& w : widths) {
    p.shift[np] = w[0];
    p.bits[np] = w[1];
    ++np;
  }
  int b = 0;
  while (b < 32 && (int64_t{1} << b) < ld) ++b;  // columns 0 .. ld - 1 fit b bits
  for (int hi = b; hi > 11;) {
    const int lo = std::max(hi - 12, 0);
    p.shift[np] = lo;
    p.bits[np] = hi - lo;
    ++np;
    hi = lo;
  }
  p.passes = np;
  p.gap = b >= 32 ? 0ull : (0xffffffffull << b) & 0xffffffffull;
  const unsigned grid = static_cast<unsigned>(T * S);
  if (const cudaError_t e = detail::launch(topk_split_kernel, grid, kThreads, 0, stream, p, 1); e != cudaSuccess)
    return e;
  if (S > 1 && ld > kCap)
    for (int s = 0; s < np; ++s)
      if (const cudaError_t e = detail::launch(topk_split_kernel, grid, kThreads, 0, stream, p, 0); e != cudaSuccess)
        return e;
  return cudaSuccess;
}

}  // namespace k3::ops::cuda
