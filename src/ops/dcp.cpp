// CPU reference of DSA's DCP top-k steps (ops/dcp.h).
#include "ops/dcp.h"

#include <limits>

namespace k3::ops {

void dcp_topk_candidates(const float* scores, int64_t ld, const int32_t* sel, const int32_t* n, int64_t T, int k,
                         int D, int r, float* cand_score, int32_t* cand_pos) {
  for (int64_t t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      const int64_t at = t * k + j;
      if (j < n[t]) {
        cand_score[at] = scores[t * ld + sel[at]];
        cand_pos[at] = sel[at] * D + r;
      } else {
        cand_score[at] = -std::numeric_limits<float>::infinity();
        cand_pos[at] = -1;
      }
    }
}

void dcp_scatter_candidates(const float* cand_score, const int32_t* cand_pos, int D, int64_t T, int k, int64_t ld,
                            float* dense) {
  for (int64_t i = 0; i < T * ld; ++i) dense[i] = -std::numeric_limits<float>::infinity();
  for (int m = 0; m < D; ++m)
    for (int64_t t = 0; t < T; ++t)
      for (int j = 0; j < k; ++j) {
        const int64_t at = (m * T + t) * k + j;
        if (cand_pos[at] >= 0 && cand_pos[at] < ld) dense[t * ld + cand_pos[at]] = cand_score[at];
      }
}

void dcp_local_selection(const int32_t* sel, const int32_t* n, int64_t T, int k, int D, int r, int32_t* out,
                         int32_t* count) {
  for (int64_t t = 0; t < T; ++t) {
    int c = 0;
    for (int j = 0; j < n[t]; ++j) {
      const int32_t p = sel[t * k + j];
      if (p >= 0 && p % D == r) out[t * k + c++] = p / D;
    }
    count[t] = c;
    for (int j = c; j < k; ++j) out[t * k + j] = -1;
  }
}

}  // namespace k3::ops
