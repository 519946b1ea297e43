// The CUDA Context of the ops (ops/cuda_context.h): create_context sets up a stream, a cuBLASLt handle and
// its workspace on the current device and records its SM count and compute capability (Hopper or newer).
#include <cublasLt.h>

#include "core/cuda.h"
#include "ops/cuda_context.h"
#include "ops/cuda_device.cuh"

namespace k3::ops::cuda {

Context create_context() {
  Context c;
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  c.sm_count = detail::device_sm_count();  // the one query of the SM count (launchers without a Context use it too)
  c.cc_major = prop.major;
  c.cc_minor = prop.minor;
  K3_CHECK(prop.major >= 9, "GPU {} is sm_{}{}: this build targets Hopper (sm_90a); rebuild with "
           "-DK3_CUDA_ARCHITECTURES=<arch> for an older GPU", prop.name, prop.major, prop.minor);
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  c.stream = s;
  cublasLtHandle_t lt;
  K3_CHECK(cublasLtCreate(&lt) == CUBLAS_STATUS_SUCCESS, "cuBLASLt: cannot create a handle");
  c.lt = lt;
  c.workspace_bytes = size_t{32} << 20;
  CUDA_CHECK(cudaMalloc(&c.workspace, c.workspace_bytes));
  return c;
}

void destroy_context(Context& c) {
  if (c.workspace) cudaFree(c.workspace);
  if (c.lt) cublasLtDestroy(c.lt);
  if (c.stream) cudaStreamDestroy(c.stream);
  c = Context{};
}

}  // namespace k3::ops::cuda
