// CPU reference of the fixed-capacity EP exchange's pack and combine (ops/ep.h).
#include "ops/ep.h"

#include <algorithm>
#include <vector>

#include "core/error.h"

namespace k3::ops {

void ep_pack(const int32_t* idx, const float* z, int64_t rows, int k, int64_t L, int experts_per_rank, int W,
             int64_t cap, int32_t* slot, int32_t* send_ids, float* send) {
  K3_CHECK(rows * k <= cap, "ep_pack: {} pairs exceed the capacity of {} per rank", rows * k, cap);
  std::fill(send_ids, send_ids + W * cap, -1);
  std::vector<int64_t> used(static_cast<size_t>(W), 0);
  for (int64_t i = 0; i < rows * k; ++i) {
    const int64_t d = idx[i] >= 0 ? idx[i] / experts_per_rank : -1;
    if (d < 0 || d >= W) {
      slot[i] = -1;
      continue;
    }
    const int64_t s = d * cap + used[d]++;
    slot[i] = static_cast<int32_t>(s);
    send_ids[s] = idx[i];
    std::copy_n(z + (i / k) * L, L, send + s * L);
  }
}

void ep_combine(const float* back, const int32_t* slot, const float* w, int64_t rows, int k, int64_t L, float* y) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < L; ++c) {
      float acc = 0;
      for (int j = 0; j < k; ++j) {
        const int32_t s = slot[r * k + j];
        if (s >= 0) acc += w[r * k + j] * back[int64_t{s} * L + c];
      }
      y[r * L + c] = round_bf16(acc);
    }
}

}  // namespace k3::ops
