// The expert GEMMs of moe_experts (moe_experts.cu has the plan, the combine and the entry point): one
// persistent, warp-specialized grouped kernel for both projections of every local expert in use.
//
// Work items, dealt by an atomic counter (each CTA takes the next item when its producer is free):
//   up:   (slot, 64 output features of I, token tile of T pairs): 64 rows of W1 and the same 64 of W3,
//         h[pair, n] = bf16(situ(bf16(W1 z), bf16(W3 z)));
//   down: (slot, 128 output features of L, token tile): 128 rows of W2, o[pair, n] = bf16(W2 h[pair]).
// One launch runs every up item, then every down item (ascending slot); a down item's producer waits until
// the up items of its slot are done (a counter per slot, release / acquire), so the two projections share
// one wave without a kernel boundary (K3_MOE_SPLIT_LAUNCH=1: two launches, up then down, a diagnostic).
//
// A CTA (1 per SM, the grid is the SM count) is 9 warps:
//   producer (warp 8): claims items and streams each item's K in stages of 256 values into a ring of
//     `stages` shared-memory slots (3 to 8, as many as fit): the 128 weight rows' packed E2M1 bytes (one
//     cp.async.bulk of 128 bytes per row), their E8M0 scales (cp.async, 8 bytes per row) and the T token
//     rows of activations (one bulk copy of 512 bytes per token: z for up, h for down), completing on the
//     slot's mbarrier, plus a header (item, k step, the tile's pair ids). It runs ahead of the consumers by
//     up to the whole ring, whatever they do. K % 256 != 0 or a weight pointer not 16-byte aligned: the
//     producer copies that item with plain loads instead (zero-filled past K).
//   consumers (warps 0-7): warp w owns 32 weight rows (row group w % 4: up, 16 rows of W1 and the same 16 of
//     W3; down, 32 rows of W2) and half of each stage's K (w / 4); it decodes its E2M1 bytes (ldmatrix from
//     the ring) to BF16 and runs mma.sync m16n8k16 (BF16 in, FP32 accumulate) against the token tile, up to
//     8 columns of 8 tokens. At an item's end the second half's partial sums are added to the first's
//     through shared memory (fixed order), the first half's warps run the epilogue.
//
// The E2M1 decode is ALU only (no table): a nibble s e1 e0 m moved to bits 15 | 8..6 of a BF16 is the value
// times 2^-126 (e = 0 gives the subnormals 0 and 2^-127); one multiply by 2^(scale - 1), exact, gives the
// dequantized value (a second one for scale bytes above 128). A 32-bit word of 8 nibbles (k .. k + 7) gives
// four BF16 pairs (k + i, k + i + 4), i = 0..3; the activations' fragments are paired the same way with a byte
// permute, so every MMA multiplies the exact dequantized weights with the activations of the same k.
//
// Determinism: every output is one item's, summed over K in a fixed order (the MMA k steps of each half in
// order, then half 0 + half 1), whatever the item's CTA or token tile; a token's column never mixes with
// another's. So an output does not depend on the other rows of the batch, only on its inputs.
//
// Resources (nvcc 13.0, sm_90a, -Xptxas -v): 288 threads, 161 registers per thread, no spills, no stack,
// no static shared memory; dynamic shared memory 2432 (barriers, headers) + 512 T (partial sums, 128-byte
// aligned) + stages x (19456 + 576 T) bytes, stages = as many as fit the opt-in limit (227 KiB), at most 8:
// T = 8: 8 stages, 194 KiB; T = 16: 7, 206 KiB; T = 32: 5, 203 KiB; T = 64: 3, 199 KiB. One CTA per SM.
#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <initializer_list>

#include "ops/cuda_bf16.cuh"
#include "ops/cuda_device.cuh"
#include "ops/cuda_mma.cuh"
#include "ops/moe_device.cuh"
#include "ops/moe_experts.cuh"

namespace k3::ops::cuda::detail {
namespace {

constexpr int kConsumerWarps = 8;
constexpr int kThreads = (kConsumerWarps + 1) * kWarp;
constexpr int kBK = 256;                  // K values per stage
constexpr int kStageRows = 128;           // weight rows per stage (up: 64 of W1, 64 of W3)
constexpr int kUpTile = kStageRows / 2;   // output features per up item
constexpr int kDownTile = kStageRows;     // output features per down item
constexpr int kRowBytes = kBK / 2;        // packed bytes of a row per stage
constexpr int kWPitch = kRowBytes + 16;   // a row's pitch in the ring: ldmatrix rows hit 8 bank groups
constexpr int kSPitch = kBK / 32;         // scale bytes of a row per stage
constexpr int kXBytes = kBK * 2;          // activation bytes of a token per stage
constexpr int kXPitch = kXBytes + 64;     // a token's pitch: the B loads of tokens g, g + 1 hit 8 bank groups
constexpr int kMaxTok = 64;               // token tile: at most 8 MMA columns of 8
constexpr int kMaxStages = 8;
constexpr uint32_t kFullArrivals = kWarp + 1;  // each producer lane (cp.async arrive) + lane 0's expect_tx

struct StageHeader {
  int kind;  // 0 up, 1 down, -1 no more work
  int ks, nks;
  int n0;    // first output feature
  int ntok;  // pairs in the token tile
  int slot;
  int pad[2];
  int pair[kMaxTok];
};
static_assert(sizeof(StageHeader) % 16 == 0, "headers stay 16-byte aligned");

// Byte offsets in the dynamic shared memory.
struct Layout {
  uint32_t hdr, part, ring, stage_bytes, total;
  static constexpr uint32_t kFull = 0, kEmpty = 8 * kMaxStages;
  static constexpr uint32_t kW = 0, kS = kStageRows * kWPitch, kX = kS + kStageRows * kSPitch;
};
__host__ __device__ constexpr Layout layout_for(int T, int stages) {
  Layout l{};
  l.hdr = 16 * kMaxStages;
  l.part = l.hdr + kMaxStages * static_cast<uint32_t>(sizeof(StageHeader));
  l.ring = (l.part + 4u * static_cast<uint32_t>(T) * kWarp * 4u + 127u) / 128u * 128u;
  l.stage_bytes = Layout::kX + static_cast<uint32_t>(T) * kXPitch;
  l.total = l.ring + static_cast<uint32_t>(stages) * l.stage_bytes;
  return l;
}

struct Params {
  MoePlan plan;
  Mxfp4ExpertTable ex;
  const bf16* z;
  bf16* h;
  bf16* o;
  int k, L, I;
  int T, stages;
  int mode;  // 0: up then down in one launch; 1: up only; 2: down only
  SituParams sp;
};

// ------------------------------------------------------------------------------------------------
// mbarriers, bulk and asynchronous copies, fences

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Arrives on bar once every cp.async this thread issued before has landed (counted in the barrier's
// arrivals: .noinc).
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];\n" ::"r"(bar) : "memory");
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
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}
// bytes (a multiple of 16) global -> shared, both 16-byte aligned; completes on bar.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
// 8 bytes global -> shared, both 8-byte aligned.
__device__ __forceinline__ void cp_async8(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async;\n" ::: "memory"); }
__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// The consumer warps' barrier (the producer never joins it).
__device__ __forceinline__ void consumer_sync() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumerWarps * kWarp) : "memory");
}

__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
__device__ __forceinline__ void sts32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void sts8(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b8 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

// ------------------------------------------------------------------------------------------------
// E2M1 -> BF16

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// 8 nibbles of w (nibble i: value k + i) -> r[i] = (value k + i, value k + i + 4) as BF16x2 of the raw value
// times m1 (times m2 when BIG). Nibbles i, i + 4 masked in place (bits 4 i' .. and 16 + 4 i', i' = i % 2; w >> 8
// brings nibbles 2, 3, 6, 7 there) times 2^(6 - 4 i') + 2^(12 - 4 i'): two copies that cannot carry into each
// other, the first with the magnitude at bits 6..8, the second with the sign at 15 (+16 for the high half);
// the mask keeps those. (Two masks, a multiply and a multiply by the scale per pair of values.)
template <bool BIG>
__device__ __forceinline__ void decode8(uint32_t w, uint32_t m1, uint32_t m2, uint32_t (&r)[4]) {
  const uint32_t hi = w >> 8;
  uint32_t v[4] = {((w & 0x000F000Fu) * 0x1040u), ((w & 0x00F000F0u) * 0x0104u), ((hi & 0x000F000Fu) * 0x1040u),
                   ((hi & 0x00F000F0u) * 0x0104u)};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t x = bf16x2_mul(v[i] & 0x81C081C0u, m1);
    if (BIG) x = bf16x2_mul(x, m2);
    r[i] = x;
  }
}

// A scale byte s -> the multipliers of the raw values: 2^(s - 1) (BF16x2) when s <= 128; BIG: 2^(min(s, 128)
// - 1) and 2^(s - 128) (s = 255: infinity, as ldexp on the CPU), both exact.
template <bool BIG>
__device__ __forceinline__ void scale_mults(uint32_t s, uint32_t& m1, uint32_t& m2) {
  if (!BIG) {
    m1 = s * 0x00800080u + 0x3F003F00u;  // (s + 126) << 7 in both halves
    m2 = 0;
  } else {
    m1 = min(s, 128u) * 0x00800080u + 0x3F003F00u;
    m2 = s == 255u ? 0x7F807F80u : (max(s, 128u) - 1u) * 0x00800080u;
  }
}

// Any byte above 128 in w.
__device__ __forceinline__ bool has_big_scale(uint32_t w) {
  return (((w & 0x7F7F7F7Fu) + 0x7F7F7F7Fu) & w & 0x80808080u) != 0;
}

// ------------------------------------------------------------------------------------------------
// Consumers

// One stage of a consumer warp: its two m-tiles (a_addr: this lane's ldmatrix row address of each, chunk
// 4 kg), the scale words (sw[m][h]: rows g, g + 8, the 4 bytes of the half's chunks) and nt token columns
// (x_addr: token g's 16 bytes at t in the half's first chunk).
template <bool BIG>
__device__ __forceinline__ void stage_mma(float (&acc)[2][8][4], const uint32_t (&a_addr)[2], uint32_t x_addr,
                                          const uint32_t (&sw)[2][2], int nt) {
#pragma unroll
  for (int cp = 0; cp < 2; ++cp) {  // chunk pairs: 64 values of K
    uint32_t d[2][4];               // [m]: row g chunk c, row g + 8 chunk c, row g chunk c + 1, row g + 8 chunk c + 1
#pragma unroll
    for (int m = 0; m < 2; ++m) ldsm_x4(d[m], a_addr[m] + 32u * cp);
#pragma unroll
    for (int cc = 0; cc < 2; ++cc) {  // one chunk: 32 values of K, one scale per row
      const int cl = 2 * cp + cc;
      uint32_t a[2][2][4];  // [m][row g, g + 8][pair]
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint32_t m1, m2;
          scale_mults<BIG>(__byte_perm(sw[m][h], 0u, 0x4440u + static_cast<uint32_t>(cl)), m1, m2);
          decode8<BIG>(d[m][h + 2 * cc], m1, m2, a[m][h]);
        }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (j < nt) {
          // Token 8 j + g's values k + 8 t .. + 7 of the chunk, paired (k + i, k + i + 4) like the weights.
          const uint4 x = lds128(x_addr + static_cast<uint32_t>(j * 8 * kXPitch + 64 * cl));
          const uint32_t b00 = __byte_perm(x.x, x.z, 0x5410u), b01 = __byte_perm(x.x, x.z, 0x7632u);
          const uint32_t b10 = __byte_perm(x.y, x.w, 0x5410u), b11 = __byte_perm(x.y, x.w, 0x7632u);
#pragma unroll
          for (int m = 0; m < 2; ++m) mma_bf16_16816(acc[m][j], a[m][0][0], a[m][1][0], a[m][0][1], a[m][1][1], b00, b01);
#pragma unroll
          for (int m = 0; m < 2; ++m) mma_bf16_16816(acc[m][j], a[m][0][2], a[m][1][2], a[m][0][3], a[m][1][3], b10, b11);
        }
      }
    }
  }
}

__device__ __forceinline__ void consumer(const Params& p, const Layout& lay, uint32_t smem, unsigned char* smem_ptr) {
  const int warp = static_cast<int>(threadIdx.x) / kWarp, lane = static_cast<int>(threadIdx.x) % kWarp;
  const int rg = warp % 4, kg = warp / 4, g = lane >> 2, t = lane & 3;
  float* part = reinterpret_cast<float*>(smem_ptr + lay.part);
  float acc[2][8][4];
  for (uint32_t f = 0;; ++f) {
    const uint32_t stage = f % static_cast<uint32_t>(p.stages);
    mbar_wait(smem + Layout::kFull + 8 * stage, (f / static_cast<uint32_t>(p.stages)) & 1u);
    const StageHeader& hd = reinterpret_cast<const StageHeader*>(smem_ptr + lay.hdr)[stage];
    const int kind = hd.kind;
    if (kind < 0) break;
    const bool up = kind == 0;
    const int ks = hd.ks, nks = hd.nks, ntok = hd.ntok, nt = (ntok + 7) >> 3;
    if (ks == 0) {
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[m][j][i] = 0.f;
    }
    const uint32_t base = smem + lay.ring + stage * lay.stage_bytes;
    // The warp's stage rows of m-tile m: up, W1 rows 16 rg.. and W3 rows 64 + 16 rg..; down, 32 rg + 16 m..
    const int row0[2] = {up ? 16 * rg : 32 * rg, up ? kUpTile + 16 * rg : 32 * rg + 16};
    uint32_t a_addr[2], sw[2][2];
    bool big = false;
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      // ldmatrix: lanes 8 i .. 8 i + 7 address matrix i = rows 0-7 / 8-15 (i & 1) of chunk 4 kg + (i >> 1).
      const int r = row0[m] + (lane & 7) + 8 * ((lane >> 3) & 1);
      a_addr[m] = base + Layout::kW + static_cast<uint32_t>(r * kWPitch + 16 * (4 * kg + (lane >> 4)));
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        sw[m][h] = lds32(base + Layout::kS + static_cast<uint32_t>((row0[m] + g + 8 * h) * kSPitch + 4 * kg));
        big = big || has_big_scale(sw[m][h]);
      }
    }
    const uint32_t x_addr = base + Layout::kX + static_cast<uint32_t>(g * kXPitch + 64 * 4 * kg + 16 * t);
    if (__any_sync(0xffffffffu, big)) {
      stage_mma<true>(acc, a_addr, x_addr, sw, nt);
    } else {
      stage_mma<false>(acc, a_addr, x_addr, sw, nt);
    }

    if (ks == nks - 1) {
      // The item's end: half 1's partial sums to shared memory, half 0 adds them (fixed order) and stores.
      const int T = p.T, T8 = T / 8;
      auto part_at = [&](int m, int j, int i) -> float& {
        return part[((rg * T + (m * T8 + j) * 4 + i) * kWarp) + lane];
      };
      if (kg == 1) {
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
          for (int j = 0; j < 8; ++j)
            if (j < nt) {
#pragma unroll
              for (int i = 0; i < 4; ++i) part_at(m, j, i) = acc[m][j][i];
            }
      }
      consumer_sync();
      if (kg == 0) {
        const int n0 = hd.n0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (j >= nt) continue;
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float v0 = acc[0][j][i] + part_at(0, j, i), v1 = acc[1][j][i] + part_at(1, j, i);
            const int tok = 8 * j + 2 * t + (i & 1);
            if (tok >= ntok) continue;
            const int64_t pair = hd.pair[tok];
            const int r = g + 8 * (i >> 1);
            if (up) {
              const int n = n0 + 16 * rg + r;
              if (n < p.I)
                p.h[pair * p.I + n] = float_to_bf16(situ_dev(round_bf16_dev(v0), round_bf16_dev(v1), p.sp));
            } else {
              const int n = n0 + 32 * rg + r;
              if (n < p.L) p.o[pair * p.L + n] = float_to_bf16(v0);
              if (n + 16 < p.L) p.o[pair * p.L + n + 16] = float_to_bf16(v1);
            }
          }
        }
        if (up && p.mode == 0) {
          // Publish the item's h to the down items' bulk copies (async proxy) of other CTAs.
          fence_proxy_async();
          __threadfence();
          __syncwarp();
          if (lane == 0) atomicAdd(p.plan.slot_done + hd.slot, 1);
        }
      }
      consumer_sync();  // the partials are read before the next item's are written
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(smem + Layout::kEmpty + 8 * stage);
  }
}

// ------------------------------------------------------------------------------------------------
// Producer

// Warp-wide plain copy of `valid` bytes from src to shared dst, zero (or fill) up to `total` bytes; words
// when src and valid are 4-byte aligned (total is), else bytes. Activations written in this launch (h) must
// not take the read-only path: plain loads.
__device__ __forceinline__ void warp_copy(uint32_t dst, const unsigned char* src, int valid, int total, uint32_t fill,
                                          int lane) {
  if (((reinterpret_cast<uintptr_t>(src) | static_cast<uintptr_t>(valid)) & 3u) == 0) {
    for (int o = 4 * lane; o < total; o += 4 * kWarp)
      sts32(dst + o, o < valid ? *reinterpret_cast<const uint32_t*>(src + o) : fill * 0x01010101u);
  } else {
    for (int o = lane; o < total; o += kWarp) sts8(dst + o, o < valid ? src[o] : fill);
  }
}

__device__ __forceinline__ void producer(const Params& p, const Layout& lay, uint32_t smem, unsigned char* smem_ptr) {
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const MoePlan& pl = p.plan;
  const int n_active = __ldg(pl.n_active), n_passes = __ldg(pl.n_passes);
  const int up_tiles = (p.I + kUpTile - 1) / kUpTile, down_tiles = (p.L + kDownTile - 1) / kDownTile;
  const int64_t U = int64_t{up_tiles} * n_passes, D = int64_t{down_tiles} * n_passes;
  const int64_t q_begin = p.mode == 2 ? U : 0, q_end = p.mode == 1 ? U : U + D;
  int* counter = p.mode == 2 ? pl.next_b : pl.next_a;
  const uint32_t stages = static_cast<uint32_t>(p.stages);
  StageHeader* hdr = reinterpret_cast<StageHeader*>(smem_ptr + lay.hdr);
  int cursor_up = 0, cursor_down = 0;  // per kind: a slot at or before the next item's (items ascend per CTA)
  uint32_t f = 0;          // fill index: stage f % stages, round f / stages

  int claim = 0;
  if (lane == 0) claim = atomicAdd(counter, 1);
  for (;;) {
    const int64_t q = q_begin + __shfl_sync(0xffffffffu, claim, 0);
    if (q >= q_end) break;
    const int kind = q < U ? 0 : 1;
    const int64_t local = kind == 0 ? q : q - U;
    const int64_t nt_items = kind == 0 ? up_tiles : down_tiles;
    // The slot: the last whose items begin at or before `local` (pass offsets ascend: a prefix of ballots).
    const int cursor = kind == 0 ? cursor_up : cursor_down;
    int slot = cursor;
    for (int base = cursor;; base += kWarp) {
      const int s = base + lane;
      const int pb = s < n_active ? __ldg(pl.slot_pass_begin + s) : INT_MAX;
      const unsigned at_or_before = __ballot_sync(0xffffffffu, nt_items * pb <= local);
      if (at_or_before != 0) slot = base + __popc(at_or_before) - 1;
      if (at_or_before != 0xffffffffu || base + kWarp >= n_active) break;
    }
    (kind == 0 ? cursor_up : cursor_down) = slot;
    const int e = __ldg(pl.slot_expert + slot), begin = __ldg(pl.slot_begin + slot),
              count = __ldg(pl.slot_count + slot), pass_begin = __ldg(pl.slot_pass_begin + slot);
    const int passes = (count + p.T - 1) / p.T;
    const int64_t in_slot = local - nt_items * pass_begin;
    const int ntile = static_cast<int>(in_slot / passes), tt = static_cast<int>(in_slot % passes);
    const int ntok = min(p.T, count - tt * p.T);
    const int N = kind == 0 ? p.I : p.L, K = kind == 0 ? p.L : p.I;
    const int n0 = ntile * (kind == 0 ? kUpTile : kDownTile);
    const int nks = (K + kBK - 1) / kBK;
    // This lane's tokens (lane, lane + 32) and its stage rows (lane + 32 r).
    int pair[2];
    const unsigned char* xsrc[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int tok = lane + kWarp * u;
      pair[u] = tok < ntok ? __ldg(pl.pair_list + begin + tt * p.T + tok) : 0;
      const bf16* x = kind == 0 ? p.z + (pair[u] / p.k) * int64_t{K} : p.h + pair[u] * int64_t{K};
      xsrc[u] = reinterpret_cast<const unsigned char*>(x);
    }
    const uint8_t* const pk0 = kind == 0 ? p.ex.w1_packed[e] : p.ex.w2_packed[e];
    const uint8_t* const pk1 = kind == 0 ? p.ex.w3_packed[e] : pk0;
    const uint8_t* const sc0 = kind == 0 ? p.ex.w1_scale[e] : p.ex.w2_scale[e];
    const uint8_t* const sc1 = kind == 0 ? p.ex.w3_scale[e] : sc0;
    const uint8_t* wrow[4];
    const uint8_t* srow[4];
    bool valid[4];
    int nvalid = 0;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = lane + kWarp * r;
      const int op = kind == 0 ? row / kUpTile : 0;
      const int n = n0 + (kind == 0 ? row % kUpTile : row);
      valid[r] = n < N;
      const int64_t nn = valid[r] ? n : 0;
      wrow[r] = (op == 0 ? pk0 : pk1) + nn * (K / 2);
      srow[r] = (op == 0 ? sc0 : sc1) + nn * (K / 32);
    }
    for (int r = 0; r < kStageRows; ++r) nvalid += n0 + (kind == 0 ? r % kUpTile : r) < N;
    const bool fast = K % kBK == 0 && ((reinterpret_cast<uintptr_t>(pk0) | reinterpret_cast<uintptr_t>(pk1) |
                                        reinterpret_cast<uintptr_t>(sc0) | reinterpret_cast<uintptr_t>(sc1)) &
                                       15u) == 0;
    if (kind == 1 && p.mode == 0) {
      // The slot's up items (4 publishing warps each) are done: h is complete for its pairs.
      const int want = 4 * up_tiles * passes;
      if (lane == 0) {
        while (ld_acquire(pl.slot_done + slot) < want) __nanosleep(256);
      }
      __syncwarp();
      (void)ld_acquire(pl.slot_done + slot);
      fence_proxy_async();
    }
    const uint32_t tx = static_cast<uint32_t>(nvalid * kRowBytes + ntok * kXBytes);
    for (int ks = 0; ks < nks; ++ks, ++f) {
      // The next item is claimed two stages before this one's end: its latency hides behind the ring, and a
      // claim is never held for long while other CTAs run dry at the end of the work.
      if (ks == max(0, nks - 2) && lane == 0) claim = atomicAdd(counter, 1);
      const uint32_t stage = f % stages;
      const uint32_t full = smem + Layout::kFull + 8 * stage, empty = smem + Layout::kEmpty + 8 * stage;
      mbar_wait(empty, ((f / stages) & 1u) ^ 1u);
      StageHeader& hd = hdr[stage];
      if (lane == 0) {
        hd.kind = kind, hd.ks = ks, hd.nks = nks, hd.n0 = n0, hd.ntok = ntok, hd.slot = slot;
      }
      hd.pair[lane] = pair[0];
      hd.pair[lane + kWarp] = pair[1];
      __syncwarp();  // the slow path reads the other lanes' pair ids
      const uint32_t base = smem + lay.ring + stage * lay.stage_bytes;
      const int k0 = ks * kBK;
      if (fast) {
        __syncwarp();
        if (lane == 0) mbar_arrive_expect_tx(full, tx);
        __syncwarp();
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          if (valid[r]) {
            const uint32_t row = static_cast<uint32_t>(lane + kWarp * r);
            bulk_load(base + Layout::kW + row * kWPitch, wrow[r] + k0 / 2, kRowBytes, full);
            cp_async8(base + Layout::kS + row * kSPitch, srow[r] + k0 / 32);
          }
        }
#pragma unroll
        for (int u = 0; u < 2; ++u)
          if (lane + kWarp * u < ntok)
            bulk_load(base + Layout::kX + static_cast<uint32_t>((lane + kWarp * u) * kXPitch), xsrc[u] + 2 * k0,
                      kXBytes, full);
      } else {
        // Plain copies, past K zero (weights and activations) or 127 (scales: 1, never "big").
        const int kb = min(kBK, K - k0);
        for (int r = 0; r < kStageRows; ++r) {
          const int op = kind == 0 ? r / kUpTile : 0;
          const int n = n0 + (kind == 0 ? r % kUpTile : r);
          if (n >= N) continue;
          const uint8_t* wr = (op == 0 ? pk0 : pk1) + int64_t{n} * (K / 2) + k0 / 2;
          const uint8_t* sr = (op == 0 ? sc0 : sc1) + int64_t{n} * (K / 32) + k0 / 32;
          warp_copy(base + Layout::kW + static_cast<uint32_t>(r * kWPitch), wr, kb / 2, kRowBytes, 0, lane);
          warp_copy(base + Layout::kS + static_cast<uint32_t>(r * kSPitch), sr, kb / 32, kSPitch, 127, lane);
        }
        for (int tok = 0; tok < ntok; ++tok) {
          const int pr = hd.pair[tok];
          const bf16* x = kind == 0 ? p.z + (pr / p.k) * int64_t{K} : p.h + pr * int64_t{K};
          warp_copy(base + Layout::kX + static_cast<uint32_t>(tok * kXPitch),
                    reinterpret_cast<const unsigned char*>(x + k0), 2 * kb, kXBytes, 0, lane);
        }
        fence_proxy_async();  // these generic writes before later bulk writes to the same bytes
        __syncwarp();
        if (lane == 0) mbar_arrive(full);
      }
      cp_async_mbar_arrive(full);
    }
  }
  // No more work: one stage that says so.
  const uint32_t stage = f % stages;
  const uint32_t full = smem + Layout::kFull + 8 * stage, empty = smem + Layout::kEmpty + 8 * stage;
  mbar_wait(empty, ((f / stages) & 1u) ^ 1u);
  if (lane == 0) hdr[stage].kind = -1;
  __syncwarp();
  if (lane == 0) mbar_arrive(full);
  cp_async_mbar_arrive(full);
}

__global__ void __launch_bounds__(kThreads, 1) moe_ws_kernel(const Params p) {
  extern __shared__ __align__(128) unsigned char smem_ptr[];
  const Layout lay = layout_for(p.T, p.stages);
  const uint32_t smem = smem_u32(smem_ptr);
  if (threadIdx.x == 0) {
    for (int s = 0; s < p.stages; ++s) {
      mbar_init(smem + Layout::kFull + 8 * s, kFullArrivals);
      mbar_init(smem + Layout::kEmpty + 8 * s, kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x / kWarp == kConsumerWarps) {
    producer(p, lay, smem, smem_ptr);
  } else {
    consumer(p, lay, smem, smem_ptr);
  }
}

}  // namespace

int moe_token_tile(int64_t pairs, int64_t max_slots) {
  const int64_t mean = max_slots > 0 ? (pairs + max_slots - 1) / max_slots : 1;
  const int64_t want = mean + mean / 2;
  return static_cast<int>(std::min<int64_t>(kMaxTok, std::max<int64_t>(8, (want + 7) / 8 * 8)));
}

int moe_expert_gemms(const MoePlan& plan, const Mxfp4ExpertTable& ex, const bf16* z, bf16* h, bf16* o, int k,
                     int64_t L, int64_t I, int T, SituParams sp, int sms, CUstream_st* stream) {
  if (T < 8 || T > kMaxTok || T % 8 != 0) return cudaErrorInvalidValue;
  if (const cudaError_t e = allow_optin_smem<moe_ws_kernel>(); e != cudaSuccess) return e;
  static int optin[64] = {};
  int dev = 0;
  if (const cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  if (dev < 0 || dev >= 64) return cudaErrorInvalidDevice;
  if (optin[dev] == 0) {
    int v = 0;
    if (const cudaError_t e = cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev); e != cudaSuccess)
      return e;
    optin[dev] = v;
  }
  const Layout l1 = layout_for(T, 1);
  const int fit = static_cast<int>((static_cast<int64_t>(optin[dev]) - l1.ring) / l1.stage_bytes);
  const int stages = std::min(kMaxStages, fit);
  if (stages < 2) return cudaErrorInvalidConfiguration;
  const uint32_t bytes = layout_for(T, stages).total;
  static const bool split = [] {
    const char* v = std::getenv("K3_MOE_SPLIT_LAUNCH");
    return v != nullptr && v[0] == '1';
  }();
  Params p{plan, ex, z, h, o, k, static_cast<int>(L), static_cast<int>(I), T, stages, 0, sp};
  const unsigned grid = static_cast<unsigned>(std::max(1, sms));
  for (int mode : split ? std::initializer_list<int>{1, 2} : std::initializer_list<int>{0}) {
    p.mode = mode;
    moe_ws_kernel<<<grid, kThreads, bytes, stream>>>(p);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace k3::ops::cuda::detail
