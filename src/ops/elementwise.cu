// CUDA kernels of the small elementwise ops (math in ops/elementwise.h): gate_sigmoid, to_bf16 and
// scale (grid-stride loops, one value per thread), cache_write (one CTA per row: the optional RMSNorm of
// its first norm_cols columns, w * bf16(v / rms), then the row into its paged-cache slot) and
// remap_experts (the bench's loopback routing).
#include <cuda_bf16.h>

#include "ops/cuda_device.cuh"
#include "ops/elementwise.h"

namespace k3::ops::cuda {

namespace {

__device__ __forceinline__ float ld(const bf16* p, int64_t i) {
  return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(p)[i]);
}
__device__ __forceinline__ void st(bf16* p, int64_t i, float v) {
  reinterpret_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
}

__global__ void gate_sigmoid_kernel(const bf16* o, const bf16* g, bf16* out, int64_t n) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    st(out, i, ld(o, i) * detail::sigmoid(ld(g, i)));
}
__global__ void to_bf16_kernel(const float* x, bf16* out, int64_t n) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    st(out, i, x[i]);
}
__global__ void scale_kernel(float* x, float s, int64_t n) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    x[i] *= s;
}

// One block per row: optional RMSNorm of the first norm_cols columns, then the row into its page.
__global__ void cache_write_kernel(const bf16* x, int64_t ldx, int64_t width, const bf16* norm_w, int64_t norm_cols,
                                   float eps, const int32_t* pos0, int q_len, const int32_t* tables, int max_pages,
                                   int page_size, int dcp_size, int dcp_rank, bf16* pool) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  const int64_t r = blockIdx.x;
  const int b = static_cast<int>(r / q_len);
  const int64_t pos = pos0[b] + r % q_len;
  if (pos % dcp_size != dcp_rank) return;
  const int64_t local = pos / dcp_size;
  bf16* dst = pool + (static_cast<int64_t>(tables[b * max_pages + local / page_size]) * page_size +
                      local % page_size) * width;
  const bf16* src = x + r * ldx;
  __shared__ float part[32];
  float inv = 1.0f;
  if (norm_w) {
    float s = 0.0f;
    for (int64_t i = threadIdx.x; i < norm_cols; i += blockDim.x) {
      const float v = ld(src, i);
      s += v * v;
    }
    s = detail::warp_sum(s);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x < 32) {
      float t = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0.0f;
      t = detail::warp_sum(t);
      if (threadIdx.x == 0) part[0] = t;
    }
    __syncthreads();
    inv = rsqrtf(part[0] / static_cast<float>(norm_cols) + eps);
  }
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
    float v = ld(src, i);
    if (norm_w && i < norm_cols) {
      // RMSNorm(v; w) = w * bf16(v / rms), rounded (ops/rmsnorm.h).
      const float n = __bfloat162float(__float2bfloat16_rn(v * inv));
      v = ld(norm_w, i) * n;
    }
    st(dst, i, v);
  }
}

__global__ void remap_kernel(int32_t* idx, int64_t n, int begin, int count) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    idx[i] = begin + (idx[i] % count + count) % count;
}

int grid(int64_t n) { return static_cast<int>(std::min<int64_t>((n + 255) / 256, 4096)); }

}  // namespace

int gate_sigmoid(const bf16* o, const bf16* gate, bf16* out, int64_t n, CUstream_st* stream) {
  if (n == 0) return 0;
  return static_cast<int>(detail::launch(gate_sigmoid_kernel, grid(n), 256, 0, stream, o, gate, out, n));
}
int to_bf16(const float* x, bf16* out, int64_t n, CUstream_st* stream) {
  if (n == 0) return 0;
  return static_cast<int>(detail::launch(to_bf16_kernel, grid(n), 256, 0, stream, x, out, n));
}
int scale(float* x, float s, int64_t n, CUstream_st* stream) {
  if (n == 0) return 0;
  return static_cast<int>(detail::launch(scale_kernel, grid(n), 256, 0, stream, x, s, n));
}
int cache_write(const bf16* x, int64_t ldx, int64_t width, const bf16* norm_w, int64_t norm_cols, float eps,
                const int32_t* pos0, int B, int q_len, const int32_t* block_tables, int max_pages, int page_size,
                int dcp_size, int dcp_rank, bf16* pool, CUstream_st* stream) {
  const int64_t rows = int64_t{B} * q_len;
  if (rows == 0) return 0;
  return static_cast<int>(detail::launch(cache_write_kernel, static_cast<unsigned>(rows), 256, 0, stream, x, ldx, width,
                                         norm_w, norm_cols, eps, pos0, q_len, block_tables, max_pages, page_size,
                                         dcp_size, dcp_rank, pool));
}

}  // namespace k3::ops::cuda

namespace k3::ops::cuda {
int remap_experts(int32_t* idx, int64_t n, int begin, int count, CUstream_st* stream) {
  if (n == 0) return 0;
  return static_cast<int>(detail::launch(remap_kernel, grid(n), 256, 0, stream, idx, n, begin, count));
}
}  // namespace k3::ops::cuda
