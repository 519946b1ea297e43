#include "model/layers.h"

#include <cmath>

#include "ops/attn_res.h"
#include "ops/dsa.h"
#include "ops/embedding.h"
#include "ops/kda.h"
#include "ops/linear.h"
#include "ops/mla.h"
#include "ops/moe.h"
#include "ops/rmsnorm.h"
#include "ops/router.h"
#include "ops/short_conv.h"

namespace k3 {

namespace {
using Buf = std::vector<float>;
Buf buf(int64_t n) { return Buf(static_cast<size_t>(n), 0.0f); }
float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
ops::SituParams situ(const ModelConfig& c) { return {c.situ_beta, c.situ_linear_beta}; }
}  // namespace

void kda_attention(const ModelConfig& c, const KdaWeights& w, int layer, const float* x, const StepShape& s,
                   AttentionCache& cache, float* out) {
  const int H = c.kda.num_heads, d = c.kda.head_dim, K = c.kda.conv_kernel;
  const int64_t D = c.hidden_size, C = int64_t{H} * d, rows = s.rows(), q = s.q;
  Buf raw[3] = {buf(rows * C), buf(rows * C), buf(rows * C)};
  ops::linear(x, w.q_proj, raw[0].data(), rows, D, C);
  ops::linear(x, w.k_proj, raw[1].data(), rows, D, C);
  ops::linear(x, w.v_proj, raw[2].data(), rows, D, C);
  const float* conv_w[3] = {w.q_conv, w.k_conv, w.v_conv};
  Buf act[3] = {buf(rows * C), buf(rows * C), buf(rows * C)};
  Buf fa = buf(rows * d), u = buf(rows * C), g = buf(rows * C), beta = buf(rows * H), gate = buf(rows * C);
  ops::linear(x, w.f_a, fa.data(), rows, D, d);
  ops::linear(fa.data(), w.f_b, u.data(), rows, d, C);
  ops::kda_gate(u.data(), w.A_log, w.dt_bias, c.kda.gate_lower_bound, g.data(), rows, H, d);
  ops::linear(x, w.b_proj, beta.data(), rows, D, H);
  ops::kda_beta(beta.data(), beta.data(), rows, H);
  ops::linear(x, w.g_proj, gate.data(), rows, D, C);
  Buf o = buf(rows * C), state = buf(int64_t{H} * d * d), conv_state = buf(C * (K - 1));
  for (int b = 0; b < s.B; ++b) {
    KdaSlotState st = cache.kda(layer, b);
    const int64_t r0 = b * q;
    for (int j = 0; j < 3; ++j) {
      std::copy(st.conv[j], st.conv[j] + C * (K - 1), conv_state.begin());
      ops::short_conv_silu(raw[j].data() + r0 * C, conv_w[j], conv_state.data(), act[j].data() + r0 * C,
                           st.conv_hist[j], q, C, K);
    }
    ops::l2norm_heads(act[0].data() + r0 * C, q, H, d, 1.0f / std::sqrt(static_cast<float>(d)));
    ops::l2norm_heads(act[1].data() + r0 * C, q, H, d, 1.0f);
    std::copy(st.S, st.S + state.size(), state.begin());
    ops::kda_recurrence(act[0].data() + r0 * C, act[1].data() + r0 * C, act[2].data() + r0 * C, g.data() + r0 * C,
                        beta.data() + r0 * H, state.data(), o.data() + r0 * C, st.S_hist, q, H, d, d);
  }
  Buf normed = buf(rows * C);
  ops::kda_gated_norm(o.data(), gate.data(), w.o_norm, c.rms_norm_eps, normed.data(), rows, H, d);
  ops::linear(normed.data(), w.o_proj, out, rows, C, D);
}

void mla_attention(const ModelConfig& c, const MlaWeights& w, int layer, const float* x, const StepShape& s,
                   AttentionCache& cache, float* out) {
  const auto& m = c.mla;
  const int H = m.num_heads, R = m.kv_lora_rank, P = m.qk_rope_head_dim, dn = m.qk_nope_head_dim, dv = m.v_head_dim;
  const int64_t D = c.hidden_size, Q = m.q_lora_rank, rows = s.rows(), E = R + P;
  Buf cq = buf(rows * Q), qf = buf(rows * H * (dn + P)), kv = buf(rows * E);
  ops::linear(x, w.q_a, cq.data(), rows, D, Q);
  ops::rmsnorm(cq.data(), w.q_a_norm, cq.data(), rows, Q, c.rms_norm_eps);
  ops::linear(cq.data(), w.q_b, qf.data(), rows, Q, int64_t{H} * (dn + P));
  ops::linear(x, w.kv_a, kv.data(), rows, D, E);
  for (int64_t r = 0; r < rows; ++r) ops::rmsnorm(&kv[r * E], w.kv_a_norm, &kv[r * E], 1, R, c.rms_norm_eps);

  // DSA indexer inputs.
  const int Hi = c.dsa ? c.dsa->index_n_heads : 0, Di = c.dsa ? c.dsa->index_head_dim : 0;
  Buf qi, ki, wi;
  if (w.has_indexer) {
    qi = buf(rows * Hi * Di);
    ki = buf(rows * Di);
    wi = buf(rows * Hi);
    ops::linear(cq.data(), w.indexer.wq_b, qi.data(), rows, Q, int64_t{Hi} * Di);
    ops::linear(x, w.indexer.wk, ki.data(), rows, D, Di);
    ops::layernorm(ki.data(), w.indexer.k_norm_w, w.indexer.k_norm_b, ki.data(), rows, Di, c.rms_norm_eps);
    ops::linear(x, w.indexer.weights_proj, wi.data(), rows, D, Hi, /*round_out=*/false);
    const float wscale = 1.0f / std::sqrt(static_cast<float>(Di)) / std::sqrt(static_cast<float>(Hi));
    for (float& v : wi) v *= wscale;
  }

  // Write every row's entries first: a verify token attends to the earlier draft tokens.
  for (int b = 0; b < s.B; ++b)
    for (int i = 0; i < s.q; ++i) {
      const int64_t r = int64_t{b} * s.q + i, pos = s.pos0[b] + i;
      std::copy(&kv[r * E], &kv[r * E] + E, cache.kv_entry(layer, b, pos));
      if (w.has_indexer) std::copy(&ki[r * Di], &ki[r * Di] + Di, cache.index_key(layer, b, pos));
    }

  Buf qlat = buf(rows * H * E), olat = buf(rows * H * R), lse = buf(H);
  ops::mla_absorb_q(qf.data(), w.kv_b, qlat.data(), rows, H, dn, P, dv, R);
  const float scale = 1.0f / std::sqrt(static_cast<float>(dn + P));
  std::vector<const float*> entries, keys;
  Buf scores;
  std::vector<int64_t> top;
  for (int b = 0; b < s.B; ++b)
    for (int i = 0; i < s.q; ++i) {
      const int64_t r = int64_t{b} * s.q + i, n = s.pos0[b] + i + 1;
      entries.resize(static_cast<size_t>(n));
      for (int64_t p = 0; p < n; ++p) entries[p] = cache.kv_entry(layer, b, p);
      int64_t used = n;
      if (w.has_indexer) {
        keys.resize(static_cast<size_t>(n));
        for (int64_t p = 0; p < n; ++p) keys[p] = cache.index_key(layer, b, p);
        scores.resize(static_cast<size_t>(n));
        top.resize(static_cast<size_t>(n));
        ops::dsa_index_scores(&qi[r * Hi * Di], &wi[r * Hi], keys.data(), n, Hi, Di, scores.data());
        used = ops::topk_indices(scores.data(), n, c.dsa->index_topk, top.data());
        for (int64_t j = 0; j < used; ++j) entries[j] = cache.kv_entry(layer, b, top[j]);
      }
      ops::mla_attend(&qlat[r * H * E], entries.data(), used, H, R, P, scale, &olat[r * H * R], lse.data());
    }
  round_bf16_inplace(olat.data(), static_cast<int64_t>(olat.size()));
  Buf o = buf(rows * H * dv), gate = buf(rows * H * dv);
  ops::mla_unabsorb(olat.data(), w.kv_b, o.data(), rows, H, dn, dv, R);
  ops::linear(x, w.g_proj, gate.data(), rows, D, int64_t{H} * dv);
  for (size_t i = 0; i < o.size(); ++i) o[i] = round_bf16(o[i] * sigmoid(gate[i]));
  ops::linear(o.data(), w.o_proj, out, rows, int64_t{H} * dv, D);
}

void moe_ffn(const ModelConfig& c, const MoeWeights& w, const float* x, int64_t rows, float* out) {
  const auto& e = c.moe;
  const int64_t D = c.hidden_size, L = e.latent_size, I = e.intermediate_size, E = e.num_experts;
  const int k = e.experts_per_token;
  Buf logits = buf(rows * E), weights = buf(rows * k);
  std::vector<int32_t> idx(static_cast<size_t>(rows * k));
  ops::linear(x, w.gate, logits.data(), rows, D, E, /*round_out=*/false);
  ops::route(logits.data(), w.gate_bias, rows, static_cast<int>(E), k, e.renormalize, e.routed_scaling_factor,
             idx.data(), weights.data());
  Buf z = buf(rows * L);
  ops::linear(x, w.down, z.data(), rows, D, L);
  // Each expert runs once on the rows that chose it; per-row sums follow the row's chosen order.
  Buf expert_out = buf(rows * k * L), zin, zout, scratch;
  std::vector<int64_t> members;
  for (int64_t ex = 0; ex < E; ++ex) {
    members.clear();
    for (int64_t i = 0; i < rows * k; ++i)
      if (idx[i] == ex) members.push_back(i);
    if (members.empty()) continue;
    const int64_t n = static_cast<int64_t>(members.size());
    zin.assign(static_cast<size_t>(n * L), 0.0f);
    zout.assign(static_cast<size_t>(n * L), 0.0f);
    scratch.assign(static_cast<size_t>(2 * n * I), 0.0f);
    for (int64_t j = 0; j < n; ++j) std::copy(&z[(members[j] / k) * L], &z[(members[j] / k) * L] + L, &zin[j * L]);
    const ExpertWeights& xw = w.experts[ex];
    ops::expert_mlp(zin.data(), xw.w1, xw.w3, xw.w2, zout.data(), n, L, I, situ(c), scratch.data());
    for (int64_t j = 0; j < n; ++j) std::copy(&zout[j * L], &zout[j * L] + L, &expert_out[members[j] * L]);
  }
  Buf y = buf(rows * L);
  for (int64_t r = 0; r < rows; ++r) {
    for (int j = 0; j < k; ++j) {
      const float wt = weights[r * k + j];
      const float* src = &expert_out[(r * k + j) * L];
      for (int64_t i = 0; i < L; ++i) y[r * L + i] += wt * src[i];
    }
  }
  round_bf16_inplace(y.data(), rows * L);
  ops::rmsnorm(y.data(), w.norm, y.data(), rows, L, c.rms_norm_eps);
  Buf up = buf(rows * D), shared = buf(rows * D);
  ops::linear(y.data(), w.up, up.data(), rows, L, D);
  const int64_t S = e.shared_intermediate();
  Buf sscratch = buf(2 * rows * S);
  ops::mlp(x, w.shared_gate, w.shared_up, w.shared_down, shared.data(), rows, D, S, situ(c), sscratch.data());
  for (int64_t i = 0; i < rows * D; ++i) out[i] = round_bf16(up[i] + shared[i]);
}

void dense_ffn(const ModelConfig& c, const DenseWeights& w, const float* x, int64_t rows, float* out) {
  const int64_t I = c.dense_intermediate_size;
  Buf scratch = buf(2 * rows * I);
  ops::mlp(x, w.gate, w.up, w.down, out, rows, c.hidden_size, I, situ(c), scratch.data());
}

void decode_forward(const ModelConfig& c, const ModelWeights& w, const int32_t* tokens, const StepShape& s,
                    AttentionCache& cache, float* logits) {
  const LayerPlan plan = LayerPlan::from(c);
  const int64_t D = c.hidden_size, rows = s.rows();
  const int nb = plan.num_blocks;
  Buf P = buf(rows * D), blocks = buf(rows * nb * D), x = buf(rows * D), a = buf(rows * D), m = buf(rows * D);
  ops::embedding(tokens, rows, w.embed, c.vocab_size, D, P.data());
  const float eps = c.rms_norm_eps;
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerInfo& li = plan.layers[l];
    const LayerWeights& lw = w.layers[l];
    ops::AttnResArgs pre{P.data(), l == 0 ? nullptr : m.data(), blocks.data(), nb, lw.attn_res_norm, lw.attn_res_proj,
                         lw.input_norm, li.blocks_before_attn, li.block_write_idx, eps, eps, x.data(), rows, D};
    ops::attn_res(pre);
    if (lw.attn == AttnKind::KDA)
      kda_attention(c, lw.kda, l, x.data(), s, cache, a.data());
    else
      mla_attention(c, lw.mla, l, x.data(), s, cache, a.data());
    if (li.block_start) std::copy(a.begin(), a.end(), P.begin());  // a new block's partial sum starts as a
    ops::AttnResArgs post{P.data(), li.block_start ? nullptr : a.data(), blocks.data(), nb, lw.mlp_res_norm,
                          lw.mlp_res_proj, lw.post_attn_norm, li.blocks_after_attn, -1, eps, eps, x.data(), rows, D};
    ops::attn_res(post);
    if (lw.ffn == FfnKind::Dense)
      dense_ffn(c, lw.dense, x.data(), rows, m.data());
    else
      moe_ffn(c, lw.moe, x.data(), rows, m.data());
  }
  ops::AttnResArgs fin{P.data(), m.data(), blocks.data(), nb, w.out_res_norm, w.out_res_proj, nullptr, nb, -1, eps, eps,
                       x.data(), rows, D};
  ops::attn_res(fin);
  ops::rmsnorm(x.data(), w.norm, x.data(), rows, D, eps);
  ops::linear(x.data(), w.lm_head, logits, rows, D, c.vocab_size, /*round_out=*/false);
}

}  // namespace k3
