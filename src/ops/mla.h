// Gated NoPE MLA decode in the absorbed latent form (kimi-k3.md section 2), per query token.
//
// W_kvb [H * (dn + dv), R] holds, per head h, dn key rows then dv value rows:
// W_uk_h = rows [h (dn + dv), h (dn + dv) + dn), W_uv_h = the next dv rows.
// A cache entry is [c_kv (R), k_pe (P)] (R = kv_lora_rank 512, P = 64).
//
//   absorb:   q_lat[t, h] = [bf16(W_uk_h^T q_nope[t, h]), q_pe[t, h]]           ([H, R + P])
//   attend:   s_j = scale * (q_lat[h] . entry_j)   over the given entries j
//             lse[h] = log sum_j exp(s_j);  o_lat[h] = sum_j exp(s_j - lse) c_kv_j   (FP32)
//             no entries: o_lat = 0, lse = -inf (an empty DCP shard contributes nothing)
//   lse_merge: out = sum_i exp(lse_i - L) o_i with L = log sum_i exp(lse_i)          (DCP partials)
//   unabsorb: o[t, h] = bf16(W_uv_h o_lat[t, h])                                  ([H, dv])
// Dense decode passes every cached entry visible to the token (positions <= its
// own); sparse (DSA) passes the top-k selected entries: one function serves both.
#pragma once

#include <cstdint>

#include "core/bf16.h"

namespace k3::ops {

// q [T, H, dn + P] (nope then pe), w_kvb as above, q_lat [T, H, R + P] (rounded to BF16).
void mla_absorb_q(const float* q, const bf16* w_kvb, float* q_lat, int64_t T, int H, int dn, int P, int dv, int R);

// One query token: q_lat [H, R + P]; entries: n pointers to cache entries [R + P];
// o_lat [H, R] FP32 (not rounded: DCP merges before rounding); lse [H].
void mla_attend(const float* q_lat, const float* const* entries, int64_t n, int H, int R, int P, float scale,
                float* o_lat, float* lse);

// Merge D partial results of the same token: o_parts [D, H, R], lse_parts [D, H] -> o [H, R], lse [H].
void lse_merge(const float* o_parts, const float* lse_parts, int D, int H, int R, float* o, float* lse);

// o_lat [T, H, R] -> o [T, H, dv] (rounded to BF16).
void mla_unabsorb(const float* o_lat, const bf16* w_kvb, float* o, int64_t T, int H, int dn, int dv, int R);

}  // namespace k3::ops
