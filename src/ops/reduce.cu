// CUDA rank-order sums (ops/reduce.h): one thread per element, the parts read in
// rank order with __fadd_rn (no contraction, the CPU reference's exact sums).
#include <algorithm>

#include "core/cuda.h"
#include "ops/cuda_bf16.cuh"
#include "ops/cuda_device.cuh"
#include "ops/reduce.h"

namespace k3::ops::cuda {
namespace {

template <typename T>
struct Parts {
  const T* p[kReduceMaxParts];
};

__device__ __forceinline__ float load(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load(const bf16* p, int64_t i) { return detail::bf16_to_float(p[i]); }
__device__ __forceinline__ void store(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store(bf16* p, int64_t i, float v) { p[i] = detail::float_to_bf16(v); }

template <typename T>
__global__ void reduce_sum_kernel(Parts<T> parts, int n, T* out, int64_t count) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    float s = 0.0f;
    for (int p = 0; p < n; ++p) s = __fadd_rn(s, load(parts.p[p], i));
    store(out, i, s);
  }
}

template <typename T>
int launch(const T* const* parts, int n, T* out, int64_t count, CUstream_st* stream) {
  if (n < 1 || n > kReduceMaxParts || count < 0) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  Parts<T> ps{};
  for (int p = 0; p < n; ++p) ps.p[p] = parts[p];
  constexpr int kThreads = 256;
  const auto grid = static_cast<unsigned>(std::min<int64_t>((count + kThreads - 1) / kThreads, 4096));
  return detail::launch(reduce_sum_kernel<T>, grid, kThreads, 0, stream, ps, n, out, count);
}

}  // namespace

int reduce_sum_f32(const float* const* parts, int n, float* out, int64_t count, CUstream_st* stream) {
  return launch(parts, n, out, count, stream);
}
int reduce_sum_bf16(const bf16* const* parts, int n, bf16* out, int64_t count, CUstream_st* stream) {
  return launch(parts, n, out, count, stream);
}

}  // namespace k3::ops::cuda
