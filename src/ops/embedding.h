// Embedding lookup: out[r, :] = table[ids[r], :] (BF16 -> float, exact).
// An id outside [0, vocab) is an Error naming the id (nothing is read).
#pragma once

#include <cstdint>

#include "core/bf16.h"
#include "ops/cuda_context.h"

namespace k3::ops {

// ids [rows]; table [vocab, dim]; out [rows, dim].
void embedding(const int32_t* ids, int64_t rows, const bf16* table, int64_t vocab, int64_t dim, float* out);

}  // namespace k3::ops

namespace k3::ops::cuda {

// ids [rows] int32 (checked on the host first: every id in [0, vocab); a bad one traps), table [vocab, dim] BF16,
// out [rows, dim] BF16.
int embedding(const int32_t* ids, int64_t rows, const bf16* table, int64_t vocab, int64_t dim, bf16* out,
              CUstream_st* stream);

}  // namespace k3::ops::cuda
