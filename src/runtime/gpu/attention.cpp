// The attention modules on the GPU (GpuRank::attention), the op sequence of
// the CPU modules in model/layers.h with the rank's caches (gpu/caches.h):
//   KDA: in_proj -> f_b of f_a (read in place) -> kda_prep (one kernel: short conv + SiLU of q, k, v,
//        l2norm of q, k, the gate of f_b f_a (A_log, dt_bias) and beta) -> the recurrence (reads the slot's
//        current state, writes the state after the last token to the other,
//        keeps the tokens' inputs for a partial commit) -> gated RMSNorm -> o_proj partial;
//   MLA / DSA: q_a, kv_a, g_proj (and the indexer's wk, weights_proj) of x
//        in one group -> norm -> q_b (and wq_b); kv_a -> cache_write (normed latent + rope
//        part); q absorbed into the latent space -> attend (paged, or DSA: the
//        indexer's keys cached, scores, top-k, attend the selected) -> (DCP:
//        partials to the head's owner, lse_merge) -> unabsorb -> sigmoid gate
//        -> o_proj partial.
#include <cmath>

#include "ops/dcp.h"
#include "ops/dsa.h"
#include "ops/elementwise.h"
#include "ops/kda.h"
#include "ops/kda_prep.h"
#include "ops/linear.h"
#include "ops/mla.h"
#include "ops/rmsnorm.h"
#include "runtime/gpu/rank.h"

namespace k3 {

namespace cu = ops::cuda;

#define K3_LAUNCH(expr) CUDA_CHECK(static_cast<cudaError_t>(expr))

void GpuRank::attention(int l, Act x, Act out) {
  if (weights_.w.layers[l].attn == AttnKind::KDA)
    kda(l, act(x), act(out));
  else
    mla(l, act(x), act(out));
}

void GpuRank::kda(int l, const bf16* x, bf16* out) {
  const auto& w = weights_.w.layers[l].kda;
  auto* s = ctx_.stream;
  const int64_t D = c_.hidden_size, rows = int64_t{B_} * q_;
  const int H = w.heads, d = c_.kda.head_dim, K = c_.kda.conv_kernel;
  const int64_t C = int64_t{H} * d, P = w.in_rows;
  Carve scratch = layer_scratch();
  const KdaScratch k = carve_kda(scratch, c_, dims_, rows);
  mark("kda.in_proj");
  K3_LAUNCH(cu::linear(ctx_, x, w.in_proj, k.proj, false, rows, D, P));
  mark("kda.conv_gate");
  K3_LAUNCH(cu::linear_ld(ctx_, k.proj + 4 * C, P, w.f_b, k.u, false, rows, d, C));
  cu::KdaPrep p;
  p.proj = k.proj;
  p.proj_ld = P;
  p.b_col = 4 * C + d;
  p.u = k.u;
  const float* cw[3] = {w.q_conv, w.k_conv, w.v_conv};
  for (int j = 0; j < 3; ++j) {
    p.conv_w[j] = cw[j];
    p.conv_pool[j] = caches_.conv(l, j);
    p.conv_kept[j] = caches_.conv_x(l, j);
  }
  p.slots = d_slots_.get<int32_t>();
  p.A_log = w.A_log;
  p.dt_bias = w.dt_bias;
  p.lower_bound = c_.kda.gate_lower_bound;
  p.q_scale = 1.0f / std::sqrt(static_cast<float>(d));
  p.q = k.qn;
  p.k = k.kn;
  p.v = k.v;
  p.g = k.g;
  p.beta = k.beta;
  K3_LAUNCH(cu::kda_prep(p, B_, q_, o_.max_q, H, d, K, s));
  mark("kda.recurrence");
  const int32_t* idx = d_state_idx_.get<int32_t>();
  K3_LAUNCH(cu::kda_recurrence(k.qn, k.kn, k.v, k.g, k.beta, caches_.state(l), idx, idx + o_.max_batch,
                               caches_.kept(l), d_slots_.get<int32_t>(), k.o, B_, q_, o_.max_q, H, d, d, s));
  mark("kda.norm_o_proj");
  K3_LAUNCH(cu::kda_gated_norm(k.o, k.proj + 3 * C, P, w.o_norm, c_.rms_norm_eps, k.normed, rows, H, d, s));
  K3_LAUNCH(cu::linear(ctx_, k.normed, w.o_proj, out, false, rows, C, D));
}

void GpuRank::mla(int l, const bf16* x, bf16* out) {
  const auto& w = weights_.w.layers[l].mla;
  const auto& m = c_.mla;
  auto* s = ctx_.stream;
  const int64_t D = c_.hidden_size, rows = int64_t{B_} * q_;
  const float eps = c_.rms_norm_eps;
  const int H = w.heads, R = m.kv_lora_rank, P = m.qk_rope_head_dim, dn = m.qk_nope_head_dim, dv = m.v_head_dim;
  const int64_t Q = m.q_lora_rank, E = R + P;
  // DCP (Dc > 1): this rank's cache holds positions p = j Dc + dr at local index j.
  const int Dc = dims_.Dc, dr = coll_.dcp_rank();
  const int32_t* ctx_here = Dc > 1 ? d_ctx_local_.get<int32_t>() : d_ctx_.get<int32_t>();
  const int ps = o_.page_size;
  Carve scratch = layer_scratch();
  const MlaScratch a = carve_mla(scratch, c_, dims_, rows);
  mark("mla.proj");
  // Every projection of x at once (one launch at 1 row, cu::linear_group): q_a, kv_a, the output gate
  // and (DSA) the indexer's key and head weights; then those of the normed q latent.
  const int Hi = w.has_indexer ? c_.dsa->index_n_heads : 0, Di = w.has_indexer ? c_.dsa->index_head_dim : 0;
  {
    cu::LinearOut px[5] = {{w.q_a, a.cq, Q}, {w.kv_a, a.kv, E}, {w.g_proj, a.gate, int64_t{H} * dv}};
    int n = 3;
    if (w.has_indexer) {
      px[n++] = {w.indexer.wk, a.ki, Di};
      px[n++] = {w.indexer.weights_proj, a.wi, Hi, /*y_f32=*/true};
    }
    K3_LAUNCH(cu::linear_group(ctx_, x, rows, D, px, n));
  }
  K3_LAUNCH(cu::rmsnorm(a.cq, w.q_a_norm, a.cq, rows, Q, eps, s));
  {
    cu::LinearOut pq[2] = {{w.q_b, a.qf, int64_t{H} * (dn + P)}};
    if (w.has_indexer) pq[1] = {w.indexer.wq_b, a.qi, int64_t{Hi} * Di};
    K3_LAUNCH(cu::linear_group(ctx_, a.cq, rows, Q, pq, w.has_indexer ? 2 : 1));
  }
  K3_LAUNCH(cu::cache_write(a.kv, E, E, w.kv_a_norm, R, eps, d_pos0_.get<int32_t>(), B_, q_, d_tables_.get<int32_t>(),
                            max_pages_, ps, Dc, dr, caches_.kv(l), s));
  K3_LAUNCH(cu::mla_absorb_q(ctx_, a.qf, w.kv_b, a.qlat, rows, H, dn, P, dv, R));
  const float scale = 1.0f / std::sqrt(static_cast<float>(dn + P));
  // The queries attended here: this rank's heads, or (DCP) every DCP member's, each member's partial
  // (o, lse) sent back to it and merged below.
  const bf16* qs = a.qlat;
  float* po = Dc > 1 ? a.po : a.olat;
  float* pl = Dc > 1 ? a.pl : a.lse;
  if (Dc > 1) {
    mark("collectives");
    coll_.dcp_all_gather(a.qlat, a.qall, rows * H * E, DType::BF16);
    qs = a.qall;
  }
  mark(w.has_indexer ? "dsa.indexer_attend" : "mla.attend");
  if (!w.has_indexer) {
    for (int mb = 0; mb < Dc; ++mb)
      K3_LAUNCH(cu::mla_attend_paged(qs + mb * rows * H * E, caches_.kv(l), d_tables_.get<int32_t>(), max_pages_, ps,
                                     ctx_here, B_, q_, static_cast<int>(max_ctx_), H, R, P, scale,
                                     po + mb * rows * H * R, pl + mb * rows * H, attn_scratch_.get(),
                                     attn_scratch_bytes_, s));
  } else {
    const int topk = c_.dsa->index_topk;
    K3_LAUNCH(cu::layernorm(a.ki, w.indexer.k_norm_w, w.indexer.k_norm_b, a.ki, rows, Di, eps, s));
    K3_LAUNCH(cu::cache_write(a.ki, Di, Di, nullptr, 0, eps, d_pos0_.get<int32_t>(), B_, q_, d_tables_.get<int32_t>(),
                              max_pages_, ps, Dc, dr, caches_.index_keys(l), s));
    K3_LAUNCH(cu::scale(a.wi, 1.0f / std::sqrt(static_cast<float>(Di)) / std::sqrt(static_cast<float>(Hi)), rows * Hi,
                        s));
    const int max_ctx = static_cast<int>(max_ctx_);
    K3_LAUNCH(cu::dsa_index_scores_paged(a.qi, a.wi, caches_.index_keys(l), d_tables_.get<int32_t>(), max_pages_, ps,
                                         ctx_here, B_, q_, max_ctx, Hi, Di, a.scores, s));
    K3_LAUNCH(cu::topk_indices(a.scores, max_ctx, ctx_here, rows, topk, a.sel, a.cnt, topk_scratch_.get(),
                               topk_scratch_.bytes(), s));
    if (Dc > 1) {
      // The global top-k (ops/dcp.h): local candidates, all-gathered, the same selection on every
      // member, then the selected positions held here as local indices.
      K3_LAUNCH(cu::dcp_topk_candidates(a.scores, max_ctx, a.sel, a.cnt, rows, topk, Dc, dr, a.cand_s, a.cand_p, s));
      mark("collectives");
      coll_.dcp_all_gather(a.cand_s, a.all_s, rows * topk, DType::F32);
      coll_.dcp_all_gather(a.cand_p, a.all_p, rows * topk, DType::I32);
      mark("dsa.indexer_attend");
      K3_LAUNCH(cu::dcp_scatter_candidates(a.all_s, a.all_p, Dc, rows, topk, max_ctx, a.scores, s));
      K3_LAUNCH(cu::topk_indices(a.scores, max_ctx, d_ctx_.get<int32_t>(), rows, topk, a.sel_g, a.cnt_g,
                                 topk_scratch_.get(), topk_scratch_.bytes(), s));
      K3_LAUNCH(cu::dcp_local_selection(a.sel_g, a.cnt_g, rows, topk, Dc, dr, a.sel, a.cnt, s));
    }
    for (int mb = 0; mb < Dc; ++mb)
      K3_LAUNCH(cu::mla_attend_indexed(qs + mb * rows * H * E, caches_.kv(l), d_tables_.get<int32_t>(), max_pages_,
                                       ps, a.sel, a.cnt, topk, B_, q_, H, R, P, scale, po + mb * rows * H * R,
                                       pl + mb * rows * H, attn_scratch_.get(), attn_scratch_bytes_, s));
  }
  if (Dc > 1) {
    mark("collectives");
    coll_.dcp_all_to_all(po, a.got_o, rows * H * R, DType::F32);
    coll_.dcp_all_to_all(pl, a.got_lse, rows * H, DType::F32);
    mark("mla.merge");
    K3_LAUNCH(cu::lse_merge(a.got_o, a.got_lse, Dc, rows, H, R, a.olat, a.lse, s));
  }
  mark("mla.out");
  K3_LAUNCH(cu::to_bf16(a.olat, a.olat_bf, rows * H * R, s));
  K3_LAUNCH(cu::mla_unabsorb(ctx_, a.olat_bf, w.kv_b, a.o, rows, H, dn, dv, R));
  K3_LAUNCH(cu::gate_sigmoid(a.o, a.gate, a.o, rows * H * dv, s));
  K3_LAUNCH(cu::linear(ctx_, a.o, w.o_proj, out, false, rows, int64_t{H} * dv, D));
}

}  // namespace k3
