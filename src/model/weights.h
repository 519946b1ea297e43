// Model weights as views into a TensorSource (memory-mapped checkpoint or
// in-memory synthetic model): nothing is copied. The loader checks every
// tensor against the schema (config/schema.h) and fails naming the tensor,
// its shape/dtype and the expected ones. Tensor names may carry the
// `language_model.` prefix (the published layout) or not.
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

struct KdaWeights {
  const bf16* q_proj = nullptr;   // [H*d, D]
  const bf16* k_proj = nullptr;   // [H*d, D]
  const bf16* v_proj = nullptr;   // [H*d, D]
  const bf16* g_proj = nullptr;   // [H*d, D]
  const float* q_conv = nullptr;  // [H*d, K] F32
  const float* k_conv = nullptr;  // [H*d, K] F32
  const float* v_conv = nullptr;  // [H*d, K] F32
  const bf16* f_a = nullptr;      // [d, D]
  const bf16* f_b = nullptr;      // [H*d, d]
  const bf16* b_proj = nullptr;   // [H, D]
  const float* A_log = nullptr;   // [H] (first H stored values) F32
  const float* dt_bias = nullptr; // [H*d] F32
  const float* o_norm = nullptr;  // [d] F32
  const bf16* o_proj = nullptr;   // [D, H*d]
};

struct DsaIndexerWeights {
  const bf16* wq_b = nullptr;          // [Hi*Di, Q]
  const bf16* wk = nullptr;            // [Di, D]
  const bf16* weights_proj = nullptr;  // [Hi, D]
  const bf16* k_norm_w = nullptr;      // [Di]
  const bf16* k_norm_b = nullptr;      // [Di]
};

struct MlaWeights {
  const bf16* q_a = nullptr;       // [Q, D]
  const bf16* q_a_norm = nullptr;  // [Q]
  const bf16* q_b = nullptr;       // [H*(dn+P), Q]
  const bf16* kv_a = nullptr;      // [R+P, D]
  const bf16* kv_a_norm = nullptr; // [R]
  const bf16* kv_b = nullptr;      // [H*(dn+dv), R]
  const bf16* g_proj = nullptr;    // [H*dv, D]
  const bf16* o_proj = nullptr;    // [D, H*dv]
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
  const bf16* down = nullptr;          // [L, D] routed_expert_down_proj
  const bf16* norm = nullptr;          // [L] routed_expert_norm
  const bf16* up = nullptr;            // [D, L] routed_expert_up_proj
  const bf16* shared_gate = nullptr;   // [S, D]
  const bf16* shared_up = nullptr;     // [S, D]
  const bf16* shared_down = nullptr;   // [D, S]
  std::vector<ExpertWeights> experts;  // [E]
};

struct DenseWeights {
  const bf16* gate = nullptr;  // [I, D]
  const bf16* up = nullptr;    // [I, D]
  const bf16* down = nullptr;  // [D, I]
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
  const bf16* lm_head = nullptr;          // [V, D]
};

// Validates and views every tensor the config needs. Keeps no reference to
// `src` beyond the views: the caller keeps `src` alive.
ModelWeights load_weights(const ModelConfig& config, const TensorSource& src);

}  // namespace k3
