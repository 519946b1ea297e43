// CPU reference of the embedding lookup (ops/embedding.h).
#include "ops/embedding.h"

#include "core/error.h"

namespace k3::ops {

void embedding(const int32_t* ids, int64_t rows, const bf16* table, int64_t vocab, int64_t dim, float* out) {
  K3_CHECK(rows >= 0 && vocab > 0 && dim > 0, "embedding: bad shape rows {} vocab {} dim {}", rows, vocab, dim);
  // Every id is checked before anything is written.
  for (int64_t r = 0; r < rows; ++r) {
    K3_CHECK(ids[r] >= 0 && ids[r] < vocab, "embedding: token id {} (row {}) outside the vocabulary [0, {})", ids[r],
             r, vocab);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const bf16* src = table + static_cast<int64_t>(ids[r]) * dim;
    float* dst = out + r * dim;
    for (int64_t i = 0; i < dim; ++i) dst[i] = to_float(src[i]);
  }
}

}  // namespace k3::ops
