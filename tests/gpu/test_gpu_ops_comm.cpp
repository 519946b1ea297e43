// GPU tests of the collective helper kernels against their CPU references:
// reduce_sum (ops/reduce.h: the rank-order sums of the device comm backends),
// the fixed-capacity EP pack / assemble / return / combine (ops/ep.h, whole rows and slices) and DSA's DCP top-k steps
// (ops/dcp.h, also against the top-k of the unsharded scores). All are exact:
// the kernels must give the CPU's bits. Random inputs with mixed magnitudes (the sum depends on
// the order), ids that include out-of-range ones, uneven destinations.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "gpu_test_util.h"
#include "ops/dcp.h"
#include "ops/dsa.h"
#include "ops/ep.h"
#include "ops/reduce.h"

namespace k3 {
namespace {

using namespace gputest;


// Values whose FP32 sum depends on the order (1e4-scale and 1e-3-scale mixed).
std::vector<float> mixed(size_t n, uint64_t seed) {
  Rng r(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = round_bf16(static_cast<float>(r.uniform(-1, 1) * (r.below(3) == 0 ? 1e4 : 1e-3)));
  return v;
}

class ReduceSumCuda : public ::testing::TestWithParam<std::pair<int, int64_t>> {};

TEST_P(ReduceSumCuda, BitwiseTheCpuRankOrderSum) {
  K3_REQUIRE_GPU();
  const auto [n, count] = GetParam();
  std::vector<std::vector<float>> f(n);
  std::vector<std::vector<bf16>> b(n);
  std::vector<DeviceBuffer> df, db;
  std::vector<const float*> pf, dpf;
  std::vector<const bf16*> pb, dpb;
  for (int p = 0; p < n; ++p) {
    f[p] = mixed(static_cast<size_t>(count), 100 + p);
    b[p] = to_bf16_vec(f[p]);
    df.push_back(upload(f[p]));
    db.push_back(upload(b[p]));
  }
  for (int p = 0; p < n; ++p) {
    pf.push_back(f[p].data());
    pb.push_back(b[p].data());
    dpf.push_back(df[p].get<float>());
    dpb.push_back(db[p].get<bf16>());
  }
  std::vector<float> want_f(count);
  std::vector<bf16> want_b(count);
  ops::reduce_sum_f32(pf.data(), n, want_f.data(), count);
  ops::reduce_sum_bf16(pb.data(), n, want_b.data(), count);
  DeviceBuffer of(count * 4 + 64), ob(count * 2 + 64);
  K3_CU(ops::cuda::reduce_sum_f32(dpf.data(), n, of.get<float>(), count, gputest::ctx().stream));
  K3_CU(ops::cuda::reduce_sum_bf16(dpb.data(), n, ob.get<bf16>(), count, gputest::ctx().stream));
  auto got_f = download<float>(of, count);
  auto got_b = download<bf16>(ob, count);
  EXPECT_EQ(0, std::memcmp(got_f.data(), want_f.data(), count * 4)) << "F32, " << n << " parts";
  EXPECT_EQ(0, std::memcmp(got_b.data(), want_b.data(), count * 2)) << "BF16, " << n << " parts";
  // The order matters on these data (the test could fail): reversed order differs somewhere.
  if (n >= 3 && count >= 1000) {
    std::vector<const float*> rev(pf.rbegin(), pf.rend());
    std::vector<float> r(count);
    ops::reduce_sum_f32(rev.data(), n, r.data(), count);
    EXPECT_NE(0, std::memcmp(r.data(), want_f.data(), count * 4));
  }
  // In place (out = part 0).
  K3_CU(ops::cuda::reduce_sum_f32(dpf.data(), n, df[0].get<float>(), count, gputest::ctx().stream));
  got_f = download<float>(df[0], count);
  EXPECT_EQ(0, std::memcmp(got_f.data(), want_f.data(), count * 4)) << "F32 in place";
}

INSTANTIATE_TEST_SUITE_P(Sizes, ReduceSumCuda,
                         ::testing::Values(std::make_pair(1, int64_t{7}), std::make_pair(2, int64_t{1}),
                                           std::make_pair(3, int64_t{1023}), std::make_pair(8, int64_t{4099}),
                                           std::make_pair(64, int64_t{300000})));

TEST(ReduceSumCuda, RejectsBadArguments) {
  K3_REQUIRE_GPU();
  std::vector<const float*> p(ops::cuda::kReduceMaxParts + 1, nullptr);
  float* out = nullptr;
  EXPECT_NE(0, ops::cuda::reduce_sum_f32(p.data(), 0, out, 4, gputest::ctx().stream));
  EXPECT_NE(0, ops::cuda::reduce_sum_f32(p.data(), ops::cuda::kReduceMaxParts + 1, out, 4, gputest::ctx().stream));
  EXPECT_EQ(0, ops::cuda::reduce_sum_f32(p.data(), 2, out, 0, gputest::ctx().stream));
}

struct EpCase {
  int64_t rows;  // routed rows (Gs > 1: the group's m)
  int k, L, W, experts_per_rank, Gs, t;
  int64_t spare;  // cap = cs k + spare
};

class EpCuda : public ::testing::TestWithParam<EpCase> {};

ops::EpShard ep_shard(const EpCase& c) {
  ops::EpShard s;
  s.rows = c.rows;
  s.k = c.k;
  s.cs = c.Gs > 1 ? (c.rows + c.Gs - 1) / c.Gs : c.rows;
  s.t = c.t;
  s.Gs = c.Gs;
  s.Ls = c.L / c.Gs;
  s.experts_per_rank = c.experts_per_rank;
  s.W = c.W;
  s.cap = s.cs * c.k + c.spare;
  return s;
}

// pack, assemble, return and combine on the GPU == on the CPU, bit for bit (send rows, slots, meta, joined
// rows, returned rows, sums); the combine also against the direct weighted sum of an emulated exchange.
TEST_P(EpCuda, PackAssembleReturnCombineMatchCpu) {
  K3_REQUIRE_GPU();
  const EpCase c = GetParam();
  const ops::EpShard sh = ep_shard(c);
  const int64_t pairs = c.rows * c.k, E = int64_t{c.W} * c.experts_per_rank, scap = c.Gs * sh.cap,
                slots = c.W * sh.cap, M = sh.meta(), own0 = sh.own0(), own = sh.own(), Ls = sh.Ls;
  Rng rng(77 + c.rows + 5 * c.Gs);
  std::vector<int32_t> idx(static_cast<size_t>(pairs));
  for (auto& x : idx) {
    // Skewed: half of the pairs go to rank 0's experts; a few ids out of range.
    const uint64_t u = rng.below(20);
    x = u == 0 ? -1 : u == 1 ? static_cast<int32_t>(E) : u < 10 ? static_cast<int32_t>(rng.below(c.experts_per_rank))
                                                                 : static_cast<int32_t>(rng.below(E));
  }
  const auto z = gputest::random_bf16_values(static_cast<size_t>(c.rows * Ls), 5 + c.L);
  std::vector<float> w(static_cast<size_t>(pairs));
  for (auto& x : w) x = static_cast<float>(rng.uniform(0.01, 2.0));
  auto* s = gputest::ctx().stream;
  // pack (send zeroed on both sides, so that unused rows compare equal)
  std::vector<int32_t> slot(own * c.k, 7), send_slot(pairs, 7), meta(c.W * M, 7);
  std::vector<float> send(slots * c.L, 0.0f);
  ops::ep_pack(idx.data(), z.data(), sh, slot.data(), send_slot.data(), meta.data(), send.data());
  DeviceBuffer d_idx = upload(idx), d_z = upload(to_bf16_vec(z)), d_slot(own * c.k * 4 + 4), d_send_slot(pairs * 4 + 4),
               d_meta(c.W * M * 4 + 4), d_send = upload(std::vector<bf16>(slots * c.L, to_bf16(0.0f)));
  K3_CU(ops::cuda::ep_pack(d_idx.get<int32_t>(), d_z.get<bf16>(), sh, d_slot.get<int32_t>(),
                           d_send_slot.get<int32_t>(), d_meta.get<int32_t>(), d_send.get<bf16>(), s));
  EXPECT_EQ(download<int32_t>(d_slot, own * c.k), slot);
  EXPECT_EQ(download<int32_t>(d_send_slot, pairs), send_slot);
  EXPECT_EQ(download<int32_t>(d_meta, c.W * M), meta);
  EXPECT_EQ(to_float_vec(download<bf16>(d_send, slots * c.L)), send);
  // The send slots are the dispatch order of moe_ffn: per destination, pairs in (row, choice) order.
  for (int64_t i = 0, prev = -1; i < pairs; ++i)
    if (send_slot[i] >= 0 && send_slot[i] / scap == 0) {
      EXPECT_GT(send_slot[i], prev);
      prev = send_slot[i];
    }
  if (c.Gs > 1) {
    // assemble: every peer's meta is this rank's (valid ids and codes), the slices random.
    std::vector<int32_t> recv_meta(c.W * M);
    for (int p = 0; p < c.W; ++p) std::copy_n(meta.data() + p * M, M, recv_meta.data() + p * M);
    const auto recv = gputest::random_bf16_values(static_cast<size_t>(slots * c.L), 9 + c.L);
    std::vector<float> joined(slots * c.L, 0.0f);
    std::vector<int32_t> ids(slots, 7), codes(slots, 7);
    ops::ep_assemble(recv.data(), recv_meta.data(), sh, joined.data(), ids.data(), codes.data());
    DeviceBuffer d_recv = upload(to_bf16_vec(recv)), d_recv_meta = upload(recv_meta),
                 d_joined = upload(std::vector<bf16>(slots * c.L, to_bf16(0.0f))), d_ids(slots * 4 + 4),
                 d_codes(slots * 4 + 4);
    K3_CU(ops::cuda::ep_assemble(d_recv.get<bf16>(), d_recv_meta.get<int32_t>(), sh, d_joined.get<bf16>(),
                                 d_ids.get<int32_t>(), d_codes.get<int32_t>(), s));
    EXPECT_EQ(download<int32_t>(d_ids, slots), ids);
    EXPECT_EQ(download<int32_t>(d_codes, slots), codes);
    EXPECT_EQ(to_float_vec(download<bf16>(d_joined, slots * c.L)), joined);
    // return: random expert outputs to their owners' rows.
    const auto out = gputest::random_bf16_values(static_cast<size_t>(slots * c.L), 11 + c.L);
    std::vector<float> back(slots * c.L, 0.0f);
    ops::ep_return(out.data(), ids.data(), codes.data(), sh, back.data());
    DeviceBuffer d_out = upload(to_bf16_vec(out)), d_back = upload(std::vector<bf16>(slots * c.L, to_bf16(0.0f)));
    K3_CU(ops::cuda::ep_return(d_out.get<bf16>(), d_ids.get<int32_t>(), d_codes.get<int32_t>(), sh, d_back.get<bf16>(),
                               s));
    EXPECT_EQ(to_float_vec(download<bf16>(d_back, slots * c.L)), back);
  }
  // combine of the own rows after an emulated whole-row exchange: back[slot] = bf16(zrow * (1 + id / 8)), with
  // the row's full latent standing in as this rank's own columns repeated.
  auto zfull = [&](int64_t r, int i) { return z[r * Ls + i % Ls]; };
  std::vector<float> back(slots * c.L, 0.0f);
  for (int64_t q = 0; q < own * c.k; ++q) {
    const int32_t sl = slot[q];
    if (sl < 0) continue;
    const int32_t id = idx[own0 * c.k + q];
    for (int i = 0; i < c.L; ++i)
      back[sl * c.L + i] = round_bf16(zfull(own0 + q / c.k, i) * (1.0f + static_cast<float>(id) / 8));
  }
  std::vector<float> y(own * c.L);
  ops::ep_combine(back.data(), slot.data(), w.data() + own0 * c.k, own, c.k, c.L, y.data());
  DeviceBuffer d_back = upload(to_bf16_vec(back)), d_w = upload(w), d_y(own * c.L * 2 + 2);
  K3_CU(ops::cuda::ep_combine(d_back.get<bf16>(), d_slot.get<int32_t>(), d_w.get<float>() + own0 * c.k, own, c.k, c.L,
                              d_y.get<bf16>(), s));
  EXPECT_EQ(to_float_vec(download<bf16>(d_y, own * c.L)), y);
  // Independent check of the combine: the weighted sum of the row's chosen experts' outputs, directly.
  double worst = 0;
  for (int64_t r = 0; r < own; ++r)
    for (int i = 0; i < c.L; ++i) {
      double want = 0;
      for (int j = 0; j < c.k; ++j) {
        const int32_t id = idx[(own0 + r) * c.k + j];
        if (id < 0 || id >= E) continue;
        want += w[(own0 + r) * c.k + j] * round_bf16(zfull(own0 + r, i) * (1.0f + static_cast<float>(id) / 8));
      }
      worst = std::max(worst, std::fabs(want - y[r * c.L + i]) / (1e-3 + std::fabs(want)));
    }
  EXPECT_LT(worst, 1e-2) << "combine vs the direct weighted sum";
  if (own == 0) return;
  // The combine with the latent norm folded in: the bits of the combine followed by cuda::rmsnorm (whole
  // 16-byte chunks: one kernel; L = 30: the two kernels), and the CPU rmsnorm of the CPU combine within the
  // two roundings the norm's FP32 sum order can move.
  const auto gamma = gputest::random_bf16_values(static_cast<size_t>(c.L), 13 + c.L);
  const float eps = 1e-5f;
  DeviceBuffer d_gamma = upload(to_bf16_vec(gamma)), d_yn(own * c.L * 2 + 2);
  K3_CU(ops::cuda::ep_combine(d_back.get<bf16>(), d_slot.get<int32_t>(), d_w.get<float>() + own0 * c.k, own, c.k, c.L,
                              d_yn.get<bf16>(), s, {d_gamma.get<bf16>(), eps}));
  K3_CU(ops::cuda::rmsnorm(d_y.get<bf16>(), d_gamma.get<bf16>(), d_y.get<bf16>(), own, c.L, eps, s));
  const auto fused = to_float_vec(download<bf16>(d_yn, own * c.L));
  EXPECT_EQ(fused, to_float_vec(download<bf16>(d_y, own * c.L))) << "combine + norm vs combine, then rmsnorm";
  std::vector<float> yn(y.size());
  ops::rmsnorm(y.data(), to_bf16_vec(gamma).data(), yn.data(), own, c.L, eps);
  double worst_norm = 0;
  for (size_t i = 0; i < yn.size(); ++i)
    worst_norm = std::max(worst_norm, std::fabs(double(fused[i]) - yn[i]) / (1e-6 + std::fabs(double(yn[i]))));
  EXPECT_LE(worst_norm, 1.0 / 64) << "combine + norm vs the CPU rmsnorm of the CPU combine";
}

// {rows, k, L, W, experts per rank, Gs, t, spare}: whole rows (Gs 1) and slices, odd sizes, a member past the
// rows (own = 0), no rows, and the K3 per-rank shapes of TP8 x DP4 at 64 rows (L 3584 over 8: 448 columns).
INSTANTIATE_TEST_SUITE_P(Shapes, EpCuda,
                         ::testing::Values(EpCase{1, 1, 8, 1, 16, 1, 0, 0}, EpCase{5, 4, 40, 2, 8, 1, 0, 0},
                                           EpCase{13, 4, 64, 8, 2, 1, 0, 51}, EpCase{0, 4, 64, 4, 4, 1, 0, 16},
                                           EpCase{64, 16, 3584, 8, 112, 1, 0, 0},
                                           EpCase{33, 3, 24, 3, 5, 1, 0, 1}, EpCase{7, 3, 24, 4, 5, 2, 1, 0},
                                           EpCase{13, 5, 30, 6, 3, 3, 2, 2}, EpCase{3, 2, 64, 8, 4, 8, 5, 0},
                                           EpCase{0, 4, 64, 8, 4, 2, 1, 4}, EpCase{70, 16, 56, 4, 8, 4, 3, 0},
                                           EpCase{64, 16, 3584, 32, 28, 8, 3, 0}));

TEST(EpCuda, RejectsShardsThatCannotFit) {
  K3_REQUIRE_GPU();
  ops::EpShard s;
  s.rows = 4;
  s.k = 2;
  s.cs = 4;
  s.Ls = 8;
  s.W = 2;
  s.cap = 7;  // < cs k
  auto* st = gputest::ctx().stream;
  EXPECT_NE(0, ops::cuda::ep_pack(nullptr, nullptr, s, nullptr, nullptr, nullptr, nullptr, st));
  std::vector<int32_t> idx(8, 0), slot(8), send_slot(8), meta(64);
  std::vector<float> z(32), send(14 * 8);
  EXPECT_THROW(ops::ep_pack(idx.data(), z.data(), s, slot.data(), send_slot.data(), meta.data(), send.data()), Error);
  s.cap = 8;
  EXPECT_NE(0, ops::cuda::ep_assemble(nullptr, nullptr, s, nullptr, nullptr, nullptr, st));  // Gs 1: nothing to join
  s.Gs = 2;
  s.cs = 1;  // 4 rows > Gs cs
  EXPECT_NE(0, ops::cuda::ep_return(nullptr, nullptr, nullptr, s, nullptr, st));
}

struct DcpCase {
  int64_t T;
  int D, k, ld;
};
class DcpTopkCuda : public ::testing::TestWithParam<DcpCase> {};

// Scores S[t, p] over positions p < ctx[t] (ties included) sharded by p mod D: each rank's
// local top-k -> candidates -> scattered -> top-k == the top-k of S itself, and every
// kernel step gives the CPU reference's bits.
TEST_P(DcpTopkCuda, ShardedTopkEqualsTheGlobalTopk) {
  K3_REQUIRE_GPU();
  const DcpCase c = GetParam();
  const int64_t T = c.T, ld = c.ld;
  const int D = c.D, k = c.k;
  auto* s = gputest::ctx().stream;
  Rng rng(900 + D * 10 + k);
  std::vector<int32_t> ctx(T);
  std::vector<float> S(T * ld, -INFINITY);
  for (int64_t t = 0; t < T; ++t) {
    ctx[t] = static_cast<int32_t>(t == 0 ? 1 : 1 + rng.below(static_cast<uint64_t>(ld)));
    for (int p = 0; p < ctx[t]; ++p) S[t * ld + p] = static_cast<float>(rng.below(9)) * 0.25f;  // many ties
  }
  // Per rank: local scores [T, ld] (local index j = position j D + r), local top-k on the CPU.
  std::vector<float> all_s(D * T * k);
  std::vector<int32_t> all_p(D * T * k);
  std::vector<DeviceBuffer> keep;
  for (int r = 0; r < D; ++r) {
    std::vector<float> local(T * ld, -INFINITY);
    std::vector<int32_t> n(T), sel(T * k, -1);
    for (int64_t t = 0; t < T; ++t) {
      n[t] = ctx[t] > r ? (ctx[t] - 1 - r) / D + 1 : 0;
      for (int j = 0; j < n[t]; ++j) local[t * ld + j] = S[t * ld + j * D + r];
      std::vector<int64_t> top(n[t]);
      const int64_t kept = ops::topk_indices(&local[t * ld], n[t], k, top.data());
      for (int64_t j = 0; j < kept; ++j) sel[t * k + j] = static_cast<int32_t>(top[j]);
      n[t] = static_cast<int32_t>(kept);
    }
    std::vector<float> cs(T * k);
    std::vector<int32_t> cp(T * k);
    ops::dcp_topk_candidates(local.data(), ld, sel.data(), n.data(), T, k, D, r, cs.data(), cp.data());
    DeviceBuffer d_local = upload(local), d_sel = upload(sel), d_n = upload(n), d_cs(T * k * 4 + 4), d_cp(T * k * 4 + 4);
    K3_CU(ops::cuda::dcp_topk_candidates(d_local.get<float>(), ld, d_sel.get<int32_t>(), d_n.get<int32_t>(), T, k, D,
                                         r, d_cs.get<float>(), d_cp.get<int32_t>(), s));
    EXPECT_EQ(download<float>(d_cs, T * k), cs) << "candidates, rank " << r;
    EXPECT_EQ(download<int32_t>(d_cp, T * k), cp) << "candidates, rank " << r;
    std::copy(cs.begin(), cs.end(), all_s.begin() + r * T * k);
    std::copy(cp.begin(), cp.end(), all_p.begin() + r * T * k);
  }
  std::vector<float> dense(T * ld);
  ops::dcp_scatter_candidates(all_s.data(), all_p.data(), D, T, k, ld, dense.data());
  DeviceBuffer d_all_s = upload(all_s), d_all_p = upload(all_p), d_dense(T * ld * 4 + 4);
  K3_CU(ops::cuda::dcp_scatter_candidates(d_all_s.get<float>(), d_all_p.get<int32_t>(), D, T, k, ld,
                                          d_dense.get<float>(), s));
  EXPECT_EQ(download<float>(d_dense, T * ld), dense) << "scatter";
  // The global selection from the scattered candidates == the top-k of S (ties low, listed by position).
  std::vector<int32_t> sel_g(T * k, -1), n_g(T);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int64_t> a(ctx[t]), b(ctx[t]);
    const int64_t ka = ops::topk_indices(&dense[t * ld], ctx[t], k, a.data());
    const int64_t kb = ops::topk_indices(&S[t * ld], ctx[t], k, b.data());
    ASSERT_EQ(ka, kb);
    for (int64_t j = 0; j < ka; ++j) {
      EXPECT_EQ(a[j], b[j]) << "row " << t << " rank " << j << ": sharded top-k differs from the global top-k";
      sel_g[t * k + j] = static_cast<int32_t>(a[j]);
    }
    n_g[t] = static_cast<int32_t>(ka);
  }
  // Local selections: exact vs CPU, and together they are the global selection.
  DeviceBuffer d_sel_g = upload(sel_g), d_n_g = upload(n_g);
  int64_t total = 0;
  for (int r = 0; r < D; ++r) {
    std::vector<int32_t> out(T * k), cnt(T);
    ops::dcp_local_selection(sel_g.data(), n_g.data(), T, k, D, r, out.data(), cnt.data());
    DeviceBuffer d_out(T * k * 4 + 4), d_cnt(T * 4 + 4);
    K3_CU(ops::cuda::dcp_local_selection(d_sel_g.get<int32_t>(), d_n_g.get<int32_t>(), T, k, D, r,
                                         d_out.get<int32_t>(), d_cnt.get<int32_t>(), s));
    EXPECT_EQ(download<int32_t>(d_out, T * k), out) << "local selection, rank " << r;
    EXPECT_EQ(download<int32_t>(d_cnt, T), cnt) << "local selection counts, rank " << r;
    for (int64_t t = 0; t < T; ++t) {
      total += cnt[t];
      for (int j = 0; j < cnt[t]; ++j) EXPECT_LT(out[t * k + j] * D + r, ctx[t]);
    }
  }
  int64_t want = 0;
  for (int64_t t = 0; t < T; ++t) want += n_g[t];
  EXPECT_EQ(total, want) << "the local selections partition the global one";
}

INSTANTIATE_TEST_SUITE_P(Shapes, DcpTopkCuda,
                         ::testing::Values(DcpCase{5, 2, 3, 40}, DcpCase{9, 4, 8, 48}, DcpCase{3, 8, 4, 70},
                                           DcpCase{17, 2, 64, 200}, DcpCase{4, 3, 40, 33}));

}  // namespace
}  // namespace k3
