// Bench-only kernels: a read-only streaming kernel (the HBM bandwidth the
// floors are measured against) and a deterministic random fill.
#include <cuda_bf16.h>

#include <cstdint>

#include "bench/kernels.h"

namespace k3::bench {

namespace {

__global__ void stream_read_kernel(const uint4* p, int64_t n, unsigned* sink) {
  uint32_t acc = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    uint4 v = __ldcs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;  // keeps the loads; practically never taken
}

__device__ uint32_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}

// kind 0: BF16 uniform [center - half, center + half]; 1: F32 the same; 2: bytes (MXFP4 codes);
// 3: E8M0 scales around 2^-3.
__global__ void fill_kernel(void* p, int64_t n, int kind, float center, float half, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const uint32_t r = mix(seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(i));
    const float u = (r >> 8) * (1.0f / 16777216.0f) * 2.0f - 1.0f;
    if (kind == 0)
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(center + half * u);
    else if (kind == 1)
      static_cast<float*>(p)[i] = center + half * u;
    else if (kind == 2)
      static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(r);
    else
      static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(120 + (r % 4));
  }
}

}  // namespace

int stream_read(const void* p, size_t bytes, unsigned* sink, int sms, cudaStream_t s) {
  stream_read_kernel<<<sms * 8, 512, 0, s>>>(static_cast<const uint4*>(p), static_cast<int64_t>(bytes / 16), sink);
  return static_cast<int>(cudaGetLastError());
}

int fill(void* p, int64_t n, int kind, float center, float half, uint64_t seed, cudaStream_t s) {
  if (n == 0) return 0;
  fill_kernel<<<4096, 256, 0, s>>>(p, n, kind, center, half, seed);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace k3::bench
