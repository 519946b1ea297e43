// HostStaged: a device Comm seen through host buffers, so that the host-side
// checks of tests/comm_checks.h run on the device backends (local_gpu, nccl).
// Every call stages its buffers on the device (allocations: test code only),
// runs the collective on the rank's stream, synchronizes and copies the
// results back; receive buffers carry 256 canary bytes on the device, and a
// write past the end is a k3::Error.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "core/cuda.h"

namespace k3 {

// A device comm seen through host buffers: every call stages its buffers on
// the device, runs the collective on the rank's stream, synchronizes and copies
// the results back. Receive buffers carry 256 canary bytes on the device.
class HostStaged : public Comm {
 public:
  HostStaged(std::unique_ptr<Comm> dev, cudaStream_t s) : dev_(std::move(dev)), s_(s) { dev_->set_stream(s); }
  int rank() const override { return dev_->rank(); }
  int size() const override { return dev_->size(); }
  std::string name() const override { return dev_->name(); }

  void all_reduce(void* data, int64_t count, DType dt) override {
    const size_t b = bytes(count, dt);
    DeviceBuffer d = stage(data, b, b);
    dev_->all_reduce(d.get(), count, dt);
    finish(d, data, b);
  }
  void all_gather(const void* send, void* recv, int64_t count, DType dt) override {
    const size_t b = bytes(count, dt), rb = b * size();
    DeviceBuffer r = stage(recv, rb, rb);
    const char* s0 = static_cast<const char*>(send);
    const char* r0 = static_cast<const char*>(recv);
    if (send && recv && s0 >= r0 && s0 < r0 + rb) {  // in place
      dev_->all_gather(r.get<char>() + (s0 - r0), r.get(), count, dt);
    } else {
      DeviceBuffer d = stage(send, b, b);
      dev_->all_gather(d.get(), r.get(), count, dt);
      sync();
    }
    finish(r, recv, rb);
  }
  void reduce_scatter(const void* send, void* recv, int64_t count, DType dt) override {
    const size_t b = bytes(count, dt);
    DeviceBuffer d = stage(send, b * size(), b * size());
    DeviceBuffer r = stage(recv, b, b);
    dev_->reduce_scatter(d.get(), r.get(), count, dt);
    finish(r, recv, b);
  }
  void all_to_all_v(const void* send, const int64_t* sc, void* recv, const int64_t* rc, DType dt) override {
    int64_t ns = 0, nr = 0;
    for (int p = 0; p < size(); ++p) {
      ns += sc[p];
      nr += rc[p];
    }
    DeviceBuffer d = stage(send, bytes(ns, dt), bytes(ns, dt));
    DeviceBuffer r = stage(recv, bytes(nr, dt), bytes(nr, dt));
    try {
      dev_->all_to_all_v(d.get(), sc, r.get(), rc, dt);
    } catch (...) {
      sync();
      throw;
    }
    finish(r, recv, bytes(nr, dt));
  }
  void broadcast(void* data, int64_t count, DType dt, int root) override {
    const size_t b = bytes(count, dt);
    DeviceBuffer d = stage(data, b, b);
    dev_->broadcast(d.get(), count, dt, root);
    finish(d, data, b);
  }
  void barrier() override {
    dev_->barrier();
    sync();
  }

 private:
  static size_t bytes(int64_t n, DType dt) { return static_cast<size_t>(std::max<int64_t>(n, 0)) * dtype_size(dt); }
  void sync() { CUDA_CHECK(cudaStreamSynchronize(s_)); }
  // Device copy of host [b] (+ canaries); copy = bytes to upload (0 for none).
  DeviceBuffer stage(const void* host, size_t b, size_t copy) {
    DeviceBuffer d(b + kCanary);
    CUDA_CHECK(cudaMemsetAsync(d.get(), 0xA5, b + kCanary, s_));
    if (host && copy) CUDA_CHECK(cudaMemcpyAsync(d.get(), host, copy, cudaMemcpyHostToDevice, s_));
    return d;
  }
  void finish(const DeviceBuffer& d, void* host, size_t b) {
    std::vector<unsigned char> tail(kCanary);
    sync();
    if (host && b) CUDA_CHECK(cudaMemcpy(host, d.get(), b, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(tail.data(), d.get<char>() + b, kCanary, cudaMemcpyDeviceToHost));
    for (unsigned char c : tail) K3_CHECK(c == 0xA5, "comm {}: a collective wrote past the end of its receive buffer", name());
  }
  static constexpr size_t kCanary = 256;
  std::unique_ptr<Comm> dev_;
  cudaStream_t s_;
};

}  // namespace k3
