// BF16 device helpers of the CUDA ops in this folder (included by .cu files only, C++17):
// BF16 <-> FP32 for one value or a 16-byte vector of 8 (round to nearest even, as the CPU's
// to_bf16), and the packing of two BF16 into a 32-bit word (the low half at the lower address).
//
// Loads here are plain (coherent) loads: data a kernel writes and reads back (attn_res's
// prefix, rmsnorm in place) must not go through the read-only cache. Kernels that stream
// read-only weights use __ldg themselves.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/bf16.h"

namespace k3::ops::cuda::detail {

__device__ __forceinline__ float bf16_to_float(uint16_t bits) { return __uint_as_float(static_cast<uint32_t>(bits) << 16); }
__device__ __forceinline__ float bf16_to_float(k3::bf16 v) { return bf16_to_float(v.bits); }

// Round to nearest even (the CPU's to_bf16 for every finite value and infinity).
__device__ __forceinline__ uint16_t float_to_bf16_bits(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }
__device__ __forceinline__ k3::bf16 float_to_bf16(float f) { return k3::bf16{float_to_bf16_bits(f)}; }

// FP32 -> the nearest BF16 value, as an FP32 (the BF16 rounding points of the math).
__device__ __forceinline__ float round_bf16_dev(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// Two floats -> a 32-bit word of two bf16 (lo in the low half, the lower address).
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  return static_cast<uint32_t>(float_to_bf16_bits(lo)) | (static_cast<uint32_t>(float_to_bf16_bits(hi)) << 16);
}

// The 8 bf16 of a 16-byte vector -> 8 floats (exact), element 0 first.
__device__ __forceinline__ void unpack_bf16x8(const uint4& v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ uint4 pack_bf16x8(const float (&f)[8]) {
  uint4 v;
  v.x = pack_bf16x2(f[0], f[1]);
  v.y = pack_bf16x2(f[2], f[3]);
  v.z = pack_bf16x2(f[4], f[5]);
  v.w = pack_bf16x2(f[6], f[7]);
  return v;
}

// VEC consecutive bf16 at p -> floats. VEC = 8 needs p 16-byte aligned; VEC = 1 is scalar.
template <int VEC>
__device__ __forceinline__ void load_bf16(const k3::bf16* p, float (&f)[VEC]) {
  static_assert(VEC == 1 || VEC == 8, "VEC is 1 or 8");
  if constexpr (VEC == 8) {
    unpack_bf16x8(*reinterpret_cast<const uint4*>(p), f);
  } else {
    f[0] = bf16_to_float(p->bits);
  }
}

// floats -> VEC consecutive bf16 at p, each rounded to nearest even.
template <int VEC>
__device__ __forceinline__ void store_bf16(k3::bf16* p, const float (&f)[VEC]) {
  static_assert(VEC == 1 || VEC == 8, "VEC is 1 or 8");
  if constexpr (VEC == 8) {
    *reinterpret_cast<uint4*>(p) = pack_bf16x8(f);
  } else {
    p->bits = float_to_bf16_bits(f[0]);
  }
}

}  // namespace k3::ops::cuda::detail
