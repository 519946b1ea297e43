// One rank's model weights, loaded from a TensorSource (memory-mapped
// checkpoint or in-memory synthetic model). Row slices are views (a rank
// touches only the pages of the rows it keeps); packed and column-sliced
// matrices are copies owned here. The loader checks every tensor against the
// schema (config/schema.h) and fails naming the tensor, its shape/dtype and
// the expected ones. Tensor names may carry the `language_model.` prefix (the
// published layout) or not.
//
// Sharding (rank t of a TP group of G, world rank w of W = G x DP):
//   KDA: heads [t Hl, (t+1) Hl), Hl = H / G, packed as in_proj_qkvgfab = rows
//        [q | k | v | g slices (Hl d each) | f_a whole (d) | b slice (Hl)] padded to a
//        multiple of 16; conv, f_b, A_log, dt_bias sliced; o_norm whole; o_proj
//        columns sliced (each rank produces a partial sum).
//   MLA / DSA: heads sliced in q_b, kv_b, g_proj (rows) and o_proj (columns);
//        q_a, kv_a, their norms and the DSA indexer replicated.
//   MoE: router, latent projections, routed norm and shared experts replicated;
//        routed experts [w E / W, (w+1) E / W) only. Dense MLP replicated.
//   lm_head: vocabulary rows [t V / G, (t+1) V / G). Embedding replicated.
//
// Shapes below use K3's names: D hidden, H heads, d KDA head dim, K conv
// width, Q q_lora_rank, R kv_lora_rank, P qk_rope_head_dim, dn qk_nope_head_dim,
// dv v_head_dim, Hi/Di indexer heads/dim, E experts, L latent, I expert
// intermediate, S shared intermediate, V vocab.
#pragma once

#include <memory>
#include <vector>

#include "config/model_config.h"
#include "core/bf16.h"
#include "io/checkpoint.h"
#include "ops/moe.h"

namespace k3 {

// Hl = local KDA heads; C = Hl d.
struct KdaWeights {
  int heads = 0;                  // Hl
  int64_t in_rows = 0;            // pad16(4 C + d + Hl)
  const bf16* in_proj = nullptr;  // [in_rows, D] in_proj_qkvgfab: q, k, v, g, f_a, b, zero padding
  const float* q_conv = nullptr;  // [C, K] F32
  const float* k_conv = nullptr;  // [C, K] F32
  const float* v_conv = nullptr;  // [C, K] F32
  const bf16* f_b = nullptr;      // [C, d]
  const float* A_log = nullptr;   // [Hl] F32 (this rank's heads of the stored values)
  const float* dt_bias = nullptr; // [C] F32
  const float* o_norm = nullptr;  // [d] F32
  const bf16* o_proj = nullptr;   // [D, C] (columns of this rank's heads)
};

struct DsaIndexerWeights {
  const bf16* wq_b = nullptr;          // [Hi*Di, Q]
  const bf16* wk = nullptr;            // [Di, D]
  const bf16* weights_proj = nullptr;  // [Hi, D]
  const bf16* k_norm_w = nullptr;      // [Di]
  const bf16* k_norm_b = nullptr;      // [Di]
};

// Hl = local MLA heads.
struct MlaWeights {
  int heads = 0;                   // Hl
  const bf16* q_a = nullptr;       // [Q, D]
  const bf16* q_a_norm = nullptr;  // [Q]
  const bf16* q_b = nullptr;       // [Hl*(dn+P), Q]
  const bf16* kv_a = nullptr;      // [R+P, D]
  const bf16* kv_a_norm = nullptr; // [R]
  const bf16* kv_b = nullptr;      // [Hl*(dn+dv), R]
  const bf16* g_proj = nullptr;    // [Hl*dv, D]
  const bf16* o_proj = nullptr;    // [D, Hl*dv]
  bool has_indexer = false;        // DSA (K3.1)
  DsaIndexerWeights indexer;
};

struct ExpertWeights {
  ops::Mxfp4Matrix w1;  // gate [I, L]
  ops::Mxfp4Matrix w3;  // up [I, L]
  ops::Mxfp4Matrix w2;  // down [L, I]
};

struct MoeWeights {
  const bf16* gate = nullptr;          // [E, D] router
  const float* gate_bias = nullptr;    // [E] F32 e_score_correction_bias
  int64_t down_rows = 0;               // Ll: L, or L / G when the FFNs are TP-sharded (rows [t Ll, (t+1) Ll))
  const bf16* down = nullptr;          // [Ll, D] routed_expert_down_proj
  const bf16* norm = nullptr;          // [L] routed_expert_norm
  const bf16* up = nullptr;            // [D, L] routed_expert_up_proj
  int64_t shared_rows = 0;             // Sl: S, or S / G when the FFNs are TP-sharded (ShardSpec::ffn_tp)
  const bf16* shared_gate = nullptr;   // [Sl, D]
  const bf16* shared_up = nullptr;     // [Sl, D]
  const bf16* shared_down = nullptr;   // [D, Sl]
  int expert_begin = 0;                // first global expert id held here
  std::vector<ExpertWeights> experts;  // [E / W] this rank's experts
};

struct DenseWeights {
  int64_t rows = 0;            // Il: I, or I / G when the FFNs are TP-sharded (ShardSpec::ffn_tp)
  const bf16* gate = nullptr;  // [Il, D]
  const bf16* up = nullptr;    // [Il, D]
  const bf16* down = nullptr;  // [D, Il]
};

struct LayerWeights {
  const bf16* attn_res_norm = nullptr;   // [D] self_attention_res_norm
  const bf16* attn_res_proj = nullptr;   // [D] self_attention_res_proj (its single row)
  const bf16* mlp_res_norm = nullptr;    // [D]
  const bf16* mlp_res_proj = nullptr;    // [D]
  const bf16* input_norm = nullptr;      // [D] input_layernorm
  const bf16* post_attn_norm = nullptr;  // [D] post_attention_layernorm
  AttnKind attn = AttnKind::KDA;
  KdaWeights kda;                        // when attn == KDA
  MlaWeights mla;                        // when attn == MLA / DSA
  FfnKind ffn = FfnKind::MoE;
  DenseWeights dense;                    // when ffn == Dense
  MoeWeights moe;                        // when ffn == MoE
};

struct ModelWeights {
  const bf16* embed = nullptr;            // [V, D]
  std::vector<LayerWeights> layers;
  const bf16* out_res_norm = nullptr;     // [D] output_attn_res_norm
  const bf16* out_res_proj = nullptr;     // [D] output_attn_res_proj
  const bf16* norm = nullptr;             // [D] final norm
  int64_t vocab_begin = 0;                // first vocabulary row of lm_head held here
  int64_t vocab_count = 0;                // V / G
  bool ffn_tp = false;                    // shared experts and dense MLP TP-sharded (ShardSpec::ffn_tp)
  const bf16* lm_head = nullptr;          // [V / G, D]
  std::vector<Tensor> owned;              // packed and column-sliced copies
};

// Which shard of the weights a rank holds.
struct ShardSpec {
  int tp_size = 1, tp_rank = 0;        // G, t
  int world_size = 1, world_rank = 0;  // W = G x DP, w
  // The shared experts and the dense MLP TP-sharded (the hybrid step's `tp` mode): gate / up rows
  // [t Sl, (t+1) Sl) of the intermediate, down's matching columns; each rank's output is a partial sum.
  // The routed experts' latent down projection too: rows [t L/G, (t+1) L/G), whose slices of every
  // row of the group meet in the EP exchange (ops/ep.h).
  bool ffn_tp = false;
};

// Errors (before any tensor is read) when heads, experts or vocabulary do not
// divide over the ranks.
void check_shardable(const ModelConfig& config, const ShardSpec& shard);

// Validates and loads this rank's weights. Views point into `src`: the caller keeps it alive.
ModelWeights load_weights(const ModelConfig& config, const TensorSource& src, const ShardSpec& shard = {});

}  // namespace k3
