// The routed experts' up and down GEMMs as a warp-specialized wgmma kernel (a prototype, selected by
// moe_experts in moe_experts.cu with K3_MOE_WG=1; math in moe.h, the plan and the E2M1 table in
// moe_experts.cuh).
//
// Why: in moe_mma_kernel the warps that wait on the weight loads also decode E2M1 and issue mma.sync, at
// few warps per scheduler. Here decode and tensor cores overlap: decoder warps turn MXFP4 into BF16 in
// shared memory, in wgmma's 128-byte-swizzled K-major layout, and one consumer warpgroup runs wgmma on it.
//
// A persistent kernel, one CTA of 384 threads per SM:
//   warpgroup 0 (warps 0..3): the consumer, wgmma m64n32k16 (BF16, FP32 accumulate), A = 64 weight rows,
//     B = the pass's 32 token columns, both K-major from the ring; the epilogue from the accumulators;
//   warpgroups 1..2 (warps 4..11): the decoders. Per 64-value K stage: the packed E2M1 bytes (32 per row
//     and operand) and the two E8M0 scales per row from global memory into registers kDepth stages ahead (across
//     items: the next item's first stages load while this one's last ones decode),
//     decoded through the 64 KiB conflict-free table (fill_lut) times the scale, stored as BF16 rows of
//     128 bytes (row r's 16-byte chunk j at chunk j ^ (r % 8)); the token columns' activations (x rows, BF16)
//     the same way, columns past the pass's count zero. Then fence.proxy.async and an arrive on the
//     stage's full mbarrier.
// Items = (slot, 64 output rows, pass of up to 32 token columns) from the plan (made with cols = kWgCols):
// item u is pass u / tiles, row tile u % tiles; CTA b takes items b, b + grid, ... Both roles walk the same
// items; the ring's stage counter runs on across items.
//   UP:   an item is 64 rows of W1 and the same 64 rows of W3 (two accumulators sharing B), epilogue
//         h[pair, n] = bf16(situ(bf16(acc1), bf16(acc3)));
//   DOWN: 64 rows of W2, o[pair, n] = bf16(acc).
// The products are exact (BF16 x dequantized E2M1 times a power of two); only the FP32 summation order
// differs from the CPU. Requires K and N multiples of 64 (else cudaErrorNotSupported, nothing launched).
//
// Shared memory (1024-byte aligned base): the table (64 KiB; the mbarriers in its first hole), then the
// ring of kStages stages: A tiles (UP: W1 then W3, 8 KiB each), then the B tile (32 x 128 bytes).
// mbarriers: full (8 decoder-warp arrivals), empty (4 consumer-warp arrivals after wgmma_wait).
//
// ptxas (sm_90a, nvcc 13.0): UP 150 registers, DOWN 167 (of 168 at 384 threads), no spills, no static shared memory, no wgmma
// serialization advisory. Dynamic shared memory: UP 148,480 B, DOWN 115,712 B (with the 1 KiB slack).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "ops/cuda_bf16.cuh"
#include "ops/cuda_device.cuh"
#include "ops/cuda_wgmma.cuh"
#include "ops/moe.h"
#include "ops/moe_device.cuh"
#include "ops/moe_experts.cuh"

namespace k3::ops::cuda::moe_detail {
namespace {

using detail::fence_proxy_async;
using detail::mbar_arrive;
using detail::mbar_init;
using detail::mbar_init_fence;
using detail::mbar_wait;
using detail::smem_u32;
using detail::Wgmma;
using detail::wgmma_commit;
using detail::wgmma_desc_sw128;
using detail::wgmma_fence;
using detail::wgmma_fence_regs;
using detail::wgmma_wait;

constexpr int kThreads = 384;        // warpgroup 0 consumer, 1..2 decoders
constexpr int kConsumerThreads = 128;
constexpr int kDecThreads = 256;
constexpr int kDecWarps = kDecThreads / kWarp;
constexpr int kStages = 4;           // ring depth
constexpr int kStageK = 64;          // K values per stage: one 128-byte swizzled row of BF16
constexpr int kRows = 64;            // output rows per item (wgmma M)
constexpr int kCols = kWgCols;       // token columns per pass (wgmma N)
constexpr uint32_t kATile = kRows * 128;  // 8 KiB
constexpr uint32_t kBTile = kCols * 128;  // 4 KiB

template <bool UP>
struct WgLayout {
  static constexpr int M = UP ? 2 : 1;                       // A operands
  static constexpr uint32_t stage = M * kATile + kBTile;     // bytes per stage (a multiple of 1024)
  static constexpr uint32_t ring = static_cast<uint32_t>(kLutBytes);
  static constexpr uint32_t bytes = ring + kStages * stage + 1024;  // + the alignment slack
  // Decoder work per stage: each thread decodes kVals consecutive values of one row of one operand.
  static constexpr int kVals = M * kRows * kStageK / kDecThreads;  // UP 32, DOWN 16
  static constexpr int kWords = kVals / 8;                          // packed 32-bit words per thread
  static constexpr int kTpr = kStageK / kVals;                      // threads per row
  // Stages each decoder thread keeps loading ahead (registers): enough bytes in flight per SM to cover the
  // memory latency with one CTA per SM (UP moves 4 KiB of weights a stage, DOWN 2 KiB).
  static constexpr int kDepth = UP ? 8 : 16;
  static_assert(stage % 1024 == 0, "swizzled tiles stay 1024-byte aligned");
  static_assert(kVals == 16 || kVals == 32, "one scale group per thread");
  static_assert(kCols * 8 <= kDecThreads, "one activation chunk per decoder thread");
};

__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// An 8-byte read-only load with the 256-byte L2 prefetch hint (ldg_l2_256's half).
__device__ __forceinline__ uint2 ldg_l2_256_v2(const void* p) {
  uint2 v;
  asm volatile("ld.global.nc.L2::256B.v2.u32 {%0,%1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

// The slot of pass p: the last one whose passes begin at or before it (slot_pass_begin ascends).
__device__ __forceinline__ int slot_of_pass(const Plan& plan, int n_active, int p) {
  int lo = 0, hi = n_active - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (plan.slot_pass_begin[mid] <= p) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// The item's place in the plan (every thread computes it; warp-uniform through a lane-0 broadcast).
struct Item {
  int slot, e, begin, t0, cnt, tile;
};
__device__ __forceinline__ Item item_at(const Plan& plan, int n_active, int64_t u, int64_t tiles) {
  Item it;
  const int pass = static_cast<int>(u / tiles);
  it.tile = static_cast<int>(u % tiles);
  it.slot = slot_of_pass(plan, n_active, pass);
  it.e = plan.slot_expert[it.slot];
  it.begin = plan.slot_begin[it.slot];
  it.t0 = (pass - plan.slot_pass_begin[it.slot]) * kCols;
  it.cnt = min(kCols, plan.slot_count[it.slot] - it.t0);
  it.slot = __shfl_sync(0xffffffffu, it.slot, 0);
  it.e = __shfl_sync(0xffffffffu, it.e, 0);
  it.begin = __shfl_sync(0xffffffffu, it.begin, 0);
  it.t0 = __shfl_sync(0xffffffffu, it.t0, 0);
  it.cnt = __shfl_sync(0xffffffffu, it.cnt, 0);
  return it;
}

template <bool UP>
__global__ void __launch_bounds__(kThreads, 1)
    moe_wg_kernel(const bf16* __restrict__ x, Plan plan, Mxfp4ExpertTable ex, bf16* __restrict__ out, int k,
                  int64_t K, int64_t N, SituParams sp) {
#if K3_SM90A
  using L = WgLayout<UP>;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* sm = smem_raw + (base - raw);
  const uint32_t ring = base + L::ring;
  auto full_bar = [&](int s) { return base + hole_offset(8u * s); };
  auto empty_bar = [&](int s) { return base + hole_offset(8u * (kStages + s)); };

  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full_bar(s), kDecWarps);
      mbar_init(empty_bar(s), kConsumerThreads / kWarp);
    }
    mbar_init_fence();
  }
  fill_lut(sm);  // ends with a barrier: the table and the mbarriers are ready
  // The table and the barriers read nothing: set up before the wait, while the kernel before still runs.
  detail::pdl_wait();
  detail::pdl_launch_dependents();

  const int64_t tiles = N / kRows;
  const int n_active = __shfl_sync(0xffffffffu, *plan.n_active, 0);
  const int64_t items = static_cast<int64_t>(__shfl_sync(0xffffffffu, *plan.n_passes, 0)) * tiles;
  const int stages = static_cast<int>(K / kStageK);

  if (warp >= kConsumerThreads / kWarp) {
    // ---------------------------------------------------------------- decoders
    const int d = tid - kConsumerThreads;
    const uint32_t lut_s = base, lane4 = 4u * static_cast<uint32_t>(lane);
    // Weights: row-operand ro = d / kTpr (operand ro / 64, row ro % 64), values sub * kVals .. + kVals - 1.
    const int ro = d / L::kTpr, sub = d % L::kTpr;
    const int m = ro / kRows, r = ro % kRows;
    const int64_t row_bytes = K / 2, row_scales = K / 32;
    // Activations: column col = d / 8, chunk j = d % 8 (threads d < kCols * 8).
    const int col = d / 8, xj = d % 8;
    // This thread's store offsets in a stage: weight chunks sub * kWords + w, activation chunk xj.
    const uint32_t a_off = m * kATile + r * 128u;
    const uint32_t b_off = L::M * kATile + col * 128u + ((static_cast<uint32_t>(xj) ^ (col & 7)) << 4);

    struct Ld {
      uint32_t w[L::kWords];
      uint32_t sc;
      uint4 xv;
    };
    // The load cursor runs L::kDepth stages ahead of the decode, across the CTA's items: the stores do not
    // depend on the item (only what was loaded does), so the next item's first stages are in flight while
    // this one's last ones are decoded.
    const int64_t my_items = items > blockIdx.x ? (items - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
    const int64_t total = my_items * stages;  // stages this CTA produces
    int64_t lu = blockIdx.x;                  // the cursor: item lu, stage ls
    int ls = 0;
    const uint8_t* wp = nullptr;
    const uint8_t* sp8 = nullptr;
    const bf16* xp = x;
    bool xlive = false;
    auto seek = [&]() {  // the cursor's pointers at stage 0 of item lu
      const Item it = item_at(plan, n_active, lu, tiles);
      wp = UP ? (m == 0 ? ex.w1_packed[it.e] : ex.w3_packed[it.e]) : ex.w2_packed[it.e];
      sp8 = UP ? (m == 0 ? ex.w1_scale[it.e] : ex.w3_scale[it.e]) : ex.w2_scale[it.e];
      const int64_t row = static_cast<int64_t>(it.tile) * kRows + r;
      wp += row * row_bytes + sub * (L::kVals / 2);
      sp8 += row * row_scales + sub * L::kVals / 32;
      xlive = col < it.cnt;
      xp = x;
      if (xlive) {
        const int64_t pair = plan.pair_list[it.begin + it.t0 + col];
        xp = x + (UP ? pair / k : pair) * K + 8 * xj;
      }
    };
    auto load_next = [&](Ld& v) {
      if constexpr (L::kWords == 4) {
        const uint4 q = ldg_l2_256(wp + ls * (kStageK / 2));
        v.w[0] = q.x, v.w[1] = q.y, v.w[2] = q.z, v.w[3] = q.w;
      } else {
        const uint2 q = ldg_l2_256_v2(wp + ls * (kStageK / 2));
        v.w[0] = q.x, v.w[1] = q.y;
      }
      v.sc = __ldg(sp8 + ls * (kStageK / 32));
      v.xv = xlive ? __ldg(reinterpret_cast<const uint4*>(xp + ls * kStageK)) : make_uint4(0u, 0u, 0u, 0u);
      if (++ls == stages) {
        ls = 0;
        lu += gridDim.x;
        if (lu < items) seek();
      }
    };
    if (total > 0) seek();
    Ld buf[L::kDepth];
#pragma unroll
    for (int j = 0; j < L::kDepth; ++j)
      if (j < total) load_next(buf[j]);
    for (int64_t t0 = 0; t0 < total; t0 += L::kDepth) {
#pragma unroll
      for (int j = 0; j < L::kDepth; ++j) {
        const int64_t t = t0 + j;  // the stage produced: ring slot t % kStages
        if (t >= total) break;
        const int slot = static_cast<int>(t % kStages);
        mbar_wait(empty_bar(slot), (static_cast<uint32_t>(t / kStages) & 1u) ^ 1u);
        const uint32_t st = ring + slot * L::stage;
        const __nv_bfloat162 sc = e8m0_or_zero(buf[j].sc);
#pragma unroll
        for (int w = 0; w < L::kWords; ++w) {
          uint32_t v[4];
          e2m1x8_to_bf16x8(lut_s, lane4, buf[j].w[w], v);
#pragma unroll
          for (int p = 0; p < 4; ++p) v[p] = scale_bf16x2(v[p], sc);
          const uint32_t c = static_cast<uint32_t>(sub * L::kWords + w);
          st_shared_v4(st + a_off + ((c ^ (r & 7)) << 4), make_uint4(v[0], v[1], v[2], v[3]));
        }
        if (d < kCols * 8) st_shared_v4(st + b_off, buf[j].xv);
        fence_proxy_async();  // these generic-proxy writes before the consumer's wgmma reads them
        __syncwarp();
        if (lane == 0) mbar_arrive(full_bar(slot));
        if (t + L::kDepth < total) load_next(buf[j]);
      }
    }
    return;
  }

  // ---------------------------------------------------------------- consumer
  constexpr int NA = kCols / 2;  // accumulator floats per thread and operand
  float acc[L::M][NA];
#pragma unroll
  for (int mm = 0; mm < L::M; ++mm)
#pragma unroll
    for (int i = 0; i < NA; ++i) acc[mm][i] = 0.f;
#pragma unroll
  for (int mm = 0; mm < L::M; ++mm) wgmma_fence_regs(acc[mm]);
  uint32_t g = 0;  // stages consumed so far
  for (int64_t u = blockIdx.x; u < items; u += gridDim.x) {
    const Item it = item_at(plan, n_active, u, tiles);
    for (int s = 0; s < stages; ++s, ++g) {
      const int slot = static_cast<int>(g % kStages);
      mbar_wait(full_bar(slot), (g / kStages) & 1u);
      const uint32_t st = ring + slot * L::stage;
#pragma unroll
      for (int mm = 0; mm < L::M; ++mm) wgmma_fence_regs(acc[mm]);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kStageK / 16; ++kk) {
        const uint64_t db = wgmma_desc_sw128(st + L::M * kATile + kk * 32, 16, 1024);
#pragma unroll
        for (int mm = 0; mm < L::M; ++mm)
          Wgmma<kCols>::template run<0>(acc[mm], wgmma_desc_sw128(st + mm * kATile + kk * 32, 16, 1024), db,
                                        (s | kk) != 0 ? 1 : 0);
      }
      wgmma_commit();
#pragma unroll
      for (int mm = 0; mm < L::M; ++mm) wgmma_fence_regs(acc[mm]);
      wgmma_wait<1>();  // the previous stage's group is done: its slot is free
#pragma unroll
      for (int mm = 0; mm < L::M; ++mm) wgmma_fence_regs(acc[mm]);
      if (s > 0) {
        __syncwarp();
        if (lane == 0) mbar_arrive(empty_bar(static_cast<int>((g - 1) % kStages)));
      }
    }
    wgmma_wait<0>();
#pragma unroll
    for (int mm = 0; mm < L::M; ++mm) wgmma_fence_regs(acc[mm]);
    __syncwarp();
    if (lane == 0) mbar_arrive(empty_bar(static_cast<int>((g - 1) % kStages)));

    // Epilogue: acc[.][4 i + 2 h + b] is row 16 warp + lane / 4 + 8 h, token column 8 i + 2 (lane % 4) + b.
#pragma unroll
    for (int i = 0; i < kCols / 8; ++i)
#pragma unroll
      for (int bb = 0; bb < 2; ++bb) {
        const int cc = 8 * i + 2 * (lane % 4) + bb;
        if (cc >= it.cnt) continue;
        const int64_t pair = plan.pair_list[it.begin + it.t0 + cc];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int64_t n = static_cast<int64_t>(it.tile) * kRows + 16 * warp + lane / 4 + 8 * h;
          const int q = 4 * i + 2 * h + bb;
          float v;
          if constexpr (UP) {
            v = detail::situ_dev(detail::round_bf16_dev(acc[0][q]), detail::round_bf16_dev(acc[L::M - 1][q]), sp);
          } else {
            v = acc[0][q];
          }
          out[pair * N + n] = detail::float_to_bf16(v);
        }
      }
  }
#endif
}

template <bool UP>
int launch(const bf16* x, const Plan& plan, const Mxfp4ExpertTable& ex, bf16* out, int k, int64_t K, int64_t N,
           int64_t max_slots, int64_t pairs, SituParams sp, int sms, cudaStream_t s) {
  using L = WgLayout<UP>;
  if (const cudaError_t e = detail::allow_optin_smem<moe_wg_kernel<UP>>(); e != cudaSuccess) return e;
  // At most max_slots + pairs / kCols passes, each N / 64 items.
  const int64_t max_items = (N / kRows) * std::min<int64_t>(pairs, max_slots + pairs / kCols);
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(sms, max_items));
  return detail::launch(moe_wg_kernel<UP>, static_cast<unsigned>(blocks), kThreads, L::bytes, s, x, plan, ex, out, k, K,
                        N, sp);
}

}  // namespace

int moe_wg_launch(bool up, const bf16* x, const Plan& plan, const Mxfp4ExpertTable& ex, bf16* out, int k, int64_t K,
                  int64_t N, int64_t max_slots, int64_t pairs, SituParams sp, int sms, cudaStream_t s) {
  if (K <= 0 || N <= 0 || K % kStageK != 0 || N % kRows != 0) return cudaErrorNotSupported;
  return up ? launch<true>(x, plan, ex, out, k, K, N, max_slots, pairs, sp, sms, s)
            : launch<false>(x, plan, ex, out, k, K, N, max_slots, pairs, sp, sms, s);
}

}  // namespace k3::ops::cuda::moe_detail
