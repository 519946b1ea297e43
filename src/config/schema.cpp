// The checkpoint schema (config/schema.h): tensor names, dtypes and shapes; the parameter count.
#include "config/schema.h"

#include <fmt/format.h>

namespace k3 {

std::string layer_prefix(int layer) { return fmt::format("model.layers.{}.", layer); }
std::string expert_prefix(int layer, int expert) {
  return fmt::format("model.layers.{}.block_sparse_moe.experts.{}.", layer, expert);
}

int a_log_stored_len(const ModelConfig& c) { return (c.kda.num_heads + 31) / 32 * 32 + 32; }

namespace {

void layer_specs(const ModelConfig& c, int l, bool with_experts, std::vector<TensorSpec>& out) {
  const int64_t D = c.hidden_size;
  const std::string p = layer_prefix(l);
  auto add = [&](const std::string& n, DType t, Shape s) { out.push_back({p + n, t, std::move(s)}); };
  for (const char* n : {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attention_res_norm.weight",
                        "mlp_res_norm.weight"})
    add(n, DType::BF16, {D});
  add("self_attention_res_proj.weight", DType::BF16, {1, D});
  add("mlp_res_proj.weight", DType::BF16, {1, D});

  const AttnKind kind = c.attn_kinds.at(l);
  if (kind == AttnKind::KDA) {
    const int64_t H = c.kda.num_heads, d = c.kda.head_dim, K = c.kda.conv_kernel;
    for (const char* n : {"q_proj", "k_proj", "v_proj", "g_proj"})
      add(fmt::format("self_attn.{}.weight", n), DType::BF16, {H * d, D});
    for (const char* n : {"q_conv1d", "k_conv1d", "v_conv1d"})
      add(fmt::format("self_attn.{}.weight", n), DType::F32, {H * d, 1, K});
    add("self_attn.f_a_proj.weight", DType::BF16, {d, D});
    add("self_attn.f_b_proj.weight", DType::BF16, {H * d, d});
    add("self_attn.b_proj.weight", DType::BF16, {H, D});
    out.push_back({p + "self_attn.A_log", DType::F32, {H}, true});
    add("self_attn.dt_bias", DType::F32, {H * d});
    add("self_attn.o_norm.weight", DType::F32, {d});
    add("self_attn.o_proj.weight", DType::BF16, {D, H * d});
  } else {
    const auto& m = c.mla;
    const int64_t H = m.num_heads;
    add("self_attn.q_a_proj.weight", DType::BF16, {m.q_lora_rank, D});
    add("self_attn.q_a_layernorm.weight", DType::BF16, {m.q_lora_rank});
    add("self_attn.q_b_proj.weight", DType::BF16, {H * m.qk_head_dim(), m.q_lora_rank});
    add("self_attn.kv_a_proj_with_mqa.weight", DType::BF16, {m.cache_dim(), D});
    add("self_attn.kv_a_layernorm.weight", DType::BF16, {m.kv_lora_rank});
    add("self_attn.kv_b_proj.weight", DType::BF16, {H * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank});
    add("self_attn.g_proj.weight", DType::BF16, {H * m.v_head_dim, D});
    add("self_attn.o_proj.weight", DType::BF16, {D, H * m.v_head_dim});
    if (kind == AttnKind::DSA) {
      const auto& s = *c.dsa;
      add("self_attn.indexer.wq_b.weight", DType::BF16, {int64_t{s.index_n_heads} * s.index_head_dim, m.q_lora_rank});
      add("self_attn.indexer.wk.weight", DType::BF16, {s.index_head_dim, D});
      add("self_attn.indexer.weights_proj.weight", DType::BF16, {s.index_n_heads, D});
      add("self_attn.indexer.k_norm.weight", DType::BF16, {s.index_head_dim});
      add("self_attn.indexer.k_norm.bias", DType::BF16, {s.index_head_dim});
    }
  }

  if (l < c.moe.first_k_dense_replace) {
    const int64_t I = c.dense_intermediate_size;
    add("mlp.gate_proj.weight", DType::BF16, {I, D});
    add("mlp.up_proj.weight", DType::BF16, {I, D});
    add("mlp.down_proj.weight", DType::BF16, {D, I});
    return;
  }
  const auto& e = c.moe;
  const int64_t E = e.num_experts, L = e.latent_size, I = e.intermediate_size, S = e.shared_intermediate();
  const int64_t G = e.group_size;
  add("block_sparse_moe.gate.weight", DType::BF16, {E, D});
  add("block_sparse_moe.gate.e_score_correction_bias", DType::F32, {E});
  add("block_sparse_moe.routed_expert_down_proj.weight", DType::BF16, {L, D});
  add("block_sparse_moe.routed_expert_norm.weight", DType::BF16, {L});
  add("block_sparse_moe.routed_expert_up_proj.weight", DType::BF16, {D, L});
  add("block_sparse_moe.shared_experts.gate_proj.weight", DType::BF16, {S, D});
  add("block_sparse_moe.shared_experts.up_proj.weight", DType::BF16, {S, D});
  add("block_sparse_moe.shared_experts.down_proj.weight", DType::BF16, {D, S});
  if (!with_experts) return;
  for (int x = 0; x < E; ++x) {
    const std::string ep = expert_prefix(l, x);
    for (const char* w : {"w1", "w3"}) {
      out.push_back({ep + w + ".weight_packed", DType::U8, {I, L / 2}});
      out.push_back({ep + w + ".weight_scale", DType::U8, {I, L / G}});
    }
    out.push_back({ep + "w2.weight_packed", DType::U8, {L, I / 2}});
    out.push_back({ep + "w2.weight_scale", DType::U8, {L, I / G}});
  }
}

std::vector<TensorSpec> schema(const ModelConfig& c, bool with_experts) {
  std::vector<TensorSpec> out;
  const int64_t D = c.hidden_size, V = c.vocab_size;
  out.push_back({"model.embed_tokens.weight", DType::BF16, {V, D}});
  for (int l = 0; l < c.num_layers; ++l) layer_specs(c, l, with_experts, out);
  out.push_back({"model.output_attn_res_norm.weight", DType::BF16, {D}});
  out.push_back({"model.output_attn_res_proj.weight", DType::BF16, {1, D}});
  out.push_back({"model.norm.weight", DType::BF16, {D}});
  out.push_back({"lm_head.weight", DType::BF16, {V, D}});
  return out;
}

int64_t spec_params(const TensorSpec& s) {
  if (s.name.size() > 13 && s.name.compare(s.name.size() - 13, 13, ".weight_scale") == 0) return 0;
  if (s.name.find(".A_log") != std::string::npos) return 0;  // counted as stored below
  return s.dtype == DType::U8 ? 2 * shape_numel(s.shape) : shape_numel(s.shape);
}

int64_t expert_params(const ModelConfig& c) {
  return 3 * int64_t{c.moe.intermediate_size} * c.moe.latent_size;
}

}  // namespace

std::vector<TensorSpec> checkpoint_schema(const ModelConfig& c) { return schema(c, true); }

int64_t parameter_count(const ModelConfig& c) {
  int64_t n = 0;
  for (const auto& s : schema(c, false)) n += spec_params(s);
  const int moe_layers = c.num_layers - c.moe.first_k_dense_replace;
  int kda_layers = 0;
  for (auto k : c.attn_kinds) kda_layers += k == AttnKind::KDA;
  return n + int64_t{moe_layers} * c.moe.num_experts * expert_params(c) + int64_t{kda_layers} * c.kda.num_heads;
}

int64_t active_parameter_count(const ModelConfig& c) {
  const int moe_layers = c.num_layers - c.moe.first_k_dense_replace;
  const int64_t D = c.hidden_size, V = c.vocab_size;
  return parameter_count(c) - int64_t{moe_layers} * (c.moe.num_experts - c.moe.experts_per_token) * expert_params(c) -
         (V - 1) * D;
}

}  // namespace k3
