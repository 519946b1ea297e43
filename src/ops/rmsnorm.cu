// CUDA RMSNorm and LayerNorm (math in rmsnorm.h). One CTA per row; each thread owns the same
// chunks of the row (8 bf16 = one 16-byte vector when dim % 8 == 0 and the pointers are aligned,
// else single elements) in every pass, so out may alias x. Sums are FP32 block reductions; the
// roundings are the CPU's: bf16(x * inv) before the weight, bf16 of the result. RMSNorm's row pass
// lives in rmsnorm.cuh, shared with the kernels that end in it (RowNorm).
#include "ops/cuda_bf16.cuh"
#include "ops/cuda_device.cuh"
#include "ops/rmsnorm.cuh"
#include "ops/rmsnorm.h"

namespace k3::ops::cuda {
namespace {

using detail::aligned16;
using detail::kNormMaxThreads;
using detail::kWarp;
using detail::norm_threads;

template <typename W, int VEC>
__global__ void __launch_bounds__(kNormMaxThreads)
    rmsnorm_kernel(const bf16* x, const W* __restrict__ w, bf16* out, int64_t dim, float eps) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  __shared__ float red[kWarp];
  const bf16* xr = x + blockIdx.x * dim;
  bf16* yr = out + blockIdx.x * dim;
  const int64_t chunks = dim / VEC;
  float ss = 0.f;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float v[VEC];
    detail::load_bf16<VEC>(xr + c * VEC, v);
    detail::norm_square_sum<VEC>(v, ss);
  }
  detail::rmsnorm_row_apply<W, VEC>(xr, w, yr, dim, eps, ss, red);
}

template <int VEC>
__global__ void __launch_bounds__(kNormMaxThreads)
    layernorm_kernel(const bf16* x, const bf16* __restrict__ w, const bf16* __restrict__ b, bf16* out, int64_t dim,
                     float eps) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  __shared__ float red[kWarp];
  const bf16* xr = x + blockIdx.x * dim;
  bf16* yr = out + blockIdx.x * dim;
  const int64_t chunks = dim / VEC;
  float sum = 0.f;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float v[VEC];
    detail::load_bf16<VEC>(xr + c * VEC, v);
#pragma unroll
    for (int i = 0; i < VEC; ++i) sum += v[i];
  }
  const float mu = detail::block_sum(sum, red) / static_cast<float>(dim);
  float sq = 0.f;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float v[VEC];
    detail::load_bf16<VEC>(xr + c * VEC, v);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const float d = v[i] - mu;
      sq = fmaf(d, d, sq);
    }
  }
  sq = detail::block_sum(sq, red);
  const float inv = 1.0f / sqrtf(sq / static_cast<float>(dim) + eps);
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float v[VEC], wv[VEC], bv[VEC];
    detail::load_bf16<VEC>(xr + c * VEC, v);
    detail::load_bf16<VEC>(w + c * VEC, wv);
    detail::load_bf16<VEC>(b + c * VEC, bv);
    // Unfused, as the CPU: w * ((x - mu) * inv) + b.
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] = __fadd_rn(__fmul_rn(wv[i], __fmul_rn(__fsub_rn(v[i], mu), inv)), bv[i]);
    detail::store_bf16<VEC>(yr + c * VEC, v);
  }
}

bool bad_shape(int64_t rows, int64_t dim) { return rows < 0 || dim <= 0 || rows > 0x7fffffff; }

template <typename W>
int rmsnorm_launch(const bf16* x, const W* w, bf16* out, int64_t rows, int64_t dim, float eps, cudaStream_t s) {
  if (bad_shape(rows, dim)) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const bool vec = dim % 8 == 0 && aligned16(x) && aligned16(w) && aligned16(out);
  const auto grid = static_cast<unsigned>(rows);
  if (vec) return detail::launch(rmsnorm_kernel<W, 8>, grid, norm_threads(dim / 8), 0, s, x, w, out, dim, eps);
  return detail::launch(rmsnorm_kernel<W, 1>, grid, norm_threads(dim), 0, s, x, w, out, dim, eps);
}

}  // namespace

int rmsnorm(const bf16* x, const bf16* w, bf16* out, int64_t rows, int64_t dim, float eps, CUstream_st* stream) {
  return rmsnorm_launch(x, w, out, rows, dim, eps, stream);
}

int rmsnorm(const bf16* x, const float* w, bf16* out, int64_t rows, int64_t dim, float eps, CUstream_st* stream) {
  return rmsnorm_launch(x, w, out, rows, dim, eps, stream);
}

int layernorm(const bf16* x, const bf16* w, const bf16* b, bf16* out, int64_t rows, int64_t dim, float eps,
              CUstream_st* stream) {
  if (bad_shape(rows, dim)) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const bool vec = dim % 8 == 0 && aligned16(x) && aligned16(w) && aligned16(b) && aligned16(out);
  const auto grid = static_cast<unsigned>(rows);
  if (vec) return detail::launch(layernorm_kernel<8>, grid, norm_threads(dim / 8), 0, stream, x, w, b, out, dim, eps);
  return detail::launch(layernorm_kernel<1>, grid, norm_threads(dim), 0, stream, x, w, b, out, dim, eps);
}

}  // namespace k3::ops::cuda
