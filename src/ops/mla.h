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

#include <cstddef>
#include <cstdint>

#include "core/bf16.h"
#include "ops/cuda_context.h"
#include "ops/linear.h"

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

// CUDA: a step of B requests x q_len tokens, T = B q_len rows (request b's tokens are rows [b q_len, (b+1) q_len)).
// Latent cache: kv_pool BF16 [num_pages, page_size, R+P]; position p of request b is row p % page_size of page
// block_tables[b, p / page_size] (block_tables int32 [B, max_pages]). Attention scores are
// scale * (q_lat . entry) over the full R+P entry; o_lat is FP32 and not rounded (DCP merges first).
// Flash-decoding: the context is split into chunks across CTAs (partials in scratch), merged like lse_merge.
namespace k3::ops::cuda {

// The per-head products of absorb and unabsorb take one of two paths (LinearPath, ops/linear.h): CublasLt
// (and Auto) = one strided-batched cuBLASLt product over the heads (tensor cores, FP32 accumulation in its
// own order; the kernels if it has no algorithm); Kernel = the hand-written kernels (FP32 sums in the
// CPU's order, CUDA cores). Auto takes cuBLASLt: its tensor cores beat the CUDA-core kernels at K3's
// shapes at every token count (bench --ops mla, docs/PERF.md); the kernels stay as the fallback and the
// CPU-order path the GPU tests compare against.

// q BF16 [T, H, dn+P], w_kvb BF16 [H*(dn+dv), R] -> q_lat BF16 [T, H, R+P].
int mla_absorb_q(const Context& ctx, const bf16* q, const bf16* w_kvb, bf16* q_lat, int64_t T, int H, int dn, int P,
                 int dv, int R, LinearPath path = LinearPath::Auto);

// Scratch bytes mla_attend_paged needs for B x q_len tokens whose context lengths are all <= max_ctx (0: none);
// also enough for any call with fewer requests, fewer tokens per request or a smaller max_ctx.
size_t mla_attend_paged_scratch_bytes(int B, int q_len, int H, int R, int max_ctx);

// q_lat BF16 [B*q_len, H, R+P], kv_pool as above, ctx_len int32 [B*q_len] (positions visible: pos + 1, each in
// [0, max_ctx]) -> o_lat F32 [B*q_len, H, R], lse F32 [B*q_len, H] (no entries: zeros and -inf).
// (R+P) % 8 == 0, R <= 512, q_lat and kv_pool 16-byte aligned; scratch of
// mla_attend_paged_scratch_bytes(B, q_len, H, R, max_ctx) bytes.
int mla_attend_paged(const bf16* q_lat, const bf16* kv_pool, const int32_t* block_tables, int max_pages, int page_size,
                     const int32_t* ctx_len, int B, int q_len, int max_ctx, int H, int R, int P, float scale,
                     float* o_lat, float* lse, void* scratch, size_t scratch_bytes, CUstream_st* stream);

// Scratch bytes mla_attend_indexed needs for T tokens of at most max_sel selected entries each (0: none); also
// enough for fewer tokens or a smaller max_sel.
size_t mla_attend_indexed_scratch_bytes(int64_t T, int H, int R, int max_sel);

// DSA: token t attends the entries at positions sel[t, 0 .. sel_count[t]) (int32 [T, max_sel], counts [T] in
// [0, max_sel]) of its request (t / q_len), in any order; otherwise as mla_attend_paged.
int mla_attend_indexed(const bf16* q_lat, const bf16* kv_pool, const int32_t* block_tables, int max_pages,
                       int page_size, const int32_t* sel, const int32_t* sel_count, int max_sel, int B, int q_len,
                       int H, int R, int P, float scale, float* o_lat, float* lse, void* scratch, size_t scratch_bytes,
                       CUstream_st* stream);

// o_parts F32 [D, T, H, R], lse_parts F32 [D, T, H] -> o F32 [T, H, R], lse F32 [T, H] (parts with lse = -inf are
// ignored; none left: zeros and -inf).
int lse_merge(const float* o_parts, const float* lse_parts, int D, int64_t T, int H, int R, float* o, float* lse,
              CUstream_st* stream);

// o_lat BF16 [T, H, R], w_kvb as above -> o BF16 [T, H, dv].
int mla_unabsorb(const Context& ctx, const bf16* o_lat, const bf16* w_kvb, bf16* o, int64_t T, int H, int dn, int dv,
                 int R, LinearPath path = LinearPath::Auto);

}  // namespace k3::ops::cuda
