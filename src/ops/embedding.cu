// CUDA embedding lookup: out[r, :] = table[ids[r], :], BF16 copied bit for bit. One CTA per row,
// 16-byte vectors when dim % 8 == 0 and both pointers are aligned. The host checks the ids before
// the launch (embedding.h); an id outside [0, vocab) here is a broken contract and traps.
#include <algorithm>

#include "core/cuda.h"
#include "ops/cuda_device.cuh"
#include "ops/embedding.h"

namespace k3::ops::cuda {
namespace {

using detail::aligned16;
using detail::kWarp;

constexpr int kEmbThreads = 256;

template <int VEC>
__global__ void __launch_bounds__(kEmbThreads)
    embedding_kernel(const int32_t* __restrict__ ids, const bf16* __restrict__ table, int64_t vocab, int64_t dim,
                     bf16* __restrict__ out) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  const int64_t r = blockIdx.x;
  const int32_t id = ids[r];
  K3_DEVICE_ASSERT(id >= 0 && id < vocab);
  const bf16* src = table + static_cast<int64_t>(id) * dim;
  bf16* dst = out + r * dim;
  const int64_t chunks = dim / VEC;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    if constexpr (VEC == 8) {
      reinterpret_cast<uint4*>(dst)[c] = __ldg(reinterpret_cast<const uint4*>(src) + c);
    } else {
      dst[c] = src[c];
    }
  }
}

}  // namespace

int embedding(const int32_t* ids, int64_t rows, const bf16* table, int64_t vocab, int64_t dim, bf16* out,
              CUstream_st* stream) {
  if (rows < 0 || vocab <= 0 || dim <= 0 || rows > 0x7fffffff) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const bool vec = dim % 8 == 0 && aligned16(table) && aligned16(out);
  const int64_t chunks = vec ? dim / 8 : dim;
  const auto threads =
      static_cast<unsigned>(std::max<int64_t>(kWarp, std::min<int64_t>(kEmbThreads, (chunks + kWarp - 1) / kWarp * kWarp)));
  const auto grid = static_cast<unsigned>(rows);
  if (vec) return detail::launch(embedding_kernel<8>, grid, threads, 0, stream, ids, table, vocab, dim, out);
  return detail::launch(embedding_kernel<1>, grid, threads, 0, stream, ids, table, vocab, dim, out);
}

}  // namespace k3::ops::cuda
