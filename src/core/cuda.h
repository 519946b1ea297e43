// CUDA error vocabulary and device buffers (compiled only with K3_CUDA).
//   CUDA_CHECK(expr): throws k3::Error naming the expression, file:line and device.
//   K3_DEVICE_ASSERT(cond): prints and traps on the device.
//   DeviceBuffer: one cudaMalloc'd allocation, freed on destruction (never per step); out of memory
//   throws OutOfDeviceMemory (a k3::Error) with the size asked for and the device's free and total memory.
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

// What DeviceBuffer throws when the device has too little memory left (a caller may say what it was building).
class OutOfDeviceMemory : public Error {
 public:
  using Error::Error;
};

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes == 0) return;
    const cudaError_t e = cudaMalloc(&ptr_, bytes);
    if (e == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // not sticky: clear it, so later launch checks do not see it
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      int dev = -1;
      cudaGetDevice(&dev);
      const auto gib = [](size_t b) { return static_cast<double>(b) / (1 << 30); };
      throw OutOfDeviceMemory(fmt::format("out of GPU memory: {:.2f} GiB asked for, {:.2f} of {:.2f} GiB free on "
                                          "device {}",
                                          gib(bytes), gib(free_b), gib(total_b), dev));
    }
    CUDA_CHECK(e);
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
