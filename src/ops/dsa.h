// DSA lightning indexer and top-k (kimi-k3.md section 2, K3.1), per query token t:
//
//   q_idx = wq_b c_q  [Hi, Di] (BF16 linear);  k_idx(s) = LayerNorm(wk x_s) [Di] (cached)
//   w(t)  = weights_proj x_t * Di^-0.5 * Hi^-0.5  [Hi] (FP32)
//   score(t, s) = sum_h w_h(t) * relu(q_idx_h(t) . k_idx(s))        (FP32)
//   top-k: the indices of the min(k, n) largest scores among the n candidates
//          (positions <= t, the token's own key written first), ordered by score
//          descending, ties to the lower index.
// The MLA attention then runs over the selected entries (ops/mla.h, mla_attend).
#pragma once

#include <cstdint>

namespace k3::ops {

// q_idx [Hi, Di]; w [Hi]; keys: n pointers to cached keys [Di]; scores [n].
void dsa_index_scores(const float* q_idx, const float* w, const float* const* keys, int64_t n, int Hi, int Di,
                      float* scores);

// Writes min(k, n) indices into idx; returns that count.
int64_t topk_indices(const float* scores, int64_t n, int64_t k, int64_t* idx);

}  // namespace k3::ops
