// moe_experts on the GPU (math in moe.h): the routed experts of one rank, grouped by expert.
//
// Four kernels on the stream (no host synchronization):
//   plan:    one CTA groups the (row, j) pairs whose expert is local by expert (counts, scans, the
//            slots of the experts in use, the pair list);
//   up:      tensor cores (mma.sync m16n8k16, BF16 in, FP32 accumulate): per (slot, 16 rows of I),
//            h[pair] = bf16(situ(bf16(W1 z), bf16(W3 z))) for the slot's pairs, 8 pairs per token tile;
//   down:    per (slot, 32 rows of L): o[pair] = bf16(W2 h[pair]);
//   combine: y[r, i] = bf16(sum_j w[r, j] o[(r, j), i]) over the local j in order, unfused FP32 as the CPU
//            (with a RowNorm: one CTA per row that then applies the latent RMSNorm, rmsnorm.cuh).
// W4A16: each lane loads 16 packed bytes (one 32-value scale group) of a weight row per 128-value
// chunk and dequantizes them exactly to BF16 in registers (two E2M1 values per lookup in a 64 KiB
// shared-memory table, one byte permute and one load per lookup, times the E8M0 power of two: exact;
// the kernels' other shared data lives in the table's unused halves), so the tensor-core products are
// the exact dequantized products; only the FP32 summation order differs from the CPU. Two kernels, by
// the mean pairs per expert in use (one fixed summation order per output either way: deterministic):
//   <= 4 (one 8-pair token tile per pass): moe_mma_splitk_kernel, a team of 4 or 8 warps splits K of one
//     row tile and sums their partials in warp order through shared memory, so few experts still fill the
//     GPU (a CTA is 8 warps sharing the table: two teams of 4, or one of 8 when the items fit one wave);
//   more (2 or 3 tiles per pass): moe_mma_kernel<NT>, each warp owns one row tile over the whole K and
//     the 4 warps take consecutive tiles of one expert, sharing the activations through a shared-memory
//     ring (cp.async); split K kept the tiles' activations in registers (176-241 registers, a quarter
//     of the HBM bandwidth at 24 pairs per pass).
// Both stream the weights through registers one chunk ahead of use.
// With K3_MOE_WG=1 in the environment (or moe_experts_force_wg(true)) and L, I multiples of 64, up and down
// run moe_experts_wg.cu's warp-specialized wgmma kernel instead (a prototype; off by default).
// The plan, the table and the MXFP4 helpers live in moe_experts.cuh (shared with moe_experts_wg.cu).
#include <algorithm>
#include <atomic>
#include <climits>

#include "ops/cuda_bf16.cuh"
#include "ops/cuda_cp_async.cuh"
#include "ops/cuda_device.cuh"
#include "ops/cuda_mma.cuh"
#include "ops/moe.h"
#include "ops/moe_device.cuh"
#include "ops/moe_experts.cuh"
#include "ops/rmsnorm.cuh"

namespace k3::ops::cuda {
namespace {

using detail::aligned16;
using detail::kWarp;
using namespace moe_detail;  // the plan, the E2M1 table and the MXFP4 helpers (moe_experts.cuh)


// Exclusive block scan of kScanN values per thread (each its own scan); totals returned too. Every thread
// calls it; ends with a barrier.
constexpr int kScanN = 3;
__device__ void block_exclusive_scan(int (&v)[kScanN], int (&total)[kScanN], int (*wt)[kScanN]) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  int in[kScanN];
#pragma unroll
  for (int n = 0; n < kScanN; ++n) in[n] = v[n];
#pragma unroll
  for (int o = 1; o < kWarp; o *= 2) {
#pragma unroll
    for (int n = 0; n < kScanN; ++n) {
      const int t = __shfl_up_sync(0xffffffffu, in[n], o);
      if (lane >= o) in[n] += t;
    }
  }
  if (lane == kWarp - 1) {
#pragma unroll
    for (int n = 0; n < kScanN; ++n) wt[warp][n] = in[n];
  }
  __syncthreads();
  if (warp == 0) {
    int x[kScanN];
#pragma unroll
    for (int n = 0; n < kScanN; ++n) x[n] = lane < warps ? wt[lane][n] : 0;
#pragma unroll
    for (int o = 1; o < kWarp; o *= 2) {
#pragma unroll
      for (int n = 0; n < kScanN; ++n) {
        const int t = __shfl_up_sync(0xffffffffu, x[n], o);
        if (lane >= o) x[n] += t;
      }
    }
    if (lane < warps) {
#pragma unroll
      for (int n = 0; n < kScanN; ++n) wt[lane][n] = x[n];  // inclusive over warps
    }
  }
  __syncthreads();
#pragma unroll
  for (int n = 0; n < kScanN; ++n) {
    v[n] = (warp > 0 ? wt[warp - 1][n] : 0) + in[n] - v[n];
    total[n] = wt[warps - 1][n];
  }
  __syncthreads();
}

constexpr int kPlanThreads = 1024;

__global__ void __launch_bounds__(kPlanThreads)
    moe_plan_kernel(const int32_t* __restrict__ idx, int64_t pairs, int expert_begin, int expert_count, int cols,
                    Plan plan) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  extern __shared__ int plan_smem[];  // cnt [expert_count], cursor [expert_count]
  __shared__ int wt[kPlanThreads / kWarp][kScanN];
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
  // Scanned: pair offsets (a), slots (b) and passes (c) of the experts before this thread's range.
  int v[kScanN] = {0, 0, 0};
  for (int e = lo; e < hi; ++e) v[0] += cnt[e], v[1] += cnt[e] > 0, v[2] += (cnt[e] + cols - 1) / cols;
  int total[kScanN];
  block_exclusive_scan(v, total, wt);
  int a = v[0], b = v[1], c = v[2];
  for (int e = lo; e < hi; ++e) {
    if (cnt[e] == 0) continue;
    plan.slot_expert[b] = e;
    plan.slot_begin[b] = a;
    plan.slot_count[b] = cnt[e];
    plan.slot_pass_begin[b] = c;
    cursor[e] = a;
    a += cnt[e];
    c += (cnt[e] + cols - 1) / cols;
    ++b;
  }
  if (threadIdx.x == 0) *plan.n_active = total[1], *plan.n_passes = total[2];
  __syncthreads();
  // Pair order inside an expert's group follows the atomics; every pair is computed alone, so results do not.
  for (int64_t p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int64_t e = static_cast<int64_t>(idx[p]) - expert_begin;
    if (e >= 0 && e < expert_count) plan.pair_list[atomicAdd(&cursor[e], 1)] = static_cast<int>(p);
  }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core expert GEMMs

// Tokens (pairs) per 8-column tile of mma.m16n8k16; warps per CTA (each its own tile of output rows
// over the whole K); K values per step; activation chunks in the shared-memory ring.
constexpr int kTokTile = 8;
constexpr int kWarps = 4;
constexpr int kMmaThreads = kWarps * kWarp;
constexpr int kChunkK = 128;  // K values per step: one 32-value scale group per lane of a quad
constexpr int kStages = 3;    // activation chunks staged ahead (cp.async ring)

using detail::cp_async16;
using detail::cp_async_wait;
using detail::smem_u32;
using detail::cp_async_commit;
using detail::mma_bf16_16816;

// Few pairs per expert (<= 4 on average: one token tile): moe_mma_splitk_kernel. One team item = (slot, tile
// of output features); the team's warps split K, each over whole kChunkK steps, their partials summed
// in warp order through shared memory (deterministic), so a layer with few experts in use still spreads
// over every SM. UP: the tile is 16 rows of W1 and the same 16 rows of W3 (the two A operands share the
// B fragments), epilogue h = bf16(situ(bf16(W1 z), bf16(W3 z))); DOWN: the tile is 32 rows of W2 (two
// A operands), epilogue o = bf16(W2 h). One token tile of 8 pairs per pass over K (more pairs: more passes). The
// activations come from L2 into registers, one chunk ahead like the weights.
//
// Fragments (lane = 4 g + t): lane t of a quad owns the 32-value scale group t of each 128-value chunk,
// for weight rows g and g + 8 of each A operand, and the same 32 activation values of token g of each
// token tile. mma step s in 0..7 takes values 4s..4s+3 of those 32 as its k slots {2t, 2t+1, 2t+8, 2t+9}
// for A and B alike: a sum over k is order-free, so any consistent assignment is the same product.
// A CTA is kSplitWarps warps sharing the table (two CTAs per SM: 16 warps with the 64 KiB table), in teams
// of team_warps (4 or 8) warps; each team walks its own item range as a virtual CTA, with its own named
// barrier. Teams of 8 halve each warp's chain of chunks; the launcher takes them when the items fit one wave
// of CTAs (at 2 experts per layer: the 224 down items, not the 384 up items).
constexpr int kSplitWarps = 8;
constexpr int kSplitThreads = kSplitWarps * kWarp;

__device__ __forceinline__ void team_sync(int team, int team_threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(1 + team), "r"(team_threads) : "memory");
}

template <bool UP>
__global__ void __launch_bounds__(kSplitThreads, 2)
    moe_mma_splitk_kernel(const bf16* __restrict__ x, Plan plan, Mxfp4ExpertTable ex, bf16* __restrict__ out, int k,
                   int64_t K, int64_t N, int64_t tiles_per_slot, int team_warps, SituParams sp) {
  constexpr int NT = 1;
  constexpr int kAcc = 2 * NT * 4;  // two A operands x NT token tiles x 4 accumulators per lane
  // The table; holes: part [kSplitWarps][kAcc][kWarp] FP32 (warp w of team t: entry t team_warps + w). It reads
  // nothing, so it is filled before the wait, while the kernel before this one (the plan) still runs.
  extern __shared__ __align__(16) unsigned char lut[];
  fill_lut(lut);
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  const uint32_t lut_s = smem_u32(lut);
  const int team_threads = team_warps * kWarp, teams = kSplitWarps / team_warps;
  const int team = static_cast<int>(threadIdx.x) / team_threads, ttid = static_cast<int>(threadIdx.x) % team_threads;
  auto part = [&](int w, int i, int ln) -> float& {
    return *reinterpret_cast<float*>(
        lut + hole_offset(4u * static_cast<uint32_t>(((team * team_warps + w) * kAcc + i) * kWarp + ln)));
  };
  const int warp = ttid / kWarp, lane = ttid % kWarp, g = lane >> 2, t = lane & 3;
  const uint32_t lane4 = 4u * static_cast<uint32_t>(lane);
  const int64_t items = static_cast<int64_t>(*plan.n_active) * tiles_per_slot;
  const int64_t vctas = int64_t{gridDim.x} * teams, vcta = int64_t{blockIdx.x} * teams + team;
  const int64_t per = (items + vctas - 1) / vctas;
  const int64_t i_begin = vcta * per, i_end = min(items, i_begin + per);
  const int64_t chunks = (K + kChunkK - 1) / kChunkK, wchunks = (chunks + team_warps - 1) / team_warps;
  const int64_t c_begin = min(chunks, warp * wchunks), c_end = min(chunks, c_begin + wchunks);
  const int64_t row_bytes = K / 2, row_scales = K / 32;
  const int tg = 32 * t < K ? t : 0;  // the lane's group in a chunk; a lane with none (K < 128) reads group 0
  for (int64_t item = i_begin; item < i_end; ++item) {
    const int slot = static_cast<int>(item / tiles_per_slot);
    const int64_t tile = item % tiles_per_slot;
    const int e = plan.slot_expert[slot], begin = plan.slot_begin[slot], count = plan.slot_count[slot];
    // A rows: [operand][row g, row g + 8].
    const uint8_t* ap[2][2];
    const uint8_t* as[2][2];
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      const uint8_t* base = UP ? (m == 0 ? ex.w1_packed[e] : ex.w3_packed[e]) : ex.w2_packed[e];
      const uint8_t* sbase = UP ? (m == 0 ? ex.w1_scale[e] : ex.w3_scale[e]) : ex.w2_scale[e];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t row = min(N - 1, (UP ? tile * 16 : tile * 32 + 16 * m) + g + 8 * h);
        ap[m][h] = base + row * row_bytes + 16 * tg;
        as[m][h] = sbase + row * row_scales + tg;
      }
    }
    for (int t0 = 0; t0 < count; t0 += kTokTile * NT) {
      const int nt = min(NT, (count - t0 + kTokTile - 1) / kTokTile);  // warp-uniform
      const bf16* xr[NT];
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int tok = min(count - 1, t0 + kTokTile * j + g);  // columns past count repeat a real token
        const int64_t pair = plan.pair_list[begin + tok];
        xr[j] = x + (UP ? pair / k : pair) * K + 32 * tg;
      }
      float acc[2][NT][4] = {};
      // Weights (HBM) and activations (L2) of the next chunk are loaded before the current one is used,
      // into two register sets used in turn (no copies between them). Loads are unconditional so they
      // issue together: a chunk past the warp's range reloads its last one (unused); a lane group past K
      // reads group tg of chunk 0 instead, with a zero scale (and finite activations).
      struct Buf {
        uint4 q[2][2];     // [operand][row g, g + 8]: 32 E2M1 values of the lane's group
        uint32_t s[2][2];  // their E8M0 scales, or kNoScale
        uint4 b[NT][4];    // the 32 activations of token g of each token tile
      };
      auto load = [&](int64_t c, Buf& u) {
        const int64_t cl = c < c_end ? c : c_end - 1;
        const bool ok = cl * kChunkK + 32 * t < K;
        const int64_t cw = ok ? cl : 0;
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            u.q[m][h] = ldg_l2_256(ap[m][h] + cw * (kChunkK / 2));
            const uint32_t sv = __ldg(as[m][h] + cw * (kChunkK / 32));
            u.s[m][h] = ok ? sv : kNoScale;
          }
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int v = 0; v < 4; ++v) u.b[j][v] = __ldg(reinterpret_cast<const uint4*>(xr[j] + cw * kChunkK) + v);
      };
      auto compute = [&](const Buf& u) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {  // word q of each lane's 16 bytes: values 8q..8q+7, mma steps 2q, 2q+1
          uint32_t a[2][2][4];
#pragma unroll
          for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const uint4 v = u.q[m][h];
              e2m1x8_to_bf16x8(lut_s, lane4, q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w, a[m][h]);
              const __nv_bfloat162 sc = e8m0_or_zero(u.s[m][h]);
#pragma unroll
              for (int p = 0; p < 4; ++p) a[m][h][p] = scale_bf16x2(a[m][h][p], sc);
            }
          // Both operands' first k step, then their second: an accumulator's two MMAs are not back to back.
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            if (j < nt) {
              const uint4 b = u.b[j][q];
#pragma unroll
              for (int m = 0; m < 2; ++m)
                mma_bf16_16816(acc[m][j], a[m][0][0], a[m][1][0], a[m][0][1], a[m][1][1], b.x, b.y);
#pragma unroll
              for (int m = 0; m < 2; ++m)
                mma_bf16_16816(acc[m][j], a[m][0][2], a[m][1][2], a[m][0][3], a[m][1][3], b.z, b.w);
            }
          }
        }
      };
      if (c_begin < c_end) {
        Buf u0, u1;
        load(c_begin, u0);
        for (int64_t c = c_begin; c < c_end; c += 2) {
          load(c + 1, u1);
          compute(u0);
          if (c + 1 >= c_end) break;
          load(c + 2, u0);
          compute(u1);
        }
      }
      // Split-K: the warps' partials meet in shared memory and are summed in warp order.
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i) part(warp, (m * NT + j) * 4 + i, lane) = acc[m][j][i];
      team_sync(team, team_threads);
      constexpr int kOut = (UP ? 1 : 2) * NT * 4 * kWarp;  // output values of the item (UP: pairs of W1, W3)
      for (int o = ttid; o < kOut; o += team_threads) {
        const int ln = o % kWarp, i = (o / kWarp) % 4, j = (o / (4 * kWarp)) % NT, m = o / (4 * kWarp * NT);
        if (j >= nt) continue;
        const int tok = t0 + kTokTile * j + 2 * (ln & 3) + (i & 1);
        const int64_t n = (UP ? tile * 16 : tile * 32 + 16 * m) + (ln >> 2) + 8 * (i >> 1);
        if (tok >= count || n >= N) continue;
        const int64_t pair = plan.pair_list[begin + tok];
        float s0 = 0.f, s1 = 0.f;
        for (int w = 0; w < team_warps; ++w) {
          s0 += part(w, (m * NT + j) * 4 + i, ln);
          if (UP) s1 += part(w, (NT + j) * 4 + i, ln);
        }
        const float v = UP ? detail::situ_dev(detail::round_bf16_dev(s0), detail::round_bf16_dev(s1), sp) : s0;
        out[pair * N + n] = detail::float_to_bf16(v);
      }
      team_sync(team, team_threads);
    }
  }
}


// A staged activation chunk is [cols][kChunkK] BF16, 256 bytes per token row; 16-byte piece p of row r
// sits at piece x_piece(p, r), so that the 8 lanes of a 128-bit shared load phase (rows g, g + 1 of the
// tile, groups t = 0..3, reading piece 4 t + q) hit 8 different bank groups.
__device__ __forceinline__ int x_piece(int p, int r) { return p ^ (((p >> 3) & 1) | ((r & 1) << 1)); }

// The activation ring of moe_mma_kernel<NT> (bytes), in the table's holes.
constexpr size_t mma_ring_bytes(int nt) { return size_t{kStages} * nt * kTokTile * kChunkK * 2; }
static_assert(hole_offset(mma_ring_bytes(3) - 1) < kLutBytes, "the ring fits the table's holes");

// More pairs per expert (2 or 3 token tiles per pass): moe_mma_kernel<NT>. A CTA walks a contiguous
// share of the units = (slot, group j of 4 consecutive tiles of output rows, pass); warp w owns tile
// 4 j + w of the group over the whole K, so no partial sums are exchanged. UP: a tile is 16 rows of W1 and
// the same 16 rows of W3 (two A operands sharing the B fragments), epilogue h = bf16(situ(bf16(W1 z),
// bf16(W3 z))); DOWN: a tile is 32 rows of W2 (two A operands), epilogue o = bf16(W2 h). A pass takes up
// to NT token tiles of 8 pairs (more pairs: more passes); its activations stream through a kStages-deep
// shared-memory ring of 128-value chunks (cp.async), read by all four warps; the weights stream through
// registers one chunk ahead of use, straight from HBM.
//
// Fragments (lane = 4 g + t): lane t of a quad owns the 32-value scale group t of each 128-value chunk,
// for weight rows g and g + 8 of each A operand, and the same 32 activation values of token g of each
// token tile. mma step s in 0..7 takes values 4s..4s+3 of those 32 as its k slots {2t, 2t+1, 2t+8, 2t+9}
// for A and B alike: a sum over k is order-free, so any consistent assignment is the same product.
template <int NT, bool UP>
__global__ void __launch_bounds__(kMmaThreads, NT >= 3 ? 3 : 4)
    moe_mma_kernel(const bf16* __restrict__ x, Plan plan, Mxfp4ExpertTable ex, bf16* __restrict__ out, int k,
                   int64_t K, int64_t N, int64_t tiles_per_slot, SituParams sp) {
  constexpr int kCols = NT * kTokTile;  // token columns per pass
  // The table; holes: the ring [kStages][kCols][kChunkK] BF16, pieces swizzled. A token column's 256
  // bytes are two holes, so column c of a stage is at stage_base + 512 c + hole_offset(piece offset).
  extern __shared__ __align__(16) unsigned char lut[];
  constexpr uint32_t kStageBytes = 2 * kCols * kChunkK * 2;  // a stage's span: its bytes and its rows' tables
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, g = lane >> 2, t = lane & 3;
  // Work units (slot, group, pass of kCols token columns), in that order, so that a CTA's passes over the same
  // rows run back to back (the later ones find the weights in L2). CTAs take shares of the units, so an
  // expert with more pairs spreads over more CTAs instead of lengthening a few. The table reads nothing, so
  // it is filled before the wait, while the kernel before this one still runs; the plan is read after it.
  fill_lut(lut);
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  const int64_t gps = (tiles_per_slot + kWarps - 1) / kWarps;  // groups per slot
  const int n_active = *plan.n_active;
  const int64_t units = static_cast<int64_t>(*plan.n_passes) * gps;
  int pass_begin = lane < n_active ? plan.slot_pass_begin[lane] : INT_MAX;
  const uint32_t lut_s = smem_u32(lut);
  const uint32_t lane4 = 4u * static_cast<uint32_t>(lane);
  // The lane's B-fragment offsets in a stage, step q (token tile j: + 8 j columns = 4096 j bytes).
  uint32_t roff[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) roff[q] = 512u * g + hole_offset(16u * x_piece(4 * t + q, g));
  // ceil(units / CTAs) consecutive units per CTA, the last CTAs none (an even split, every CTA busy, was
  // tried and was no faster: the busiest CTA sets the time either way).
  const int64_t per = (units + gridDim.x - 1) / gridDim.x;
  const int64_t u_begin = min(units, per * blockIdx.x), u_end = min(units, u_begin + per);
  // The slot of unit u_begin: the last one whose units begin at or before it. The pass offsets ascend, so
  // the slots at or before it are a prefix: 32 slots per ballot.
  int slot = 0;
  for (int base = 0;;) {
    const unsigned at_or_before = __ballot_sync(0xffffffffu, gps * pass_begin <= u_begin);
    if (at_or_before != 0) slot = base + __popc(at_or_before) - 1;
    base += kWarp;
    if (at_or_before != 0xffffffffu || base >= n_active) break;
    pass_begin = base + lane < n_active ? plan.slot_pass_begin[base + lane] : INT_MAX;
  }
  const int chunks = static_cast<int>((K + kChunkK - 1) / kChunkK), full = static_cast<int>(K / kChunkK);
  const int64_t row_bytes = K / 2, row_scales = K / 32;
  // The lane's group in the last chunk may lie past K (K % 128 != 0): its weights are read from chunk 0
  // and its scale is zero, so they add nothing (the staged activations there are zeros too).
  const bool tail_ok = full * kChunkK + 32 * t < K;
  const int tg = 32 * t < K ? t : 0;  // the lane's group in chunk 0 (a group past a short row: group 0)
  // Staging: thread -> pieces tid + 128 r (r < NT) of a chunk: token column c / 16, piece c % 16.
  for (int64_t u = u_begin; u < u_end; ++slot) {
    const int e = plan.slot_expert[slot], begin = plan.slot_begin[slot], count = plan.slot_count[slot];
    const int passes = (count + kCols - 1) / kCols;
    const int64_t ub = gps * plan.slot_pass_begin[slot], ue = min(u_end, ub + gps * passes);
    for (; u < ue; ++u) {
      const int64_t tile_raw = (u - ub) / passes * kWarps + warp;
      const bool live = tile_raw < tiles_per_slot;
      const int64_t tile = live ? tile_raw : tiles_per_slot - 1;  // an idle warp computes a real tile, unstored
      // A rows g (pointers per operand) and g + 8 (hop bytes further).
      const uint8_t* ap[2];
      const uint8_t* as[2];
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        const uint8_t* base = UP ? (m == 0 ? ex.w1_packed[e] : ex.w3_packed[e]) : ex.w2_packed[e];
        const uint8_t* sbase = UP ? (m == 0 ? ex.w1_scale[e] : ex.w3_scale[e]) : ex.w2_scale[e];
        const int64_t row = (UP ? tile * 16 : tile * 32 + 16 * m) + g;
        ap[m] = base + row * row_bytes + 16 * tg;
        as[m] = sbase + row * row_scales + tg;
      }
      // (N, a multiple of 32 as moe_experts checks, holds whole tiles: every row is real.)
      const int64_t hop = 8 * row_bytes, shop = 8 * row_scales;
      {  // the unit's pass: token columns t0 .. t0 + kCols - 1 of the slot
        const int t0 = static_cast<int>((u - ub) % passes) * kCols;
        const int nt = min(NT, (count - t0 + kTokTile - 1) / kTokTile);  // CTA-uniform
        // This thread's staged pieces: sources (columns past count repeat a real token) and ring offsets.
        const bf16* xsrc[NT];
        uint32_t xdst[NT];
#pragma unroll
        for (int r = 0; r < NT; ++r) {
          const int c = threadIdx.x + kMmaThreads * r, col = c / 16, piece = c % 16;
          const int tok = min(count - 1, t0 + col);
          const int64_t pair = plan.pair_list[begin + tok];
          xsrc[r] = x + (UP ? pair / k : pair) * K;
          xdst[r] = 512u * col + hole_offset(16u * x_piece(piece, col));
        }
        auto stage = [&](int c) {
          unsigned char* dst = lut + (c % kStages) * kStageBytes;
#pragma unroll
          for (int r = 0; r < NT; ++r) {
            if (r < nt) {
              const int piece = (threadIdx.x + kMmaThreads * r) % 16;
              const bool ok = static_cast<int64_t>(c) * kChunkK + 8 * piece < K;
              cp_async16(dst + xdst[r], ok ? xsrc[r] + c * kChunkK + 8 * piece : xsrc[r], ok);
            }
          }
        };
#pragma unroll
        for (int s = 0; s < kStages - 1; ++s) {
          if (s < chunks) stage(s);
          cp_async_commit();
        }

        float acc[2][NT][4] = {};

        struct W {
          uint4 q[2][2];    // [operand][row g, g + 8]: 32 E2M1 values of group t
          uint32_t s[2][2];  // their E8M0 scales, or kNoScale
        };
        // Chunk c's weights of this lane (c past the end: the last chunk again, unused).
        auto load_w = [&](int c, W& w) {
          int cc = c < chunks ? c : chunks - 1;
          const bool ok = cc < full || tail_ok;
          cc = ok ? cc : 0;
#pragma unroll
          for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              w.q[m][h] = ldg_l2_256(ap[m] + h * hop + cc * (kChunkK / 2));
              const uint32_t sv = __ldg(as[m] + h * shop + cc * (kChunkK / 32));
              w.s[m][h] = ok ? sv : kNoScale;
            }
        };
        // One chunk: wait for its activations, free the oldest ring slot, stage chunk c + kStages - 1, then
        // decode and multiply.
        auto compute = [&](int c, const W& w) {
          cp_async_wait<kStages - 2>();
          __syncthreads();  // chunk c is visible to every warp, and every warp is done with chunk c - 1
          if (c + kStages - 1 < chunks) stage(c + kStages - 1);
          cp_async_commit();
          const unsigned char* xs = lut + (c % kStages) * kStageBytes;
#pragma unroll
          for (int q = 0; q < 4; ++q) {  // word q of each lane's 16 bytes: values 8q..8q+7, mma steps 2q, 2q+1
            uint4 b[NT];
#pragma unroll
            for (int j = 0; j < NT; ++j) {
              if (j < nt) b[j] = *reinterpret_cast<const uint4*>(xs + kTokTile * 512 * j + roff[q]);
            }
#pragma unroll
            for (int m = 0; m < 2; ++m) {
              uint32_t a[2][4];
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                const uint4 v = w.q[m][h];
                e2m1x8_to_bf16x8(lut_s, lane4, q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w, a[h]);
                const __nv_bfloat162 sc = e8m0_or_zero(w.s[m][h]);
#pragma unroll
                for (int p = 0; p < 4; ++p) a[h][p] = scale_bf16x2(a[h][p], sc);
              }
              // Every token tile's first k step, then their second: an accumulator's two MMAs are nt apart.
#pragma unroll
              for (int j = 0; j < NT; ++j)
                if (j < nt) mma_bf16_16816(acc[m][j], a[0][0], a[1][0], a[0][1], a[1][1], b[j].x, b[j].y);
#pragma unroll
              for (int j = 0; j < NT; ++j)
                if (j < nt) mma_bf16_16816(acc[m][j], a[0][2], a[1][2], a[0][3], a[1][3], b[j].z, b[j].w);
            }
          }
        };
        // Two register sets of weights, alternating (no copies between them).
        W w0, w1;
        load_w(0, w0);
        for (int c = 0; c < chunks; c += 2) {
          load_w(c + 1, w1);
          compute(c, w0);
          if (c + 1 >= chunks) break;
          load_w(c + 2, w0);
          compute(c + 1, w1);
        }
        cp_async_wait<0>();
        __syncthreads();  // the ring is free for the next unit

        // Epilogue straight from the accumulators: lane (g, t) holds rows g, g + 8 and columns 2t, 2t + 1.
        if (live) {
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            if (j >= nt) continue;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int tok = t0 + kTokTile * j + 2 * t + (i & 1);
              if (tok >= count) continue;
              const int64_t pair = plan.pair_list[begin + tok];
#pragma unroll
              for (int m = 0; m < (UP ? 1 : 2); ++m) {
                const int64_t n = (UP ? tile * 16 : tile * 32 + 16 * m) + g + 8 * (i >> 1);
                if (n >= N) continue;
                const float v = UP ? detail::situ_dev(detail::round_bf16_dev(acc[0][j][i]),
                                                      detail::round_bf16_dev(acc[1][j][i]), sp)
                                   : acc[m][j][i];
                out[pair * N + n] = detail::float_to_bf16(v);
              }
            }
          }
        }
      }
    }
  }
}

// CTAs of a kernel resident per SM with blocks of `threads` and dyn_smem bytes of dynamic shared memory
// (queried once per kernel and device).
template <auto Kernel>
int ctas_per_sm(int threads, size_t dyn_smem) {
  static int cached[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 2;
  if (cached[dev] == 0) {
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, Kernel, threads, dyn_smem) != cudaSuccess || n <= 0) n = 1;
    cached[dev] = n;
  }
  return cached[dev];
}

// K3_MOE_TEAM / moe_experts_force_team: 0 (by the wave), 1 (teams of 4) or 2 (of 8).
std::atomic<int> g_team{-1};
int team_choice() { return env_knob(g_team, "K3_MOE_TEAM", 0, 2, 0); }

template <bool UP>
int launch_splitk(const bf16* x, const Plan& plan, const Mxfp4ExpertTable& ex, bf16* out, int k, int64_t K, int64_t N,
                  int64_t max_slots, SituParams sp, int sms, cudaStream_t s) {
  const int64_t tiles = UP ? (N + 15) / 16 : (N + 31) / 32;
  // The table (64 KiB) passes the 48 KiB a CTA gets without asking.
  if (const cudaError_t e = detail::allow_optin_smem<moe_mma_splitk_kernel<UP>>(); e != cudaSuccess) return e;
  // Teams of 8 warps when every item gets its own CTA in one wave, else of 4 (two per CTA); K3_MOE_TEAM (or
  // moe_experts_force_team) fixes one size for A/B runs.
  const int64_t items = max_slots * tiles;
  const int64_t slots = int64_t{sms} * ctas_per_sm<moe_mma_splitk_kernel<UP>>(kSplitThreads, kLutBytes);
  const int team = team_choice();
  const bool eight = team == 2 || (team == 0 && items <= slots);
  const int team_warps = eight ? kSplitWarps : kSplitWarps / 2;
  const int64_t teams = kSplitWarps / team_warps;
  const int64_t blocks = std::min<int64_t>((items + teams - 1) / teams, slots);
  return detail::launch(moe_mma_splitk_kernel<UP>, static_cast<unsigned>(std::max<int64_t>(1, blocks)), kSplitThreads,
                        kLutBytes, s, x, plan, ex, out, k, K, N, tiles, team_warps, sp);
}

template <int NT, bool UP>
int launch_mma(const bf16* x, const Plan& plan, const Mxfp4ExpertTable& ex, bf16* out, int k, int64_t K, int64_t N,
               int64_t max_slots, int64_t pairs, SituParams sp, int sms, cudaStream_t s) {
  const int64_t tiles = UP ? (N + 15) / 16 : (N + 31) / 32;
  const int64_t gps = (tiles + kWarps - 1) / kWarps;
  // The table with the ring in its holes (64 KiB) passes the 48 KiB a CTA gets without asking.
  if (const cudaError_t e = detail::allow_optin_smem<moe_mma_kernel<NT, UP>>(); e != cudaSuccess) return e;
  // At most gps units per slot and pass, and at most max_slots + pairs / kCols passes.
  const int64_t max_units = gps * std::min<int64_t>(pairs, max_slots + pairs / (NT * kTokTile));
  const int64_t blocks =
      std::min<int64_t>(max_units, int64_t{sms} * ctas_per_sm<moe_mma_kernel<NT, UP>>(kMmaThreads, kLutBytes));
  return detail::launch(moe_mma_kernel<NT, UP>, static_cast<unsigned>(std::max<int64_t>(1, blocks)), kMmaThreads,
                        kLutBytes, s, x, plan, ex, out, k, K, N, tiles, sp);
}

template <bool UP>
int launch_mma_nt(int nt, const bf16* x, const Plan& plan, const Mxfp4ExpertTable& ex, bf16* out, int k, int64_t K,
                  int64_t N, int64_t max_slots, int64_t pairs, SituParams sp, int sms, cudaStream_t s) {
  if (nt <= 1) return launch_splitk<UP>(x, plan, ex, out, k, K, N, max_slots, sp, sms, s);
  if (nt <= 2) return launch_mma<2, UP>(x, plan, ex, out, k, K, N, max_slots, pairs, sp, sms, s);
  return launch_mma<3, UP>(x, plan, ex, out, k, K, N, max_slots, pairs, sp, sms, s);
}

// acc[u] = sum over local j, in order, of w[r, j] * o[(r, j), i + u] (u < 8; 0 for a row with none):
// one 16-byte load per (r, j).
__device__ __forceinline__ void combine_chunk(const bf16* __restrict__ o, const int32_t* __restrict__ idx,
                                              const float* __restrict__ w, int expert_begin, int expert_count,
                                              int64_t r, int k, int64_t L, int64_t i, float (&acc)[8]) {
#pragma unroll
  for (int u = 0; u < 8; ++u) acc[u] = 0.f;
  for (int j = 0; j < k; ++j) {
    const int64_t pair = r * k + j;
    const int64_t e = static_cast<int64_t>(idx[pair]) - expert_begin;
    if (e < 0 || e >= expert_count) continue;
    const float wj = w[pair];
    float v[8];
    detail::load_bf16<8>(o + pair * L + i, v);
#pragma unroll
    for (int u = 0; u < 8; ++u) acc[u] = __fadd_rn(acc[u], __fmul_rn(wj, v[u]));
  }
}

// y[r, i] = bf16(combine_chunk). A thread per 8 consecutive i (L % 32 == 0; o and y 16-byte aligned).
__global__ void moe_combine_kernel(const bf16* __restrict__ o, const int32_t* __restrict__ idx,
                                   const float* __restrict__ w, int expert_begin, int expert_count, bf16* __restrict__ y,
                                   int64_t rows, int k, int64_t L) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  const int64_t L8 = L / 8, total = rows * L8;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = t / L8, i = (t % L8) * 8;
    float acc[8];
    combine_chunk(o, idx, w, expert_begin, expert_count, r, k, L, i, acc);
    detail::store_bf16<8>(y + r * L + i, acc);
  }
}

// The combine followed by the latent RMSNorm (norm_w [L]): one CTA of norm_threads(L / 8) per row, each
// thread the 8-value chunks rmsnorm_kernel would give it, so the bits are those of the two kernels.
__global__ void __launch_bounds__(detail::kNormMaxThreads)
    moe_combine_norm_kernel(const bf16* __restrict__ o, const int32_t* __restrict__ idx, const float* __restrict__ w,
                            int expert_begin, int expert_count, bf16* y, int k, int64_t L,
                            const bf16* __restrict__ norm_w, float eps) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  __shared__ float red[detail::kWarp];
  const int64_t r = blockIdx.x;
  detail::rmsnorm_row_produced<8>(
      [&](int64_t c, float (&acc)[8]) { combine_chunk(o, idx, w, expert_begin, expert_count, r, k, L, c * 8, acc); },
      y + r * L, L, norm_w, eps, red);
}

unsigned grid_for(int64_t threads_needed, int threads_per_block, int cap_blocks) {
  const int64_t b = (threads_needed + threads_per_block - 1) / threads_per_block;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(b, cap_blocks)));
}

// K3_MOE_WG / moe_experts_force_wg: 0 or 1.
std::atomic<int> g_force_wg{-1};
bool use_wg() { return env_knob(g_force_wg, "K3_MOE_WG", 0, 1, 0) == 1; }

}  // namespace

void moe_experts_force_wg(bool on) { g_force_wg.store(on ? 1 : 0, std::memory_order_relaxed); }

void moe_experts_force_team(int choice) {
  g_team.store(choice == 1 || choice == 2 ? choice : 0, std::memory_order_relaxed);
}

int moe_experts(const Context& ctx, const bf16* z, const int32_t* idx, const float* w, const Mxfp4ExpertTable& experts,
                int expert_begin, int expert_count, bf16* y, void* scratch, int64_t rows, int k, int64_t L, int64_t I,
                SituParams p, const RowNorm& norm) {
  if (rows < 0 || k <= 0 || L <= 0 || I <= 0 || L % 32 != 0 || I % 32 != 0) return cudaErrorInvalidValue;
  if (expert_count < 0 || expert_count > kMoeMaxLocalExperts) return cudaErrorInvalidValue;
  if (rows * k > 0x7fffffff) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (!aligned16(z) || !aligned16(y) || !aligned16(scratch)) return cudaErrorMisalignedAddress;
  if (norm.w != nullptr && !aligned16(norm.w)) return cudaErrorMisalignedAddress;
  const cudaStream_t s = ctx.stream;
  const int64_t pairs = rows * k;
  const size_t meta_bytes = (static_cast<size_t>(4 * (kPlanHeader + kPlanArrays * pairs)) + 255) / 256 * 256;
  const Plan plan = plan_at(scratch, pairs);
  bf16* h = reinterpret_cast<bf16*>(static_cast<char*>(scratch) + meta_bytes);
  bf16* o = h + (pairs * I + 127) / 128 * 128;  // the 256-byte aligned offset of moe_experts_scratch_bytes

  const int sms = ctx.sm_count > 0 ? ctx.sm_count : detail::device_sm_count();
  const int64_t max_slots = std::min<int64_t>(expert_count, pairs);
  // Token tiles per pass (1 to 3: registers hold the next chunk's activations), for the mean pairs per
  // used expert plus headroom; more pairs take more passes, whose weight re-reads come from L2.
  const int64_t mean = max_slots > 0 ? (pairs + max_slots - 1) / max_slots : 1;
  const int nt = mean <= 4 ? 1 : mean <= 12 ? 2 : 3;
  const size_t plan_smem = 2 * static_cast<size_t>(expert_count) * sizeof(int);
  // The warp-specialized path (K3_MOE_WG) plans passes of kWgCols token columns, the mma.sync kernels nt tiles.
  const bool wg = max_slots > 0 && use_wg() && moe_wg_supported(L, I);
  if (const cudaError_t e = detail::launch(moe_plan_kernel, 1, kPlanThreads, plan_smem, s, idx, pairs, expert_begin,
                                           expert_count, wg ? kWgCols : kTokTile * nt, plan);
      e != cudaSuccess)
    return e;
  if (wg) {
    if (const int e = moe_wg_launch(true, z, plan, experts, h, k, L, I, max_slots, pairs, p, sms, s); e != 0) return e;
    if (const int e = moe_wg_launch(false, h, plan, experts, o, k, I, L, max_slots, pairs, p, sms, s); e != 0) return e;
  } else if (max_slots > 0) {
    if (const int e = launch_mma_nt<true>(nt, z, plan, experts, h, k, L, I, max_slots, pairs, p, sms, s); e != 0) return e;
    if (const int e = launch_mma_nt<false>(nt, h, plan, experts, o, k, I, L, max_slots, pairs, p, sms, s); e != 0) return e;
  }
  if (norm.w != nullptr)
    return detail::launch(moe_combine_norm_kernel, static_cast<unsigned>(rows), detail::norm_threads(L / 8), 0, s, o,
                          idx, w, expert_begin, expert_count, y, k, L, norm.w, norm.eps);
  return detail::launch(moe_combine_kernel, grid_for(rows * L / 8, 256, 8 * sms), 256, 0, s, o, idx, w, expert_begin,
                        expert_count, y, rows, k, L);
}

}  // namespace k3::ops::cuda
