// Device-side basics of the CUDA ops in this folder (included by .cu files only, C++17): the warp
// size, warp and block sums (butterfly shuffles: every lane gets the total), the sigmoid, the
// host-side alignment test that picks the vectorized kernels, the 32-bit shared-window address of a
// pointer, the SM count of the device, the one way a launcher raises a kernel's dynamic
// shared-memory limit, the last-CTA-arrives handoff of kernels that split a row over CTAs, and
// programmatic dependent launch (the device-side wait and trigger, the one launcher of every kernel).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <utility>

#include "core/env.h"

namespace k3::ops::cuda::detail {

constexpr int kWarp = 32;

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Sum of v over the warp (xor butterfly, offsets 16, 8, 4, 2, 1); every lane gets the total.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Max of v over the block (fmaxf: a NaN never wins); every thread gets it. Every thread of the block must
// call it; red is a __shared__ float[32]. Ends with a barrier, so red may be reused at once.
__device__ __forceinline__ float block_max(float v, float* red) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  const int warps = (blockDim.x + kWarp - 1) / kWarp;
  float m = -INFINITY;
  for (int i = 0; i < warps; ++i) m = fmaxf(m, red[i]);
  __syncthreads();
  return m;
}

// Whether this CTA is the last of `ctas` to arrive at `counter` (a global counter at 0 before the first);
// the last one may then read what the others wrote before arriving, and resets the counter for the next
// use. No CTA waits for another. Every thread calls it after its writes; ends with a barrier. flag: a
// __shared__ int for the broadcast.
__device__ __forceinline__ bool last_cta_arrives(unsigned* counter, int ctas, int& flag) {
  __threadfence();  // this thread's writes before the counter
  __syncthreads();
  if (threadIdx.x == 0) {
    const bool last = atomicAdd(counter, 1u) == static_cast<unsigned>(ctas - 1);
    if (last) atomicExch(counter, 0u);  // every CTA has arrived: ready for the next use
    flag = last;
  }
  __syncthreads();
  const bool last = flag != 0;
  if (last) __threadfence();  // the others' writes after the counter
  return last;
}

// 1 / (1 + e^-x) in FP32 with expf, the CPU reference's expression.
__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

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

// The 32-bit shared-window address of a pointer into shared memory.
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
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

// Programmatic dependent launch (Hopper): a kernel launched by launch() below may start while the kernel
// before it in the stream still runs, so that its launch and CTA scheduling overlap that kernel's tail.
// Every kernel therefore begins with pdl_wait(), which returns once the grids it depends on have
// completed and their writes are visible; before it, a kernel may read only data that no kernel of the
// step writes (the weights) or set up what reads nothing (the MoE kernels fill their E2M1 table there).
// It then calls pdl_launch_dependents() at once, so that its own successor is
// launched while it runs; the successor's wait still holds it until this grid completes. Both are no-ops
// below sm_90 and in a kernel launched without the attribute.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// Whether launches carry the programmatic-serialization attribute: on unless K3_PDL=0 in the environment
// (read once; A/B runs of the step compare the two in separate processes).
inline bool pdl_enabled() {
  static const bool on = env_int("K3_PDL", 0, 1, 1) == 1;
  return on;
}

// The launch attribute that lets a kernel start before the previous one in its stream completes.
inline cudaLaunchAttribute pdl_attribute() {
  cudaLaunchAttribute a = {};
  a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a.val.programmaticStreamSerializationAllowed = pdl_enabled() ? 1 : 0;
  return a;
}

// The one launcher of the kernels in this folder: the triple-chevron launch of kernel (grid, block, smem,
// stream s) with pdl_attribute(), the arguments converted to the kernel's parameter types as that launch
// converts them. Returns the launch's error, else an earlier one still pending (what cudaGetLastError
// after the chevron launch returned), and clears the pending error as that did.
template <typename... KArgs, typename... Args>
cudaError_t launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, Args&&... args) {
  static_assert(sizeof...(KArgs) == sizeof...(Args), "launch: one argument per kernel parameter");
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[1] = {pdl_attribute()};
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  const cudaError_t last = cudaGetLastError();
  return e != cudaSuccess ? e : last;
}

}  // namespace k3::ops::cuda::detail
