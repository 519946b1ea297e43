// The K3 modules on the CPU, built from ops (kimi-k3.md section 2). Rows are
// the tokens of a step: B requests x q tokens, request b's tokens are rows
// [b q, (b+1) q) at positions pos0[b] .. pos0[b] + q - 1. Activations between
// modules are [rows, D] float arrays of BF16 values.
//
// KDA (kda_attention), per request, token by token:
//   q, k, v = silu(conv(W_{q,k,v} x)); q = l2norm(q) d^-0.5; k = l2norm(k)
//   g = lower * sigmoid(exp(A_log) (W_fb W_fa x + dt_bias)); beta = sigmoid(W_b x)
//   S' = S diag(exp g); S = S' + beta (v - S' k) k^T; o = S q
//   out = W_o [RMSNorm(o_h; o_norm) * sigmoid(W_g x)_h]_h
// The committed state is never written during a step: the state after the
// last token goes to the slot's other state buffer, and the step keeps its
// per-token inputs so that the runtime can commit any accepted prefix.
//
// MLA / DSA (mla_attention), absorbed decode:
//   c_q = RMSNorm(W_qa x); q = W_qb c_q; [c_kv, k_pe] = W_kva x; c_kv = RMSNorm(c_kv)
//   every row's cache entry is written first, then each row attends to the
//   entries at positions <= its own (MLA), or to the top-k of them chosen by
//   the lightning indexer (DSA: q_idx = W_qb^idx c_q, k_idx = LayerNorm(W_k x)
//   cached, w = W_w x Di^-0.5 Hi^-0.5, score = sum_h w_h relu(q_idx_h . k_idx));
//   o = W_uv softmax(scale q_lat . entry) c_kv; out = W_o (o * sigmoid(W_g x)).
//
// MoE (moe_ffn): router on FP32 logits (sigmoid, biased top-k, unbiased
//   renormalized weights); z = W_down x; y = bf16(sum_i w_i expert_i(z)) in FP32
//   in the row's chosen order; y = RMSNorm(y; routed_expert_norm); out = bf16(W_up y +
//   shared(x)) with shared the SiTU-GLU MLP of the merged shared experts. With the
//   FFNs TP-sharded (ShardSpec::ffn_tp) shared(x) is this rank's partial sum over
//   its slice of the intermediate rows, computed on all rows by the step, and
//   z = W_down x is sliced too (MoeSlice): every member of the TP group routes
//   all m rows and computes its L / G columns of z; the expert's owner joins the
//   G slices of a pair, and the member owning the row gets the output back.
// Dense (dense_ffn): the SiTU-GLU MLP.
//
// Every module works on this rank's shard of the weights (model/weights.h):
// attention modules return the o_proj partial sum of the local heads (the
// caller all-reduces or reduce-scatters it); moe_ffn exchanges rows with the
// ranks that own the chosen experts (EP over the world group).
//
// DCP (mla_attention with dcp.size = D > 1): position p's cache entry lives on
// DCP rank p mod D. The D ranks all-gather their query latents, each attends
// every gathered head over its own positions, the partial (o, lse) of each
// head go back to the rank that owns the head (all-to-all) and merge by
// log-sum-exp. DSA selects the global top-k: each rank scores its positions
// and keeps its local top-k, the candidates are all-gathered, and every rank
// takes the same top-k of the union (ties to the lower position).
#pragma once

#include <cstdint>
#include <vector>

#include "comm/comm.h"
#include "config/model_config.h"
#include "model/weights.h"

namespace k3 {

struct StepShape {
  int B = 0;                  // requests
  int q = 0;                  // tokens per request
  std::vector<int64_t> pos0;  // [B] position of each request's first token in this step
  int64_t rows() const { return int64_t{B} * q; }
};

// One request's KDA state for one layer during a step. The step reads the
// committed states and never writes them: it writes the recurrent state after
// its last token to S_next (the slot's other state buffer) and keeps its
// per-token inputs (pre-conv q, k, v; the recurrence's k, v, g, beta), from
// which commit(n) rebuilds the state after any n accepted tokens.
struct KdaSlotState {
  const float* conv[3] = {};  // committed q, k, v conv states [C, K-1] (C = H d)
  float* conv_x[3] = {};      // [q, C]: the step's pre-conv q, k, v inputs
  const float* S = nullptr;   // committed recurrent state [H, d, d] F32
  float* S_next = nullptr;    // [H, d, d]: the state after the step's last token
  float* kept_k = nullptr;    // [q, H, d]: the recurrence's (normalized) k per token
  float* kept_g = nullptr;    // [q, H, d]: its log decay g
  float* kept_v = nullptr;    // [q, H, d]: its v
  float* kept_beta = nullptr; // [q, H]: its beta
};

// What the attention modules need from the runtime's caches.
class AttentionCache {
 public:
  virtual ~AttentionCache() = default;
  virtual KdaSlotState kda(int layer, int b) = 0;
  // Latent KV entry [R + P] of request b at position pos (written before it is
  // read); only positions this DCP rank holds (pos mod D == dcp rank).
  virtual float* kv_entry(int layer, int b, int64_t pos) = 0;
  // DSA indexer key [Di] of request b at position pos (same rule).
  virtual float* index_key(int layer, int b, int64_t pos) = 0;
};

struct Dcp {
  Comm* comm = nullptr;  // the DCP group (null when size == 1)
  int size = 1;
  int rank = 0;
};

// x [rows, D] normalized input -> out [rows, D] o_proj partial of the local heads.
void kda_attention(const ModelConfig& c, const KdaWeights& w, int layer, const float* x, const StepShape& s,
                   AttentionCache& cache, float* out);
void mla_attention(const ModelConfig& c, const MlaWeights& w, int layer, const float* x, const StepShape& s,
                   AttentionCache& cache, const Dcp& dcp, float* out);
// x [rows, D]: the first `real` rows are tokens, the rest padding (never routed,
// output zero). Collective over `world` (every rank calls it, rows may be 0).
// out [rows, D] = bf16(W_up y + shared(x)), the shared experts' BF16 output and the FP32 up projection
// rounded once. with_shared = false: out [real, D] already holds the shared experts' TP partial sum of the
// real rows (shared_mlp on all rows) and the routed part is added into it the same way.
// Sliced (w.down_rows = L / G < L, the weights' ffn_tp): x [m, D] holds all m rows of the TP group (rows =
// real = m) and `slice` names this rank's member t of G and the rows per member cs; out [m, D] holds the
// shared partial sum, and the routed output of rows [t cs, min(m, (t+1) cs)) is added into those rows.
struct MoeSlice {
  int G = 1;       // members of the TP group
  int t = 0;       // this rank's member index
  int64_t cs = 0;  // rows per member (sp_shard_rows)
};
void moe_ffn(const ModelConfig& c, const MoeWeights& w, const float* x, int64_t rows, int64_t real, Comm& world,
             float* out, bool with_shared = true, const MoeSlice& slice = {});
// The shared experts' SiTU-GLU MLP on `rows` rows (a partial sum when they are TP-sharded).
void shared_mlp(const ModelConfig& c, const MoeWeights& w, const float* x, int64_t rows, float* out);
// The dense MLP (a partial sum when it is TP-sharded).
void dense_ffn(const ModelConfig& c, const DenseWeights& w, const float* x, int64_t rows, float* out);

}  // namespace k3
