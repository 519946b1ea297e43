// ModelConfig: the Kimi K3 / K3.1 text model as config.json describes it
// (top-level `text_config`, nested `linear_attn_config`, `quantization_config`,
// and K3.1's `dsa_config`). Every model-critical key is required: a missing or
// inconsistent one is an Error naming the key. Config keys live in one place
// (model_config.cpp, kKeys) so aliases are easy to add.
//
// LayerPlan: per layer (zero-based l) the attention kind (KDA, or full
// attention: MLA in K3, DSA in K3.1, l+1 in `full_attn_layers`), the FFN kind
// (dense for l < first_k_dense_replace, else MoE), and the Attention-Residual
// block bookkeeping of the fused attn_res (kimi-k3.md section 2).
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace k3 {

enum class AttnKind { KDA, MLA, DSA };
enum class FfnKind { Dense, MoE };
const char* attn_kind_name(AttnKind k);

struct KdaConfig {
  int num_heads = 0;        // H (96)
  int head_dim = 0;         // d, keys and values (128)
  int conv_kernel = 0;      // short_conv_kernel_size (4)
  float gate_lower_bound = 0;  // -5
  bool use_full_rank_gate = true;
};

struct MlaConfig {
  int num_heads = 0;        // 96
  int q_lora_rank = 0;      // 1536
  int kv_lora_rank = 0;     // 512
  int qk_nope_head_dim = 0; // 128
  int qk_rope_head_dim = 0; // 64 (the "pe" part; NoPE: never rotated)
  int v_head_dim = 0;       // 128
  bool use_output_gate = true;
  int qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  int cache_dim() const { return kv_lora_rank + qk_rope_head_dim; }  // 576 values per token
};

struct DsaConfig {
  int index_n_heads = 0;    // 32
  int index_head_dim = 0;   // 128
  int index_topk = 0;       // 2048
};

struct MoeConfig {
  int num_experts = 0;             // 896
  int experts_per_token = 0;       // 16
  int num_shared_experts = 0;      // 2
  int intermediate_size = 0;       // moe_intermediate_size, 3072
  int latent_size = 0;             // routed_expert_hidden_size, 3584
  bool latent_use_norm = true;
  bool renormalize = true;
  float routed_scaling_factor = 1.0f;
  int first_k_dense_replace = 1;
  int group_size = 32;             // MXFP4 block size
  int64_t shared_intermediate() const { return int64_t{num_shared_experts} * intermediate_size; }
};

struct ModelConfig {
  int hidden_size = 0;             // 7168
  int num_layers = 0;              // 93
  int vocab_size = 0;              // 163840
  int eos_token_id = -1;           // -1 when absent
  float rms_norm_eps = 0;          // 1e-5
  float situ_beta = 0;             // activation_situ_beta (4)
  float situ_linear_beta = 0;      // activation_situ_linear_beta (25)
  int attn_res_block_size = 0;     // 12
  int dense_intermediate_size = 0; // intermediate_size (33792)
  KdaConfig kda;
  MlaConfig mla;
  MoeConfig moe;
  std::optional<DsaConfig> dsa;    // K3.1
  std::vector<AttnKind> attn_kinds;  // per layer, zero-based

  // Parses a whole config.json (with `text_config`, or a bare text config).
  static ModelConfig from_json(const nlohmann::json& j);
  static ModelConfig from_file(const std::string& path);
  // Writes the config.json this project reads (and make-model emits).
  nlohmann::json to_json() const;

  bool is_dsa() const { return dsa.has_value(); }
  int num_attn_res_blocks() const { return (num_layers + attn_res_block_size - 1) / attn_res_block_size; }
};

struct LayerInfo {
  AttnKind attn;
  FfnKind ffn;
  bool block_start;      // l % block_size == 0: the partial sum is snapshotted before attention
  int blocks_before_attn;  // num_blocks mixed before attention: ceil(l / block_size)
  int block_write_idx;     // l / block_size when block_start, else -1
  int blocks_after_attn;   // blocks_before_attn + block_start
};

struct LayerPlan {
  std::vector<LayerInfo> layers;
  int num_blocks = 0;  // ceil(L / block_size): blocks mixed by the final attn_res
  static LayerPlan from(const ModelConfig& c);
  int count(AttnKind k) const;
  // Whose weights each layer reads when the layers of one kind (attention kind and FFN kind) share
  // `copies` sets of weights (a benchmark's rank that would not fit the GPU otherwise): layer l reads
  // those of the (i % copies)-th layer of its kind, i its index among them. copies = 0: every layer its
  // own (l -> l). [layers]; copies < 0 is an error.
  std::vector<int> weight_sources(int copies) const;
};

}  // namespace k3
