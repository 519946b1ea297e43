// GpuWeights (runtime/gpu/weights.h).
#include "runtime/gpu/weights.h"

#include "config/schema.h"

namespace k3 {

namespace cu = ops::cuda;

GpuFill upload_fill() {
  return [](void* dev, const void* host, size_t bytes, DType, const std::string& role) {
    K3_CHECK(host != nullptr, "gpu weights: no host data for {}", role);
    CUDA_CHECK(cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice));
  };
}

GpuWeights build_gpu_weights(const ModelConfig& c, const ShardSpec& shard, const ModelWeights* host,
                             const GpuFill& fill, int layer_copies) {
  check_shardable(c, shard);
  GpuWeights g;
  auto put = [&](const void* h, int64_t n, DType dt, const std::string& role) -> void* {
    const size_t bytes = static_cast<size_t>(n) * dtype_size(dt);
    g.bufs.emplace_back(bytes);
    g.bytes += bytes;
    fill(g.bufs.back().get(), h, bytes, dt, role);
    return g.bufs.back().get();
  };
  auto bf = [&](const bf16* h, int64_t n, const std::string& role) {
    return static_cast<const bf16*>(put(h, n, DType::BF16, role));
  };
  auto f32 = [&](const float* h, int64_t n, const std::string& role) {
    return static_cast<const float*>(put(h, n, DType::F32, role));
  };
  const ModelWeights empty;
  const ModelWeights& H = host ? *host : empty;
  const int64_t D = c.hidden_size, V = c.vocab_size, G = shard.tp_size;
  ModelWeights& w = g.w;
  w.embed = bf(H.embed, V * D, "embed");
  w.out_res_norm = bf(H.out_res_norm, D, "norm");
  w.out_res_proj = bf(H.out_res_proj, D, "res_proj");
  w.norm = bf(H.norm, D, "norm");
  w.vocab_count = V / G;
  w.vocab_begin = shard.tp_rank * w.vocab_count;
  w.ffn_tp = shard.ffn_tp;
  w.lm_head = bf(H.lm_head, w.vocab_count * D, "lm_head");
  const LayerPlan plan = LayerPlan::from(c);
  const int64_t per_rank = c.moe.num_experts / shard.world_size;
  const std::vector<int> source = plan.weight_sources(layer_copies);
  g.tables.resize(static_cast<size_t>(c.num_layers));
  for (int l = 0; l < c.num_layers; ++l) {
    if (const int from = source[static_cast<size_t>(l)]; from != l) {  // a copy of an earlier layer of its kind
      w.layers.push_back(w.layers[static_cast<size_t>(from)]);
      g.tables[static_cast<size_t>(l)] = g.tables[static_cast<size_t>(from)];
      continue;
    }
    const LayerWeights* hl = host ? &host->layers[l] : nullptr;
    const LayerWeights hz;
    const LayerWeights& h = hl ? *hl : hz;
    LayerWeights L;
    L.attn = plan.layers[l].attn;
    L.ffn = plan.layers[l].ffn;
    L.attn_res_norm = bf(h.attn_res_norm, D, "norm");
    L.attn_res_proj = bf(h.attn_res_proj, D, "res_proj");
    L.mlp_res_norm = bf(h.mlp_res_norm, D, "norm");
    L.mlp_res_proj = bf(h.mlp_res_proj, D, "res_proj");
    L.input_norm = bf(h.input_norm, D, "norm");
    L.post_attn_norm = bf(h.post_attn_norm, D, "norm");
    if (L.attn == AttnKind::KDA) {
      const int64_t d = c.kda.head_dim, Hl = c.kda.num_heads / G, C = Hl * d, K = c.kda.conv_kernel;
      auto& k = L.kda;
      const auto& hk = h.kda;
      k.heads = static_cast<int>(Hl);
      k.in_rows = (4 * C + d + Hl + 15) / 16 * 16;
      k.in_proj = bf(hk.in_proj, k.in_rows * D, "proj");
      k.q_conv = f32(hk.q_conv, C * K, "conv");
      k.k_conv = f32(hk.k_conv, C * K, "conv");
      k.v_conv = f32(hk.v_conv, C * K, "conv");
      k.f_b = bf(hk.f_b, C * d, "proj");
      k.A_log = f32(hk.A_log, Hl, "A_log");
      k.dt_bias = f32(hk.dt_bias, C, "dt_bias");
      k.o_norm = f32(hk.o_norm, d, "norm");
      k.o_proj = bf(hk.o_proj, D * C, "out_proj");
    } else {
      const auto& m = c.mla;
      const int64_t Hl = m.num_heads / G, Q = m.q_lora_rank, R = m.kv_lora_rank, dn = m.qk_nope_head_dim,
                    dv = m.v_head_dim, E = m.cache_dim();
      auto& a = L.mla;
      const auto& ha = h.mla;
      a.heads = static_cast<int>(Hl);
      a.q_a = bf(ha.q_a, Q * D, "proj");
      a.q_a_norm = bf(ha.q_a_norm, Q, "norm");
      a.q_b = bf(ha.q_b, Hl * m.qk_head_dim() * Q, "proj");
      a.kv_a = bf(ha.kv_a, E * D, "proj");
      a.kv_a_norm = bf(ha.kv_a_norm, R, "norm");
      a.kv_b = bf(ha.kv_b, Hl * (dn + dv) * R, "proj");
      a.g_proj = bf(ha.g_proj, Hl * dv * D, "proj");
      a.o_proj = bf(ha.o_proj, D * Hl * dv, "out_proj");
      if (L.attn == AttnKind::DSA) {
        const int64_t Hi = c.dsa->index_n_heads, Di = c.dsa->index_head_dim;
        a.has_indexer = true;
        a.indexer.wq_b = bf(ha.indexer.wq_b, Hi * Di * Q, "proj");
        a.indexer.wk = bf(ha.indexer.wk, Di * D, "proj");
        a.indexer.weights_proj = bf(ha.indexer.weights_proj, Hi * D, "proj");
        a.indexer.k_norm_w = bf(ha.indexer.k_norm_w, Di, "norm");
        a.indexer.k_norm_b = bf(ha.indexer.k_norm_b, Di, "bias");
      }
    }
    // The FFNs' MLPs: whole, or TP-sharded (shard.ffn_tp: 1/G of the intermediate rows).
    const int64_t ffn_parts = shard.ffn_tp ? G : 1;
    if (L.ffn == FfnKind::Dense) {
      const int64_t I = c.dense_intermediate_size / ffn_parts;
      L.dense.rows = I;
      L.dense.gate = bf(h.dense.gate, I * D, "proj");
      L.dense.up = bf(h.dense.up, I * D, "proj");
      L.dense.down = bf(h.dense.down, D * I, "out_proj");
    } else {
      const auto& e = c.moe;
      const int64_t E = e.num_experts, Lt = e.latent_size, I = e.intermediate_size,
                    S = e.shared_intermediate() / ffn_parts;
      auto& m = L.moe;
      const auto& hm = h.moe;
      m.gate = bf(hm.gate, E * D, "router");
      m.gate_bias = f32(hm.gate_bias, E, "bias");
      m.down_rows = Lt / ffn_parts;
      m.down = bf(hm.down, m.down_rows * D, "proj");
      m.norm = bf(hm.norm, Lt, "norm");
      m.up = bf(hm.up, D * Lt, "out_proj");
      m.shared_rows = S;
      m.shared_gate = bf(hm.shared_gate, S * D, "proj");
      m.shared_up = bf(hm.shared_up, S * D, "proj");
      m.shared_down = bf(hm.shared_down, D * S, "out_proj");
      m.expert_begin = static_cast<int>(shard.world_rank * per_rank);
      std::vector<const uint8_t*> ptrs[6];
      for (int64_t x = 0; x < per_rank; ++x) {
        const ExpertWeights* hx = host ? &hm.experts[x] : nullptr;
        auto mx = [&](const ops::Mxfp4Matrix* hmx, int64_t N, int64_t K) {
          ops::Mxfp4Matrix d;
          d.packed = static_cast<const uint8_t*>(put(hmx ? hmx->packed : nullptr, N * K / 2, DType::U8, "mxfp4"));
          d.scale = static_cast<const uint8_t*>(put(hmx ? hmx->scale : nullptr, N * K / 32, DType::U8, "e8m0"));
          return d;
        };
        ExpertWeights ex{mx(hx ? &hx->w1 : nullptr, I, Lt), mx(hx ? &hx->w3 : nullptr, I, Lt),
                         mx(hx ? &hx->w2 : nullptr, Lt, I)};
        m.experts.push_back(ex);
        ptrs[0].push_back(ex.w1.packed);
        ptrs[1].push_back(ex.w1.scale);
        ptrs[2].push_back(ex.w3.packed);
        ptrs[3].push_back(ex.w3.scale);
        ptrs[4].push_back(ex.w2.packed);
        ptrs[5].push_back(ex.w2.scale);
      }
      const uint8_t* const* dev[6];
      for (int j = 0; j < 6; ++j) {
        g.bufs.emplace_back(ptrs[j].size() * sizeof(void*));
        CUDA_CHECK(cudaMemcpy(g.bufs.back().get(), ptrs[j].data(), ptrs[j].size() * sizeof(void*),
                              cudaMemcpyHostToDevice));
        dev[j] = g.bufs.back().get<const uint8_t* const>();
      }
      g.tables[l] = cu::Mxfp4ExpertTable{dev[0], dev[1], dev[2], dev[3], dev[4], dev[5]};
    }
    w.layers.push_back(L);
  }
  // Every copy landed before a step reads it: a pageable cudaMemcpy may return before its DMA ends, and the
  // step's non-blocking streams do not wait for it.
  CUDA_CHECK(cudaDeviceSynchronize());
  return g;
}

GpuWeights load_gpu_weights(const TensorSource& src, const ModelConfig& c, const ShardSpec& shard) {
  const ModelWeights host = load_weights(c, src, shard);
  return build_gpu_weights(c, shard, &host, upload_fill());
}

}  // namespace k3
