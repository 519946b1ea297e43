// GPU tests of the KDA-layer CUDA ops against their CPU references (src/ops/*.cpp; the CPU tests:
// tests/test_ops_kda.cpp): short_conv_silu, commit_state, kda_gate / kda_beta / l2norm_heads /
// kda_recurrence / kda_gated_norm. Random inputs from fixed seeds (never zeros), odd shapes and the K3
// per-rank shapes (TP8), the verify semantics (history rows, commit of n accepted tokens), and
// sentinels around every output so that a stray write or read shows.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "gpu_test_util.h"
#include "ops/kda.h"
#include "ops/short_conv.h"

namespace k3 {
namespace {

using namespace gputest;


constexpr float kSentinel = 12345.0f;





// B distinct slots out of num_slots, in shuffled order.
std::vector<int32_t> pick_slots(int B, int num_slots, uint64_t seed) {
  std::vector<int32_t> s(static_cast<size_t>(num_slots));
  std::iota(s.begin(), s.end(), 0);
  Rng r(seed);
  shuffle(s, r);
  s.resize(static_cast<size_t>(B));
  return s;
}

// Accepted counts cycling through {0, 1, q}.
std::vector<int32_t> accepted_pattern(int B, int q) {
  std::vector<int32_t> a(static_cast<size_t>(B));
  for (int b = 0; b < B; ++b) a[b] = b % 3 == 0 ? 0 : (b % 3 == 1 ? 1 : q);
  if (B == 1) a[0] = q;
  return a;
}

void expect_exact(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool same = std::memcmp(&got[i], &want[i], sizeof(float)) == 0 || got[i] == want[i];
    if (!same) {
      ADD_FAILURE() << what << ": first difference at " << i << " got " << got[i] << " want " << want[i];
      return;
    }
  }
}

// Rows [first, first + count) of a [rows, width] array.
std::vector<float> rows_of(const std::vector<float>& a, int64_t width, int64_t first, int64_t count) {
  return std::vector<float>(a.begin() + first * width, a.begin() + (first + count) * width);
}

// ---------------------------------------------------------------- short conv + commit

struct ConvShape {
  int B, q, max_q, num_slots;
  int64_t C;
  int K;
  int64_t x_pad;  // extra columns per row of x (a packed projection output)
};

class ShortConvCuda : public ::testing::TestWithParam<ConvShape> {};

TEST_P(ShortConvCuda, MatchesCpuWritesHistoryAndCommits) {
  K3_REQUIRE_GPU();
  const ConvShape s = GetParam();
  const int B = s.B, q = s.q, max_q = s.max_q, K = s.K, S = K - 1;
  const int64_t C = s.C, x_ld = C + s.x_pad, rows = int64_t{B} * q, st_f = C * S;
  const auto x = random_bf16_values(static_cast<size_t>(rows * x_ld), 11, 2.0);
  const auto w = uniform(static_cast<size_t>(C * K), 12, -0.8, 0.8);
  const auto pool = uniform(static_cast<size_t>(s.num_slots * st_f), 13, -2.0, 2.0);
  const auto slots = pick_slots(B, s.num_slots, 14);
  std::vector<float> hist(static_cast<size_t>(s.num_slots * max_q * st_f), kSentinel);

  auto d_x = up_bf16(x);
  auto d_w = upload(w);
  auto d_pool = upload(pool);
  auto d_hist = upload(hist);
  auto d_slots = upload(slots);
  DeviceBuffer d_y(static_cast<size_t>(rows * C) * sizeof(bf16));
  K3_CU(ops::cuda::short_conv_silu(d_x.get<bf16>(), x_ld, d_w.get<float>(), d_pool.get<float>(), d_hist.get<float>(),
                                   d_slots.get<int32_t>(), d_y.get<bf16>(), B, q, max_q, C, K, st()));

  // CPU: per request, from a copy of its committed state.
  std::vector<float> y_ref(static_cast<size_t>(rows * C)), hist_ref = hist;
  for (int b = 0; b < B; ++b) {
    std::vector<float> xb(static_cast<size_t>(q * C)),
        state(pool.begin() + slots[b] * st_f, pool.begin() + (slots[b] + 1) * st_f);
    for (int t = 0; t < q; ++t) std::copy_n(&x[(int64_t{b} * q + t) * x_ld], C, &xb[static_cast<size_t>(t * C)]);
    ops::short_conv_silu(xb.data(), w.data(), state.data(), &y_ref[static_cast<size_t>(b * q * C)],
                         &hist_ref[static_cast<size_t>(int64_t{slots[b]} * max_q * st_f)], q, C, K);
  }
  expect_close(down_bf16(d_y, y_ref.size()), y_ref, 5e-3, 0, "short_conv y");
  expect_exact(down_f32(d_hist, hist.size()), hist_ref, "short_conv history (and untouched rows)");
  expect_exact(down_f32(d_pool, pool.size()), pool, "committed conv state is read only");

  // Commit n accepted tokens: the CPU state after exactly n tokens.
  const auto accepted = accepted_pattern(B, q);
  auto d_acc = upload(accepted);
  K3_CU(ops::cuda::commit_state(d_hist.get<float>(), d_pool.get<float>(), d_slots.get<int32_t>(), d_acc.get<int32_t>(),
                                B, max_q, st_f, st()));
  std::vector<float> pool_ref = pool;
  for (int b = 0; b < B; ++b) {
    const int n = accepted[b];
    if (n == 0) continue;
    std::vector<float> xb(static_cast<size_t>(n * C)), yb(static_cast<size_t>(n * C));
    for (int t = 0; t < n; ++t) std::copy_n(&x[(int64_t{b} * q + t) * x_ld], C, &xb[static_cast<size_t>(t * C)]);
    ops::short_conv_silu(xb.data(), w.data(), &pool_ref[static_cast<size_t>(slots[b] * st_f)], yb.data(), nullptr, n, C,
                         K);
  }
  expect_exact(down_f32(d_pool, pool.size()), pool_ref, "conv state after commit");
}

INSTANTIATE_TEST_SUITE_P(Shapes, ShortConvCuda,
                         ::testing::Values(ConvShape{1, 1, 1, 2, 1536, 4, 0},  // K3 TP8 q/k/v, plain decode
                                           ConvShape{3, 4, 8, 5, 1536, 4, 0},  // verify, 3 requests
                                           ConvShape{8, 8, 8, 9, 4608, 4,
                                                     6288 - 4608},             // fused q|k|v of the packed proj
                                           ConvShape{2, 3, 5, 4, 37, 3, 5},    // odd channels, K 3
                                           ConvShape{3, 2, 2, 3, 300, 2, 0},   // K 2
                                           ConvShape{2, 5, 6, 3, 33, 8, 1}));  // K 8 (the maximum)

// ---------------------------------------------------------------- KDA elementwise ops

struct KdaShape {
  int64_t rows;
  int H, d;
};

class KdaPointwiseCuda : public ::testing::TestWithParam<KdaShape> {};

TEST_P(KdaPointwiseCuda, GateBetaL2normGatedNormMatchCpu) {
  K3_REQUIRE_GPU();
  const KdaShape s = GetParam();
  const int64_t rows = s.rows, C = int64_t{s.H} * s.d;
  const int H = s.H, d = s.d;

  {  // kda_gate
    const auto u = random_bf16_values(static_cast<size_t>(rows * C), 21, 3.0);
    const auto A_log = uniform(static_cast<size_t>(H + 3), 22, -1.5, 1.5);  // padded storage, first H used
    const auto dt_bias = uniform(static_cast<size_t>(C), 23, -1.0, 1.0);
    auto d_u = up_bf16(u);
    auto d_A = upload(A_log);
    auto d_dt = upload(dt_bias);
    DeviceBuffer d_g(static_cast<size_t>(rows * C) * sizeof(float));
    K3_CU(ops::cuda::kda_gate(d_u.get<bf16>(), d_A.get<float>(), d_dt.get<float>(), -5.0f, d_g.get<float>(), rows, H, d,
                              st()));
    std::vector<float> g_ref(static_cast<size_t>(rows * C));
    ops::kda_gate(u.data(), A_log.data(), dt_bias.data(), -5.0f, g_ref.data(), rows, H, d);
    expect_close(down_f32(d_g, g_ref.size()), g_ref, 2e-6, 1e-6, "kda_gate");
  }
  {  // kda_beta from a strided (packed) input
    const int64_t b_ld = H + 7;
    const auto bsrc = random_bf16_values(static_cast<size_t>(rows * b_ld), 24, 4.0);
    auto d_b = up_bf16(bsrc);
    DeviceBuffer d_beta(static_cast<size_t>(rows * H) * sizeof(float));
    K3_CU(ops::cuda::kda_beta(d_b.get<bf16>(), b_ld, d_beta.get<float>(), rows, H, st()));
    std::vector<float> b_ref(static_cast<size_t>(rows * H));
    for (int64_t r = 0; r < rows; ++r) std::copy_n(&bsrc[r * b_ld], H, &b_ref[r * H]);
    ops::kda_beta(b_ref.data(), b_ref.data(), rows, H);
    expect_close(down_f32(d_beta, b_ref.size()), b_ref, 1e-6, 1e-7, "kda_beta");
  }
  {  // l2norm_heads, both scales the model uses
    const auto x = random_bf16_values(static_cast<size_t>(rows * C), 25, 1.5);
    auto d_x = up_bf16(x);
    DeviceBuffer d_out(static_cast<size_t>(rows * C) * sizeof(float));
    for (float scale : {1.0f, 1.0f / std::sqrt(static_cast<float>(d))}) {
      K3_CU(ops::cuda::l2norm_heads(d_x.get<bf16>(), d_out.get<float>(), rows, H, d, scale, st()));
      std::vector<float> ref = x;
      ops::l2norm_heads(ref.data(), rows, H, d, scale);
      expect_close(down_f32(d_out, ref.size()), ref, 1e-6, 0, "l2norm_heads");
    }
  }
  {  // kda_gated_norm with a strided gate
    const int64_t g_ld = C + 12;
    const auto o = uniform(static_cast<size_t>(rows * C), 26, -0.7, 0.7);
    const auto gate = random_bf16_values(static_cast<size_t>(rows * g_ld), 27, 4.0);
    const auto w = uniform(static_cast<size_t>(d), 28, 0.5, 1.5);
    auto d_o = upload(o);
    auto d_gate = up_bf16(gate);
    auto d_w = upload(w);
    DeviceBuffer d_out(static_cast<size_t>(rows * C) * sizeof(bf16));
    K3_CU(ops::cuda::kda_gated_norm(d_o.get<float>(), d_gate.get<bf16>(), g_ld, d_w.get<float>(), 1e-5f,
                                    d_out.get<bf16>(), rows, H, d, st()));
    std::vector<float> gate_c(static_cast<size_t>(rows * C)), ref(static_cast<size_t>(rows * C));
    for (int64_t r = 0; r < rows; ++r) std::copy_n(&gate[r * g_ld], C, &gate_c[r * C]);
    ops::kda_gated_norm(o.data(), gate_c.data(), w.data(), 1e-5f, ref.data(), rows, H, d);
    expect_close(down_bf16(d_out, ref.size()), ref, 5e-3, 0, "kda_gated_norm");
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, KdaPointwiseCuda,
                         ::testing::Values(KdaShape{1, 12, 128}, KdaShape{64, 12, 128}, KdaShape{5, 3, 20},
                                           KdaShape{7, 2, 33}, KdaShape{3, 1, 300}));

// ---------------------------------------------------------------- KDA recurrence (verify + commit)

struct RecShape {
  int B, q, max_q, num_slots, H, dk, dv;
};

class KdaRecurrenceCuda : public ::testing::TestWithParam<RecShape> {};

TEST_P(KdaRecurrenceCuda, MatchesCpuPerTokenHistoryAndCommit) {
  K3_REQUIRE_GPU();
  const RecShape s = GetParam();
  const int B = s.B, q = s.q, max_q = s.max_q, H = s.H, dk = s.dk, dv = s.dv;
  const int64_t rows = int64_t{B} * q, Ck = int64_t{H} * dk, Cv = int64_t{H} * dv, st_f = int64_t{H} * dv * dk;
  const uint64_t seed = 1000 + static_cast<uint64_t>(B * 100 + q * 10 + H + dk + dv);

  // Inputs as the layer makes them: l2-normalized q (scale dk^-0.5) and k, v BF16, g in (-5, 0), beta in (0, 1).
  auto qf = random_bf16_values(static_cast<size_t>(rows * Ck), seed + 1);
  auto kf = random_bf16_values(static_cast<size_t>(rows * Ck), seed + 2);
  ops::l2norm_heads(qf.data(), rows, H, dk, 1.0f / std::sqrt(static_cast<float>(dk)));
  ops::l2norm_heads(kf.data(), rows, H, dk, 1.0f);
  const auto v = random_bf16_values(static_cast<size_t>(rows * Cv), seed + 3, 2.0);
  const auto u = random_bf16_values(static_cast<size_t>(rows * Ck), seed + 4, 3.0);
  const auto A_log = uniform(static_cast<size_t>(H), seed + 5, -2.0, 0.5);
  const auto dt_bias = uniform(static_cast<size_t>(Ck), seed + 6, -1.0, 1.0);
  std::vector<float> g(static_cast<size_t>(rows * Ck));
  ops::kda_gate(u.data(), A_log.data(), dt_bias.data(), -5.0f, g.data(), rows, H, dk);
  std::vector<float> beta = uniform(static_cast<size_t>(rows * H), seed + 7, -3.0, 3.0);
  ops::kda_beta(beta.data(), beta.data(), rows, H);
  const auto pool = uniform(static_cast<size_t>(s.num_slots * st_f), seed + 8, -1.0, 1.0);
  const auto slots = pick_slots(B, s.num_slots, seed + 9);
  std::vector<float> hist(static_cast<size_t>(s.num_slots * max_q * st_f), kSentinel);

  auto d_q = upload(qf);
  auto d_k = upload(kf);
  auto d_v = up_bf16(v);
  auto d_g = upload(g);
  auto d_beta = upload(beta);
  auto d_pool = upload(pool);
  auto d_hist = upload(hist);
  auto d_slots = upload(slots);
  DeviceBuffer d_o(static_cast<size_t>(rows * Cv) * sizeof(float));
  K3_CU(ops::cuda::kda_recurrence(d_q.get<float>(), d_k.get<float>(), d_v.get<bf16>(), d_g.get<float>(),
                                  d_beta.get<float>(), d_pool.get<float>(), d_hist.get<float>(), d_slots.get<int32_t>(),
                                  d_o.get<float>(), B, q, max_q, H, dk, dv, st()));

  std::vector<float> o_ref(static_cast<size_t>(rows * Cv)), hist_ref = hist;
  for (int b = 0; b < B; ++b) {
    std::vector<float> S(pool.begin() + slots[b] * st_f, pool.begin() + (slots[b] + 1) * st_f);
    const int64_t r0 = int64_t{b} * q;
    ops::kda_recurrence(&qf[r0 * Ck], &kf[r0 * Ck], &v[r0 * Cv], &g[r0 * Ck], &beta[r0 * H], S.data(), &o_ref[r0 * Cv],
                        &hist_ref[static_cast<size_t>(int64_t{slots[b]} * max_q * st_f)], q, H, dk, dv);
  }
  expect_close(down_f32(d_o, o_ref.size()), o_ref, 1e-4, 1e-6, "kda o");
  const auto hist_got = down_f32(d_hist, hist.size());
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < max_q; ++t) {
      const int64_t row = int64_t{slots[b]} * max_q + t;
      const auto got = rows_of(hist_got, st_f, row, 1), want = rows_of(hist_ref, st_f, row, 1);
      if (t < q)
        expect_close(got, want, 1e-4, 1e-6, "kda state after token t");
      else
        expect_exact(got, want, "history rows past q_len untouched");
    }
  for (int sl = 0; sl < s.num_slots; ++sl)
    if (std::find(slots.begin(), slots.end(), sl) == slots.end())
      expect_exact(rows_of(hist_got, st_f * max_q, sl, 1), rows_of(hist_ref, st_f * max_q, sl, 1),
                   "history of unbound slots untouched");
  expect_exact(down_f32(d_pool, pool.size()), pool, "committed state is read only");

  // Commit n in {0, 1, q}: the state of decoding exactly the accepted tokens one by one.
  const auto accepted = accepted_pattern(B, q);
  auto d_acc = upload(accepted);
  K3_CU(ops::cuda::commit_state(d_hist.get<float>(), d_pool.get<float>(), d_slots.get<int32_t>(), d_acc.get<int32_t>(),
                                B, max_q, st_f, st()));
  std::vector<float> pool_ref = pool;
  for (int b = 0; b < B; ++b) {
    const int n = accepted[b];
    const int64_t r0 = int64_t{b} * q;
    std::vector<float> ob(static_cast<size_t>(n * Cv));
    if (n > 0)
      ops::kda_recurrence(&qf[r0 * Ck], &kf[r0 * Ck], &v[r0 * Cv], &g[r0 * Ck], &beta[r0 * H],
                          &pool_ref[static_cast<size_t>(slots[b] * st_f)], ob.data(), nullptr, n, H, dk, dv);
  }
  const auto pool_got = down_f32(d_pool, pool.size());
  for (int sl = 0; sl < s.num_slots; ++sl) {
    const auto got = rows_of(pool_got, st_f, sl, 1), want = rows_of(pool_ref, st_f, sl, 1);
    const auto it = std::find(slots.begin(), slots.end(), sl);
    if (it != slots.end() && accepted[static_cast<size_t>(it - slots.begin())] > 0)
      expect_close(got, want, 1e-4, 1e-6, "committed state after n tokens");
    else
      expect_exact(got, want, "slot kept (n = 0 or unbound)");
  }
}

std::vector<RecShape> rec_shapes() {
  std::vector<RecShape> v;
  for (int B : {1, 3, 8})
    for (int q : {1, 2, 4, 8}) v.push_back({B, q, 8, B + 2, 12, 128, 128});  // K3 TP8: 12 heads of 128
  v.push_back({2, 3, 5, 4, 3, 20, 37});                                      // odd dk (5 float4 chunks) and dv
  v.push_back({1, 2, 2, 2, 2, 256, 16});                                     // dk 256: two chunks per lane
  v.push_back({3, 1, 1, 3, 1, 64, 130});                                     // dv not a multiple of the CTA rows
  return v;
}
INSTANTIATE_TEST_SUITE_P(Shapes, KdaRecurrenceCuda, ::testing::ValuesIn(rec_shapes()));

TEST(KdaCuda, RejectsBadShapes) {
  K3_REQUIRE_GPU();
  EXPECT_NE(ops::cuda::kda_recurrence(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                      1, 9, 8, 12, 128, 128, st()),
            0);  // q_len > max_q
  EXPECT_NE(ops::cuda::kda_recurrence(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                      1, 1, 8, 12, 130, 128, st()),
            0);  // dk % 4 != 0
  EXPECT_NE(ops::cuda::short_conv_silu(nullptr, 8, nullptr, nullptr, nullptr, nullptr, nullptr, 1, 1, 1, 8, 9, st()),
            0);  // K > 8
}

}  // namespace
}  // namespace k3
