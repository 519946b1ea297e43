// CUDA error vocabulary and device buffers (compiled only with K3_CUDA).
//   CUDA_CHECK(expr): throws k3::Error naming the expression, file:line and device.
//   K3_DEVICE_ASSERT(cond): prints and traps on the device.
//   DeviceBuffer: one cudaMalloc'd allocation, freed on destruction (never per step).
#pragma once

#include <cuda_runtime.h>

#include <cstdio>

#include "core/error.h"

#define CUDA_CHECK(expr)                                                                                  \
  do {                                                                                                    \
    cudaError_t k3_err_ = (expr);                                                                         \
    if (k3_err_ != cudaSuccess) {                                                                         \
      int k3_dev_ = -1;                                                                                   \
      cudaGetDevice(&k3_dev_);                                                                            \
      ::k3::fail("CUDA error {} ({}) in {} at {}:{} on device {}", cudaGetErrorName(k3_err_),             \
                 cudaGetErrorString(k3_err_), #expr, __FILE__, __LINE__, k3_dev_);                        \
    }                                                                                                     \
  } while (0)

#define K3_DEVICE_ASSERT(cond)                                                             \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      printf("device assert %s failed at %s:%d\n", #cond, __FILE__, __LINE__);             \
      __trap();                                                                            \
    }                                                                                      \
  } while (0)

namespace k3 {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes) CUDA_CHECK(cudaMalloc(&ptr_, bytes));
  }
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) {
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  template <typename T = void>
  T* get() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// True when a CUDA device is present and usable (GPU tests skip otherwise).
inline bool cuda_device_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

}  // namespace k3
