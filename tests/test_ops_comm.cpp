// CPU references of the collectives' helper ops, against independent
// formulations (the GPU tests hold the kernels to these references bit for bit):
//   OpsEp    ep_pack over W emulated ranks + the exchange + ep_combine == the
//            direct weighted sum of each row's chosen experts in its order; the
//            slots of a destination are the CPU moe_ffn's (row, choice) order
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

TEST(OpsEp, PackExchangeCombineEqualsTheDirectWeightedSum) {
  const int W = 3, epr = 4, k = 3, L = 8;
  const int64_t rows = 7, cap = rows * k;  // per sender
  Rng rng(5);
  // Each rank's shard: ids (a few out of range), rows, weights.
  std::vector<std::vector<int32_t>> idx(W, std::vector<int32_t>(rows * k));
  std::vector<std::vector<float>> z(W, std::vector<float>(rows * L)), wt(W, std::vector<float>(rows * k));
  for (int s = 0; s < W; ++s) {
    for (auto& x : idx[s]) x = rng.below(10) == 0 ? -1 : static_cast<int32_t>(rng.below(W * epr));
    for (auto& x : z[s]) x = k3::round_bf16(static_cast<float>(rng.uniform(-1, 1)));
    for (auto& x : wt[s]) x = static_cast<float>(rng.uniform(0.1, 1));
  }
  auto expert = [](int32_t id, float v) { return k3::round_bf16(v * (1.0f + 0.125f * static_cast<float>(id))); };
  std::vector<std::vector<int32_t>> slot(W, std::vector<int32_t>(rows * k)), ids(W, std::vector<int32_t>(W * cap));
  std::vector<std::vector<float>> send(W, std::vector<float>(W * cap * L, 0.0f));
  for (int s = 0; s < W; ++s)
    k3::ops::ep_pack(idx[s].data(), z[s].data(), rows, k, L, epr, W, cap, slot[s].data(), ids[s].data(),
                     send[s].data());
  // Dispatch order: per destination, the pairs in (row, choice) order fill slots 0, 1, ...
  for (int s = 0; s < W; ++s)
    for (int d = 0; d < W; ++d) {
      int64_t next = 0;
      for (int64_t i = 0; i < rows * k; ++i)
        if (idx[s][i] >= 0 && idx[s][i] / epr == d) {
          EXPECT_EQ(slot[s][i], d * cap + next) << "sender " << s << " pair " << i;
          EXPECT_EQ(ids[s][d * cap + next], idx[s][i]);
          ++next;
        }
      for (int64_t p = next; p < cap; ++p) EXPECT_EQ(ids[s][d * cap + p], -1);
    }
  // Exchange: owner d gets [s, cap] from every sender s, runs the experts, sends back.
  std::vector<std::vector<float>> back(W, std::vector<float>(W * cap * L, 0.0f));
  for (int d = 0; d < W; ++d)
    for (int s = 0; s < W; ++s)
      for (int64_t p = 0; p < cap; ++p) {
        const int32_t id = ids[s][d * cap + p];
        if (id < 0) continue;
        EXPECT_TRUE(id / epr == d);
        for (int c = 0; c < L; ++c) back[s][(d * cap + p) * L + c] = expert(id, send[s][(d * cap + p) * L + c]);
      }
  for (int s = 0; s < W; ++s) {
    std::vector<float> y(rows * L);
    k3::ops::ep_combine(back[s].data(), slot[s].data(), wt[s].data(), rows, k, L, y.data());
    for (int64_t r = 0; r < rows; ++r)
      for (int c = 0; c < L; ++c) {
        float want = 0;
        for (int j = 0; j < k; ++j) {
          const int32_t id = idx[s][r * k + j];
          if (id >= 0) want += wt[s][r * k + j] * expert(id, z[s][r * L + c]);
        }
        EXPECT_EQ(y[r * L + c], k3::round_bf16(want)) << "sender " << s << " row " << r << " col " << c;
      }
  }
}

TEST(OpsEp, CapacityBelowThePairsIsAnError) {
  std::vector<int32_t> idx(8, 0), slot(8), ids(14);
  std::vector<float> z(32), send(14 * 8);
  EXPECT_THROW(k3::ops::ep_pack(idx.data(), z.data(), 4, 2, 8, 1, 2, 7, slot.data(), ids.data(), send.data()),
               k3::Error);
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
