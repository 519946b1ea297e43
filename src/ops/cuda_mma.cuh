// Tensor-core device helpers of the CUDA ops in this folder (included by .cu files only, C++17):
// mma.sync m16n8k16 (BF16 in, FP32 accumulate), ldmatrix of four 8x8 b16 matrices from shared
// memory (plain and transposed), and the 32-bit load of two adjacent BF16 as one fragment register.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace k3::ops::cuda::detail {

// Tensor cores: D += A B (mma.sync m16n8k16, BF16 in, FP32 accumulate). Fragments, g = lane / 4,
// t = lane % 4: A 16x16 row-major (a0: row g, k 2t..2t+1; a1: row g+8; a2: row g, k 2t+8..; a3: row g+8,
// k 2t+8..), B 16x8 (b0: k 2t..2t+1, col g; b1: k 2t+8..), D (c0, c1: row g, cols 2t, 2t+1; c2, c3: row g+8).
__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Four 8x8 b16 matrices; lanes 8i .. 8i+7 give the row addresses of matrix i, register i is matrix i
// (thread t: row t / 4, elements 2 (t % 4), +1; .trans: elements [2 (t % 4)][t / 4], [2 (t % 4) + 1][t / 4]).
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// Two adjacent BF16 (p 4-byte aligned) as one 32-bit fragment register, element 0 in the low half.
__device__ __forceinline__ uint32_t ld_u32(const __nv_bfloat16* p) { return *reinterpret_cast<const uint32_t*>(p); }

}  // namespace k3::ops::cuda::detail
