// DSA lightning indexer and top-k (kimi-k3.md section 2, K3.1), per query token t:
//
//   q_idx = wq_b c_q  [Hi, Di] (BF16 linear);  k_idx(s) = LayerNorm(wk x_s) [Di] (cached)
//   w(t)  = weights_proj x_t * Di^-0.5 * Hi^-0.5  [Hi] (FP32)
//   score(t, s) = sum_h w_h(t) * relu(q_idx_h(t) . k_idx(s))        (FP32)
//   top-k: the indices of the min(k, n) largest scores among the n candidates
//          (positions <= t, the token's own key written first), ties to the lower
//          index, listed in ascending index order (the attention is a softmax over
//          the set: it needs no score order).
// The MLA attention then runs over the selected entries (ops/mla.h, mla_attend).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/bf16.h"
#include "ops/cuda_context.h"

namespace k3::ops {

// q_idx [Hi, Di]; w [Hi]; keys: n pointers to cached keys [Di]; scores [n].
void dsa_index_scores(const float* q_idx, const float* w, const float* const* keys, int64_t n, int Hi, int Di,
                      float* scores);

// Writes the min(k, n) indices of the largest scores into idx, ascending (NaN ranks as -inf, -0 ties with +0,
// ties go to the lower index); returns that count.
int64_t topk_indices(const float* scores, int64_t n, int64_t k, int64_t* idx);

}  // namespace k3::ops

// CUDA: a step of B requests x q_len tokens, T = B q_len rows (request b's tokens are rows [b q_len, (b+1) q_len)).
// Indexer keys: key_pool BF16 [num_pages, page_size, Di]; position p of request b is row p % page_size of page
// block_tables[b, p / page_size] (int32 [B, max_pages], the same tables as the latent cache).
namespace k3::ops::cuda {

// q_idx BF16 [T, Hi, Di], w F32 [T, Hi] (scale folded in), ctx_len int32 [T] (candidates: positions
// [0, ctx_len[t]), each ctx_len <= max_ctx) -> scores F32 [T, max_ctx], columns >= ctx_len[t] set to -inf.
// Di % 8 == 0, Hi <= 64, q_idx and key_pool 16-byte aligned.
int dsa_index_scores_paged(const bf16* q_idx, const float* w, const bf16* key_pool, const int32_t* block_tables,
                           int max_pages, int page_size, const int32_t* ctx_len, int B, int q_len, int max_ctx, int Hi,
                           int Di, float* scores, CUstream_st* stream);

// Row t of scores F32 [T, ld] has n[t] candidates (columns [0, n[t]), n[t] <= ld): idx int32 [T, k] receives the
// min(k, n[t]) columns of the largest scores, ties to the lower column, NaN ranked as -inf and -0 as +0, in
// ASCENDING COLUMN ORDER (the CPU topk_indices, exactly); the rest of the row is -1. count int32 [T] =
// min(k, n[t]). k <= 2048, ld < 2^31.
//
// One kernel family (dsa_topk.cu): a radix select to the exact threshold, then an ordered compaction (no
// sort). ctas_per_row 0 chooses: one CTA per row (a single launch) for rows of at most 16384 columns or at
// least one row per SM; otherwise each row is split over several CTAs (about two CTAs per SM over all rows,
// at least 2048 columns each); > 0 forces that many (at least 4 columns each, at most 512), for the tests.
// The result does not depend on the split. Split rows take up to 6 kernels in stream order (1 when
// ld <= 4096), one CTA per row 1; no allocation, no host synchronization: capturable in a CUDA graph.
//
// scratch: topk_indices_scratch_bytes(T) bytes or more, 16-byte aligned, ZEROED ONCE before its first use
// (cudaMemset); every call leaves its counters and histograms back at zero, so it needs no clearing between
// calls, whatever T and ld. One scratch per stream: calls on one scratch must not overlap.
size_t topk_indices_scratch_bytes(int64_t max_rows);
int topk_indices(const float* scores, int64_t ld, const int32_t* n, int64_t T, int k, int32_t* idx, int32_t* count,
                 void* scratch, size_t scratch_bytes, CUstream_st* stream, int64_t ctas_per_row = 0);

}  // namespace k3::ops::cuda
