// ModelConfig and LayerPlan against expectations written from kimi-k3.md
// sections 1-3 (not from the code under test): layer kinds, AttnRes block
// bookkeeping, the parameter count from the checkpoint shapes, and rejection
// of missing or inconsistent keys.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "config/model_config.h"
#include "config/schema.h"
#include "core/env.h"
#include "core/error.h"
#include "core/rng.h"
#include "fuzz_util.h"

namespace {

using nlohmann::json;
using k3::AttnKind;
using k3::FfnKind;

const std::string kK3 = std::string(K3_CONFIG_DIR) + "/kimi-k3.config.json";
const std::string kK31 = std::string(K3_CONFIG_DIR) + "/kimi-k3.1.config.json";

// A missing or unreadable config fails the test (it throws), it never skips it.
json load(const std::string& path) {
  std::ifstream in(path);
  if (!in.good()) throw std::runtime_error("cannot read " + path);
  return json::parse(in);
}

// Message of the k3::Error that f throws ("" and a failure when it throws nothing or something else).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const k3::Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a k3::Error: " << e.what();
    return "";
  }
  ADD_FAILURE() << "no error thrown";
  return "";
}

// `key` appears in msg as a whole key, not inside a longer one (num_experts vs num_experts_per_token,
// intermediate_size vs moe_intermediate_size).
bool mentions_key(const std::string& msg, const std::string& key) {
  auto ident = [](char ch) { return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_'; };
  for (size_t pos = msg.find(key); pos != std::string::npos; pos = msg.find(key, pos + 1)) {
    const size_t after = pos + key.size();
    if ((pos == 0 || !ident(msg[pos - 1])) && (after == msg.size() || !ident(msg[after]))) return true;
  }
  return false;
}

bool is_full_attention_k3(int l) { return (l + 1) % 4 == 0 || l + 1 == 93; }

// ---------------------------------------------------------------- the shared configs

TEST(ConfigShared, K3FieldsMatchTheSpec) {
  const auto c = k3::ModelConfig::from_file(kK3);
  EXPECT_EQ(c.hidden_size, 7168);
  EXPECT_EQ(c.num_layers, 93);
  EXPECT_EQ(c.vocab_size, 163840);
  EXPECT_EQ(c.eos_token_id, 163586);
  EXPECT_FLOAT_EQ(c.rms_norm_eps, 1e-5f);
  EXPECT_FLOAT_EQ(c.situ_beta, 4.0f);
  EXPECT_FLOAT_EQ(c.situ_linear_beta, 25.0f);
  EXPECT_EQ(c.attn_res_block_size, 12);
  EXPECT_EQ(c.dense_intermediate_size, 33792);
  EXPECT_EQ(c.kda.num_heads, 96);
  EXPECT_EQ(c.kda.head_dim, 128);
  EXPECT_EQ(c.kda.conv_kernel, 4);
  EXPECT_FLOAT_EQ(c.kda.gate_lower_bound, -5.0f);
  EXPECT_TRUE(c.kda.use_full_rank_gate);
  EXPECT_EQ(c.mla.num_heads, 96);
  EXPECT_EQ(c.mla.q_lora_rank, 1536);
  EXPECT_EQ(c.mla.kv_lora_rank, 512);
  EXPECT_EQ(c.mla.qk_nope_head_dim, 128);
  EXPECT_EQ(c.mla.qk_rope_head_dim, 64);
  EXPECT_EQ(c.mla.v_head_dim, 128);
  EXPECT_EQ(c.mla.cache_dim(), 576);
  EXPECT_EQ(c.mla.qk_head_dim(), 192);
  EXPECT_EQ(c.moe.num_experts, 896);
  EXPECT_EQ(c.moe.experts_per_token, 16);
  EXPECT_EQ(c.moe.num_shared_experts, 2);
  EXPECT_EQ(c.moe.intermediate_size, 3072);
  EXPECT_EQ(c.moe.latent_size, 3584);
  EXPECT_EQ(c.moe.shared_intermediate(), 6144);
  EXPECT_FLOAT_EQ(c.moe.routed_scaling_factor, 1.0f);
  EXPECT_EQ(c.moe.first_k_dense_replace, 1);
  EXPECT_EQ(c.moe.group_size, 32);
  EXPECT_FALSE(c.is_dsa());
  EXPECT_EQ(c.num_attn_res_blocks(), 8);
}

TEST(ConfigShared, K31HasDsa) {
  const auto c = k3::ModelConfig::from_file(kK31);
  ASSERT_TRUE(c.is_dsa());
  EXPECT_EQ(c.dsa->index_n_heads, 32);
  EXPECT_EQ(c.dsa->index_head_dim, 128);
  EXPECT_EQ(c.dsa->index_topk, 2048);
  EXPECT_EQ(c.hidden_size, 7168);
  EXPECT_EQ(c.num_layers, 93);
  EXPECT_EQ(c.moe.num_experts, 896);
}

void expect_k3_plan(const k3::ModelConfig& c, AttnKind full_kind) {
  const auto plan = k3::LayerPlan::from(c);
  ASSERT_EQ(plan.layers.size(), 93u);
  EXPECT_EQ(plan.num_blocks, 8);
  EXPECT_EQ(plan.count(AttnKind::KDA), 69);
  EXPECT_EQ(plan.count(full_kind), 24);
  EXPECT_EQ(plan.count(full_kind == AttnKind::MLA ? AttnKind::DSA : AttnKind::MLA), 0);
  for (int l = 0; l < 93; ++l) {
    const auto& li = plan.layers[l];
    SCOPED_TRACE("layer " + std::to_string(l));
    EXPECT_EQ(li.attn, is_full_attention_k3(l) ? full_kind : AttnKind::KDA);
    EXPECT_EQ(c.attn_kinds[l], li.attn);
    EXPECT_EQ(li.ffn, l == 0 ? FfnKind::Dense : FfnKind::MoE);
    EXPECT_EQ(li.block_start, l % 12 == 0);
    EXPECT_EQ(li.blocks_before_attn, static_cast<int>(std::ceil(l / 12.0)));
    EXPECT_EQ(li.block_write_idx, l % 12 == 0 ? l / 12 : -1);
    EXPECT_EQ(li.blocks_after_attn, static_cast<int>(std::ceil(l / 12.0)) + (l % 12 == 0 ? 1 : 0));
  }
  // The spec's own examples: (K K K M) x 22 then K K K M M.
  for (int l : {0, 1, 2, 4, 88, 89, 90}) EXPECT_EQ(plan.layers[l].attn, AttnKind::KDA) << l;
  for (int l : {3, 7, 87, 91, 92}) EXPECT_EQ(plan.layers[l].attn, full_kind) << l;
  // Hand-checked AttnRes bookkeeping.
  EXPECT_EQ(plan.layers[0].blocks_before_attn, 0);
  EXPECT_EQ(plan.layers[0].block_write_idx, 0);
  EXPECT_EQ(plan.layers[0].blocks_after_attn, 1);
  EXPECT_EQ(plan.layers[1].blocks_before_attn, 1);
  EXPECT_EQ(plan.layers[1].block_write_idx, -1);
  EXPECT_EQ(plan.layers[1].blocks_after_attn, 1);
  EXPECT_EQ(plan.layers[12].blocks_before_attn, 1);
  EXPECT_EQ(plan.layers[12].block_write_idx, 1);
  EXPECT_EQ(plan.layers[12].blocks_after_attn, 2);
  EXPECT_EQ(plan.layers[84].blocks_before_attn, 7);
  EXPECT_EQ(plan.layers[84].block_write_idx, 7);
  EXPECT_EQ(plan.layers[84].blocks_after_attn, 8);
  EXPECT_EQ(plan.layers[92].blocks_before_attn, 8);
  EXPECT_EQ(plan.layers[92].block_write_idx, -1);
  EXPECT_EQ(plan.layers[92].blocks_after_attn, 8);
}

TEST(ConfigLayerPlan, K3) { expect_k3_plan(k3::ModelConfig::from_file(kK3), AttnKind::MLA); }
TEST(ConfigLayerPlan, K31) { expect_k3_plan(k3::ModelConfig::from_file(kK31), AttnKind::DSA); }

TEST(ConfigLayerPlan, BareTextConfigParsesTheSame) {
  const auto c = k3::ModelConfig::from_json(load(kK3).at("text_config"));
  expect_k3_plan(c, AttnKind::MLA);
}

TEST(ConfigLayerPlan, KdaLayersListIsOptional) {
  json j = load(kK3);
  j["text_config"]["linear_attn_config"].erase("kda_layers");
  expect_k3_plan(k3::ModelConfig::from_json(j), AttnKind::MLA);
}

TEST(ConfigLayerPlan, NoDenseLayerWhenFirstKDenseIsZero) {
  json j = load(kK3);
  j["text_config"]["first_k_dense_replace"] = 0;
  const auto plan = k3::LayerPlan::from(k3::ModelConfig::from_json(j));
  for (const auto& li : plan.layers) EXPECT_EQ(li.ffn, FfnKind::MoE);
}

// A benchmark rank whose layers of one kind share `copies` sets of weights: checked against the kind lists
// built here (a layer reads the weights of the layer at its index modulo copies in its kind's list).
TEST(ConfigLayerPlan, WeightSourcesRotateWithinEachKind) {
  for (const std::string& path : {kK3, kK31}) {
    const auto plan = k3::LayerPlan::from(k3::ModelConfig::from_file(path));
    const int L = static_cast<int>(plan.layers.size());
    std::vector<std::vector<int>> lists;  // the layers of each (attention, FFN) kind, in order
    std::vector<int> list_of(static_cast<size_t>(L), -1);
    for (int l = 0; l < L; ++l) {
      for (int k = 0; k < static_cast<int>(lists.size()) && list_of[l] < 0; ++k) {
        const auto& first = plan.layers[static_cast<size_t>(lists[k][0])];
        if (first.attn == plan.layers[l].attn && first.ffn == plan.layers[l].ffn) list_of[l] = k;
      }
      if (list_of[l] < 0) {
        list_of[l] = static_cast<int>(lists.size());
        lists.emplace_back();
      }
      lists[static_cast<size_t>(list_of[l])].push_back(l);
    }
    ASSERT_GE(lists.size(), 3u) << path;  // dense, KDA + MoE, full attention + MoE
    for (int copies : {0, 1, 2, 3, 7, 1000}) {
      const std::vector<int> src = plan.weight_sources(copies);
      ASSERT_EQ(static_cast<int>(src.size()), L);
      for (const auto& list : lists)
        for (size_t i = 0; i < list.size(); ++i) {
          const int want = copies == 0 ? list[i] : list[i % static_cast<size_t>(copies)];
          EXPECT_EQ(src[static_cast<size_t>(list[i])], want) << path << " copies " << copies << " layer " << list[i];
        }
      std::set<int> distinct(src.begin(), src.end());
      size_t expect = 0;
      for (const auto& list : lists) expect += copies == 0 ? list.size() : std::min(list.size(), size_t(copies));
      EXPECT_EQ(distinct.size(), expect) << path << " copies " << copies;
    }
  }
  const auto plan = k3::LayerPlan::from(k3::ModelConfig::from_file(kK3));
  EXPECT_THROW(plan.weight_sources(-1), std::exception);
}

// ---------------------------------------------------------------- parameter count

// kimi-k3.md section 3, shape by shape. MXFP4 packed bytes hold two parameters,
// scales none; A_log counts the 96 heads it serves (its storage is padded to 128).
int64_t k3_parameters_by_hand() {
  const int64_t D = 7168, V = 163840, HD = 96 * 128;
  const int64_t global = V * D /* embed_tokens */ + V * D /* lm_head */ + D /* output_attn_res_norm */ +
                         1 * D /* output_attn_res_proj */ + D /* norm */;
  const int64_t layer_norms = D + D + D + 1 * D + D + 1 * D;  // input, post_attention, self_attention_res {norm, proj}, mlp_res {norm, proj}
  const int64_t kda = 4 * HD * D          // q, k, v, g
                      + 3 * HD * 1 * 4    // q, k, v conv1d
                      + 128 * D           // f_a
                      + HD * 128          // f_b
                      + 96 * D            // b
                      + 96                // A_log
                      + HD                // dt_bias
                      + 128               // o_norm
                      + D * HD;           // o_proj
  const int64_t mla = 1536 * D + 1536 + 18432 * 1536 + 576 * D + 512 + 24576 * 512 + HD * D + D * HD;
  const int64_t expert = 2 * (3072 * 1792) * 2  // w1, w3 packed
                         + (3584 * 1536) * 2;   // w2 packed
  const int64_t moe = 896 * D + 896                 // gate, e_score_correction_bias
                      + 3584 * D + 3584 + D * 3584  // routed_expert down, norm, up
                      + 2 * 6144 * D + D * 6144     // shared experts
                      + 896 * expert;
  const int64_t dense = 2 * 33792 * D + D * 33792;
  return global + 93 * layer_norms + 69 * kda + 24 * mla + 92 * moe + 1 * dense;
}

TEST(ConfigParameters, K3CountMatchesSpecShapes) {
  EXPECT_EQ(2 * (3072 * 1792) * 2 + (3584 * 1536) * 2, int64_t{3} * 3584 * 3072);
  const auto c = k3::ModelConfig::from_file(kK3);
  const int64_t n = k3::parameter_count(c);
  EXPECT_GT(n, int64_t{2'700'000'000'000});
  EXPECT_LT(n, int64_t{2'850'000'000'000});
  EXPECT_EQ(n, k3_parameters_by_hand());
}

TEST(ConfigParameters, K31AddsTheIndexers) {
  const int64_t D = 7168;
  const int64_t indexer = 32 * 128 * 1536 + 128 * D + 32 * D + 128 + 128;  // wq_b, wk, weights_proj, k_norm
  EXPECT_EQ(k3::parameter_count(k3::ModelConfig::from_file(kK31)), k3_parameters_by_hand() + 24 * indexer);
}

// ---------------------------------------------------------------- missing keys

struct Key {
  bool k31;                       // erase it from the K3.1 config
  std::vector<std::string> path;  // under text_config
  std::string dotted() const {
    std::string s;
    for (const auto& p : path) s += (s.empty() ? "" : ".") + p;
    return s;
  }
};

class ConfigMissingKey : public ::testing::TestWithParam<Key> {};

TEST_P(ConfigMissingKey, ErrorNamesTheKey) {
  const Key& k = GetParam();
  json j = load(k.k31 ? kK31 : kK3);
  json* obj = &j["text_config"];
  for (size_t i = 0; i + 1 < k.path.size(); ++i) obj = &obj->at(k.path[i]);
  ASSERT_EQ(obj->erase(k.path.back()), 1u) << k.dotted();
  const std::string msg = error_of([&] { k3::ModelConfig::from_json(j); });
  EXPECT_TRUE(mentions_key(msg, k.dotted())) << msg;
}

INSTANTIATE_TEST_SUITE_P(
    Config, ConfigMissingKey,
    ::testing::Values(Key{false, {"hidden_size"}}, Key{false, {"num_hidden_layers"}}, Key{false, {"vocab_size"}},
                      Key{false, {"rms_norm_eps"}}, Key{false, {"linear_attn_config"}},
                      Key{false, {"linear_attn_config", "full_attn_layers"}},
                      Key{false, {"linear_attn_config", "num_heads"}}, Key{false, {"linear_attn_config", "head_dim"}},
                      Key{false, {"kv_lora_rank"}}, Key{false, {"q_lora_rank"}}, Key{false, {"num_attention_heads"}},
                      Key{false, {"num_experts"}}, Key{false, {"num_experts_per_token"}},
                      Key{false, {"moe_intermediate_size"}}, Key{false, {"routed_expert_hidden_size"}},
                      Key{false, {"intermediate_size"}}, Key{false, {"attn_res_block_size"}},
                      Key{true, {"dsa_config", "index_topk"}}, Key{true, {"dsa_config", "dsa_layers"}},
                      Key{true, {"hidden_size"}}),
    [](const ::testing::TestParamInfo<Key>& info) {
      std::string s = (info.param.k31 ? "K31_" : "K3_") + info.param.dotted();
      for (char& ch : s)
        if (ch == '.') ch = '_';
      return s;
    });

// ---------------------------------------------------------------- inconsistent configs

std::string error_with(const std::string& path, const std::function<void(json&)>& edit) {
  json j = load(path);
  edit(j["text_config"]);
  return error_of([&] { k3::ModelConfig::from_json(j); });
}

// Without kda_layers, so that only the range check of full_attn_layers can catch the entry.
void expect_full_attn_entry_rejected(int entry) {
  const auto msg = error_with(kK3, [&](json& t) {
    t["linear_attn_config"].erase("kda_layers");
    t["linear_attn_config"]["full_attn_layers"].push_back(entry);
  });
  EXPECT_TRUE(mentions_key(msg, "full_attn_layers")) << msg;
  EXPECT_TRUE(mentions_key(msg, std::to_string(entry))) << msg;
}

TEST(ConfigInvalid, FullAttnLayerZeroIsOutOfRange) { expect_full_attn_entry_rejected(0); }  // 1-based
TEST(ConfigInvalid, FullAttnLayer94IsOutOfRange) { expect_full_attn_entry_rejected(94); }
TEST(ConfigInvalid, FullAttnLayerNegative) { expect_full_attn_entry_rejected(-1); }

TEST(ConfigInvalid, FullAttnLayerZeroWithKdaLayers) {
  const auto msg = error_with(kK3, [](json& t) { t["linear_attn_config"]["full_attn_layers"][0] = 0; });
  EXPECT_TRUE(mentions_key(msg, "full_attn_layers")) << msg;
}

TEST(ConfigInvalid, FullAttnLayer93IsInRange) {
  // The last layer, 1-based, is legal (and in the shared config already).
  const auto c = k3::ModelConfig::from_json(load(kK3));
  EXPECT_EQ(c.attn_kinds.back(), AttnKind::MLA);
}

TEST(ConfigInvalid, DuplicatedLayer) {
  const auto msg = error_with(kK3, [](json& t) { t["linear_attn_config"]["full_attn_layers"].push_back(8); });
  EXPECT_TRUE(mentions_key(msg, "full_attn_layers")) << msg;
  EXPECT_NE(msg.find("8"), std::string::npos) << msg;
}

TEST(ConfigInvalid, LayerInBothLists) {
  const auto msg = error_with(kK3, [](json& t) {
    auto& la = t["linear_attn_config"];
    la["kda_layers"].push_back(4);
  });
  EXPECT_TRUE(mentions_key(msg, "kda_layers")) << msg;
}

TEST(ConfigInvalid, DsaLayersDifferFromFullAttnLayers) {
  const auto msg = error_with(kK31, [](json& t) {
    auto& d = t["dsa_config"]["dsa_layers"];
    d.erase(d.size() - 1);  // drop 93
    d.push_back(91);
  });
  EXPECT_TRUE(mentions_key(msg, "dsa_layers")) << msg;
  const auto missing = error_with(kK31, [](json& t) { t["dsa_config"]["dsa_layers"].erase(size_t{0}); });
  EXPECT_TRUE(mentions_key(missing, "dsa_layers")) << missing;
}

TEST(ConfigInvalid, MoreExpertsPerTokenThanExperts) {
  const auto msg = error_with(kK3, [](json& t) { t["num_experts_per_token"] = 897; });
  EXPECT_TRUE(mentions_key(msg, "num_experts_per_token")) << msg;
}

TEST(ConfigInvalid, WrongJsonType) {
  const auto msg = error_with(kK3, [](json& t) { t["hidden_size"] = "7168"; });
  EXPECT_TRUE(mentions_key(msg, "hidden_size")) << msg;
  const auto list = error_with(kK3, [](json& t) { t["linear_attn_config"]["full_attn_layers"] = "4,8"; });
  EXPECT_TRUE(mentions_key(list, "full_attn_layers")) << list;
}

TEST(ConfigInvalid, NonPositiveSizes) {
  for (const char* key : {"hidden_size", "num_hidden_layers", "vocab_size", "attn_res_block_size", "num_experts"}) {
    const auto msg = error_with(kK3, [&](json& t) { t[key] = 0; });
    EXPECT_TRUE(mentions_key(msg, key)) << msg;
  }
}

TEST(ConfigInvalid, TopLevelNotAnObject) {
  EXPECT_THROW(k3::ModelConfig::from_json(json::array({1, 2})), k3::Error);
}

TEST(ConfigFile, NonexistentPath) {
  const std::string path = (std::filesystem::temp_directory_path() / "k3_no_such_config_dir" / "config.json").string();
  const std::string msg = error_of([&] { k3::ModelConfig::from_file(path); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
}

TEST(ConfigFile, InvalidJson) {
  const auto path = std::filesystem::temp_directory_path() / ("k3_bad_config_" + std::to_string(::getpid()) + ".json");
  std::ofstream(path) << "{\"text_config\": {\"hidden_size\": 7168,";
  const std::string msg = error_of([&] { k3::ModelConfig::from_file(path.string()); });
  std::filesystem::remove(path);
  EXPECT_NE(msg.find(path.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("JSON"), std::string::npos) << msg;
}

// ---------------------------------------------------------------- round trip

void expect_same_config(const k3::ModelConfig& a, const k3::ModelConfig& b) {
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.num_layers, b.num_layers);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.eos_token_id, b.eos_token_id);
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_EQ(a.situ_beta, b.situ_beta);
  EXPECT_EQ(a.situ_linear_beta, b.situ_linear_beta);
  EXPECT_EQ(a.attn_res_block_size, b.attn_res_block_size);
  EXPECT_EQ(a.dense_intermediate_size, b.dense_intermediate_size);
  EXPECT_EQ(a.kda.num_heads, b.kda.num_heads);
  EXPECT_EQ(a.kda.head_dim, b.kda.head_dim);
  EXPECT_EQ(a.kda.conv_kernel, b.kda.conv_kernel);
  EXPECT_EQ(a.kda.gate_lower_bound, b.kda.gate_lower_bound);
  EXPECT_EQ(a.kda.use_full_rank_gate, b.kda.use_full_rank_gate);
  EXPECT_EQ(a.mla.num_heads, b.mla.num_heads);
  EXPECT_EQ(a.mla.q_lora_rank, b.mla.q_lora_rank);
  EXPECT_EQ(a.mla.kv_lora_rank, b.mla.kv_lora_rank);
  EXPECT_EQ(a.mla.qk_nope_head_dim, b.mla.qk_nope_head_dim);
  EXPECT_EQ(a.mla.qk_rope_head_dim, b.mla.qk_rope_head_dim);
  EXPECT_EQ(a.mla.v_head_dim, b.mla.v_head_dim);
  EXPECT_EQ(a.mla.use_output_gate, b.mla.use_output_gate);
  EXPECT_EQ(a.moe.num_experts, b.moe.num_experts);
  EXPECT_EQ(a.moe.experts_per_token, b.moe.experts_per_token);
  EXPECT_EQ(a.moe.num_shared_experts, b.moe.num_shared_experts);
  EXPECT_EQ(a.moe.intermediate_size, b.moe.intermediate_size);
  EXPECT_EQ(a.moe.latent_size, b.moe.latent_size);
  EXPECT_EQ(a.moe.latent_use_norm, b.moe.latent_use_norm);
  EXPECT_EQ(a.moe.renormalize, b.moe.renormalize);
  EXPECT_EQ(a.moe.routed_scaling_factor, b.moe.routed_scaling_factor);
  EXPECT_EQ(a.moe.first_k_dense_replace, b.moe.first_k_dense_replace);
  EXPECT_EQ(a.moe.group_size, b.moe.group_size);
  ASSERT_EQ(a.dsa.has_value(), b.dsa.has_value());
  if (a.dsa) {
    EXPECT_EQ(a.dsa->index_n_heads, b.dsa->index_n_heads);
    EXPECT_EQ(a.dsa->index_head_dim, b.dsa->index_head_dim);
    EXPECT_EQ(a.dsa->index_topk, b.dsa->index_topk);
  }
  EXPECT_EQ(a.attn_kinds, b.attn_kinds);

  const auto pa = k3::LayerPlan::from(a), pb = k3::LayerPlan::from(b);
  EXPECT_EQ(pa.num_blocks, pb.num_blocks);
  ASSERT_EQ(pa.layers.size(), pb.layers.size());
  for (size_t l = 0; l < pa.layers.size(); ++l) {
    EXPECT_EQ(pa.layers[l].attn, pb.layers[l].attn) << l;
    EXPECT_EQ(pa.layers[l].ffn, pb.layers[l].ffn) << l;
    EXPECT_EQ(pa.layers[l].block_start, pb.layers[l].block_start) << l;
    EXPECT_EQ(pa.layers[l].blocks_before_attn, pb.layers[l].blocks_before_attn) << l;
    EXPECT_EQ(pa.layers[l].block_write_idx, pb.layers[l].block_write_idx) << l;
    EXPECT_EQ(pa.layers[l].blocks_after_attn, pb.layers[l].blocks_after_attn) << l;
  }
}

TEST(ConfigRoundTrip, K3) {
  const auto c = k3::ModelConfig::from_file(kK3);
  const json j = c.to_json();
  expect_same_config(c, k3::ModelConfig::from_json(j));
  // Through text as config.json is written.
  expect_same_config(c, k3::ModelConfig::from_json(json::parse(j.dump(1))));
  EXPECT_EQ(j.at("text_config").at("linear_attn_config").at("full_attn_layers"),
            load(kK3).at("text_config").at("linear_attn_config").at("full_attn_layers"));
}

TEST(ConfigRoundTrip, K31) {
  const auto c = k3::ModelConfig::from_file(kK31);
  const json j = c.to_json();
  expect_same_config(c, k3::ModelConfig::from_json(json::parse(j.dump(1))));
  EXPECT_EQ(j.at("text_config").at("dsa_config").at("dsa_layers"),
            load(kK31).at("text_config").at("dsa_config").at("dsa_layers"));
}

TEST(ConfigRoundTrip, TinyIrregularConfig) {
  // A small config of the same family with an unusual layout survives the round trip.
  json j = load(kK3);
  auto& t = j["text_config"];
  t["num_hidden_layers"] = 5;
  t["attn_res_block_size"] = 2;
  t["first_k_dense_replace"] = 2;
  t["linear_attn_config"]["full_attn_layers"] = {2, 5};
  t["linear_attn_config"]["kda_layers"] = {1, 3, 4};
  const auto c = k3::ModelConfig::from_json(j);
  EXPECT_EQ(c.attn_kinds, (std::vector<AttnKind>{AttnKind::KDA, AttnKind::MLA, AttnKind::KDA, AttnKind::KDA,
                                                 AttnKind::MLA}));
  const auto plan = k3::LayerPlan::from(c);
  EXPECT_EQ(plan.num_blocks, 3);
  EXPECT_EQ(plan.layers[1].ffn, FfnKind::Dense);
  EXPECT_EQ(plan.layers[2].ffn, FfnKind::MoE);
  EXPECT_EQ(plan.layers[4].block_write_idx, 2);
  EXPECT_EQ(plan.layers[3].blocks_before_attn, 2);
  expect_same_config(c, k3::ModelConfig::from_json(c.to_json()));
}

}  // namespace

// Seeded mutations of the K3 and K3.1 configs: a value anywhere in the tree (a key of an object, an element of
// an array, at any depth) replaced by one of another type or out of range. Each parses, or fails with a
// one-line k3::Error; no other exception, no crash (run under ASan in CI). A config that parses also gives a
// layer plan and a parameter count, or a k3::Error.
TEST(ConfigInvalid, MutatedConfigsParseOrFailCleanly) {
  const json values[] = {nullptr, true, false, 0, -1, 1, 2, 7, 1 << 20, int64_t{1} << 40, -(int64_t{1} << 40),
                         2.5, -0.5, 1e30, -1e30, "", "x", "3", json::array(), json::array({1, 2}),
                         json::array({-1}), json::array({"a"}), json::object(), json::object({{"a", 1}})};
  k3::Rng rng(77);
  int parsed = 0, refused = 0;
  for (const std::string& path : {kK3, kK31}) {
    const json base = load(path);
    for (int it = 0; it < 400; ++it) {
      json j = base;
      // The model reads text_config: start there (the top level holds a few keys it never reads).
      json* at = j.contains("text_config") ? &j["text_config"] : &j;
      std::string where = j.contains("text_config") ? "/text_config" : "";
      // Walk down 1 to 5 levels at random, then replace what is there.
      for (int depth = 1 + static_cast<int>(rng.below(5)); depth > 0 && (at->is_object() || at->is_array()) &&
                                                           !at->empty();
           --depth) {
        if (at->is_object()) {
          auto item = at->begin();
          std::advance(item, static_cast<long>(rng.below(at->size())));
          where += "/" + item.key();
          at = &item.value();
        } else {
          const size_t i = rng.below(at->size());
          where += "/" + std::to_string(i);
          at = &(*at)[i];
        }
      }
      *at = values[rng.below(std::size(values))];
      SCOPED_TRACE(testing::Message() << path << " " << where << " = " << at->dump());
      const bool ok = k3::test::accepted_or_clean_error([&] {
        const k3::ModelConfig c = k3::ModelConfig::from_json(j);
        k3::test::accepted_or_clean_error([&] {
          (void)k3::LayerPlan::from(c);
          (void)k3::parameter_count(c);
        });
      });
      (ok ? parsed : refused)++;
      if (ok && std::getenv("K3_FUZZ_LOG")) std::fprintf(stderr, "parsed %s = %s\n", where.c_str(), at->dump().c_str());
    }
  }
  EXPECT_GT(refused, 300);
  EXPECT_GT(parsed, 20);  // values the model does not read (token ids, max_position_embeddings) still parse
}

// Values nlohmann would convert without a word are refused, the key named: a float or a bool where an integer
// belongs, an integer past int, a number where a bool belongs, a non-finite or non-positive scale.
TEST(ConfigInvalid, StrictTypesAndRanges) {
  const json base = load(kK3);
  const std::pair<const char*, json> cases[] = {
      {"hidden_size", 2.5},           {"qk_rope_head_dim", true},   {"kv_lora_rank", int64_t{1} << 40},
      {"moe_renormalize", 1},         {"rms_norm_eps", 0},          {"rms_norm_eps", -1e-6},
      {"routed_scaling_factor", -1},  {"routed_scaling_factor", 1e39}, {"num_hidden_layers", "93"},
  };
  for (const auto& [key, value] : cases) {
    json j = base;
    ASSERT_TRUE(j["text_config"].contains(key)) << key;
    j["text_config"][key] = value;
    const std::string msg = error_of([&] { k3::ModelConfig::from_json(j); });
    EXPECT_TRUE(mentions_key(msg, key)) << key << " = " << value.dump() << ": " << msg;
  }
}

// The kernels' environment knobs (core/env.h): a value in range (and on the step) is taken; unset,
// malformed, out of range or between the steps give the fallback, all but unset with a warning naming the
// variable.
TEST(EnvInt, TakesInRangeIntegersAndWarnsOnAnythingElse) {
  const char* name = "K3_TEST_ENV_INT";
  ::unsetenv(name);
  testing::internal::CaptureStderr();
  EXPECT_EQ(k3::env_int(name, 1, 8, 3), 3);
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
  for (const auto& [value, want] : std::vector<std::pair<std::string, int64_t>>{{"1", 1}, {"8", 8}, {"5", 5}}) {
    ::setenv(name, value.c_str(), 1);
    testing::internal::CaptureStderr();
    EXPECT_EQ(k3::env_int(name, 1, 8, 3), want) << value;
    EXPECT_EQ(testing::internal::GetCapturedStderr(), "") << value;
  }
  for (const std::string bad : {"0", "9", "-1", "4x", "", "4 ", "x", "99999999999999999999999"}) {
    ::setenv(name, bad.c_str(), 1);
    testing::internal::CaptureStderr();
    EXPECT_EQ(k3::env_int(name, 1, 8, 3), 3) << bad;
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_NE(err.find(name), std::string::npos) << bad << ": " << err;
    EXPECT_NE(err.find("[1, 8]"), std::string::npos) << bad << ": " << err;
  }
  // With a step (K3_LINEAR_TC_WARPS: 4 or 8), a value in range between the steps warns too.
  for (const auto& [value, want] : std::vector<std::pair<std::string, int64_t>>{{"4", 4}, {"8", 8}}) {
    ::setenv(name, value.c_str(), 1);
    testing::internal::CaptureStderr();
    EXPECT_EQ(k3::env_int(name, 4, 8, 8, 4), want) << value;
    EXPECT_EQ(testing::internal::GetCapturedStderr(), "") << value;
  }
  for (const std::string bad : {"5", "6", "7", "0", "12"}) {
    ::setenv(name, bad.c_str(), 1);
    testing::internal::CaptureStderr();
    EXPECT_EQ(k3::env_int(name, 4, 8, 8, 4), 8) << bad;
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_NE(err.find(name), std::string::npos) << bad << ": " << err;
    EXPECT_NE(err.find("in steps of 4 from 4"), std::string::npos) << bad << ": " << err;
  }
  ::unsetenv(name);
}

// env_knob: a value a test set wins; else the environment's, read once and kept (a later change of the
// variable is not seen) until the slot is set back to -1; a bad value gives the fallback.
TEST(EnvInt, KnobTakesTheForcedValueElseTheEnvironmentsReadOnce) {
  const char* name = "K3_TEST_ENV_KNOB";
  std::atomic<int> slot{-1};
  ::setenv(name, "2", 1);
  EXPECT_EQ(k3::env_knob(slot, name, 0, 3, 1), 2);
  ::setenv(name, "3", 1);
  EXPECT_EQ(k3::env_knob(slot, name, 0, 3, 1), 2) << "read once";
  slot.store(0);
  EXPECT_EQ(k3::env_knob(slot, name, 0, 3, 1), 0) << "forced";
  slot.store(-1);
  EXPECT_EQ(k3::env_knob(slot, name, 0, 3, 1), 3) << "back to the environment";
  slot.store(-1);
  ::setenv(name, "7", 1);
  testing::internal::CaptureStderr();
  EXPECT_EQ(k3::env_knob(slot, name, 0, 3, 1), 1) << "out of range: the fallback";
  EXPECT_NE(testing::internal::GetCapturedStderr().find(name), std::string::npos);
  slot.store(-1);
  ::unsetenv(name);
  EXPECT_EQ(k3::env_knob(slot, name, 0, 3, 1), 1) << "unset: the fallback";
}
