// What every CUDA launcher may need beyond its pointers: the stream it runs
// on (never the default stream, so a step can be captured in a CUDA graph),
// and for cuBLASLt a handle and a workspace allocated once.
// Launchers return the cudaError_t of their launch as int (0 = cudaSuccess).
#pragma once

#include <cstddef>

struct CUstream_st;
struct cublasLtContext;

namespace k3::ops::cuda {

struct Context {
  CUstream_st* stream = nullptr;          // cudaStream_t
  cublasLtContext* lt = nullptr;          // cublasLtHandle_t
  void* workspace = nullptr;              // cuBLASLt workspace (device)
  size_t workspace_bytes = 0;
  int sm_count = 0;
  int cc_major = 0, cc_minor = 0;
};

// Creates a non-blocking stream, a cuBLASLt handle and a 32 MB workspace on
// the current device; Error if no device or the device is older than sm_90
// when the build targets sm_90a only.
Context create_context();
void destroy_context(Context& c);

// A Context owned for a scope: created on construction, destroyed with it.
class ScopedContext {
 public:
  ScopedContext() : c_(create_context()) {}
  ~ScopedContext() { destroy_context(c_); }
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;
  Context& get() { return c_; }
  Context* operator->() { return &c_; }

 private:
  Context c_;
};

}  // namespace k3::ops::cuda
