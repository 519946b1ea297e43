// One rank's weights loaded and sharded from a TensorSource (model/weights.h).
#include "model/weights.h"

#include <fmt/format.h>

#include <algorithm>
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

void check_shardable(const ModelConfig& c, const ShardSpec& s) {
  K3_CHECK(s.tp_size >= 1 && s.world_size >= s.tp_size && s.world_size % s.tp_size == 0,
           "layout: world size {} is not a multiple of the TP size {}", s.world_size, s.tp_size);
  K3_CHECK(c.kda.num_heads % s.tp_size == 0, "layout: {} KDA heads do not divide over --tp {}", c.kda.num_heads,
           s.tp_size);
  K3_CHECK(c.mla.num_heads % s.tp_size == 0, "layout: {} attention heads do not divide over --tp {}", c.mla.num_heads,
           s.tp_size);
  K3_CHECK(c.moe.num_experts % s.world_size == 0, "layout: {} experts do not divide over {} ranks (tp x dp)",
           c.moe.num_experts, s.world_size);
  K3_CHECK(c.vocab_size % s.tp_size == 0, "layout: vocabulary {} does not divide over --tp {}", c.vocab_size,
           s.tp_size);
  if (s.ffn_tp) {
    K3_CHECK(c.moe.shared_intermediate() % s.tp_size == 0,
             "layout: the shared experts' {} intermediate rows do not divide over --tp {} (--shared-experts tp)",
             c.moe.shared_intermediate(), s.tp_size);
    K3_CHECK(c.dense_intermediate_size % s.tp_size == 0,
             "layout: the dense MLP's {} intermediate rows do not divide over --tp {} (--shared-experts tp)",
             c.dense_intermediate_size, s.tp_size);
    K3_CHECK(c.moe.latent_size % s.tp_size == 0,
             "layout: the routed experts' latent size {} does not divide over --tp {} (--shared-experts tp)",
             c.moe.latent_size, s.tp_size);
  }
}

namespace {

// Copies columns [c0, c1) of a BF16 [rows, cols] matrix.
Tensor column_slice(const TensorView& v, int64_t c0, int64_t c1) {
  const int64_t rows = v.dim(0), cols = v.dim(1);
  Tensor t(DType::BF16, {rows, c1 - c0});
  const bf16* src = v.as<bf16>();
  bf16* dst = t.as<bf16>();
  for (int64_t r = 0; r < rows; ++r) std::copy(src + r * cols + c0, src + r * cols + c1, dst + r * (c1 - c0));
  return t;
}

}  // namespace

ModelWeights load_weights(const ModelConfig& c, const TensorSource& src, const ShardSpec& shard) {
  check_shardable(c, shard);
  Views v(c, src);
  ModelWeights w;
  const int64_t D = c.hidden_size, G = shard.tp_size, t = shard.tp_rank;
  auto own = [&](Tensor x) -> const bf16* {
    w.owned.push_back(std::move(x));
    return w.owned.back().as<bf16>();
  };
  w.embed = v.ptr<bf16>("model.embed_tokens.weight");
  w.out_res_norm = v.ptr<bf16>("model.output_attn_res_norm.weight");
  w.out_res_proj = v.ptr<bf16>("model.output_attn_res_proj.weight");
  w.norm = v.ptr<bf16>("model.norm.weight");
  w.vocab_count = c.vocab_size / G;
  w.ffn_tp = shard.ffn_tp;
  w.vocab_begin = t * w.vocab_count;
  w.lm_head = v.ptr<bf16>("lm_head.weight") + w.vocab_begin * D;
  const LayerPlan plan = LayerPlan::from(c);
  const int64_t per_rank_experts = c.moe.num_experts / shard.world_size;
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
      const int64_t d = c.kda.head_dim, Hl = c.kda.num_heads / G, C = Hl * d, K = c.kda.conv_kernel;
      k.heads = static_cast<int>(Hl);
      k.in_rows = (4 * C + d + Hl + 15) / 16 * 16;
      Tensor packed(DType::BF16, {k.in_rows, D});
      bf16* dst = packed.as<bf16>();
      auto put = [&](const bf16* rows_src, int64_t n) {
        std::copy(rows_src, rows_src + n * D, dst);
        dst += n * D;
      };
      for (const char* n : {"q_proj", "k_proj", "v_proj", "g_proj"})
        put(b(fmt::format("self_attn.{}.weight", n)) + t * C * D, C);
      put(b("self_attn.f_a_proj.weight"), d);
      put(b("self_attn.b_proj.weight") + t * Hl * D, Hl);
      k.in_proj = own(std::move(packed));
      k.q_conv = f("self_attn.q_conv1d.weight") + t * C * K;
      k.k_conv = f("self_attn.k_conv1d.weight") + t * C * K;
      k.v_conv = f("self_attn.v_conv1d.weight") + t * C * K;
      k.f_b = b("self_attn.f_b_proj.weight") + t * C * d;
      k.A_log = f("self_attn.A_log") + t * Hl;
      k.dt_bias = f("self_attn.dt_bias") + t * C;
      k.o_norm = f("self_attn.o_norm.weight");
      k.o_proj = own(column_slice(v.get(p + "self_attn.o_proj.weight"), t * C, (t + 1) * C));
    } else {
      auto& m = L.mla;
      const int64_t Hl = c.mla.num_heads / G, qk = c.mla.qk_head_dim(), dn = c.mla.qk_nope_head_dim,
                    dv = c.mla.v_head_dim, Q = c.mla.q_lora_rank, R = c.mla.kv_lora_rank;
      m.heads = static_cast<int>(Hl);
      m.q_a = b("self_attn.q_a_proj.weight");
      m.q_a_norm = b("self_attn.q_a_layernorm.weight");
      m.q_b = b("self_attn.q_b_proj.weight") + t * Hl * qk * Q;
      m.kv_a = b("self_attn.kv_a_proj_with_mqa.weight");
      m.kv_a_norm = b("self_attn.kv_a_layernorm.weight");
      m.kv_b = b("self_attn.kv_b_proj.weight") + t * Hl * (dn + dv) * R;
      m.g_proj = b("self_attn.g_proj.weight") + t * Hl * dv * D;
      m.o_proj = own(column_slice(v.get(p + "self_attn.o_proj.weight"), t * Hl * dv, (t + 1) * Hl * dv));
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
    // The FFNs' SiTU-GLU MLPs: whole, or (ffn_tp) intermediate rows [t n / G, (t+1) n / G).
    auto mlp = [&](const std::string& gate, const std::string& up, const std::string& down, int64_t n,
                   int64_t& rows, const bf16*& g, const bf16*& u, const bf16*& d) {
      const int64_t parts = shard.ffn_tp ? G : 1, part = shard.ffn_tp ? t : 0;
      rows = n / parts;
      g = b(gate) + part * rows * D;
      u = b(up) + part * rows * D;
      d = parts == 1 ? b(down) : own(column_slice(v.get(p + down), part * rows, (part + 1) * rows));
    };
    if (L.ffn == FfnKind::Dense) {
      mlp("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", c.dense_intermediate_size,
          L.dense.rows, L.dense.gate, L.dense.up, L.dense.down);
    } else {
      auto& e = L.moe;
      e.gate = b("block_sparse_moe.gate.weight");
      e.gate_bias = f("block_sparse_moe.gate.e_score_correction_bias");
      e.down_rows = shard.ffn_tp ? c.moe.latent_size / G : c.moe.latent_size;
      e.down = b("block_sparse_moe.routed_expert_down_proj.weight") + (shard.ffn_tp ? t : 0) * e.down_rows * D;
      e.norm = b("block_sparse_moe.routed_expert_norm.weight");
      e.up = b("block_sparse_moe.routed_expert_up_proj.weight");
      mlp("block_sparse_moe.shared_experts.gate_proj.weight", "block_sparse_moe.shared_experts.up_proj.weight",
          "block_sparse_moe.shared_experts.down_proj.weight", c.moe.shared_intermediate(), e.shared_rows,
          e.shared_gate, e.shared_up, e.shared_down);
      e.expert_begin = static_cast<int>(shard.world_rank * per_rank_experts);
      for (int64_t x = e.expert_begin; x < e.expert_begin + per_rank_experts; ++x) {
        const std::string ep = expert_prefix(l, static_cast<int>(x));
        auto mx = [&](const char* which) {
          const std::string base = ep + which;
          K3_CHECK(src.has(v.prefix() + base + ".weight_packed"),
                   "checkpoint: routed expert {} has no MXFP4 tensors ({}.weight_packed + .weight_scale)", base,
                   v.prefix() + base);
          return ops::Mxfp4Matrix{v.ptr<uint8_t>(base + ".weight_packed"), v.ptr<uint8_t>(base + ".weight_scale")};
        };
        e.experts.push_back({mx("w1"), mx("w3"), mx("w2")});
      }
    }
    w.layers.push_back(L);
  }
  return w;
}

}  // namespace k3
