// Device pieces shared by the routed-expert kernels (moe_experts.cu, moe_experts_wg.cu; C++17): the
// routing plan in scratch, the E2M1 lookup table and the MXFP4 load and scale helpers, and the entry of
// the warp-specialized wgmma path (moe_experts_wg.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda_device.cuh"
#include "ops/moe.h"

namespace k3::ops::cuda::moe_detail {

using detail::kWarp;

// The routing plan in scratch (int32): n_active, n_passes, then [pairs] each of slot_expert, slot_begin,
// slot_count, slot_pass_begin (slots of the experts in use, ascending expert; the exclusive prefix of their
// passes of `cols` token columns, n_passes the total) and pair_list (pair ids grouped by slot).
struct Plan {
  int* n_active;
  int* n_passes;
  int* slot_expert;
  int* slot_begin;
  int* slot_count;
  int* slot_pass_begin;
  int* pair_list;
};

constexpr int kPlanHeader = 2;
constexpr int kPlanArrays = 5;
static_assert(kPlanHeader == 2 && kPlanArrays == 5, "moe_experts_scratch_bytes (moe.h) sizes the plan as [2 + 5 pairs]");
__host__ __device__ inline Plan plan_at(void* scratch, int64_t pairs) {
  int* m = static_cast<int*>(scratch);
  int* a = m + kPlanHeader;
  return Plan{m, m + 1, a, a + pairs, a + 2 * pairs, a + 3 * pairs, a + 4 * pairs};
}

// E2M1 decoding by table: a byte (two E2M1 nibbles, low nibble first) -> BF16x2 (the low nibble's value
// in the low half), exact: magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 as BF16, the nibble's bit 3 as the sign.
// The 256 entries live in shared memory with one copy per lane: row b (256 bytes) holds entry b in words
// 0..31, word l read only by lane l (bank l: lookups never conflict). One lookup decodes two values with
// one byte permute (byte p of the weights next to the lane's 4 l: the row offset b * 256 + 4 l) and one
// load, which adds the table's address from a uniform register. (Bit manipulation took ~20 integer instructions
// per 8 values; a 128-byte row needed a shift and a LOP3 per lookup: 8 instructions per 2 values in all.)
// Words 32..63 of the rows (32 KiB, "the holes") hold each kernel's other shared data: 128-byte pieces,
// piece i at byte 256 i + 128 of the kernel's dynamic shared memory.
constexpr int kLutEntries = 256;
constexpr int kLutRowBytes = 256;
constexpr size_t kLutBytes = size_t{kLutEntries} * kLutRowBytes;  // 64 KiB: the kernels' dynamic shared memory

__device__ __forceinline__ uint32_t e2m1_bits(uint32_t nibble) {
  const uint32_t c = nibble & 7;  // BF16 of 0, .5, 1, 1.5, 2, 3, 4, 6: 0000 3F00 3F80 3FC0 4000 4040 4080 40C0
  const uint32_t mag = c == 0 ? 0u : c == 1 ? 0x3F00u : 0x3F00u + ((c >> 1) << 7) + ((c & 1) << 6);
  return mag | ((nibble & 8) ? 0x8000u : 0u);
}

__device__ __forceinline__ uint32_t e2m1_pair_bits(uint32_t byte) {
  return e2m1_bits(byte & 15) | (e2m1_bits(byte >> 4) << 16);
}

// Every thread of the CTA fills the table at the start of its dynamic shared memory, then one barrier:
// row b's 32 words are all entry b, stored 16 bytes at a time (one entry computed per store; an entry
// computed per 4-byte word made the fill a visible share of a small kernel).
__device__ __forceinline__ void fill_lut(unsigned char* smem) {
  constexpr int kPerRow = kWarp * 4 / 16;  // 16-byte stores per row
  for (int i = threadIdx.x; i < kLutEntries * kPerRow; i += blockDim.x) {
    const uint32_t e = e2m1_pair_bits(static_cast<uint32_t>(i / kPerRow));
    *reinterpret_cast<uint4*>(smem + (i / kPerRow) * kLutRowBytes + 16 * (i % kPerRow)) = make_uint4(e, e, e, e);
  }
  __syncthreads();
}

// Byte offset of byte o of a kernel's hole data (o < 32 KiB).
__host__ __device__ constexpr uint32_t hole_offset(uint32_t o) {
  return (o >> 7) * kLutRowBytes + 128 + (o & 127);
}

// A 32-bit load from the shared-memory address base + off, base the table's (the same for every thread, so
// the compiler keeps it in a uniform register that the load adds: LDS [R + UR], one permute and one load
// per lookup; through a generic pointer it added an IADD per lookup).
__device__ __forceinline__ uint32_t lds_u32(uint32_t base, uint32_t off) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(base + off));
  return v;
}

// 8 E2M1 nibbles of w (nibble i = value i) -> 4 BF16x2 words (word p = values 2p, 2p+1), from the lane's
// column of the table (lut: the table's shared-memory address; lane4 = 4 * lane, the column's byte
// offset): the permute puts lane4 in byte 0 and byte p of w in byte 1 of the offset (selector nibbles 4,
// p, 5, 5; byte 5 is lane4's zero byte 1).
__device__ __forceinline__ void e2m1x8_to_bf16x8(uint32_t lut, uint32_t lane4, uint32_t w, uint32_t (&out)[4]) {
  out[0] = lds_u32(lut, __byte_perm(w, lane4, 0x5504u));
  out[1] = lds_u32(lut, __byte_perm(w, lane4, 0x5514u));
  out[2] = lds_u32(lut, __byte_perm(w, lane4, 0x5524u));
  out[3] = lds_u32(lut, __byte_perm(w, lane4, 0x5534u));
}

// E8M0 scale byte s -> 2^(s - 127) as BF16x2 (both halves): s << 7 is that BF16 for s in 1..255 (255:
// inf, as ldexp on the CPU); s = 0 is the subnormal 2^-127. kNoScale (the scale slot of a lane group past
// K) gives zero: the decoded values are multiplied by zero.
constexpr uint32_t kNoScale = 0xFFFFFFFFu;
__device__ __forceinline__ __nv_bfloat162 e8m0_or_zero(uint32_t s) {
  const uint32_t b = max(s << 7, 0x0040u);  // s >= 1: s << 7 (>= 0x80); s = 0: 0x40
  const uint32_t w = s == kNoScale ? 0u : b * 0x10001u;
  return *reinterpret_cast<const __nv_bfloat162*>(&w);
}

__device__ __forceinline__ uint32_t scale_bf16x2(uint32_t v, __nv_bfloat162 s) {
  __nv_bfloat162 x = *reinterpret_cast<const __nv_bfloat162*>(&v);
  x = __hmul2(x, s);  // a power of two: exact
  return *reinterpret_cast<const uint32_t*>(&x);
}

// A 16-byte read-only load that asks L2 to fetch the surrounding 256 bytes: a weight row is read in
// 64-byte steps, so the next three chunks of the row are on their way when this one arrives.
__device__ __forceinline__ uint4 ldg_l2_256(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// The warp-specialized path (moe_experts_wg.cu): decoder warps turn MXFP4 into BF16 tiles in shared
// memory, one warpgroup runs wgmma on them. Token columns per pass (the plan's `cols`).
constexpr int kWgCols = 32;
// Whether the shapes suit it: K and N of both GEMMs multiples of 64 (L and I).
inline bool moe_wg_supported(int64_t L, int64_t I) { return L > 0 && I > 0 && L % 64 == 0 && I % 64 == 0; }
// UP: h[pair, n] = bf16(situ(bf16(W1 x), bf16(W3 x))) (x = z rows pair / k, K = L, N = I); DOWN:
// o[pair, n] = bf16(W2 x) (x = h rows, K = I, N = L), over a plan made with cols = kWgCols. Returns
// cudaErrorNotSupported before launching anything when K or N is not a multiple of 64.
int moe_wg_launch(bool up, const bf16* x, const Plan& plan, const Mxfp4ExpertTable& ex, bf16* out, int k, int64_t K,
                  int64_t N, int64_t max_slots, int64_t pairs, SituParams sp, int sms, cudaStream_t s);

}  // namespace k3::ops::cuda::moe_detail
