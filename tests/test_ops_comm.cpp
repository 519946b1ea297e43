// CPU references of the collectives' helper ops, against independent
// formulations (the GPU tests hold the kernels to these references bit for bit):
//   OpsEp    ep_pack over W emulated ranks + the exchange (+ ep_assemble and
//            ep_return when members send slices) + ep_combine == the direct
//            weighted sum of each row's chosen experts in its order; the slots
//            of a destination are the CPU moe_ffn's (row, choice) order
//   OpsDcp   DSA's sharded top-k (local candidates, scatter, local selection)
//            == the top-k of the unsharded scores, and the local selections
//            partition it
//   OpsReduce reduce_sum is the FP32 rank-order sum (the order shows)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/bf16.h"
#include "core/error.h"
#include "core/rng.h"
#include "ops/dcp.h"
#include "ops/dsa.h"
#include "ops/ep.h"
#include "ops/reduce.h"

namespace {

using k3::Rng;

// W emulated ranks in groups of Gs members. A group's members route the same m rows (the same ids) and
// each holds its Ls columns of z (Gs = 1: each rank its own rows, whole). pack on every rank, the two
// exchanges emulated by index arithmetic, assemble / return when sliced, combine on the owners: each
// member's own rows [t cs, ...) == the direct weighted sum of expert(id, z[r]) of the row's choices.
void ep_round_trip(int W, int Gs, int64_t m, uint64_t seed) {
  const int epr = 4, k = 3, L = 8 * Gs, Ls = L / Gs, groups = W / Gs;
  const int64_t cs = (m + Gs - 1) / Gs, cap = cs * k + 1;  // one spare slot per (owner, dest)
  Rng rng(seed);
  std::vector<std::vector<int32_t>> idx(groups, std::vector<int32_t>(m * k));
  std::vector<std::vector<float>> z(groups, std::vector<float>(m * L)), wt(groups, std::vector<float>(m * k));
  for (int g = 0; g < groups; ++g) {
    for (auto& x : idx[g]) x = rng.below(10) == 0 ? -1 : static_cast<int32_t>(rng.below(W * epr));
    for (auto& x : z[g]) x = k3::round_bf16(static_cast<float>(rng.uniform(-1, 1)));
    for (auto& x : wt[g]) x = static_cast<float>(rng.uniform(0.1, 1));
  }
  auto expert = [](int32_t id, float v) { return k3::round_bf16(v * (1.0f + 0.125f * static_cast<float>(id))); };
  auto shard_of = [&](int w) {
    k3::ops::EpShard s;
    s.rows = m;
    s.k = k;
    s.cs = Gs > 1 ? cs : m;
    s.t = w % Gs;
    s.Gs = Gs;
    s.Ls = Ls;
    s.experts_per_rank = epr;
    s.W = W;
    s.cap = cap;
    return s;
  };
  const int64_t scap = Gs * cap, M = shard_of(0).meta(), slots = W * cap;
  std::vector<std::vector<int32_t>> slot(W), send_slot(W, std::vector<int32_t>(m * k)), meta(W, std::vector<int32_t>(W * M));
  std::vector<std::vector<float>> send(W, std::vector<float>(slots * L, 0.0f));
  for (int w = 0; w < W; ++w) {
    const k3::ops::EpShard s = shard_of(w);
    slot[w].assign(s.own() * k, 7);
    std::vector<float> zs(m * Ls);  // this member's columns
    for (int64_t r = 0; r < m; ++r)
      for (int c = 0; c < Ls; ++c) zs[r * Ls + c] = z[w / Gs][r * L + s.t * Ls + c];
    k3::ops::ep_pack(idx[w / Gs].data(), zs.data(), s, slot[w].data(), send_slot[w].data(), meta[w].data(),
                     send[w].data());
    // Send order: per destination, the group's pairs in (row, choice) order fill slots 0, 1, ...
    for (int d = 0; d < W; ++d) {
      int64_t next = 0;
      for (int64_t i = 0; i < m * k; ++i)
        if (idx[w / Gs][i] >= 0 && idx[w / Gs][i] / epr == d) {
          EXPECT_EQ(send_slot[w][i], d * scap + next) << "sender " << w << " pair " << i;
          EXPECT_EQ(meta[w][d * M + next], idx[w / Gs][i]);
          ++next;
        }
      for (int64_t p = next; p < scap; ++p) EXPECT_EQ(meta[w][d * M + p], -1);
    }
  }
  // Exchange: rank d's recv[src] = send[src][d].
  std::vector<std::vector<float>> back(W, std::vector<float>(slots * L, 0.0f));
  std::vector<std::vector<float>> back_recv(W, std::vector<float>(slots * L, 0.0f));
  for (int d = 0; d < W; ++d) {
    const k3::ops::EpShard s = shard_of(d);
    std::vector<float> recv(slots * L), full(slots * L, 0.0f), out(slots * L, 0.0f);
    std::vector<int32_t> recv_meta(W * M), ids(slots), codes(slots);
    for (int src = 0; src < W; ++src) {
      std::copy_n(send[src].data() + d * scap * Ls, scap * Ls, recv.data() + src * scap * Ls);
      std::copy_n(meta[src].data() + d * M, M, recv_meta.data() + src * M);
    }
    if (Gs > 1) {
      k3::ops::ep_assemble(recv.data(), recv_meta.data(), s, full.data(), ids.data(), codes.data());
    } else {
      full = recv;
      ids = recv_meta;
    }
    for (int64_t q = 0; q < slots; ++q) {
      if (ids[q] < 0) continue;
      EXPECT_EQ(ids[q] / epr, d);
      for (int c = 0; c < L; ++c) out[q * L + c] = expert(ids[q], full[q * L + c]);
    }
    if (Gs > 1)
      k3::ops::ep_return(out.data(), ids.data(), codes.data(), s, back[d].data());
    else
      back[d] = out;
  }
  // Exchange back: owner w's back_recv[d] = back[d][w].
  for (int w = 0; w < W; ++w)
    for (int d = 0; d < W; ++d) std::copy_n(back[d].data() + w * cap * L, cap * L, back_recv[w].data() + d * cap * L);
  for (int w = 0; w < W; ++w) {
    const k3::ops::EpShard s = shard_of(w);
    const int64_t own0 = s.own0(), own = s.own();
    std::vector<float> y(own * L);
    k3::ops::ep_combine(back_recv[w].data(), slot[w].data(), wt[w / Gs].data() + own0 * k, own, k, L, y.data());
    for (int64_t r = 0; r < own; ++r)
      for (int c = 0; c < L; ++c) {
        float want = 0;
        for (int j = 0; j < k; ++j) {
          const int32_t id = idx[w / Gs][(own0 + r) * k + j];
          if (id >= 0) want += wt[w / Gs][(own0 + r) * k + j] * expert(id, z[w / Gs][(own0 + r) * L + c]);
        }
        EXPECT_EQ(y[r * L + c], k3::round_bf16(want)) << "rank " << w << " row " << own0 + r << " col " << c;
      }
  }
}

TEST(OpsEp, PackExchangeCombineEqualsTheDirectWeightedSum) {
  for (int64_t m : {int64_t{7}, int64_t{1}, int64_t{0}}) ep_round_trip(3, 1, m, 5 + m);
}

TEST(OpsEp, SlicedRowsJoinAtTheOwnerAndReturnToTheRowsMember) {
  for (int64_t m : {int64_t{7}, int64_t{8}, int64_t{1}, int64_t{0}}) {
    ep_round_trip(4, 2, m, 11 + m);
    ep_round_trip(6, 3, m, 13 + m);
    ep_round_trip(4, 4, m, 17 + m);
  }
}

TEST(OpsEp, ShardsThatCannotFitAreErrors) {
  std::vector<int32_t> idx(8, 0), slot(8), send_slot(8), meta(64);
  std::vector<float> z(32), send(14 * 8);
  k3::ops::EpShard s;
  s.rows = 4;
  s.k = 2;
  s.cs = 4;
  s.Ls = 8;
  s.W = 2;
  s.cap = 7;  // < cs k
  EXPECT_THROW(k3::ops::ep_pack(idx.data(), z.data(), s, slot.data(), send_slot.data(), meta.data(), send.data()),
               k3::Error);
  s.cap = 8;
  s.Gs = 2;
  s.cs = 1;  // 4 rows > Gs cs
  EXPECT_THROW(k3::ops::check(s), k3::Error);
  s.cs = 2;
  s.t = 2;  // outside the group
  EXPECT_THROW(k3::ops::check(s), k3::Error);
  s.t = 1;
  s.W = 3;  // not a multiple of Gs
  EXPECT_THROW(k3::ops::check(s), k3::Error);
  s.W = 2;
  EXPECT_NO_THROW(k3::ops::check(s));
}

TEST(OpsDcp, ShardedTopkIsTheGlobalTopk) {
  for (int D : {2, 3, 4})
    for (int k : {1, 3, 8}) {
      const int64_t T = 6, ld = 30;
      Rng rng(31 * D + k);
      std::vector<int32_t> ctx(T);
      std::vector<float> S(T * ld, -INFINITY);
      for (int64_t t = 0; t < T; ++t) {
        ctx[t] = static_cast<int32_t>(1 + rng.below(ld));
        for (int p = 0; p < ctx[t]; ++p) S[t * ld + p] = static_cast<float>(rng.below(5));  // ties
      }
      std::vector<float> all_s(D * T * k);
      std::vector<int32_t> all_p(D * T * k);
      for (int r = 0; r < D; ++r) {
        std::vector<float> local(T * ld, -INFINITY);
        std::vector<int32_t> n(T), sel(T * k, -1);
        for (int64_t t = 0; t < T; ++t) {
          const int nl = ctx[t] > r ? (ctx[t] - 1 - r) / D + 1 : 0;
          for (int j = 0; j < nl; ++j) local[t * ld + j] = S[t * ld + j * D + r];
          std::vector<int64_t> top(nl);
          n[t] = static_cast<int32_t>(k3::ops::topk_indices(&local[t * ld], nl, k, top.data()));
          for (int j = 0; j < n[t]; ++j) sel[t * k + j] = static_cast<int32_t>(top[j]);
        }
        k3::ops::dcp_topk_candidates(local.data(), ld, sel.data(), n.data(), T, k, D, r, &all_s[r * T * k],
                                     &all_p[r * T * k]);
      }
      std::vector<float> dense(T * ld);
      k3::ops::dcp_scatter_candidates(all_s.data(), all_p.data(), D, T, k, ld, dense.data());
      std::vector<int32_t> sel_g(T * k, -1), n_g(T);
      for (int64_t t = 0; t < T; ++t) {
        std::vector<int64_t> a(ctx[t]), b(ctx[t]);
        const int64_t ka = k3::ops::topk_indices(&dense[t * ld], ctx[t], k, a.data());
        const int64_t kb = k3::ops::topk_indices(&S[t * ld], ctx[t], k, b.data());
        ASSERT_EQ(ka, kb);
        for (int64_t j = 0; j < ka; ++j) {
          ASSERT_EQ(a[j], b[j]) << "D " << D << " k " << k << " row " << t;
          sel_g[t * k + j] = static_cast<int32_t>(a[j]);
        }
        n_g[t] = static_cast<int32_t>(ka);
      }
      // The local selections, mapped back to positions, partition the global one in its order.
      for (int64_t t = 0; t < T; ++t) {
        std::vector<int32_t> seen;
        for (int r = 0; r < D; ++r) {
          std::vector<int32_t> out(T * k), cnt(T);
          k3::ops::dcp_local_selection(sel_g.data(), n_g.data(), T, k, D, r, out.data(), cnt.data());
          std::vector<int32_t> mine;
          for (int j = 0; j < n_g[t]; ++j)
            if (sel_g[t * k + j] % D == r) mine.push_back(sel_g[t * k + j]);
          ASSERT_EQ(cnt[t], static_cast<int32_t>(mine.size()));
          for (int j = 0; j < cnt[t]; ++j) EXPECT_EQ(out[t * k + j] * D + r, mine[j]);
          for (int j = cnt[t]; j < k; ++j) EXPECT_EQ(out[t * k + j], -1);
          seen.insert(seen.end(), mine.begin(), mine.end());
        }
        EXPECT_EQ(static_cast<int32_t>(seen.size()), n_g[t]);
      }
    }
}

TEST(OpsReduce, RankOrderFp32Sum) {
  const float a = 1e8f, b = -1e8f, c = 1.0f;
  const float* parts[3] = {&a, &b, &c};
  float out = 0;
  k3::ops::reduce_sum_f32(parts, 3, &out, 1);
  EXPECT_EQ(out, 1.0f);  // (1e8 - 1e8) + 1
  const float* rev[3] = {&c, &b, &a};
  k3::ops::reduce_sum_f32(rev, 3, &out, 1);
  EXPECT_EQ(out, 0.0f);  // (1 - 1e8) + 1e8 in FP32
  const k3::bf16 x = k3::to_bf16(1.0f), y = k3::to_bf16(0.00390625f);  // 1 + 2^-8: a BF16 tie
  const k3::bf16* bp[2] = {&x, &y};
  k3::bf16 o;
  k3::ops::reduce_sum_bf16(bp, 2, &o, 1);
  EXPECT_EQ(k3::to_float(o), 1.0f);  // round to nearest even
}

}  // namespace
