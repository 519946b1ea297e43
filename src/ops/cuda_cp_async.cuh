// cp.async device helpers of the CUDA ops in this folder (included by .cu files only, C++17):
// 16-byte asynchronous copies global -> shared (zero-filled when the source is not valid), their
// commit groups and the waits on them.
#pragma once

#include <cuda_runtime.h>

namespace k3::ops::cuda::detail {

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
// Waits for every cp.async copy of this thread, the ones not yet committed included (wait_all commits
// them first; cp_async_wait<0> leaves uncommitted copies pending).
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

}  // namespace k3::ops::cuda::detail
