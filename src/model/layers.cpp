// The K3 modules on the CPU (model/layers.h): KDA, MLA / DSA with DCP, the EP MoE, the dense MLP.
#include "model/layers.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "ops/dsa.h"
#include "ops/elementwise.h"
#include "ops/kda.h"
#include "ops/kda_prep.h"
#include "ops/linear.h"
#include "ops/mla.h"
#include "ops/moe.h"
#include "ops/rmsnorm.h"
#include "ops/router.h"

namespace k3 {

namespace {
using Buf = std::vector<float>;
Buf buf(int64_t n) { return Buf(static_cast<size_t>(n), 0.0f); }
ops::SituParams situ(const ModelConfig& c) { return {c.situ_beta, c.situ_linear_beta}; }
}  // namespace

void kda_attention(const ModelConfig& c, const KdaWeights& w, int layer, const float* x, const StepShape& s,
                   AttentionCache& cache, float* out) {
  const int H = w.heads, d = c.kda.head_dim, K = c.kda.conv_kernel;
  const int64_t D = c.hidden_size, C = int64_t{H} * d, rows = s.rows(), q = s.q, P = w.in_rows;
  // One projection: columns [q | k | v | g | f_a | b | padding] of in_proj_qkvgfab.
  Buf proj = buf(rows * P);
  ops::linear(x, w.in_proj, proj.data(), rows, D, P);
  auto column = [&](int64_t c0, int64_t n) {
    Buf o = buf(rows * n);
    for (int64_t r = 0; r < rows; ++r) std::copy(&proj[r * P + c0], &proj[r * P + c0 + n], &o[r * n]);
    return o;
  };
  Buf raw[3] = {column(0, C), column(C, C), column(2 * C, C)};
  Buf gate = column(3 * C, C), fa = column(4 * C, d), beta = column(4 * C + d, H);
  Buf u = buf(rows * C), g = buf(rows * C);
  ops::linear(fa.data(), w.f_b, u.data(), rows, d, C);
  ops::KdaPrepWeights pw;
  pw.conv[0] = w.q_conv;
  pw.conv[1] = w.k_conv;
  pw.conv[2] = w.v_conv;
  pw.A_log = w.A_log;
  pw.dt_bias = w.dt_bias;
  pw.lower_bound = c.kda.gate_lower_bound;
  Buf act[3] = {buf(rows * C), buf(rows * C), buf(rows * C)};
  Buf o = buf(rows * C), conv_state[3] = {buf(C * (K - 1)), buf(C * (K - 1)), buf(C * (K - 1))};
  for (int b = 0; b < s.B; ++b) {
    KdaSlotState st = cache.kda(layer, b);
    const int64_t r0 = b * q;
    // The committed conv states are read, not written (commit advances them): kda_prep runs on copies.
    const float* xs[3];
    float* states[3];
    float* ys[3];
    for (int j = 0; j < 3; ++j) {
      std::copy(raw[j].begin() + r0 * C, raw[j].begin() + (r0 + q) * C, st.conv_x[j]);
      std::copy(st.conv[j], st.conv[j] + C * (K - 1), conv_state[j].begin());
      xs[j] = raw[j].data() + r0 * C;
      states[j] = conv_state[j].data();
      ys[j] = act[j].data() + r0 * C;
    }
    ops::kda_prep(xs, u.data() + r0 * C, beta.data() + r0 * H, pw, states, ys, g.data() + r0 * C,
                  beta.data() + r0 * H, q, H, d, K);
    std::copy(st.S, st.S + C * d, st.S_next);
    ops::kda_recurrence(act[0].data() + r0 * C, act[1].data() + r0 * C, act[2].data() + r0 * C, g.data() + r0 * C,
                        beta.data() + r0 * H, st.S_next, o.data() + r0 * C, q, H, d, d);
    std::copy(act[1].begin() + r0 * C, act[1].begin() + (r0 + q) * C, st.kept_k);
    std::copy(act[2].begin() + r0 * C, act[2].begin() + (r0 + q) * C, st.kept_v);
    std::copy(g.begin() + r0 * C, g.begin() + (r0 + q) * C, st.kept_g);
    std::copy(beta.begin() + r0 * H, beta.begin() + (r0 + q) * H, st.kept_beta);
  }
  Buf normed = buf(rows * C);
  ops::kda_gated_norm(o.data(), gate.data(), w.o_norm, c.rms_norm_eps, normed.data(), rows, H, d);
  ops::linear(normed.data(), w.o_proj, out, rows, C, D);
}

namespace {

// DSA: the top-k positions (global over the DCP shards) for each row.
std::vector<std::vector<int64_t>> dsa_select(const ModelConfig& c, const MlaWeights& w, int layer, const float* x,
                                             const float* cq, const StepShape& s, AttentionCache& cache,
                                             const Dcp& dcp) {
  const int Hi = c.dsa->index_n_heads, Di = c.dsa->index_head_dim;
  const int64_t D = c.hidden_size, Q = c.mla.q_lora_rank, rows = s.rows(), topk = c.dsa->index_topk;
  Buf qi = buf(rows * Hi * Di), wi = buf(rows * Hi);
  ops::linear(cq, w.indexer.wq_b, qi.data(), rows, Q, int64_t{Hi} * Di);
  ops::linear(x, w.indexer.weights_proj, wi.data(), rows, D, Hi, /*round_out=*/false);
  const float wscale = 1.0f / std::sqrt(static_cast<float>(Di)) / std::sqrt(static_cast<float>(Hi));
  for (float& v : wi) v *= wscale;
  // Local candidates: this rank's positions <= the row's own, their top-k.
  Buf cand_score = buf(rows * topk);
  std::vector<int32_t> cand_pos(static_cast<size_t>(rows * topk), -1);
  std::fill(cand_score.begin(), cand_score.end(), -std::numeric_limits<float>::infinity());
  std::vector<const float*> keys;
  std::vector<int64_t> pos, top;
  Buf scores;
  for (int b = 0; b < s.B; ++b)
    for (int i = 0; i < s.q; ++i) {
      const int64_t r = int64_t{b} * s.q + i, t = s.pos0[b] + i;
      keys.clear();
      pos.clear();
      for (int64_t p = dcp.rank; p <= t; p += dcp.size) {
        keys.push_back(cache.index_key(layer, b, p));
        pos.push_back(p);
      }
      const int64_t n = static_cast<int64_t>(pos.size());
      scores.resize(static_cast<size_t>(n));
      top.resize(static_cast<size_t>(n));
      ops::dsa_index_scores(&qi[r * Hi * Di], &wi[r * Hi], keys.data(), n, Hi, Di, scores.data());
      const int64_t kept = ops::topk_indices(scores.data(), n, topk, top.data());
      for (int64_t j = 0; j < kept; ++j) {
        cand_score[r * topk + j] = scores[top[j]];
        cand_pos[r * topk + j] = static_cast<int32_t>(pos[top[j]]);
      }
    }
  std::vector<std::vector<int64_t>> selected(static_cast<size_t>(rows));
  if (dcp.size == 1) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < topk && cand_pos[r * topk + j] >= 0; ++j) selected[r].push_back(cand_pos[r * topk + j]);
    return selected;
  }
  Buf all_score = buf(dcp.size * rows * topk);
  std::vector<int32_t> all_pos(static_cast<size_t>(dcp.size * rows * topk));
  dcp.comm->all_gather(cand_score.data(), all_score.data(), rows * topk, DType::F32);
  dcp.comm->all_gather(cand_pos.data(), all_pos.data(), rows * topk, DType::I32);
  std::vector<std::pair<int32_t, float>> cands;
  for (int64_t r = 0; r < rows; ++r) {
    cands.clear();
    for (int m = 0; m < dcp.size; ++m)
      for (int64_t j = 0; j < topk; ++j) {
        const int64_t at = (m * rows + r) * topk + j;
        if (all_pos[at] >= 0) cands.emplace_back(all_pos[at], all_score[at]);
      }
    std::sort(cands.begin(), cands.end());  // by position: ties in score go to the lower position
    scores.resize(cands.size());
    top.resize(cands.size());
    for (size_t j = 0; j < cands.size(); ++j) scores[j] = cands[j].second;
    const int64_t kept = ops::topk_indices(scores.data(), static_cast<int64_t>(cands.size()), topk, top.data());
    for (int64_t j = 0; j < kept; ++j) selected[r].push_back(cands[top[j]].first);
  }
  return selected;
}

}  // namespace

void mla_attention(const ModelConfig& c, const MlaWeights& w, int layer, const float* x, const StepShape& s,
                   AttentionCache& cache, const Dcp& dcp, float* out) {
  const auto& m = c.mla;
  const int H = w.heads, R = m.kv_lora_rank, P = m.qk_rope_head_dim, dn = m.qk_nope_head_dim, dv = m.v_head_dim;
  const int64_t D = c.hidden_size, Q = m.q_lora_rank, rows = s.rows(), E = R + P;
  const int Dc = dcp.size;
  Buf cq = buf(rows * Q), qf = buf(rows * H * (dn + P)), kv = buf(rows * E);
  ops::linear(x, w.q_a, cq.data(), rows, D, Q);
  ops::rmsnorm(cq.data(), w.q_a_norm, cq.data(), rows, Q, c.rms_norm_eps);
  ops::linear(cq.data(), w.q_b, qf.data(), rows, Q, int64_t{H} * (dn + P));
  ops::linear(x, w.kv_a, kv.data(), rows, D, E);
  for (int64_t r = 0; r < rows; ++r) ops::rmsnorm(&kv[r * E], w.kv_a_norm, &kv[r * E], 1, R, c.rms_norm_eps);
  Buf ki;
  if (w.has_indexer) {
    const int Di = c.dsa->index_head_dim;
    ki = buf(rows * Di);
    ops::linear(x, w.indexer.wk, ki.data(), rows, D, Di);
    ops::layernorm(ki.data(), w.indexer.k_norm_w, w.indexer.k_norm_b, ki.data(), rows, Di, c.rms_norm_eps);
  }

  // Write every row's entries first (a verify token attends to the earlier drafts);
  // each position lives on DCP rank pos mod D.
  for (int b = 0; b < s.B; ++b)
    for (int i = 0; i < s.q; ++i) {
      const int64_t r = int64_t{b} * s.q + i, pos = s.pos0[b] + i;
      if (pos % Dc != dcp.rank) continue;
      std::copy(&kv[r * E], &kv[r * E] + E, cache.kv_entry(layer, b, pos));
      if (w.has_indexer) {
        const int Di = c.dsa->index_head_dim;
        std::copy(&ki[r * Di], &ki[r * Di] + Di, cache.index_key(layer, b, pos));
      }
    }
  std::vector<std::vector<int64_t>> selected;
  if (w.has_indexer) selected = dsa_select(c, w, layer, x, cq.data(), s, cache, dcp);

  Buf qlat = buf(rows * H * E);
  ops::mla_absorb_q(qf.data(), w.kv_b, qlat.data(), rows, H, dn, P, dv, R);
  // Queries of every DCP member's heads: [Dc, rows, H, E].
  Buf qall = Dc == 1 ? qlat : buf(Dc * rows * H * E);
  if (Dc > 1) all_gather_bf16(*dcp.comm, qlat.data(), qall.data(), rows * H * E);
  const float scale = 1.0f / std::sqrt(static_cast<float>(dn + P));
  Buf part_o = buf(Dc * rows * H * R), part_lse = buf(Dc * rows * H);
  std::vector<const float*> entries;
  for (int b = 0; b < s.B; ++b)
    for (int i = 0; i < s.q; ++i) {
      const int64_t r = int64_t{b} * s.q + i, t = s.pos0[b] + i;
      entries.clear();
      if (w.has_indexer) {
        for (int64_t p : selected[r])
          if (p % Dc == dcp.rank) entries.push_back(cache.kv_entry(layer, b, p));
      } else {
        for (int64_t p = dcp.rank; p <= t; p += Dc) entries.push_back(cache.kv_entry(layer, b, p));
      }
      for (int mbr = 0; mbr < Dc; ++mbr) {
        const int64_t at = mbr * rows + r;
        ops::mla_attend(&qall[at * H * E], entries.data(), static_cast<int64_t>(entries.size()), H, R, P, scale,
                        &part_o[at * H * R], &part_lse[at * H]);
      }
    }
  Buf olat = buf(rows * H * R);
  if (Dc == 1) {
    olat = part_o;
  } else {
    // Send member m its heads' partials; receive [Dc, rows, H, R] partials of mine and merge.
    Buf got_o = buf(Dc * rows * H * R), got_lse = buf(Dc * rows * H);
    std::vector<int64_t> n_o(Dc, rows * H * R), n_lse(Dc, rows * H);
    dcp.comm->all_to_all_v(part_o.data(), n_o.data(), got_o.data(), n_o.data(), DType::F32);
    dcp.comm->all_to_all_v(part_lse.data(), n_lse.data(), got_lse.data(), n_lse.data(), DType::F32);
    Buf po = buf(Dc * H * R), pl = buf(Dc * H), lse = buf(H);
    for (int64_t r = 0; r < rows; ++r) {
      for (int src = 0; src < Dc; ++src) {
        std::copy_n(&got_o[(src * rows + r) * H * R], H * R, &po[src * H * R]);
        std::copy_n(&got_lse[(src * rows + r) * H], H, &pl[src * H]);
      }
      ops::lse_merge(po.data(), pl.data(), Dc, H, R, &olat[r * H * R], lse.data());
    }
  }
  round_bf16_inplace(olat.data(), static_cast<int64_t>(olat.size()));
  Buf o = buf(rows * H * dv), gate = buf(rows * H * dv);
  ops::mla_unabsorb(olat.data(), w.kv_b, o.data(), rows, H, dn, dv, R);
  ops::linear(x, w.g_proj, gate.data(), rows, D, int64_t{H} * dv);
  ops::gate_sigmoid(o.data(), gate.data(), o.data(), static_cast<int64_t>(o.size()));
  ops::linear(o.data(), w.o_proj, out, rows, int64_t{H} * dv, D);
}

void moe_ffn(const ModelConfig& c, const MoeWeights& w, const float* x, int64_t rows, int64_t real, Comm& world,
             float* out, bool with_shared, const MoeSlice& slice) {
  const auto& e = c.moe;
  const int64_t D = c.hidden_size, L = e.latent_size, I = e.intermediate_size, E = e.num_experts, Ll = w.down_rows;
  const int k = e.experts_per_token, W = world.size();
  const int64_t per_rank = E / W;
  const bool sliced = Ll < L;
  const int Gs = sliced ? slice.G : 1;
  K3_CHECK(!sliced || (int64_t{Gs} * Ll == L && W % Gs == 0 && slice.t >= 0 && slice.t < Gs && !with_shared &&
                       rows == real && real <= Gs * slice.cs),
           "moe: latent down rows {} of {} need the sliced call (G {}, member {}, {} of {} rows, {} per member)", Ll, L,
           slice.G, slice.t, real, rows, slice.cs);
  // Own rows [own0, own0 + own): all real rows, or (sliced) member t's.
  const int64_t own0 = sliced ? std::min(real, slice.t * slice.cs) : 0,
                own = sliced ? std::min(real, own0 + slice.cs) - own0 : real;
  auto owner = [&](int64_t i) { return sliced ? static_cast<int32_t>((i / k) / slice.cs) : 0; };
  Buf logits = buf(real * E), weights = buf(real * k), z = buf(real * Ll);
  std::vector<int32_t> idx(static_cast<size_t>(real * k));
  if (real > 0) {
    ops::linear(x, w.gate, logits.data(), real, D, E, /*round_out=*/false);
    ops::route(logits.data(), w.gate_bias, real, static_cast<int>(E), k, e.renormalize, e.routed_scaling_factor,
               idx.data(), weights.data());
    ops::linear(x, w.down, z.data(), real, D, Ll);
  }
  // Dispatch: every (row, choice) goes to the rank owning its expert, in (row, choice) order, with the
  // member that owns its row (sliced: every member sends its slice of every pair).
  std::vector<std::vector<int64_t>> items(W);
  for (int64_t i = 0; i < real * k; ++i) items[idx[i] / per_rank].push_back(i);
  std::vector<int32_t> send_n(W), recv_n(W);
  std::vector<int64_t> ones(W, 1);
  for (int p = 0; p < W; ++p) send_n[p] = static_cast<int32_t>(items[p].size());
  world.all_to_all_v(send_n.data(), ones.data(), recv_n.data(), ones.data(), DType::I32);
  std::vector<int64_t> sc(W), rc(W), scL(W), rcL(W);
  int64_t nsend = 0, nrecv = 0;
  for (int p = 0; p < W; ++p) {
    sc[p] = send_n[p];
    rc[p] = recv_n[p];
    scL[p] = sc[p] * Ll;
    rcL[p] = rc[p] * Ll;
    nsend += sc[p];
    nrecv += rc[p];
  }
  std::vector<int32_t> send_ids, send_own, recv_ids(static_cast<size_t>(nrecv)), recv_own(static_cast<size_t>(nrecv));
  Buf send_z, recv_z = buf(nrecv * Ll);
  for (int p = 0; p < W; ++p)
    for (int64_t i : items[p]) {
      send_ids.push_back(idx[i]);
      send_own.push_back(owner(i));
      send_z.insert(send_z.end(), &z[(i / k) * Ll], &z[(i / k) * Ll] + Ll);
    }
  send_ids.resize(static_cast<size_t>(nsend));
  send_own.resize(static_cast<size_t>(nsend));
  send_z.resize(static_cast<size_t>(nsend * Ll));
  world.all_to_all_v(send_ids.data(), sc.data(), recv_ids.data(), rc.data(), DType::I32);
  if (sliced) world.all_to_all_v(send_own.data(), sc.data(), recv_own.data(), rc.data(), DType::I32);
  all_to_all_v_bf16(world, send_z.data(), scL.data(), recv_z.data(), rcL.data());
  // The latent rows: what arrived (whole rows), or each group's pairs joined from its G members' slices
  // (every member sent the same pairs: the first member's count, ids and owners; a mismatch is an error below).
  std::vector<int64_t> first(W + 1, 0);
  for (int p = 0; p < W; ++p) first[p + 1] = first[p] + rc[p];
  std::vector<int64_t> src, group;  // [nfull] the first member's received index of each joined pair, its group
  for (int g = 0; g < W / Gs; ++g)
    for (int64_t j = 0; j < rc[g * Gs]; ++j) {
      src.push_back(first[g * Gs] + j);
      group.push_back(g);
    }
  const int64_t nfull = static_cast<int64_t>(src.size());
  bool counts_agree = true;
  Buf full_z = sliced ? buf(nfull * L) : Buf{};
  if (sliced)
    for (int64_t q = 0, g = 0; g < W / Gs; ++g)
      for (int64_t j = 0; j < rc[g * Gs]; ++j, ++q)
        for (int t = 0; t < Gs; ++t) {
          const int64_t p = g * Gs + t;
          if (rc[p] != rc[g * Gs]) counts_agree = false;
          if (j < rc[p]) std::copy_n(&recv_z[(first[p] + j) * Ll], Ll, &full_z[q * L + t * Ll]);
        }
  const float* zin_all = sliced ? full_z.data() : recv_z.data();
  // Each local expert runs once on the items routed to it.
  Buf full_out = buf(nfull * L), zin, zout, scratch;
  std::vector<int64_t> members;
  for (int64_t ex = 0; ex < static_cast<int64_t>(w.experts.size()); ++ex) {
    members.clear();
    for (int64_t q = 0; q < nfull; ++q)
      if (recv_ids[src[q]] == w.expert_begin + ex) members.push_back(q);
    if (members.empty()) continue;
    const int64_t n = static_cast<int64_t>(members.size());
    zin.assign(static_cast<size_t>(n * L), 0.0f);
    zout.assign(static_cast<size_t>(n * L), 0.0f);
    scratch.assign(static_cast<size_t>(2 * n * I), 0.0f);
    for (int64_t j = 0; j < n; ++j) std::copy_n(&zin_all[members[j] * L], L, &zin[j * L]);
    const ExpertWeights& xw = w.experts[ex];
    ops::expert_mlp(zin.data(), xw.w1, xw.w3, xw.w2, zout.data(), n, L, I, situ(c), scratch.data());
    for (int64_t j = 0; j < n; ++j) std::copy_n(&zout[j * L], L, &full_out[members[j] * L]);
  }
  // Return: each output to the member owning its row (whole rows: the sender), in the order it was sent;
  // a rank gets back the outputs of its own pairs, per expert owner in (row, choice) order.
  std::vector<int64_t> ret(W, 0), retL(W), own_n(W, 0), own_nL(W);
  std::vector<std::vector<int64_t>> ret_rows(W);
  for (int64_t q = 0; q < nfull; ++q) {
    const int32_t o = sliced ? std::clamp<int32_t>(recv_own[src[q]], 0, Gs - 1) : 0;
    ret_rows[group[q] * Gs + o].push_back(q);
  }
  Buf send_back;
  for (int p = 0; p < W; ++p) {
    ret[p] = static_cast<int64_t>(ret_rows[p].size());
    retL[p] = ret[p] * L;
    for (int64_t q : ret_rows[p]) send_back.insert(send_back.end(), &full_out[q * L], &full_out[q * L] + L);
  }
  std::vector<std::vector<int64_t>> mine(W);  // this rank's own pairs per expert owner
  for (int p = 0; p < W; ++p)
    for (int64_t i : items[p])
      if (i >= own0 * k && i < (own0 + own) * k) mine[p].push_back(i);
  int64_t nback = 0;
  for (int p = 0; p < W; ++p) {
    own_n[p] = static_cast<int64_t>(mine[p].size());
    own_nL[p] = own_n[p] * L;
    nback += own_n[p];
  }
  Buf back = buf(nback * L), expert_out = buf(own * k * L);
  send_back.resize(static_cast<size_t>(nfull * L));
  all_to_all_v_bf16(world, send_back.data(), retL.data(), back.data(), own_nL.data());
  // Checked only after the last exchange, so that a failure never leaves a peer waiting.
  K3_CHECK(counts_agree, "moe: the members of a TP group sent different pair counts (their routing differs)");
  for (int64_t j = 0; j < nrecv; ++j)
    K3_CHECK(recv_ids[j] >= w.expert_begin && recv_ids[j] < w.expert_begin + static_cast<int64_t>(w.experts.size()),
             "moe: expert {} routed to a rank holding {}..{}", recv_ids[j], w.expert_begin,
             w.expert_begin + w.experts.size() - 1);
  int64_t at = 0;
  for (int p = 0; p < W; ++p)
    for (int64_t i : mine[p]) std::copy_n(&back[(at++) * L], L, &expert_out[(i - own0 * k) * L]);
  if (with_shared) std::fill(out, out + rows * D, 0.0f);
  if (own == 0) return;
  Buf y = buf(own * L);
  for (int64_t r = 0; r < own; ++r)
    for (int j = 0; j < k; ++j) {
      const float wt = weights[(own0 + r) * k + j];
      const float* from = &expert_out[(r * k + j) * L];
      for (int64_t i = 0; i < L; ++i) y[r * L + i] += wt * from[i];
    }
  round_bf16_inplace(y.data(), own * L);
  ops::rmsnorm(y.data(), w.norm, y.data(), own, L, c.rms_norm_eps);
  // The shared experts' output first (with_shared = false: the caller's TP partial sum of them is in out),
  // then W_up y added into it, rounded once.
  if (with_shared) shared_mlp(c, w, x, real, out);
  ops::linear_add(y.data(), w.up, out + own0 * D, own, L, D);
}

void shared_mlp(const ModelConfig& c, const MoeWeights& w, const float* x, int64_t rows, float* out) {
  if (rows == 0) return;
  const int64_t S = w.shared_rows;
  Buf scratch = buf(2 * rows * S);
  ops::mlp(x, w.shared_gate, w.shared_up, w.shared_down, out, rows, c.hidden_size, S, situ(c), scratch.data());
}

void dense_ffn(const ModelConfig& c, const DenseWeights& w, const float* x, int64_t rows, float* out) {
  const int64_t I = w.rows;
  if (rows == 0) return;
  Buf scratch = buf(2 * rows * I);
  ops::mlp(x, w.gate, w.up, w.down, out, rows, c.hidden_size, I, situ(c), scratch.data());
}

}  // namespace k3
