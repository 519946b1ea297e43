// Device helpers of the CUDA ops in this folder (included by .cu files only, C++17):
// BF16 <-> FP32 for one value or a 16-byte vector of 8, warp and block sums, and the
// host-side alignment test that picks the vectorized kernels.
//
// Loads here are plain (coherent) loads: data a kernel writes and reads back (attn_res's
// prefix, rmsnorm in place) must not go through the read-only cache. Kernels that stream
// read-only weights use __ldg themselves.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "core/bf16.h"

namespace k3::ops::cuda::detail {

constexpr int kWarp = 32;

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

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

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum of v over the block; every thread gets the total. Every thread of the block must call it;
// red is a __shared__ float[32]. Ends with a barrier, so red may be reused at once.
__device__ __forceinline__ float block_sum(float v, float* red) {
  v = warp_sum(v);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  const int warps = (blockDim.x + kWarp - 1) / kWarp;
  float t = 0.f;
  for (int i = 0; i < warps; ++i) t += red[i];
  __syncthreads();
  return t;
}

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

// 16 bytes global -> shared, asynchronous; zero-filled (nothing read) when !valid.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N committed groups of this thread's cp.async copies are pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// SMs of the current device (host; queried once per device, 132 if the query fails): the one source of
// the SM count (Context::sm_count is set from it).
inline int device_sm_count() {
  static int sms[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) dev = 0;
  if (sms[dev] <= 0 && cudaDeviceGetAttribute(&sms[dev], cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    sms[dev] = 132;
  return sms[dev];
}

// Lets Kernel take all the dynamic shared memory the device allows a CTA (the opt-in maximum less the
// kernel's static shared memory), set once per device; with max_carveout, the SM's carveout preferred for
// shared memory too. The one way a launcher raises the limit: it admits a launch, and a launch's shared
// memory is still what it asks for. (Set per launch to the launch's own size, it raced between concurrent
// launchers, ranks as threads on one GPU: a smaller setting in between failed a larger launch with
// cudaErrorInvalidValue.)
template <auto Kernel>
cudaError_t allow_optin_smem(bool max_carveout = false) {
  static std::atomic<uint64_t> done{0};
  int dev = 0, optin = 0;
  if (const cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  const uint64_t bit = dev >= 0 && dev < 64 ? uint64_t{1} << dev : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  cudaFuncAttributes fa{};
  if (const cudaError_t e = cudaFuncGetAttributes(&fa, Kernel); e != cudaSuccess) return e;
  if (const cudaError_t e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
      e != cudaSuccess)
    return e;
  const int dyn = optin - static_cast<int>(fa.sharedSizeBytes);
  if (const cudaError_t e = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dyn);
      e != cudaSuccess)
    return e;
  if (max_carveout) {
    if (const cudaError_t e =
            cudaFuncSetAttribute(Kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
        e != cudaSuccess)
      return e;
  }
  done.fetch_or(bit, std::memory_order_acq_rel);
  return cudaSuccess;
}

// The 32-bit shared-window address of a pointer into shared memory.
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
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

}  // namespace k3::ops::cuda::detail
