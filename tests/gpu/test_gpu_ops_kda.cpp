// GPU tests of the KDA-layer CUDA ops against their CPU references (src/ops/*.cpp; the CPU tests:
// tests/test_ops_kda.cpp): kda_prep (the convs, l2 norms, gate and beta of a step) + short_conv_commit,
// kda_recurrence + kda_replay, kda_gated_norm. Random inputs from fixed seeds (never zeros), odd shapes
// and the K3 per-rank shapes (TP8) at B = 1 and B > 1, the verify semantics (the double-buffered state:
// read one, write the other; the kept inputs; the commit of every n accepted tokens, bit-identical to a
// step of those n tokens), and sentinels around every output so that a stray write or read shows.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "gpu_test_util.h"
#include "ops/kda.h"
#include "ops/kda_prep.h"
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

// ---------------------------------------------------------------- kda_prep (conv, norms, gate, beta) + commit

struct PrepShape {
  int B, q, max_q, num_slots, H, d, K;
};

// Values within `loose` of the largest |want| everywhere and within `tight` of it at all but 1% of them: a
// conv output may round to the neighbouring BF16 value (CUDA's expf against the CPU's), which moves the
// l2-normalized values of its (token, head) by up to a BF16 ulp; elsewhere the norms agree to FP32.
void expect_close_but_rare(const std::vector<float>& got, const std::vector<float>& want, double tight, double loose,
                           const char* what) {
  expect_close(got, want, loose, 0, what);
  double scale = 0;
  for (float w : want) scale = std::max(scale, static_cast<double>(std::fabs(w)));
  size_t off = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (!(std::fabs(static_cast<double>(got[i]) - want[i]) <= tight * scale)) ++off;
  EXPECT_LE(off, got.size() / 100) << what << ": " << off << " of " << got.size() << " values beyond " << tight;
}

// Each output of a launcher in a buffer of n values and kTail more set to kSentinel: the tail must stay.
constexpr int64_t kTail = 64;
DeviceBuffer sentinel_f32(int64_t n) {
  return upload(std::vector<float>(static_cast<size_t>(n + kTail), kSentinel));
}
DeviceBuffer sentinel_bf16(int64_t n) {
  return up_bf16(std::vector<float>(static_cast<size_t>(n + kTail), kSentinel));
}
void expect_tail(const std::vector<float>& all, int64_t n, const char* what, float sentinel = kSentinel) {
  for (int64_t i = n; i < n + kTail; ++i)
    if (all[i] != sentinel) {
      ADD_FAILURE() << what << ": written past its end at " << i - n;
      return;
    }
}

class KdaPrepCuda : public ::testing::TestWithParam<PrepShape> {};

TEST_P(KdaPrepCuda, MatchesCpuKeepsInputsAndCommits) {
  K3_REQUIRE_GPU();
  const PrepShape s = GetParam();
  const int B = s.B, q = s.q, max_q = s.max_q, H = s.H, d = s.d, K = s.K, S = K - 1;
  const int64_t C = int64_t{H} * d, rows = int64_t{B} * q, st_f = C * S;
  // The packed projection as the layer has it: q | k | v | g | f_a | b | padding.
  const int64_t ld = (4 * C + d + H + 15) / 16 * 16, b_col = 4 * C + d;
  const uint64_t seed = 3000 + static_cast<uint64_t>(B * 1000 + q * 100 + H * 10 + d + K);
  const auto proj = random_bf16_values(static_cast<size_t>(rows * ld), seed, 2.0);
  const auto u = random_bf16_values(static_cast<size_t>(rows * C), seed + 1, 3.0);
  std::vector<float> conv_w[3], pool[3];
  for (int j = 0; j < 3; ++j) {
    conv_w[j] = uniform(static_cast<size_t>(C * K), seed + 2 + j, -0.8, 0.8);
    pool[j] = uniform(static_cast<size_t>(s.num_slots * st_f), seed + 5 + j, -2.0, 2.0);
  }
  const auto A_log = uniform(static_cast<size_t>(H + 3), seed + 8, -1.5, 1.5);  // padded storage, first H used
  const auto dt_bias = uniform(static_cast<size_t>(C), seed + 9, -1.0, 1.0);
  const float lower = -5.0f;
  const auto slots = pick_slots(B, s.num_slots, seed + 10);
  const int64_t kept_n = int64_t{s.num_slots} * max_q * C;
  const std::vector<float> kept(static_cast<size_t>(kept_n), kSentinel);

  auto d_proj = up_bf16(proj);
  auto d_u = up_bf16(u);
  auto d_A = upload(A_log);
  auto d_dt = upload(dt_bias);
  auto d_slots = upload(slots);
  DeviceBuffer d_w[3], d_pool[3], d_kept[3];
  for (int j = 0; j < 3; ++j) {
    d_w[j] = upload(conv_w[j]);
    d_pool[j] = upload(pool[j]);
    d_kept[j] = upload(kept);
  }
  DeviceBuffer d_q = sentinel_f32(rows * C), d_k = sentinel_f32(rows * C), d_v = sentinel_bf16(rows * C),
               d_g = sentinel_f32(rows * C), d_beta = sentinel_f32(rows * H);
  ops::cuda::KdaPrep p;
  p.proj = d_proj.get<bf16>();
  p.proj_ld = ld;
  p.b_col = b_col;
  p.u = d_u.get<bf16>();
  for (int j = 0; j < 3; ++j) {
    p.conv_w[j] = d_w[j].get<float>();
    p.conv_pool[j] = d_pool[j].get<float>();
    p.conv_kept[j] = d_kept[j].get<float>();
  }
  p.slots = d_slots.get<int32_t>();
  p.A_log = d_A.get<float>();
  p.dt_bias = d_dt.get<float>();
  p.lower_bound = lower;
  p.q_scale = 1.0f / std::sqrt(static_cast<float>(d));
  p.q = d_q.get<float>();
  p.k = d_k.get<float>();
  p.v = d_v.get<bf16>();
  p.g = d_g.get<float>();
  p.beta = d_beta.get<float>();
  K3_CU(ops::cuda::kda_prep(p, B, q, max_q, H, d, K, st()));

  // CPU: kda_prep per request, from copies of its slot's committed states; the kept rows are the inputs.
  ops::KdaPrepWeights w;
  for (int j = 0; j < 3; ++j) w.conv[j] = conv_w[j].data();
  w.A_log = A_log.data();
  w.dt_bias = dt_bias.data();
  w.lower_bound = lower;
  std::vector<float> y_ref[3], g_ref(static_cast<size_t>(rows * C)), beta_ref(static_cast<size_t>(rows * H));
  std::vector<float> kept_ref[3] = {kept, kept, kept};
  std::vector<std::vector<float>> xs[3];
  for (int j = 0; j < 3; ++j) {
    y_ref[j].resize(static_cast<size_t>(rows * C));
    xs[j].resize(static_cast<size_t>(B));
  }
  for (int b = 0; b < B; ++b) {
    const int64_t r0 = int64_t{b} * q;
    std::vector<float> state[3], bcol(static_cast<size_t>(q * H));
    const float* x_in[3];
    float* st_in[3];
    float* y_out[3];
    for (int j = 0; j < 3; ++j) {
      std::vector<float>& xb = xs[j][b];
      xb.resize(static_cast<size_t>(q * C));
      for (int t = 0; t < q; ++t) std::copy_n(&proj[(r0 + t) * ld + j * C], C, &xb[static_cast<size_t>(t * C)]);
      state[j].assign(pool[j].begin() + slots[b] * st_f, pool[j].begin() + (slots[b] + 1) * st_f);
      x_in[j] = xb.data();
      st_in[j] = state[j].data();
      y_out[j] = &y_ref[j][static_cast<size_t>(r0 * C)];
      std::copy(xb.begin(), xb.end(), kept_ref[j].begin() + int64_t{slots[b]} * max_q * C);
    }
    for (int t = 0; t < q; ++t) std::copy_n(&proj[(r0 + t) * ld + b_col], H, &bcol[static_cast<size_t>(t * H)]);
    ops::kda_prep(x_in, &u[static_cast<size_t>(r0 * C)], bcol.data(), w, st_in, y_out,
                  &g_ref[static_cast<size_t>(r0 * C)], &beta_ref[static_cast<size_t>(r0 * H)], q, H, d, K);
  }
  const auto q_all = down_f32(d_q, static_cast<size_t>(rows * C + kTail));
  const auto k_all = down_f32(d_k, static_cast<size_t>(rows * C + kTail));
  const auto v_all = down_bf16(d_v, static_cast<size_t>(rows * C + kTail));
  const auto g_all = down_f32(d_g, static_cast<size_t>(rows * C + kTail));
  const auto beta_all = down_f32(d_beta, static_cast<size_t>(rows * H + kTail));
  const auto head = [](const std::vector<float>& a, int64_t n) { return std::vector<float>(a.begin(), a.begin() + n); };
  expect_close_but_rare(head(q_all, rows * C), y_ref[0], 1e-6, kOneRounding, "q (conv, l2norm, scale)");
  expect_close_but_rare(head(k_all, rows * C), y_ref[1], 1e-6, kOneRounding, "k (conv, l2norm)");
  expect_close(head(v_all, rows * C), y_ref[2], kOneRounding, 0, "v (conv)");
  expect_close(head(g_all, rows * C), g_ref, 2e-6, 1e-6, "g");
  expect_close(head(beta_all, rows * H), beta_ref, 1e-6, 1e-7, "beta");
  expect_tail(q_all, rows * C, "q");
  expect_tail(k_all, rows * C, "k");
  expect_tail(v_all, rows * C, "v", round_bf16(kSentinel));
  expect_tail(g_all, rows * C, "g");
  expect_tail(beta_all, rows * H, "beta");
  for (int j = 0; j < 3; ++j) {
    expect_exact(down_f32(d_kept[j], kept.size()), kept_ref[j], "kept inputs (and untouched rows)");
    expect_exact(down_f32(d_pool[j], pool[j].size()), pool[j], "committed conv state is read only");
  }

  // Commit n accepted tokens, every n in 0..q across the requests: the CPU state after exactly n tokens.
  for (int shift = 0; shift <= q; ++shift) {
    std::vector<int32_t> accepted(static_cast<size_t>(B));
    for (int b = 0; b < B; ++b) accepted[b] = (b + shift) % (q + 1);
    auto d_acc = upload(accepted);
    for (int j = 0; j < 3; ++j) {
      auto d_pool2 = upload(pool[j]);
      K3_CU(ops::cuda::short_conv_commit(d_kept[j].get<float>(), d_pool2.get<float>(), d_slots.get<int32_t>(),
                                         d_acc.get<int32_t>(), B, max_q, C, K, st()));
      std::vector<float> pool_ref = pool[j];
      for (int b = 0; b < B; ++b) {
        const int n = accepted[b];
        std::vector<float> yb(static_cast<size_t>(std::max(n, 1) * C));
        ops::short_conv_silu(xs[j][b].data(), conv_w[j].data(), pool_ref.data() + slots[b] * st_f, yb.data(), n,
                             C, K);
      }
      expect_exact(down_f32(d_pool2, pool[j].size()), pool_ref, "conv state after commit");
    }
  }
}

std::vector<PrepShape> prep_shapes() {
  std::vector<PrepShape> v;
  for (int B : {1, 3, 64})
    for (int q = 1; q <= 4; ++q) {
      v.push_back({B, q, 4, B + 2, 12, 128, 4});  // K3 TP8: 12 heads of 128, K 4
      v.push_back({B, q, q + 1, B + 1, 3, 7, 4});  // odd: 3 heads of 7
    }
  v.push_back({2, 3, 5, 4, 2, 33, 3});   // two channels per lane, the second partial; K 3
  v.push_back({2, 5, 6, 3, 1, 200, 8});  // d 200: eight channels per lane; K 8 (the maximum)
  v.push_back({3, 2, 2, 3, 4, 64, 2});   // K 2
  v.push_back({2, 2, 3, 3, 5, 32, 1});   // K 1: no state
  return v;
}
INSTANTIATE_TEST_SUITE_P(Shapes, KdaPrepCuda, ::testing::ValuesIn(prep_shapes()));

// ---------------------------------------------------------------- KDA gated norm

struct KdaShape {
  int64_t rows;
  int H, d;
};

class KdaGatedNormCuda : public ::testing::TestWithParam<KdaShape> {};

TEST_P(KdaGatedNormCuda, MatchesCpu) {
  K3_REQUIRE_GPU();
  const KdaShape s = GetParam();
  const int64_t rows = s.rows, C = int64_t{s.H} * s.d;
  const int H = s.H, d = s.d;
  // A strided gate, as the layer reads it from the packed projection.
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

INSTANTIATE_TEST_SUITE_P(Shapes, KdaGatedNormCuda,
                         ::testing::Values(KdaShape{1, 12, 128}, KdaShape{64, 12, 128}, KdaShape{5, 3, 20},
                                           KdaShape{7, 2, 33}, KdaShape{3, 1, 300}));

// ---------------------------------------------------------------- KDA recurrence (verify + commit)

struct RecShape {
  int B, q, max_q, num_slots, H, dk, dv;
};

class KdaRecurrenceCuda : public ::testing::TestWithParam<RecShape> {};

struct RecInputs {
  std::vector<float> q, k, v, g, beta;  // [B q, ...] as the layer makes them
};

RecInputs make_rec(int64_t rows, int H, int dk, int dv, uint64_t seed) {
  RecInputs in;
  const int64_t Ck = int64_t{H} * dk, Cv = int64_t{H} * dv;
  // l2-normalized q (scale dk^-0.5) and k, v BF16, g in (-5, 0), beta in (0, 1).
  in.q = random_bf16_values(static_cast<size_t>(rows * Ck), seed + 1);
  in.k = random_bf16_values(static_cast<size_t>(rows * Ck), seed + 2);
  ops::l2norm_heads(in.q.data(), rows, H, dk, 1.0f / std::sqrt(static_cast<float>(dk)));
  ops::l2norm_heads(in.k.data(), rows, H, dk, 1.0f);
  in.v = random_bf16_values(static_cast<size_t>(rows * Cv), seed + 3, 2.0);
  const auto u = random_bf16_values(static_cast<size_t>(rows * Ck), seed + 4, 3.0);
  const auto A_log = uniform(static_cast<size_t>(H), seed + 5, -2.0, 0.5);
  const auto dt_bias = uniform(static_cast<size_t>(Ck), seed + 6, -1.0, 1.0);
  in.g.resize(static_cast<size_t>(rows * Ck));
  ops::kda_gate(u.data(), A_log.data(), dt_bias.data(), -5.0f, in.g.data(), rows, H, dk);
  in.beta = uniform(static_cast<size_t>(rows * H), seed + 7, -3.0, 3.0);
  ops::kda_beta(in.beta.data(), in.beta.data(), rows, H);
  return in;
}

// The first n of each request's q rows (widths per row).
std::vector<float> first_rows(const std::vector<float>& a, int B, int q, int n, int64_t width) {
  std::vector<float> out;
  for (int b = 0; b < B; ++b)
    out.insert(out.end(), a.begin() + (int64_t{b} * q) * width, a.begin() + (int64_t{b} * q + n) * width);
  return out;
}

struct KeptBuf {
  DeviceBuffer buf;
  ops::cuda::KdaKept kept;
  int64_t nk, nv;  // floats of k (and of g), of v
};
KeptBuf make_kept(int num_slots, int max_q, int H, int dk, int dv, const std::vector<float>& init) {
  KeptBuf k;
  k.nk = int64_t{num_slots} * max_q * H * dk;
  k.nv = int64_t{num_slots} * max_q * H * dv;
  k.buf = upload(init);
  float* b = k.buf.get<float>();
  k.kept = {b, b + k.nk, b + 2 * k.nk, b + 2 * k.nk + k.nv};
  return k;
}

// One step of q tokens into the write states, GPU (o and the pool back).
struct StepOut {
  std::vector<float> o, pool;
};
StepOut gpu_step(const RecInputs& in, const std::vector<float>& pool, const std::vector<int32_t>& rd,
                 const std::vector<int32_t>& wr, const std::vector<int32_t>& slots, ops::cuda::KdaKept kept, int B,
                 int q, int max_q, int H, int dk, int dv) {
  auto d_q = upload(in.q);
  auto d_k = upload(in.k);
  auto d_v = up_bf16(in.v);
  auto d_g = upload(in.g);
  auto d_beta = upload(in.beta);
  auto d_pool = upload(pool);
  auto d_rd = upload(rd);
  auto d_wr = upload(wr);
  auto d_slots = upload(slots);
  const int64_t Cv = int64_t{H} * dv;
  DeviceBuffer d_o(static_cast<size_t>(int64_t{B} * q * Cv) * sizeof(float));
  EXPECT_EQ(ops::cuda::kda_recurrence(d_q.get<float>(), d_k.get<float>(), d_v.get<bf16>(), d_g.get<float>(),
                                      d_beta.get<float>(), d_pool.get<float>(), d_rd.get<int32_t>(),
                                      d_wr.get<int32_t>(), kept, d_slots.get<int32_t>(), d_o.get<float>(), B, q, max_q,
                                      H, dk, dv, st()),
            0);
  return {down_f32(d_o, static_cast<size_t>(int64_t{B} * q * Cv)), down_f32(d_pool, pool.size())};
}

TEST_P(KdaRecurrenceCuda, MatchesCpuKeepsInputsAndReplaysEveryAccept) {
  K3_REQUIRE_GPU();
  const RecShape s = GetParam();
  const int B = s.B, q = s.q, max_q = s.max_q, H = s.H, dk = s.dk, dv = s.dv;
  const int64_t rows = int64_t{B} * q, Ck = int64_t{H} * dk, Cv = int64_t{H} * dv, st_f = int64_t{H} * dv * dk;
  const uint64_t seed = 1000 + static_cast<uint64_t>(B * 100 + q * 10 + H + dk + dv);
  const RecInputs in = make_rec(rows, H, dk, dv, seed);
  // Two states per slot; each request reads a random one of its slot's two and writes the other.
  const auto pool = uniform(static_cast<size_t>(2 * s.num_slots * st_f), seed + 8, -1.0, 1.0);
  const auto slots = pick_slots(B, s.num_slots, seed + 9);
  std::vector<int32_t> rd(static_cast<size_t>(B)), wr(static_cast<size_t>(B));
  Rng r(seed + 10);
  for (int b = 0; b < B; ++b) {
    const int cur = static_cast<int>(r.below(2));
    rd[b] = 2 * slots[b] + cur;
    wr[b] = 2 * slots[b] + 1 - cur;
  }
  const int64_t kept_floats = int64_t{s.num_slots} * max_q * (2 * Ck + Cv + H);
  KeptBuf kb = make_kept(s.num_slots, max_q, H, dk, dv, std::vector<float>(static_cast<size_t>(kept_floats), kSentinel));
  const StepOut got = gpu_step(in, pool, rd, wr, slots, kb.kept, B, q, max_q, H, dk, dv);

  // CPU: o, the final state into the write state; every other state untouched.
  std::vector<float> o_ref(static_cast<size_t>(rows * Cv)), pool_ref = pool;
  for (int b = 0; b < B; ++b) {
    std::vector<float> S(pool.begin() + rd[b] * st_f, pool.begin() + (rd[b] + 1) * st_f);
    const int64_t r0 = int64_t{b} * q;
    ops::kda_recurrence(&in.q[r0 * Ck], &in.k[r0 * Ck], &in.v[r0 * Cv], &in.g[r0 * Ck], &in.beta[r0 * H], S.data(),
                        &o_ref[r0 * Cv], q, H, dk, dv);
    std::copy(S.begin(), S.end(), pool_ref.begin() + wr[b] * st_f);
  }
  expect_close(got.o, o_ref, 1e-4, 1e-6, "kda o");
  for (int64_t i = 0; i < 2 * s.num_slots; ++i) {
    const bool written = std::find(wr.begin(), wr.end(), static_cast<int32_t>(i)) != wr.end();
    const auto g = rows_of(got.pool, st_f, i, 1), w = rows_of(pool_ref, st_f, i, 1);
    if (written)
      expect_close(g, w, 1e-4, 1e-6, "the state after the last token");
    else
      expect_exact(g, w, "states read or unbound are untouched");
  }

  // The kept inputs: q > 1 keeps k, g, v, beta exactly in the slot's rows; q = 1 keeps nothing.
  const auto kept_got = download<float>(kb.buf, static_cast<size_t>(kept_floats));
  std::vector<float> kept_ref(static_cast<size_t>(kept_floats), kSentinel);
  if (q > 1)
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < q; ++t) {
        const int64_t row = int64_t{b} * q + t, krow = int64_t{slots[b]} * max_q + t;
        std::copy_n(&in.k[row * Ck], Ck, &kept_ref[krow * Ck]);
        std::copy_n(&in.g[row * Ck], Ck, &kept_ref[kb.nk + krow * Ck]);
        std::copy_n(&in.v[row * Cv], Cv, &kept_ref[2 * kb.nk + krow * Cv]);
        std::copy_n(&in.beta[row * H], H, &kept_ref[2 * kb.nk + kb.nv + krow * H]);
      }
  expect_exact(kept_got, kept_ref, "kept inputs (and untouched rows)");

  // A step of just the first m tokens, GPU, for every m in 1..q-1 (kept not written: null).
  std::vector<std::vector<float>> step_m(static_cast<size_t>(q));
  for (int m = 1; m < q; ++m) {
    RecInputs im;
    im.q = first_rows(in.q, B, q, m, Ck);
    im.k = first_rows(in.k, B, q, m, Ck);
    im.v = first_rows(in.v, B, q, m, Cv);
    im.g = first_rows(in.g, B, q, m, Ck);
    im.beta = first_rows(in.beta, B, q, m, H);
    step_m[m] = gpu_step(im, pool, rd, wr, slots, ops::cuda::KdaKept{}, B, m, max_q, H, dk, dv).pool;
  }
  // Commit: every n in 0..q across the requests. 0 < n < q: the write state is bit for bit the state of a
  // step of those n tokens (and close to the CPU's); n = 0 or q: nothing changes (the step's state stays).
  for (int shift = 0; shift <= q; ++shift) {
    std::vector<int32_t> accepted(static_cast<size_t>(B));
    for (int b = 0; b < B; ++b) accepted[b] = (b + shift) % (q + 1);
    auto d_pool = upload(got.pool);
    auto d_rd = upload(rd);
    auto d_wr = upload(wr);
    auto d_slots = upload(slots);
    auto d_acc = upload(accepted);
    K3_CU(ops::cuda::kda_replay(kb.kept, d_pool.get<float>(), d_rd.get<int32_t>(), d_wr.get<int32_t>(),
                                d_slots.get<int32_t>(), d_acc.get<int32_t>(), B, q, max_q, H, dk, dv, st()));
    const auto after = down_f32(d_pool, pool.size());
    std::vector<float> want = got.pool;
    for (int b = 0; b < B; ++b) {
      const int n = accepted[b];
      if (n <= 0 || n >= q) continue;
      std::copy_n(&step_m[n][wr[b] * st_f], st_f, &want[wr[b] * st_f]);
      std::vector<float> S(pool.begin() + rd[b] * st_f, pool.begin() + (rd[b] + 1) * st_f);
      const int64_t r0 = int64_t{b} * q;
      ops::kda_replay(&in.k[r0 * Ck], &in.v[r0 * Cv], &in.g[r0 * Ck], &in.beta[r0 * H], S.data(), n, H, dk, dv);
      expect_close(rows_of(after, st_f, wr[b], 1), S, 1e-4, 1e-6, "replayed state vs CPU");
    }
    expect_exact(after, want, "replayed states equal a step of the accepted tokens; the rest unchanged");
  }
}

// A request's bits do not depend on its batch: request 0 alone gives the same bits as in a batch of 8.
TEST(KdaCuda, BatchDoesNotChangeTheBits) {
  K3_REQUIRE_GPU();
  const int H = 12, d = 128, q = 3, max_q = 4, B = 8;
  const int64_t st_f = int64_t{H} * d * d, C = int64_t{H} * d;
  const RecInputs in = make_rec(int64_t{B} * q, H, d, d, 77);
  const auto pool = uniform(static_cast<size_t>(2 * B * st_f), 78, -1.0, 1.0);
  std::vector<int32_t> slots(B), rd(B), wr(B);
  for (int b = 0; b < B; ++b) {
    slots[b] = b;
    rd[b] = 2 * b;
    wr[b] = 2 * b + 1;
  }
  const StepOut all = gpu_step(in, pool, rd, wr, slots, ops::cuda::KdaKept{}, B, q, max_q, H, d, d);
  RecInputs one;
  one.q = first_rows(in.q, 1, q, q, C);
  one.k = first_rows(in.k, 1, q, q, C);
  one.v = first_rows(in.v, 1, q, q, C);
  one.g = first_rows(in.g, 1, q, q, C);
  one.beta = first_rows(in.beta, 1, q, q, H);
  const StepOut alone = gpu_step(one, pool, rd, wr, slots, ops::cuda::KdaKept{}, 1, q, max_q, H, d, d);
  expect_exact(alone.o, rows_of(all.o, C, 0, q), "o of request 0");
  expect_exact(rows_of(alone.pool, st_f, 1, 1), rows_of(all.pool, st_f, 1, 1), "state of request 0");
  // and the state moved
  EXPECT_NE(rows_of(alone.pool, st_f, 1, 1), rows_of(pool, st_f, 1, 1));
}

std::vector<RecShape> rec_shapes() {
  std::vector<RecShape> v;
  for (int B : {1, 3, 8})
    for (int q : {1, 2, 4, 8}) v.push_back({B, q, 8, B + 2, 12, 128, 128});  // K3 TP8: 12 heads of 128
  v.push_back({64, 4, 4, 64, 12, 128, 128});                                 // K3 TP8, a wide verify batch
  v.push_back({2, 3, 5, 4, 3, 20, 37});                                      // odd dk (5 float4 chunks) and dv
  v.push_back({1, 2, 2, 2, 2, 256, 16});                                     // dk 256: two chunks per lane
  v.push_back({3, 3, 4, 3, 1, 64, 130});                                     // dv not a multiple of the CTA rows
  v.push_back({40, 2, 3, 41, 1, 16, 60});                                    // 8-row CTAs, the last one partial
  v.push_back({5, 5, 7, 6, 2, 36, 36});                                      // odd q, max_q
  return v;
}
INSTANTIATE_TEST_SUITE_P(Shapes, KdaRecurrenceCuda, ::testing::ValuesIn(rec_shapes()));

TEST(KdaCuda, RejectsBadShapes) {
  K3_REQUIRE_GPU();
  const ops::cuda::KdaKept none{};
  EXPECT_NE(ops::cuda::kda_recurrence(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, none,
                                      nullptr, nullptr, 1, 9, 8, 12, 128, 128, st()),
            0);  // q_len > max_q
  EXPECT_NE(ops::cuda::kda_recurrence(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, none,
                                      nullptr, nullptr, 1, 1, 8, 12, 130, 128, st()),
            0);  // dk % 4 != 0
  EXPECT_NE(ops::cuda::kda_replay(none, nullptr, nullptr, nullptr, nullptr, nullptr, 1, 4, 8, 12, 128, 128, st()),
            0);  // a replay without kept inputs
  EXPECT_NE(ops::cuda::short_conv_commit(nullptr, nullptr, nullptr, nullptr, 1, 4, 8, 9, st()), 0);  // K > 8
  const ops::cuda::KdaPrep none_p{};
  EXPECT_NE(ops::cuda::kda_prep(none_p, 1, 1, 1, 12, 128, 9, st()), 0);    // K > 8
  EXPECT_NE(ops::cuda::kda_prep(none_p, 1, 1, 1, 1, 257, 4, st()), 0);     // d > 256
  EXPECT_NE(ops::cuda::kda_prep(none_p, 1, 2, 1, 12, 128, 4, st()), 0);    // q_len > max_q
  ops::cuda::KdaPrep narrow{};
  narrow.proj_ld = 3 * 12 * 128 - 1;
  EXPECT_NE(ops::cuda::kda_prep(narrow, 1, 1, 1, 12, 128, 4, st()), 0);    // proj narrower than q | k | v
  narrow.proj_ld = 4 * 12 * 128 + 128 + 12;
  narrow.b_col = 4 * 12 * 128 + 128 + 1;
  EXPECT_NE(ops::cuda::kda_prep(narrow, 1, 1, 1, 12, 128, 4, st()), 0);    // b past the row
  narrow.b_col = 4 * 12 * 128 + 128;
  EXPECT_NE(ops::cuda::kda_prep(narrow, 1, 1, 1, 12, 128, 4, st()), 0);    // null pointers
}

}  // namespace
}  // namespace k3
