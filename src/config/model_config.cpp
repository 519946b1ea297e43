// ModelConfig from config.json (every model-critical key required), presets, and the LayerPlan.
#include "config/model_config.h"

#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"

namespace k3 {

namespace {

using json = nlohmann::json;

constexpr int64_t kMaxConfigInt = int64_t{1} << 24;

// The value of key `key` (at `where`) as T, strictly: an int is a JSON integer in int's range (not a float, not
// a bool), a float any JSON number, a bool a JSON bool, a list of ints an array of such ints. nlohmann's get<T>
// would turn 2.5 into 2 and true into 1 without a word.
template <typename T>
T strict(const json& v, const char* key, const std::string& where) {
  auto wrong = [&](const char* want) {
    fail("config: key {}{} must be {}, got {} {}", where, key, want, v.type_name(), v.dump().substr(0, 40));
  };
  // Every integer of a config (sizes, counts, layer numbers, token ids) is far below 2^24; the bound keeps
  // the sums and products the model forms of two of them inside their types.
  auto as_int = [&](const json& x) {
    if (!x.is_number_integer()) wrong("an integer");
    if (x.is_number_unsigned() && x.get<uint64_t>() > uint64_t{kMaxConfigInt}) wrong("an integer of at most 2^24");
    const int64_t i = x.get<int64_t>();
    if (i < -kMaxConfigInt || i > kMaxConfigInt) wrong("an integer of at most 2^24");
    return static_cast<int>(i);
  };
  if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean()) wrong("a boolean");
    return v.get<bool>();
  } else if constexpr (std::is_same_v<T, int>) {
    return as_int(v);
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!v.is_number() || !std::isfinite(v.get<double>()) || !std::isfinite(static_cast<double>(v.get<T>())))
      wrong("a finite number");
    return v.get<T>();
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!v.is_string()) wrong("a string");
    return v.get<std::string>();
  } else {
    static_assert(std::is_same_v<T, std::vector<int>>, "config: no strict reading of this type");
    if (!v.is_array()) wrong("an array of integers");
    std::vector<int> out;
    for (const json& x : v) out.push_back(as_int(x));
    return out;
  }
}

// Reads a required key of `obj` (at `where`) as T; names the key on failure.
template <typename T>
T need(const json& obj, const char* key, const std::string& where) {
  auto it = obj.find(key);
  K3_CHECK(it != obj.end() && !it->is_null(), "config: missing key {}{}", where, key);
  return strict<T>(*it, key, where);
}

template <typename T>
T want(const json& obj, const char* key, const std::string& where, T fallback) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return fallback;
  return strict<T>(*it, key, where);
}

void positive(int v, const std::string& key) { K3_CHECK(v > 0, "config: {} must be positive, got {}", key, v); }
void positive(float v, const std::string& key) { K3_CHECK(v > 0, "config: {} must be positive, got {}", key, v); }

std::vector<int> layer_list(const json& obj, const char* key, const std::string& where, int num_layers) {
  auto list = need<std::vector<int>>(obj, key, where);
  std::set<int> seen;
  for (int v : list) {
    K3_CHECK(v >= 1 && v <= num_layers, "config: {}{} holds layer {} outside 1..{} (the list is 1-based)", where,
             key, v, num_layers);
    K3_CHECK(seen.insert(v).second, "config: {}{} lists layer {} twice", where, key, v);
  }
  return list;
}

}  // namespace

const char* attn_kind_name(AttnKind k) {
  switch (k) {
    case AttnKind::KDA: return "KDA";
    case AttnKind::MLA: return "MLA";
    case AttnKind::DSA: return "DSA";
  }
  return "?";
}

ModelConfig ModelConfig::from_json(const json& root) {
  K3_CHECK(root.is_object(), "config: top level is not a JSON object");
  const json& t = root.contains("text_config") ? root.at("text_config") : root;
  K3_CHECK(t.is_object(), "config: text_config is not an object");
  const std::string w = root.contains("text_config") ? "text_config." : "";
  ModelConfig c;
  c.hidden_size = need<int>(t, "hidden_size", w);
  c.num_layers = need<int>(t, "num_hidden_layers", w);
  c.vocab_size = need<int>(t, "vocab_size", w);
  c.eos_token_id = want<int>(t, "eos_token_id", w, -1);
  c.rms_norm_eps = need<float>(t, "rms_norm_eps", w);
  positive(c.rms_norm_eps, w + "rms_norm_eps");
  auto act = need<std::string>(t, "hidden_act", w);
  K3_CHECK(act == "situ", "config: {}hidden_act is \"{}\"; only \"situ\" is supported", w, act);
  c.situ_beta = need<float>(t, "activation_situ_beta", w);
  c.situ_linear_beta = need<float>(t, "activation_situ_linear_beta", w);
  c.attn_res_block_size = need<int>(t, "attn_res_block_size", w);
  c.dense_intermediate_size = need<int>(t, "intermediate_size", w);
  positive(c.hidden_size, w + "hidden_size");
  positive(c.num_layers, w + "num_hidden_layers");
  positive(c.vocab_size, w + "vocab_size");
  positive(c.attn_res_block_size, w + "attn_res_block_size");
  positive(c.dense_intermediate_size, w + "intermediate_size");
  K3_CHECK(c.rms_norm_eps > 0, "config: {}rms_norm_eps must be positive", w);
  K3_CHECK(c.eos_token_id < c.vocab_size, "config: {}eos_token_id {} >= vocab_size {}", w, c.eos_token_id,
           c.vocab_size);

  // Linear attention (KDA) and the layer kinds.
  K3_CHECK(t.contains("linear_attn_config"), "config: missing key {}linear_attn_config", w);
  const json& la = t.at("linear_attn_config");
  const std::string lw = w + "linear_attn_config.";
  c.kda.num_heads = need<int>(la, "num_heads", lw);
  c.kda.head_dim = need<int>(la, "head_dim", lw);
  c.kda.conv_kernel = need<int>(la, "short_conv_kernel_size", lw);
  c.kda.gate_lower_bound = need<float>(la, "gate_lower_bound", lw);
  c.kda.use_full_rank_gate = need<bool>(la, "use_full_rank_gate", lw);
  positive(c.kda.num_heads, lw + "num_heads");
  positive(c.kda.head_dim, lw + "head_dim");
  positive(c.kda.conv_kernel, lw + "short_conv_kernel_size");
  K3_CHECK(c.kda.use_full_rank_gate, "config: {}use_full_rank_gate false is not supported", lw);
  auto full = layer_list(la, "full_attn_layers", lw, c.num_layers);
  if (la.contains("kda_layers")) {
    auto kda = layer_list(la, "kda_layers", lw, c.num_layers);
    std::set<int> all(full.begin(), full.end());
    for (int v : kda) K3_CHECK(all.insert(v).second, "config: layer {} is in both {}kda_layers and full_attn_layers", v, lw);
    K3_CHECK(static_cast<int>(all.size()) == c.num_layers,
             "config: {}kda_layers and full_attn_layers together cover {} of {} layers", lw, all.size(), c.num_layers);
  }

  // MLA (the full-attention layers' core, K3 and K3.1).
  c.mla.num_heads = need<int>(t, "num_attention_heads", w);
  c.mla.q_lora_rank = need<int>(t, "q_lora_rank", w);
  c.mla.kv_lora_rank = need<int>(t, "kv_lora_rank", w);
  c.mla.qk_nope_head_dim = need<int>(t, "qk_nope_head_dim", w);
  c.mla.qk_rope_head_dim = need<int>(t, "qk_rope_head_dim", w);
  c.mla.v_head_dim = need<int>(t, "v_head_dim", w);
  c.mla.use_output_gate = need<bool>(t, "mla_use_output_gate", w);
  K3_CHECK(need<bool>(t, "mla_use_nope", w), "config: {}mla_use_nope false (rotary MLA) is not supported", w);
  K3_CHECK(c.mla.use_output_gate, "config: {}mla_use_output_gate false is not supported", w);
  for (auto [v, k] : {std::pair{c.mla.num_heads, "num_attention_heads"}, {c.mla.q_lora_rank, "q_lora_rank"},
                      {c.mla.kv_lora_rank, "kv_lora_rank"}, {c.mla.qk_nope_head_dim, "qk_nope_head_dim"},
                      {c.mla.qk_rope_head_dim, "qk_rope_head_dim"}, {c.mla.v_head_dim, "v_head_dim"}})
    positive(v, w + k);

  // MoE.
  c.moe.num_experts = need<int>(t, "num_experts", w);
  c.moe.experts_per_token = need<int>(t, "num_experts_per_token", w);
  c.moe.num_shared_experts = need<int>(t, "num_shared_experts", w);
  c.moe.intermediate_size = need<int>(t, "moe_intermediate_size", w);
  c.moe.latent_size = need<int>(t, "routed_expert_hidden_size", w);
  c.moe.latent_use_norm = need<bool>(t, "latent_moe_use_norm", w);
  c.moe.renormalize = need<bool>(t, "moe_renormalize", w);
  c.moe.routed_scaling_factor = need<float>(t, "routed_scaling_factor", w);
  positive(c.moe.routed_scaling_factor, w + "routed_scaling_factor");
  c.moe.first_k_dense_replace = need<int>(t, "first_k_dense_replace", w);
  auto router = need<std::string>(t, "moe_router_activation_func", w);
  K3_CHECK(router == "sigmoid", "config: {}moe_router_activation_func \"{}\": only sigmoid is supported", w, router);
  K3_CHECK(want<int>(t, "num_expert_group", w, 1) == 1 && want<int>(t, "topk_group", w, 1) == 1,
           "config: {}num_expert_group / topk_group other than 1 are not supported", w);
  K3_CHECK(want<int>(t, "moe_layer_freq", w, 1) == 1, "config: {}moe_layer_freq other than 1 is not supported", w);
  K3_CHECK(c.moe.latent_use_norm, "config: {}latent_moe_use_norm false is not supported", w);
  positive(c.moe.num_experts, w + "num_experts");
  positive(c.moe.experts_per_token, w + "num_experts_per_token");
  positive(c.moe.num_shared_experts, w + "num_shared_experts");
  positive(c.moe.intermediate_size, w + "moe_intermediate_size");
  positive(c.moe.latent_size, w + "routed_expert_hidden_size");
  K3_CHECK(c.moe.experts_per_token <= c.moe.num_experts, "config: {}num_experts_per_token {} > num_experts {}", w,
           c.moe.experts_per_token, c.moe.num_experts);
  K3_CHECK(c.moe.first_k_dense_replace >= 0 && c.moe.first_k_dense_replace <= c.num_layers,
           "config: {}first_k_dense_replace {} outside 0..{}", w, c.moe.first_k_dense_replace, c.num_layers);
  if (t.contains("quantization_config")) {
    const json& q = t.at("quantization_config");
    c.moe.group_size = want<int>(q, "group_size", w + "quantization_config.", 32);
    K3_CHECK(c.moe.group_size == 32, "config: {}quantization_config.group_size {}: MXFP4 needs 32", w,
             c.moe.group_size);
  }
  K3_CHECK(c.moe.intermediate_size % 32 == 0 && c.moe.latent_size % 32 == 0,
           "config: {}moe_intermediate_size {} and routed_expert_hidden_size {} must be multiples of 32 (MXFP4 groups)",
           w, c.moe.intermediate_size, c.moe.latent_size);

  // DSA (K3.1): the same layers as full_attn_layers.
  if (t.contains("dsa_config") && !t.at("dsa_config").is_null()) {
    const json& d = t.at("dsa_config");
    const std::string dw = w + "dsa_config.";
    DsaConfig dsa;
    dsa.index_n_heads = need<int>(d, "index_n_heads", dw);
    dsa.index_head_dim = need<int>(d, "index_head_dim", dw);
    dsa.index_topk = need<int>(d, "index_topk", dw);
    positive(dsa.index_n_heads, dw + "index_n_heads");
    positive(dsa.index_head_dim, dw + "index_head_dim");
    positive(dsa.index_topk, dw + "index_topk");
    auto layers = layer_list(d, "dsa_layers", dw, c.num_layers);
    std::sort(layers.begin(), layers.end());
    auto f = full;
    std::sort(f.begin(), f.end());
    K3_CHECK(layers == f, "config: {}dsa_layers must equal linear_attn_config.full_attn_layers", dw);
    c.dsa = dsa;
  }

  c.attn_kinds.assign(c.num_layers, AttnKind::KDA);
  for (int v : full) c.attn_kinds[v - 1] = c.dsa ? AttnKind::DSA : AttnKind::MLA;
  return c;
}

ModelConfig ModelConfig::from_file(const std::string& path) {
  std::ifstream in(path);
  K3_CHECK(in.good(), "config: cannot open {}", path);
  json j;
  try {
    j = json::parse(in);
  } catch (const json::parse_error& e) {
    fail("config: {} is not valid JSON: {}", path, e.what());
  }
  try {
    return from_json(j);
  } catch (const Error& e) {
    fail("{} ({})", e.what(), path);
  }
}

json ModelConfig::to_json() const {
  json full = json::array(), kda_list = json::array();
  for (int l = 0; l < num_layers; ++l) (attn_kinds[l] == AttnKind::KDA ? kda_list : full).push_back(l + 1);
  json t = {
      {"model_type", "kimi_linear"},
      {"architectures", {"KimiLinearForCausalLM"}},
      {"hidden_size", hidden_size},
      {"num_hidden_layers", num_layers},
      {"vocab_size", vocab_size},
      {"eos_token_id", eos_token_id},
      {"tie_word_embeddings", false},
      {"rms_norm_eps", rms_norm_eps},
      {"hidden_act", "situ"},
      {"activation_situ_beta", situ_beta},
      {"activation_situ_linear_beta", situ_linear_beta},
      {"num_attention_heads", mla.num_heads},
      {"num_key_value_heads", mla.num_heads},
      {"q_lora_rank", mla.q_lora_rank},
      {"kv_lora_rank", mla.kv_lora_rank},
      {"qk_nope_head_dim", mla.qk_nope_head_dim},
      {"qk_rope_head_dim", mla.qk_rope_head_dim},
      {"v_head_dim", mla.v_head_dim},
      {"mla_use_nope", true},
      {"mla_use_output_gate", mla.use_output_gate},
      {"num_experts", moe.num_experts},
      {"num_experts_per_token", moe.experts_per_token},
      {"num_shared_experts", moe.num_shared_experts},
      {"moe_intermediate_size", moe.intermediate_size},
      {"routed_expert_hidden_size", moe.latent_size},
      {"latent_moe_use_norm", moe.latent_use_norm},
      {"moe_router_activation_func", "sigmoid"},
      {"moe_renormalize", moe.renormalize},
      {"routed_scaling_factor", moe.routed_scaling_factor},
      {"num_expert_group", 1},
      {"topk_group", 1},
      {"first_k_dense_replace", moe.first_k_dense_replace},
      {"moe_layer_freq", 1},
      {"intermediate_size", dense_intermediate_size},
      {"attn_res_block_size", attn_res_block_size},
      {"dtype", "bfloat16"},
      {"linear_attn_config",
       {{"num_heads", kda.num_heads},
        {"head_dim", kda.head_dim},
        {"short_conv_kernel_size", kda.conv_kernel},
        {"use_full_rank_gate", kda.use_full_rank_gate},
        {"gate_lower_bound", kda.gate_lower_bound},
        {"full_attn_layers", full},
        {"kda_layers", kda_list}}},
      {"quantization_config",
       {{"quant_method", "compressed-tensors"},
        {"format", "mxfp4-pack-quantized"},
        {"num_bits", 4},
        {"group_size", moe.group_size},
        {"ignore", {"lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\..*", "re:.*gate$",
                    "re:.*routed_expert.*"}}}},
  };
  if (dsa) {
    t["dsa_config"] = {{"index_n_heads", dsa->index_n_heads},
                       {"index_head_dim", dsa->index_head_dim},
                       {"index_topk", dsa->index_topk},
                       {"dsa_layers", full}};
  }
  return json{{"model_type", "kimi_k3"},
              {"architectures", {dsa ? "KimiK31ForConditionalGeneration" : "KimiK3ForConditionalGeneration"}},
              {"text_config", t}};
}

LayerPlan LayerPlan::from(const ModelConfig& c) {
  LayerPlan p;
  const int bs = c.attn_res_block_size;
  for (int l = 0; l < c.num_layers; ++l) {
    LayerInfo li;
    li.attn = c.attn_kinds.at(l);
    li.ffn = l < c.moe.first_k_dense_replace ? FfnKind::Dense : FfnKind::MoE;
    li.block_start = l % bs == 0;
    li.blocks_before_attn = (l + bs - 1) / bs;
    li.block_write_idx = li.block_start ? l / bs : -1;
    li.blocks_after_attn = li.blocks_before_attn + (li.block_start ? 1 : 0);
    p.layers.push_back(li);
  }
  p.num_blocks = c.num_attn_res_blocks();
  return p;
}

int LayerPlan::count(AttnKind k) const {
  return static_cast<int>(std::count_if(layers.begin(), layers.end(), [k](const LayerInfo& l) { return l.attn == k; }));
}

std::vector<int> LayerPlan::weight_sources(int copies) const {
  K3_CHECK(copies >= 0, "layer weight copies: {} (expected 0 = every layer its own, or a positive count)", copies);
  std::vector<int> src(layers.size());
  // The layers of each kind so far, in order: the i-th of a kind reads the (i % copies)-th's weights.
  std::vector<std::pair<std::pair<AttnKind, FfnKind>, std::vector<int>>> kinds;
  for (size_t l = 0; l < layers.size(); ++l) {
    src[l] = static_cast<int>(l);
    if (copies == 0) continue;
    const auto kind = std::make_pair(layers[l].attn, layers[l].ffn);
    auto it = std::find_if(kinds.begin(), kinds.end(), [&](const auto& k) { return k.first == kind; });
    if (it == kinds.end()) it = kinds.insert(kinds.end(), {kind, {}});
    std::vector<int>& seen = it->second;
    if (static_cast<int>(seen.size()) >= copies) src[l] = seen[seen.size() % static_cast<size_t>(copies)];
    seen.push_back(static_cast<int>(l));
  }
  return src;
}

}  // namespace k3
