#include "model/weights.h"

#include <map>

#include "config/schema.h"

namespace k3 {

namespace {

// Schema lookup + dtype/shape validation, with the checkpoint's name prefix.
class Views {
 public:
  Views(const ModelConfig& c, const TensorSource& src) : src_(src) {
    prefix_ = src.has(std::string(kTextPrefix) + "model.embed_tokens.weight") ? kTextPrefix : "";
    for (auto& s : checkpoint_schema(c)) specs_.emplace(s.name, s);
  }

  TensorView get(const std::string& name) const {
    auto it = specs_.find(name);
    K3_CHECK(it != specs_.end(), "internal: tensor {} is not in the schema", name);
    const TensorSpec& s = it->second;
    const std::string full = prefix_ + name;
    K3_CHECK(src_.has(full), "checkpoint: missing tensor {}", full);
    TensorView v = src_.get(full);
    K3_CHECK(v.dtype == s.dtype, "tensor {}: dtype {} expected {}", full, dtype_name(v.dtype), dtype_name(s.dtype));
    if (s.min_numel) {
      K3_CHECK(v.numel() >= shape_numel(s.shape), "tensor {}: shape {} holds {} values, need at least {}", full,
               shape_str(v.shape), v.numel(), shape_numel(s.shape));
    } else {
      K3_CHECK(v.shape == s.shape, "tensor {}: shape {} expected {}", full, shape_str(v.shape), shape_str(s.shape));
    }
    return v;
  }
  const std::string& prefix() const { return prefix_; }
  template <typename T>
  const T* ptr(const std::string& name) const {
    return get(name).as<T>();
  }

 private:
  const TensorSource& src_;
  std::string prefix_;
  std::map<std::string, TensorSpec> specs_;
};

}  // namespace

ModelWeights load_weights(const ModelConfig& c, const TensorSource& src) {
  Views v(c, src);
  ModelWeights w;
  w.embed = v.ptr<bf16>("model.embed_tokens.weight");
  w.out_res_norm = v.ptr<bf16>("model.output_attn_res_norm.weight");
  w.out_res_proj = v.ptr<bf16>("model.output_attn_res_proj.weight");
  w.norm = v.ptr<bf16>("model.norm.weight");
  w.lm_head = v.ptr<bf16>("lm_head.weight");
  const LayerPlan plan = LayerPlan::from(c);
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = layer_prefix(l);
    auto b = [&](const std::string& n) { return v.ptr<bf16>(p + n); };
    auto f = [&](const std::string& n) { return v.ptr<float>(p + n); };
    LayerWeights L;
    L.attn_res_norm = b("self_attention_res_norm.weight");
    L.attn_res_proj = b("self_attention_res_proj.weight");
    L.mlp_res_norm = b("mlp_res_norm.weight");
    L.mlp_res_proj = b("mlp_res_proj.weight");
    L.input_norm = b("input_layernorm.weight");
    L.post_attn_norm = b("post_attention_layernorm.weight");
    L.attn = plan.layers[l].attn;
    if (L.attn == AttnKind::KDA) {
      auto& k = L.kda;
      k.q_proj = b("self_attn.q_proj.weight");
      k.k_proj = b("self_attn.k_proj.weight");
      k.v_proj = b("self_attn.v_proj.weight");
      k.g_proj = b("self_attn.g_proj.weight");
      k.q_conv = f("self_attn.q_conv1d.weight");
      k.k_conv = f("self_attn.k_conv1d.weight");
      k.v_conv = f("self_attn.v_conv1d.weight");
      k.f_a = b("self_attn.f_a_proj.weight");
      k.f_b = b("self_attn.f_b_proj.weight");
      k.b_proj = b("self_attn.b_proj.weight");
      k.A_log = f("self_attn.A_log");
      k.dt_bias = f("self_attn.dt_bias");
      k.o_norm = f("self_attn.o_norm.weight");
      k.o_proj = b("self_attn.o_proj.weight");
    } else {
      auto& m = L.mla;
      m.q_a = b("self_attn.q_a_proj.weight");
      m.q_a_norm = b("self_attn.q_a_layernorm.weight");
      m.q_b = b("self_attn.q_b_proj.weight");
      m.kv_a = b("self_attn.kv_a_proj_with_mqa.weight");
      m.kv_a_norm = b("self_attn.kv_a_layernorm.weight");
      m.kv_b = b("self_attn.kv_b_proj.weight");
      m.g_proj = b("self_attn.g_proj.weight");
      m.o_proj = b("self_attn.o_proj.weight");
      if (L.attn == AttnKind::DSA) {
        m.has_indexer = true;
        m.indexer.wq_b = b("self_attn.indexer.wq_b.weight");
        m.indexer.wk = b("self_attn.indexer.wk.weight");
        m.indexer.weights_proj = b("self_attn.indexer.weights_proj.weight");
        m.indexer.k_norm_w = b("self_attn.indexer.k_norm.weight");
        m.indexer.k_norm_b = b("self_attn.indexer.k_norm.bias");
      }
    }
    L.ffn = plan.layers[l].ffn;
    if (L.ffn == FfnKind::Dense) {
      L.dense.gate = b("mlp.gate_proj.weight");
      L.dense.up = b("mlp.up_proj.weight");
      L.dense.down = b("mlp.down_proj.weight");
    } else {
      auto& e = L.moe;
      e.gate = b("block_sparse_moe.gate.weight");
      e.gate_bias = f("block_sparse_moe.gate.e_score_correction_bias");
      e.down = b("block_sparse_moe.routed_expert_down_proj.weight");
      e.norm = b("block_sparse_moe.routed_expert_norm.weight");
      e.up = b("block_sparse_moe.routed_expert_up_proj.weight");
      e.shared_gate = b("block_sparse_moe.shared_experts.gate_proj.weight");
      e.shared_up = b("block_sparse_moe.shared_experts.up_proj.weight");
      e.shared_down = b("block_sparse_moe.shared_experts.down_proj.weight");
      e.experts.resize(c.moe.num_experts);
      for (int x = 0; x < c.moe.num_experts; ++x) {
        const std::string ep = expert_prefix(l, x);
        auto mx = [&](const char* w) {
          const std::string base = ep + w;
          K3_CHECK(src.has(v.prefix() + base + ".weight_packed"),
                   "checkpoint: routed expert {} has no MXFP4 tensors ({}.weight_packed + .weight_scale)", base,
                   v.prefix() + base);
          return ops::Mxfp4Matrix{v.ptr<uint8_t>(base + ".weight_packed"), v.ptr<uint8_t>(base + ".weight_scale")};
        };
        e.experts[x] = {mx("w1"), mx("w3"), mx("w2")};
      }
    }
    w.layers.push_back(L);
  }
  return w;
}

}  // namespace k3
