// CUDA SiTU-GLU, MXFP4 linears, the routed expert MLP, the BF16 MLP and the grouped routed experts
// (math in moe.h).
//
// MXFP4 dot products (mxfp4_warp_dots): a warp owns NW weight rows and up to RT activation rows. The
// K dimension goes to the lanes in chunks of 16 values (8 packed bytes, half a scale group): each
// lane dequantizes a chunk exactly in registers (E2M1 bits placed into an FP32 and scaled by 2^126,
// which is exact), forms the chunk's FP32 dot with each activation row and adds it times the group's
// power-of-two scale (exact, so this equals summing the dequantized products in another order).
// Warp shuffles reduce the lanes.
//
// moe_experts, three steps on the stream (no host synchronization):
//   plan:    one CTA groups the (row, j) pairs whose expert is local by expert (counts, scans,
//            slots of the experts in use, the pair list);
//   up:      persistent warps over (slot, n in I): h[pair, n] = bf16(situ(bf16(W1 z), bf16(W3 z)))
//            for every pair of the slot's expert (RT pairs at a time, the weight rows read once per tile);
//   down:    persistent warps over (slot, n pair in L): o[pair, n] = bf16(W2 h[pair]);
//   combine: y[r, i] = bf16(sum_j w[r, j] o[(r, j), i]) over the local j in order, unfused FP32 as the CPU.
#include <algorithm>

#include "ops/cuda_bf16.cuh"
#include "ops/linear.h"
#include "ops/moe.h"

namespace k3::ops::cuda {
namespace {

using detail::aligned16;
using detail::kWarp;

constexpr int kMoeThreads = 256;
constexpr int kMoeWarps = kMoeThreads / kWarp;
constexpr int kNW = 2;       // weight rows per warp
constexpr int kMoeRT = 4;    // activation rows (pairs) per pass over the weight rows
constexpr int kChunk = 16;   // values per lane chunk (8 packed bytes)

__device__ __forceinline__ float round_bf16_dev(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

__device__ __forceinline__ float situ_dev(float a, float b, SituParams p) {
  const float sig = 1.f / (1.f + expf(-a));  // expf overflow gives 1 / inf = 0, as on the CPU
  const float gate = p.beta * tanhf(a / p.beta) * sig;
  const float lin = p.linear_beta * tanhf(b / p.linear_beta);
  return gate * lin;
}

// E8M0 scale byte -> 2^(s - 127) (s = 0: the subnormal 2^-127; s = 255: +inf, as ldexp on the CPU).
__device__ __forceinline__ float e8m0_dev(uint32_t s) {
  return __uint_as_float(s == 0 ? 0x00400000u : (s << 23));
}

// Nibble J of q as E2M1, exact: magnitude bits (e e m) go to FP32 bits 24..22, the sign to bit 31; as an
// FP32 that is the E2M1 value times 2^-126 (code 1, the E2M1 subnormal 0.5, becomes the FP32 subnormal
// 2^-127), so one exact multiply by 2^126 finishes it.
template <int J>
__device__ __forceinline__ float e2m1_nibble(uint32_t q) {
  constexpr int sm = 22 - 4 * J, ss = 28 - 4 * J;
  const uint32_t m = sm >= 0 ? (q << (sm >= 0 ? sm : 0)) : (q >> (sm < 0 ? -sm : 0));
  const uint32_t s = ss >= 0 ? (q << (ss >= 0 ? ss : 0)) : (q >> (ss < 0 ? -ss : 0));
  return __uint_as_float((m & 0x01c00000u) | (s & 0x80000000u)) * 0x1p126f;
}

__device__ __forceinline__ void dequant8(uint32_t q, float* f) {
  f[0] = e2m1_nibble<0>(q);
  f[1] = e2m1_nibble<1>(q);
  f[2] = e2m1_nibble<2>(q);
  f[3] = e2m1_nibble<3>(q);
  f[4] = e2m1_nibble<4>(q);
  f[5] = e2m1_nibble<5>(q);
  f[6] = e2m1_nibble<6>(q);
  f[7] = e2m1_nibble<7>(q);
}

// 8 packed bytes at p (low byte first); aligned: p is 8-byte aligned (one load), else bytewise.
__device__ __forceinline__ uint2 load_packed8(const uint8_t* p, bool aligned) {
  if (aligned) return __ldg(reinterpret_cast<const uint2*>(p));
  uint32_t lo = 0, hi = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    lo |= static_cast<uint32_t>(__ldg(p + i)) << (8 * i);
    hi |= static_cast<uint32_t>(__ldg(p + 4 + i)) << (8 * i);
  }
  return make_uint2(lo, hi);
}

// Per-lane partial dot products of NW MXFP4 weight rows (wp packed, ws scales) with the first nr (<= RT)
// of RT activation rows x[r] (16-byte aligned, K values each). acc is added to.
template <int NW, int RT>
__device__ __forceinline__ void mxfp4_warp_dots(const uint8_t* const (&wp)[NW], const uint8_t* const (&ws)[NW],
                                                const bf16* const (&x)[RT], int nr, int64_t K, int lane,
                                                float (&acc)[NW][RT]) {
  bool aligned = true;
#pragma unroll
  for (int n = 0; n < NW; ++n) aligned = aligned && (reinterpret_cast<uintptr_t>(wp[n]) & 7u) == 0;
  const int64_t chunks = K / kChunk;
#pragma unroll 2
  for (int64_t c = lane; c < chunks; c += kWarp) {
    float wv[NW][kChunk];
    float sc[NW];
#pragma unroll
    for (int n = 0; n < NW; ++n) {
      const uint2 q = load_packed8(wp[n] + c * (kChunk / 2), aligned);
      dequant8(q.x, wv[n]);
      dequant8(q.y, wv[n] + 8);
      sc[n] = e8m0_dev(__ldg(ws[n] + c / 2));  // 2 chunks per 32-value group
    }
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      if (r < nr) {
        const uint4* xp = reinterpret_cast<const uint4*>(x[r] + c * kChunk);
        float x0[8], x1[8];
        detail::unpack_bf16x8(__ldg(xp), x0);
        detail::unpack_bf16x8(__ldg(xp + 1), x1);
#pragma unroll
        for (int n = 0; n < NW; ++n) {
          float g = 0.f;
#pragma unroll
          for (int i = 0; i < 8; ++i) g = fmaf(x0[i], wv[n][i], g);
#pragma unroll
          for (int i = 0; i < 8; ++i) g = fmaf(x1[i], wv[n][8 + i], g);
          acc[n][r] = fmaf(g, sc[n], acc[n][r]);  // g * 2^e is exact
        }
      }
    }
  }
}

template <int NW, int RT>
__device__ __forceinline__ void warp_reduce_all(float (&acc)[NW][RT]) {
#pragma unroll
  for (int n = 0; n < NW; ++n) {
#pragma unroll
    for (int r = 0; r < RT; ++r) acc[n][r] = detail::warp_sum(acc[n][r]);
  }
}

// ---------------------------------------------------------------------------------------------
// situ_glu, mxfp4_linear

__global__ void situ_kernel(const bf16* a, const bf16* b, bf16* out, int64_t n, SituParams p) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = detail::float_to_bf16(situ_dev(detail::bf16_to_float(a[i]), detail::bf16_to_float(b[i]), p));
  }
}

// Warp item = (pair of output features, tile of RT rows), the row tile fastest.
template <int RT>
__global__ void __launch_bounds__(kMoeThreads)
    mxfp4_linear_kernel(const bf16* __restrict__ x, const uint8_t* __restrict__ packed,
                        const uint8_t* __restrict__ scale, bf16* __restrict__ y, int64_t rows, int64_t K, int64_t N,
                        int64_t row_tiles, int64_t items) {
  const int lane = threadIdx.x % kWarp;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kMoeWarps + threadIdx.x / kWarp;
  if (item >= items) return;
  const int64_t r0 = (item % row_tiles) * RT, n0 = (item / row_tiles) * kNW;
  const int nr = static_cast<int>(min(static_cast<int64_t>(RT), rows - r0));
  const int nn = static_cast<int>(min(static_cast<int64_t>(kNW), N - n0));
  const uint8_t* wp[kNW];
  const uint8_t* ws[kNW];
#pragma unroll
  for (int n = 0; n < kNW; ++n) {
    const int64_t row = n0 + min(n, nn - 1);
    wp[n] = packed + row * (K / 2);
    ws[n] = scale + row * (K / 32);
  }
  const bf16* xr[RT];
#pragma unroll
  for (int r = 0; r < RT; ++r) xr[r] = x + (r0 + min(r, nr - 1)) * K;
  float acc[kNW][RT] = {};
  mxfp4_warp_dots<kNW, RT>(wp, ws, xr, nr, K, lane, acc);
  warp_reduce_all(acc);
  if (lane == 0) {
#pragma unroll
    for (int n = 0; n < kNW; ++n) {
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        if (n < nn && r < nr) y[(r0 + r) * N + n0 + n] = detail::float_to_bf16(acc[n][r]);
      }
    }
  }
}

template <int RT>
int launch_mxfp4_linear(const bf16* x, const uint8_t* packed, const uint8_t* scale, bf16* y, int64_t rows, int64_t K,
                        int64_t N, cudaStream_t s) {
  const int64_t row_tiles = (rows + RT - 1) / RT;
  const int64_t items = row_tiles * ((N + kNW - 1) / kNW);
  const int64_t blocks = (items + kMoeWarps - 1) / kMoeWarps;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  mxfp4_linear_kernel<RT>
      <<<static_cast<unsigned>(blocks), kMoeThreads, 0, s>>>(x, packed, scale, y, rows, K, N, row_tiles, items);
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// moe_experts

// The routing plan in scratch (int32): n_active, then [pairs] each of slot_expert, slot_begin,
// slot_count (slots of the experts in use, ascending expert) and pair_list (pair ids grouped by slot).
struct Plan {
  int* n_active;
  int* slot_expert;
  int* slot_begin;
  int* slot_count;
  int* pair_list;
};

__host__ __device__ inline Plan plan_at(void* scratch, int64_t pairs) {
  int* m = static_cast<int*>(scratch);
  return Plan{m, m + 1, m + 1 + pairs, m + 1 + 2 * pairs, m + 1 + 3 * pairs};
}

// Exclusive block scan of (a, b); totals returned too. Every thread calls it; ends with a barrier.
__device__ void block_exclusive_scan2(int& a, int& b, int& total_a, int& total_b, int (*wt)[2]) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  int ia = a, ib = b;
#pragma unroll
  for (int o = 1; o < kWarp; o *= 2) {
    const int ta = __shfl_up_sync(0xffffffffu, ia, o), tb = __shfl_up_sync(0xffffffffu, ib, o);
    if (lane >= o) ia += ta, ib += tb;
  }
  if (lane == kWarp - 1) wt[warp][0] = ia, wt[warp][1] = ib;
  __syncthreads();
  if (warp == 0) {
    int wa = lane < warps ? wt[lane][0] : 0, wb = lane < warps ? wt[lane][1] : 0;
#pragma unroll
    for (int o = 1; o < kWarp; o *= 2) {
      const int ta = __shfl_up_sync(0xffffffffu, wa, o), tb = __shfl_up_sync(0xffffffffu, wb, o);
      if (lane >= o) wa += ta, wb += tb;
    }
    if (lane < warps) wt[lane][0] = wa, wt[lane][1] = wb;  // inclusive over warps
  }
  __syncthreads();
  const int base_a = warp > 0 ? wt[warp - 1][0] : 0, base_b = warp > 0 ? wt[warp - 1][1] : 0;
  a = base_a + ia - a;
  b = base_b + ib - b;
  total_a = wt[warps - 1][0];
  total_b = wt[warps - 1][1];
  __syncthreads();
}

constexpr int kPlanThreads = 1024;

__global__ void __launch_bounds__(kPlanThreads)
    moe_plan_kernel(const int32_t* __restrict__ idx, int64_t pairs, int expert_begin, int expert_count, Plan plan) {
  extern __shared__ int plan_smem[];  // cnt [expert_count], cursor [expert_count]
  __shared__ int wt[kPlanThreads / kWarp][2];
  int* cnt = plan_smem;
  int* cursor = plan_smem + expert_count;
  for (int e = threadIdx.x; e < expert_count; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  for (int64_t p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int64_t e = static_cast<int64_t>(idx[p]) - expert_begin;
    if (e >= 0 && e < expert_count) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  // Each thread scans a contiguous range of experts: pair offsets and slots of the experts in use.
  const int per = (expert_count + blockDim.x - 1) / blockDim.x;
  const int lo = min(expert_count, static_cast<int>(threadIdx.x) * per), hi = min(expert_count, lo + per);
  int a = 0, b = 0;
  for (int e = lo; e < hi; ++e) a += cnt[e], b += cnt[e] > 0;
  int total_a, total_b;
  block_exclusive_scan2(a, b, total_a, total_b, wt);
  for (int e = lo; e < hi; ++e) {
    if (cnt[e] == 0) continue;
    plan.slot_expert[b] = e;
    plan.slot_begin[b] = a;
    plan.slot_count[b] = cnt[e];
    cursor[e] = a;
    a += cnt[e];
    ++b;
  }
  if (threadIdx.x == 0) *plan.n_active = total_b;
  __syncthreads();
  // Pair order inside an expert's group follows the atomics; every pair is computed alone, so results do not.
  for (int64_t p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int64_t e = static_cast<int64_t>(idx[p]) - expert_begin;
    if (e >= 0 && e < expert_count) plan.pair_list[atomicAdd(&cursor[e], 1)] = static_cast<int>(p);
  }
}

// Warp item (slot, n): h[pair, n] = bf16(situ(bf16(W1[n] z_row), bf16(W3[n] z_row))) for the slot's pairs.
__global__ void __launch_bounds__(kMoeThreads)
    moe_up_kernel(const bf16* __restrict__ z, Plan plan, Mxfp4ExpertTable ex, bf16* __restrict__ h, int k, int64_t L,
                  int64_t I, SituParams sp) {
  const int lane = threadIdx.x % kWarp;
  const int64_t items = static_cast<int64_t>(*plan.n_active) * I;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kMoeWarps;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kMoeWarps + threadIdx.x / kWarp; item < items;
       item += stride) {
    const int slot = static_cast<int>(item / I);
    const int64_t n = item % I;
    const int e = plan.slot_expert[slot], begin = plan.slot_begin[slot], count = plan.slot_count[slot];
    const uint8_t* wp[kNW] = {ex.w1_packed[e] + n * (L / 2), ex.w3_packed[e] + n * (L / 2)};
    const uint8_t* ws[kNW] = {ex.w1_scale[e] + n * (L / 32), ex.w3_scale[e] + n * (L / 32)};
    for (int t0 = 0; t0 < count; t0 += kMoeRT) {
      const int nr = min(kMoeRT, count - t0);
      int pair[kMoeRT];
      const bf16* xr[kMoeRT];
#pragma unroll
      for (int r = 0; r < kMoeRT; ++r) {
        pair[r] = plan.pair_list[begin + t0 + min(r, nr - 1)];
        xr[r] = z + static_cast<int64_t>(pair[r] / k) * L;
      }
      float acc[kNW][kMoeRT] = {};
      mxfp4_warp_dots<kNW, kMoeRT>(wp, ws, xr, nr, L, lane, acc);
      warp_reduce_all(acc);
      if (lane == 0) {
#pragma unroll
        for (int r = 0; r < kMoeRT; ++r) {
          if (r < nr) {
            const float v = situ_dev(round_bf16_dev(acc[0][r]), round_bf16_dev(acc[1][r]), sp);
            h[static_cast<int64_t>(pair[r]) * I + n] = detail::float_to_bf16(v);
          }
        }
      }
    }
  }
}

// Warp item (slot, n pair): o[pair, n] = bf16(W2[n] h[pair]) for the slot's pairs.
__global__ void __launch_bounds__(kMoeThreads)
    moe_down_kernel(const bf16* __restrict__ h, Plan plan, Mxfp4ExpertTable ex, bf16* __restrict__ o, int64_t L,
                    int64_t I) {
  const int lane = threadIdx.x % kWarp;
  const int64_t npairs_l = (L + kNW - 1) / kNW;
  const int64_t items = static_cast<int64_t>(*plan.n_active) * npairs_l;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kMoeWarps;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kMoeWarps + threadIdx.x / kWarp; item < items;
       item += stride) {
    const int slot = static_cast<int>(item / npairs_l);
    const int64_t n0 = (item % npairs_l) * kNW;
    const int nn = static_cast<int>(min(static_cast<int64_t>(kNW), L - n0));
    const int e = plan.slot_expert[slot], begin = plan.slot_begin[slot], count = plan.slot_count[slot];
    const uint8_t* wp[kNW];
    const uint8_t* ws[kNW];
#pragma unroll
    for (int i = 0; i < kNW; ++i) {
      const int64_t row = n0 + min(i, nn - 1);
      wp[i] = ex.w2_packed[e] + row * (I / 2);
      ws[i] = ex.w2_scale[e] + row * (I / 32);
    }
    for (int t0 = 0; t0 < count; t0 += kMoeRT) {
      const int nr = min(kMoeRT, count - t0);
      int pair[kMoeRT];
      const bf16* xr[kMoeRT];
#pragma unroll
      for (int r = 0; r < kMoeRT; ++r) {
        pair[r] = plan.pair_list[begin + t0 + min(r, nr - 1)];
        xr[r] = h + static_cast<int64_t>(pair[r]) * I;
      }
      float acc[kNW][kMoeRT] = {};
      mxfp4_warp_dots<kNW, kMoeRT>(wp, ws, xr, nr, I, lane, acc);
      warp_reduce_all(acc);
      if (lane == 0) {
#pragma unroll
        for (int i = 0; i < kNW; ++i) {
#pragma unroll
          for (int r = 0; r < kMoeRT; ++r) {
            if (i < nn && r < nr) o[static_cast<int64_t>(pair[r]) * L + n0 + i] = detail::float_to_bf16(acc[i][r]);
          }
        }
      }
    }
  }
}

// y[r, i] = bf16(sum over local j, in order, of w[r, j] * o[(r, j), i]); 0 for a row with none.
__global__ void moe_combine_kernel(const bf16* __restrict__ o, const int32_t* __restrict__ idx,
                                   const float* __restrict__ w, int expert_begin, int expert_count, bf16* __restrict__ y,
                                   int64_t rows, int k, int64_t L) {
  const int64_t total = rows * L;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = t / L, i = t % L;
    float acc = 0.f;
    for (int j = 0; j < k; ++j) {
      const int64_t pair = r * k + j;
      const int64_t e = static_cast<int64_t>(idx[pair]) - expert_begin;
      if (e >= 0 && e < expert_count) acc = __fadd_rn(acc, __fmul_rn(w[pair], detail::bf16_to_float(o[pair * L + i])));
    }
    y[t] = detail::float_to_bf16(acc);
  }
}

unsigned grid_for(int64_t threads_needed, int threads_per_block, int cap_blocks) {
  const int64_t b = (threads_needed + threads_per_block - 1) / threads_per_block;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(b, cap_blocks)));
}

int sm_count_of(const Context& ctx) { return ctx.sm_count > 0 ? ctx.sm_count : 132; }

}  // namespace

int situ_glu(const bf16* a, const bf16* b, bf16* out, int64_t n, SituParams p, CUstream_st* stream) {
  if (n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  situ_kernel<<<grid_for(n, 256, 65535), 256, 0, stream>>>(a, b, out, n, p);
  return cudaGetLastError();
}

int mxfp4_linear(const bf16* x, const uint8_t* packed, const uint8_t* scale, bf16* y, int64_t rows, int64_t K,
                 int64_t N, CUstream_st* stream) {
  if (rows < 0 || K <= 0 || K % 32 != 0 || N <= 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (!aligned16(x)) return cudaErrorMisalignedAddress;
  if (rows <= 1) return launch_mxfp4_linear<1>(x, packed, scale, y, rows, K, N, stream);
  if (rows <= 2) return launch_mxfp4_linear<2>(x, packed, scale, y, rows, K, N, stream);
  return launch_mxfp4_linear<4>(x, packed, scale, y, rows, K, N, stream);
}

int expert_mlp(const bf16* z, Mxfp4Matrix w1, Mxfp4Matrix w3, Mxfp4Matrix w2, bf16* out, int64_t rows, int64_t D,
               int64_t I, SituParams p, bf16* scratch, CUstream_st* stream) {
  if (rows < 0 || D <= 0 || I <= 0 || D % 32 != 0 || I % 32 != 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (!aligned16(scratch)) return cudaErrorMisalignedAddress;
  bf16* a = scratch;
  bf16* b = scratch + rows * I;  // 16-byte aligned: I % 32 == 0
  int err = mxfp4_linear(z, w1.packed, w1.scale, a, rows, D, I, stream);
  if (err == 0) err = mxfp4_linear(z, w3.packed, w3.scale, b, rows, D, I, stream);
  if (err == 0) err = situ_glu(a, b, a, rows * I, p, stream);
  if (err == 0) err = mxfp4_linear(a, w2.packed, w2.scale, out, rows, I, D, stream);
  return err;
}

int mlp(const Context& ctx, const bf16* x, const bf16* w_gate, const bf16* w_up, const bf16* w_down, bf16* out,
        int64_t rows, int64_t D, int64_t I, SituParams p, bf16* scratch) {
  if (rows < 0 || D <= 0 || I <= 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  bf16* a = scratch;
  bf16* b = scratch + rows * I;
  int err = linear(ctx, x, w_gate, a, false, rows, D, I);
  if (err == 0) err = linear(ctx, x, w_up, b, false, rows, D, I);
  if (err == 0) err = situ_glu(a, b, a, rows * I, p, ctx.stream);
  if (err == 0) err = linear(ctx, a, w_down, out, false, rows, I, D);
  return err;
}

int moe_experts(const Context& ctx, const bf16* z, const int32_t* idx, const float* w, const Mxfp4ExpertTable& experts,
                int expert_begin, int expert_count, bf16* y, void* scratch, int64_t rows, int k, int64_t L, int64_t I,
                SituParams p) {
  if (rows < 0 || k <= 0 || L <= 0 || I <= 0 || L % 32 != 0 || I % 32 != 0) return cudaErrorInvalidValue;
  if (expert_count < 0 || expert_count > kMoeMaxLocalExperts) return cudaErrorInvalidValue;
  if (rows * k > 0x7fffffff) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (!aligned16(z) || !aligned16(scratch)) return cudaErrorMisalignedAddress;
  const cudaStream_t s = ctx.stream;
  const int64_t pairs = rows * k;
  const size_t meta_bytes = (static_cast<size_t>(4 * (1 + 4 * pairs)) + 255) / 256 * 256;
  const Plan plan = plan_at(scratch, pairs);
  bf16* h = reinterpret_cast<bf16*>(static_cast<char*>(scratch) + meta_bytes);
  bf16* o = h + (pairs * I + 127) / 128 * 128;  // the 256-byte aligned offset of moe_experts_scratch_bytes

  const size_t plan_smem = 2 * static_cast<size_t>(expert_count) * sizeof(int);
  moe_plan_kernel<<<1, kPlanThreads, plan_smem, s>>>(idx, pairs, expert_begin, expert_count, plan);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;

  // Persistent warps: enough for the largest possible plan, at most 4 CTAs per SM.
  const int cap = 4 * sm_count_of(ctx);
  const int64_t max_slots = std::min<int64_t>(expert_count, pairs);
  if (max_slots > 0) {
    moe_up_kernel<<<grid_for(max_slots * I * kWarp, kMoeThreads, cap), kMoeThreads, 0, s>>>(z, plan, experts, h, k, L,
                                                                                            I, p);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    moe_down_kernel<<<grid_for(max_slots * ((L + 1) / 2) * kWarp, kMoeThreads, cap), kMoeThreads, 0, s>>>(
        h, plan, experts, o, L, I);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  moe_combine_kernel<<<grid_for(rows * L, 256, 8 * sm_count_of(ctx)), 256, 0, s>>>(o, idx, w, expert_begin,
                                                                                    expert_count, y, rows, k, L);
  return cudaGetLastError();
}

}  // namespace k3::ops::cuda
