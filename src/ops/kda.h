// Kimi Delta Attention on the CPU, per request, token by token (kimi-k3.md section 2):
//
//   gate:  g[t, h, j] = lower * sigmoid(exp(A_log[h]) * (u[t, h, j] + dt_bias[h, j]))   (FP32, in (lower, 0))
//          u = W_fb (W_fa x) (BF16 linears); alpha = exp(g)
//   beta:  beta[t, h] = sigmoid(b[t, h])                                              (FP32)
//   l2norm_heads: x_h <- x_h / sqrt(|x_h|^2 + 1e-6) * scale                          (FP32, per head)
//   recurrence, per head h, state S [dv, dk] FP32:
//          S' = S diag(alpha_t);  delta = beta_t (v_t - S' k_t);  S = S' + delta k_t^T;  o_t = S q_t
//   gated output norm: out[t, h] = bf16(RMSNorm(o[t, h]; o_norm, eps) * sigmoid(gate[t, h]))
#pragma once

#include <cstdint>

#include "core/bf16.h"
#include "ops/cuda_context.h"

namespace k3::ops {

// u, g [T, H * dk]; A_log [H] (the first H stored values); dt_bias [H * dk].
void kda_gate(const float* u, const float* A_log, const float* dt_bias, float lower_bound, float* g, int64_t T, int H,
              int dk);

// b, beta [T, H] (may alias).
void kda_beta(const float* b, float* beta, int64_t T, int H);

// x [T, H * d] in place.
void l2norm_heads(float* x, int64_t T, int H, int d, float scale);

// q, k, g [T, H * dk]; v [T, H * dv]; beta [T, H]; S [H, dv, dk] in/out;
// o [T, H * dv] FP32.
void kda_recurrence(const float* q, const float* k, const float* v, const float* g, const float* beta, float* S,
                    float* o, int64_t T, int H, int dk, int dv);

// The state update of kda_recurrence alone (no q, no o), T tokens of the kept inputs k, g [T, H * dk],
// v [T, H * dv], beta [T, H]: the same FP32 operations in the same order, so S ends bit-identical to
// kda_recurrence's S over the same T tokens (commit of n < q accepted tokens of a verify step).
void kda_replay(const float* k, const float* v, const float* g, const float* beta, float* S, int64_t T, int H, int dk,
                int dv);

// o, gate [T, H * dv]; o_norm_w [dv] F32 shared by all heads; out [T, H * dv].
void kda_gated_norm(const float* o, const float* gate, const float* o_norm_w, float eps, float* out, int64_t T, int H,
                    int dv);

}  // namespace k3::ops

// CUDA: a step of B requests x q_len tokens (request b's tokens are rows [b q_len, (b+1) q_len), rows = B q_len).
// Recurrent states are double-buffered: a state pool holds two states per slot and the runtime keeps which one
// is current (runtime/gpu/caches.h). A step reads state read_idx[b], never writes it, and writes only the state
// after its last token to state write_idx[b]; with q_len > 1 it also keeps its per-token recurrence inputs in
// the slot's rows of a KdaKept pool, from which kda_replay rebuilds the state after n < q_len accepted tokens.
// The recurrence's inputs (l2-normalized q and k, v, the gate g and beta) come from kda_prep (ops/kda_prep.h).
namespace k3::ops::cuda {

// A step's per-token recurrence inputs, per slot, all F32: k and g [num_slots, max_q, H, dk] (the l2-normalized
// k; g the log decay), v [num_slots, max_q, H, dv], beta [num_slots, max_q, H].
struct KdaKept {
  float* k = nullptr;
  float* g = nullptr;
  float* v = nullptr;
  float* beta = nullptr;
};

// q, k, g F32 [B*q_len, H*dk]; v BF16 [B*q_len, H*dv]; beta F32 [B*q_len, H]; state_pool F32 [num_states, H, dv, dk]:
// reads state read_idx[b], writes the state after the last token to state write_idx[b] (!= read_idx[b]);
// kept: the rows of slot slots[b] take the inputs when q_len > 1 (kept.k null: not kept); o F32 [B*q_len, H*dv].
// dk % 4 == 0, dk <= 256, q_len <= max_q.
int kda_recurrence(const float* q, const float* k, const bf16* v, const float* g, const float* beta, float* state_pool,
                   const int32_t* read_idx, const int32_t* write_idx, KdaKept kept, const int32_t* slots, float* o,
                   int B, int q_len, int max_q, int H, int dk, int dv, CUstream_st* stream);

// Commit of a partial accept: for each b with 0 < n = accepted[b] < q_len, state write_idx[b] = state
// read_idx[b] advanced by the first n kept tokens of slot slots[b] (the recurrence's arithmetic, bit-identical
// to kda_recurrence over those n tokens); other b are left alone (n = q_len: the step wrote that state).
int kda_replay(KdaKept kept, float* state_pool, const int32_t* read_idx, const int32_t* write_idx,
               const int32_t* slots, const int32_t* accepted, int B, int q_len, int max_q, int H, int dk, int dv,
               CUstream_st* stream);

// o F32 [rows, H*dv], gate BF16 [rows, gate_ld] (columns [0, H*dv) used), o_norm_w F32 [dv] -> out BF16 [rows, H*dv].
int kda_gated_norm(const float* o, const bf16* gate, int64_t gate_ld, const float* o_norm_w, float eps, bf16* out,
                   int64_t rows, int H, int dv, CUstream_st* stream);

}  // namespace k3::ops::cuda
