// Benchmark-only kernels: the streaming read that measures HBM bandwidth and a deterministic random fill.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace k3::bench {

// Reads `bytes` (a multiple of 16) once with streaming loads.
int stream_read(const void* p, size_t bytes, unsigned* sink, int sms, cudaStream_t s);
// Random fill; kind: 0 BF16 uniform, 1 F32 uniform, 2 random bytes, 3 E8M0 scales near 2^-6.
int fill(void* p, int64_t n, int kind, float center, float half, uint64_t seed, cudaStream_t s);

}  // namespace k3::bench
