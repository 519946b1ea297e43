// GPU tests of the MLA and DSA CUDA ops against their CPU references (src/ops/*.cpp; the CPU tests:
// tests/test_ops_attention.cpp): mla_absorb_q / mla_unabsorb (both paths: the hand-written kernels and
// cuBLASLt), lse_merge, mla_attend_paged / mla_attend_indexed (the Hopper kernel at the K3 latent shape,
// the mma.sync kernels elsewhere and for DSA; with and without context splits), dsa_index_scores_paged /
// topk_indices. Random inputs from fixed seeds (never zeros),
// odd shapes and the K3 per-rank shapes (TP8), and sentinels around every output so that a stray write
// or read shows.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "gpu_test_util.h"
#include "ops/dsa.h"
#include "ops/mla.h"

namespace k3 {
namespace {

using namespace gputest;


const float kNaN = std::numeric_limits<float>::quiet_NaN();





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

void expect_no_nan(const std::vector<float>& v, const char* what) {
  for (size_t i = 0; i < v.size(); ++i)
    if (std::isnan(v[i])) {
      ADD_FAILURE() << what << ": NaN at " << i;
      return;
    }
}

// The split top-k's scratch for up to 512 rows, zeroed once (as its contract asks) and shared by every test
// here: each call must leave it reusable, whatever the shape of the call before.
constexpr int64_t kTopkMaxRows = 512;
DeviceBuffer& topk_scratch() {
  static DeviceBuffer b = [] {
    DeviceBuffer d(ops::cuda::topk_indices_scratch_bytes(kTopkMaxRows));
    CUDA_CHECK(cudaMemset(d.get(), 0, d.bytes()));
    return d;
  }();
  return b;
}

// ---------------------------------------------------------------- MLA absorb / unabsorb

struct MlaProj {
  int64_t T;
  int H, dn, P, dv, R;
};

class MlaProjCuda : public ::testing::TestWithParam<MlaProj> {};

TEST_P(MlaProjCuda, AbsorbAndUnabsorbMatchCpu) {
  K3_REQUIRE_GPU();
  const MlaProj s = GetParam();
  const int64_t T = s.T, E = int64_t{s.R} + s.P;
  const auto w = random_bf16_values(static_cast<size_t>(int64_t{s.H} * (s.dn + s.dv) * s.R), 31, 0.1);
  auto d_w = up_bf16(w);
  const auto w_b = to_bf16_vec(w);
  // Every path: the kernels, cuBLASLt (the kernels where it has no algorithm), and Auto.
  using ops::cuda::LinearPath;
  for (const auto path : {LinearPath::Kernel, LinearPath::CublasLt, LinearPath::Auto}) {
    SCOPED_TRACE(testing::Message() << "path " << static_cast<int>(path));
    {
      const auto q = random_bf16_values(static_cast<size_t>(T * s.H * (s.dn + s.P)), 32, 1.0);
      auto d_q = up_bf16(q);
      DeviceBuffer d_lat(static_cast<size_t>(T * s.H * E) * sizeof(bf16));
      fill_nan_bf16(d_lat, static_cast<size_t>(T * s.H * E));  // every value must be written
      K3_CU(ops::cuda::mla_absorb_q(ctx(), d_q.get<bf16>(), d_w.get<bf16>(), d_lat.get<bf16>(), T, s.H, s.dn, s.P,
                                    s.dv, s.R, path));
      std::vector<float> ref(static_cast<size_t>(T * s.H * E));
      ops::mla_absorb_q(q.data(), w_b.data(), ref.data(), T, s.H, s.dn, s.P, s.dv, s.R);
      expect_close(down_bf16(d_lat, ref.size()), ref, 5e-3, 0, "mla_absorb_q");
    }
    {
      const auto ol = random_bf16_values(static_cast<size_t>(T * s.H * s.R), 33, 1.0);
      auto d_ol = up_bf16(ol);
      DeviceBuffer d_o(static_cast<size_t>(T * s.H * s.dv) * sizeof(bf16));
      fill_nan_bf16(d_o, static_cast<size_t>(T * s.H * s.dv));
      K3_CU(ops::cuda::mla_unabsorb(ctx(), d_ol.get<bf16>(), d_w.get<bf16>(), d_o.get<bf16>(), T, s.H, s.dn, s.dv, s.R,
                                    path));
      std::vector<float> ref(static_cast<size_t>(T * s.H * s.dv));
      ops::mla_unabsorb(ol.data(), w_b.data(), ref.data(), T, s.H, s.dn, s.dv, s.R);
      expect_close(down_bf16(d_o, ref.size()), ref, 5e-3, 0, "mla_unabsorb");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, MlaProjCuda,
                         ::testing::Values(MlaProj{1, 12, 128, 64, 128, 512},   // K3 TP8, plain decode
                                           MlaProj{4, 12, 128, 64, 128, 512},   // q = 4
                                           MlaProj{3, 3, 21, 8, 24, 40},        // few tokens, odd dn
                                           MlaProj{37, 12, 128, 64, 128, 512},  // several token tiles
                                           MlaProj{256, 12, 128, 64, 128, 512}, // B 64 x q 4
                                           MlaProj{5, 8, 16, 8, 16, 32},        // tiny preset
                                           MlaProj{9, 3, 21, 8, 24, 40}));      // odd dn

// ---------------------------------------------------------------- lse_merge

struct MergeShape {
  int D;
  int64_t T;
  int H, R;
};

class LseMergeCuda : public ::testing::TestWithParam<MergeShape> {};

TEST_P(LseMergeCuda, MatchesCpuSkipsEmptyPartsNeverNaN) {
  K3_REQUIRE_GPU();
  const MergeShape s = GetParam();
  const int D = s.D, H = s.H, R = s.R;
  const int64_t T = s.T, TH = T * H;
  auto o_parts = uniform(static_cast<size_t>(D * TH * R), 41, -1.0, 1.0);
  auto lse_parts = uniform(static_cast<size_t>(D * TH), 42, -6.0, 6.0);
  Rng r(43);
  for (int d = 0; d < D; ++d)
    for (int64_t th = 0; th < TH; ++th) {
      const bool empty = th == 1 || (D > 1 && r.below(4) == 0);  // (t, h) = 1: every part empty
      if (!empty) continue;
      lse_parts[d * TH + th] = -INFINITY;
      std::fill_n(&o_parts[(d * TH + th) * R], R, kNaN);  // an empty part's o is never read
    }
  auto d_o_parts = upload(o_parts);
  auto d_lse_parts = upload(lse_parts);
  DeviceBuffer d_o(static_cast<size_t>(TH * R) * sizeof(float)), d_lse(static_cast<size_t>(TH) * sizeof(float));
  K3_CU(ops::cuda::lse_merge(d_o_parts.get<float>(), d_lse_parts.get<float>(), D, T, H, R, d_o.get<float>(),
                             d_lse.get<float>(), st()));
  std::vector<float> o_ref(static_cast<size_t>(TH * R)), lse_ref(static_cast<size_t>(TH));
  for (int64_t t = 0; t < T; ++t) {
    std::vector<float> op(static_cast<size_t>(int64_t{D} * H * R)), lp(static_cast<size_t>(int64_t{D} * H));
    for (int d = 0; d < D; ++d) {
      std::copy_n(&o_parts[(d * TH + t * H) * R], H * R, &op[static_cast<size_t>(int64_t{d} * H * R)]);
      std::copy_n(&lse_parts[d * TH + t * H], H, &lp[static_cast<size_t>(d * H)]);
    }
    ops::lse_merge(op.data(), lp.data(), D, H, R, &o_ref[t * H * R], &lse_ref[t * H]);
  }
  const auto o_got = down_f32(d_o, o_ref.size());
  const auto lse_got = down_f32(d_lse, lse_ref.size());
  expect_no_nan(o_got, "lse_merge o");
  expect_no_nan(lse_got, "lse_merge lse");
  expect_close(o_got, o_ref, 1e-5, 1e-6, "lse_merge o");
  for (int64_t th = 0; th < TH; ++th) {
    if (std::isinf(lse_ref[th])) {
      EXPECT_EQ(lse_got[th], lse_ref[th]) << "lse at " << th;
      for (int i = 0; i < R; ++i) ASSERT_EQ(o_got[th * R + i], 0.0f) << "empty (t, h) must give zeros";
    } else {
      EXPECT_NEAR(lse_got[th], lse_ref[th], 1e-5) << "lse at " << th;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, LseMergeCuda,
                         ::testing::Values(MergeShape{1, 4, 12, 512}, MergeShape{3, 4, 12, 512},
                                           MergeShape{8, 3, 12, 512}, MergeShape{2, 3, 5, 33},
                                           MergeShape{128, 1, 12, 512},  // one request's 128 splits
                                           MergeShape{130, 2, 3, 40},    // parts past a whole load batch
                                           MergeShape{33, 64, 12, 512},  // enough CTAs for one thread group
                                           // <= 32 parts, R % 4 == 0 and >= 4 x 132 (t, h, 128 columns): a warp
                                           // per (t, h)
                                           MergeShape{2, 256, 12, 512},  // 64 requests x q 4, 2 splits
                                           MergeShape{32, 48, 12, 512},  // a part per lane
                                           MergeShape{5, 64, 12, 260},   // R past whole 128-column steps
                                           MergeShape{3, 200, 3, 20},    // R below one step (lanes 5.. idle)
                                           MergeShape{4, 50, 3, 1028},   // R over one pass of 512
                                           MergeShape{0, 2, 3, 16}));

// ---------------------------------------------------------------- paged cache helpers

// A paged cache whose pages are handed out in shuffled order; every row that is not a live position of some
// request (the rest of a last page, unused pages) holds NaN, so reading it poisons the result.
struct Paged {
  int page_size = 0, max_pages = 0;
  int64_t num_pages = 0, width = 0;
  std::vector<int32_t> tables;  // [B, max_pages], -1 past the request's pages
  std::vector<float> pool;      // [num_pages * page_size, width]
  int64_t row(int b, int64_t pos) const {
    return int64_t{tables[static_cast<size_t>(b * max_pages + pos / page_size)]} * page_size + pos % page_size;
  }
  const float* at(int b, int64_t pos) const { return &pool[static_cast<size_t>(row(b, pos) * width)]; }
};

Paged make_paged(const std::vector<int>& lens, int page_size, int64_t width, uint64_t seed, double amp,
                 bool integers = false) {
  Paged c;
  c.page_size = page_size;
  c.width = width;
  std::vector<int> need(lens.size());
  int64_t total = 0;
  for (size_t b = 0; b < lens.size(); ++b) {
    need[b] = (lens[b] + page_size - 1) / page_size;
    total += need[b];
    c.max_pages = std::max(c.max_pages, need[b]);
  }
  c.max_pages += 1;
  c.num_pages = total + 3;
  std::vector<int32_t> perm(static_cast<size_t>(c.num_pages));
  std::iota(perm.begin(), perm.end(), 0);
  Rng r(seed);
  shuffle(perm, r);
  c.tables.assign(lens.size() * static_cast<size_t>(c.max_pages), -1);
  size_t next = 0;
  for (size_t b = 0; b < lens.size(); ++b)
    for (int p = 0; p < need[b]; ++p) c.tables[b * c.max_pages + p] = perm[next++];
  c.pool.assign(static_cast<size_t>(c.num_pages * page_size * width), kNaN);
  for (size_t b = 0; b < lens.size(); ++b)
    for (int64_t pos = 0; pos < lens[b]; ++pos) {
      float* e = &c.pool[static_cast<size_t>(c.row(static_cast<int>(b), pos) * width)];
      for (int64_t i = 0; i < width; ++i)
        e[i] = integers ? static_cast<float>(static_cast<int>(r.below(5)) - 2)
                        : round_bf16(static_cast<float>(r.uniform(-amp, amp)));
    }
  return c;
}

// ---------------------------------------------------------------- MLA attention

struct AttendCase {
  int B, q, H, R, P, page_size;
  std::vector<int> ctx;  // per request: the context of its last token
};

class MlaAttendPagedCuda : public ::testing::TestWithParam<AttendCase> {};

TEST_P(MlaAttendPagedCuda, MatchesCpuOverShuffledPages) {
  K3_REQUIRE_GPU();
  const AttendCase& c = GetParam();
  const int B = c.B, q = c.q, H = c.H, R = c.R, P = c.P;
  const int64_t E = int64_t{R} + P, T = int64_t{B} * q;
  const float scale = 1.0f / std::sqrt(192.0f);
  const Paged cache = make_paged(c.ctx, c.page_size, E, 51, 1.0);
  std::vector<int32_t> ctx_len(static_cast<size_t>(T));
  int max_ctx = 0;
  for (int b = 0; b < B; ++b) {
    for (int i = 0; i < q; ++i) ctx_len[static_cast<size_t>(b * q + i)] = c.ctx[b] - q + 1 + i;
    max_ctx = std::max(max_ctx, c.ctx[b]);
  }
  max_ctx += 5;  // a loose bound, as the engine may pass
  const auto q_lat = random_bf16_values(static_cast<size_t>(T * H * E), 52, 2.0);

  auto d_q = up_bf16(q_lat);
  auto d_pool = up_bf16(cache.pool);
  auto d_tables = upload(cache.tables);
  auto d_ctx = upload(ctx_len);
  const size_t scratch_bytes = ops::cuda::mla_attend_paged_scratch_bytes(B, q, H, R, max_ctx);
  DeviceBuffer d_scratch(scratch_bytes);
  DeviceBuffer d_o(static_cast<size_t>(T * H * R) * sizeof(float)), d_lse(static_cast<size_t>(T * H) * sizeof(float));
  K3_CU(ops::cuda::mla_attend_paged(d_q.get<bf16>(), d_pool.get<bf16>(), d_tables.get<int32_t>(), cache.max_pages,
                                    c.page_size, d_ctx.get<int32_t>(), B, q, max_ctx, H, R, P, scale, d_o.get<float>(),
                                    d_lse.get<float>(), d_scratch.get(), scratch_bytes, st()));

  std::vector<float> o_ref(static_cast<size_t>(T * H * R)), lse_ref(static_cast<size_t>(T * H));
  std::vector<const float*> entries;
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < q; ++i) {
      const int64_t t = int64_t{b} * q + i, n = ctx_len[static_cast<size_t>(t)];
      entries.resize(static_cast<size_t>(n));
      for (int64_t p = 0; p < n; ++p) entries[static_cast<size_t>(p)] = cache.at(b, p);
      ops::mla_attend(&q_lat[t * H * E], entries.data(), n, H, R, P, scale, &o_ref[t * H * R], &lse_ref[t * H]);
    }
  const auto o_got = down_f32(d_o, o_ref.size());
  const auto lse_got = down_f32(d_lse, lse_ref.size());
  expect_no_nan(o_got, "o_lat");
  expect_close(o_got, o_ref, 1e-3, 1e-6, "mla_attend_paged o_lat");
  expect_close(lse_got, lse_ref, 0, 5e-4, "mla_attend_paged lse");
}

INSTANTIATE_TEST_SUITE_P(
    Cases, MlaAttendPagedCuda,
    ::testing::Values(AttendCase{4, 1, 12, 512, 64, 64, {1, 17, 1000, 8192}},  // K3 TP8, plain decode
                      AttendCase{2, 4, 12, 512, 64, 64, {17, 1000}},           // verify: 48 rows = 3 M tiles
                      AttendCase{1, 8, 12, 512, 64, 64, {8192}},               // verify width 8, long context
                      AttendCase{3, 2, 12, 512, 64, 64, {2, 100, 8192}},
                      AttendCase{2, 3, 8, 32, 8, 16, {3, 50}},      // tiny preset shapes
                      AttendCase{2, 2, 20, 64, 16, 16, {40, 300}},  // rows straddle M tiles
                      AttendCase{1, 1, 5, 40, 8, 8, {777}},         // R not a multiple of 16
                      // R 512, P 64, page 64: the Hopper kernel; other shapes: from 8 requests of <= 16 rows on, the
                      // 16-row kernel (mla_attend.cu, kTile16MinGroups), 7 stay on the multi-row kernel.
                      AttendCase{9, 1, 12, 512, 64, 64, {1, 17, 300, 1000, 2, 8192, 64, 65, 4000}},
                      AttendCase{7, 1, 12, 512, 64, 64, {5, 900, 64, 1, 2000, 333, 8192}},
                      AttendCase{8, 1, 5, 40, 8, 8, {777, 1, 30, 9, 100, 64, 5, 256}}));

// ---------------------------------------------------------------- MLA attention at the K3 per-rank shapes

// K3 TP8 per rank: 12 heads, 512 + 64 latent values, the engine's paged cache (page 64 by default). With
// DCP the op sees this rank's share: position p lives on rank p % D at local index p / D, and a token at
// position pos sees the local entries of positions <= pos (GpuRank::mla passes those local lengths).
struct K3AttendCase {
  int B, q, page_size;
  std::vector<int> ctx;  // per request: the context of its last token (global positions)
  int dcp = 1, dcp_rank = 0;
};

int local_len(int pos, int D, int r) { return pos < r ? 0 : (pos - r) / D + 1; }

// 64 ragged requests: mostly short (so that the CPU reference stays quick), every 16th at 8192.
std::vector<int> ragged64() {
  std::vector<int> v(64);
  for (int b = 0; b < 64; ++b) v[static_cast<size_t>(b)] = b % 16 == 0 ? 8192 : 1 + (b * 397) % 1300;
  return v;
}

class MlaAttendK3Cuda : public ::testing::TestWithParam<K3AttendCase> {};

TEST_P(MlaAttendK3Cuda, MatchesCpuAndRepeatsBitIdentical) {
  K3_REQUIRE_GPU();
  const K3AttendCase& c = GetParam();
  const int B = c.B, q = c.q, H = 12, R = 512, P = 64, D = c.dcp, dr = c.dcp_rank;
  const int64_t E = int64_t{R} + P, T = int64_t{B} * q;
  const float scale = 1.0f / std::sqrt(192.0f);
  // Token i of request b sits at position ctx[b] - q + i (the last at ctx - 1; before 0: nothing visible).
  std::vector<int32_t> ctx_len(static_cast<size_t>(T));
  std::vector<int> held(static_cast<size_t>(B));
  int max_ctx = 0;
  for (int b = 0; b < B; ++b) {
    const int ctx = c.ctx[static_cast<size_t>(b)];
    held[static_cast<size_t>(b)] = local_len(ctx - 1, D, dr);
    for (int i = 0; i < q; ++i) {
      const int pos = ctx - q + i;
      ctx_len[static_cast<size_t>(b * q + i)] = pos >= 0 ? local_len(pos, D, dr) : 0;
    }
    max_ctx = std::max(max_ctx, held[static_cast<size_t>(b)]);
  }
  max_ctx += 3;  // a loose bound, as the engine may pass
  const Paged cache = make_paged(held, c.page_size, E, 81 + static_cast<uint64_t>(B), 1.0);
  const auto q_lat = random_bf16_values(static_cast<size_t>(T * H * E), 82, 2.0);
  auto d_q = up_bf16(q_lat);
  auto d_pool = up_bf16(cache.pool);
  auto d_tables = upload(cache.tables);
  auto d_ctx = upload(ctx_len);
  const size_t scratch_bytes = ops::cuda::mla_attend_paged_scratch_bytes(B, q, H, R, max_ctx);
  DeviceBuffer d_scratch(std::max<size_t>(scratch_bytes, 16));
  const size_t no = static_cast<size_t>(T * H * R), nl = static_cast<size_t>(T * H);
  DeviceBuffer d_o(no * sizeof(float)), d_lse(nl * sizeof(float));
  std::vector<float> o_got, lse_got;
  for (int rep = 0; rep < 2; ++rep) {  // NaN-filled outputs: every value is written, the same bits twice
    ASSERT_EQ(cudaMemset(d_o.get(), 0xFF, no * sizeof(float)), cudaSuccess);
    ASSERT_EQ(cudaMemset(d_lse.get(), 0xFF, nl * sizeof(float)), cudaSuccess);
    K3_CU(ops::cuda::mla_attend_paged(d_q.get<bf16>(), d_pool.get<bf16>(), d_tables.get<int32_t>(), cache.max_pages,
                                      c.page_size, d_ctx.get<int32_t>(), B, q, max_ctx, H, R, P, scale,
                                      d_o.get<float>(), d_lse.get<float>(), d_scratch.get(), scratch_bytes, st()));
    auto o = down_f32(d_o, no);
    auto l = down_f32(d_lse, nl);
    if (rep == 0) {
      o_got = std::move(o);
      lse_got = std::move(l);
    } else {
      expect_exact(o, o_got, "repeated call o_lat");
      expect_exact(l, lse_got, "repeated call lse");
    }
  }
  std::vector<float> o_ref(no), lse_ref(nl);
  std::vector<const float*> entries;
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < q; ++i) {
      const int64_t t = int64_t{b} * q + i, n = ctx_len[static_cast<size_t>(t)];
      entries.resize(static_cast<size_t>(n));
      for (int64_t p = 0; p < n; ++p) entries[static_cast<size_t>(p)] = cache.at(b, p);
      ops::mla_attend(&q_lat[t * H * E], entries.data(), n, H, R, P, scale, &o_ref[t * H * R], &lse_ref[t * H]);
    }
  expect_no_nan(o_got, "o_lat");
  expect_close(o_got, o_ref, 1e-3, 1e-6, "mla_attend_paged o_lat (K3)");
  for (size_t i = 0; i < nl; ++i) {
    if (std::isinf(lse_ref[i]))
      EXPECT_EQ(lse_got[i], lse_ref[i]) << "lse at " << i;
    else
      EXPECT_NEAR(lse_got[i], lse_ref[i], 5e-4) << "lse at " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(
    K3, MlaAttendK3Cuda,
    ::testing::Values(
        // One request, q = 1: tile edges (63, 64, 65: a partial tile, one full, one full and one entry), 8k
        // (splits over the SMs) and 64k.
        K3AttendCase{1, 1, 64, {1}}, K3AttendCase{1, 1, 64, {63}}, K3AttendCase{1, 1, 64, {64}},
        K3AttendCase{1, 1, 64, {65}}, K3AttendCase{1, 1, 64, {8192}}, K3AttendCase{1, 1, 64, {65536}},
        // q = 2..4 (24, 36, 48 rows: N = 32, 48, 48); a token before position 0 sees nothing.
        K3AttendCase{1, 2, 64, {64}}, K3AttendCase{1, 3, 64, {65}}, K3AttendCase{1, 4, 64, {63}},
        K3AttendCase{1, 4, 64, {8192}}, K3AttendCase{2, 4, 64, {65536, 65}}, K3AttendCase{2, 2, 64, {65536, 1}},
        // 7 ragged requests, q = 1..4.
        K3AttendCase{7, 1, 64, {1, 63, 64, 65, 8192, 300, 129}},
        K3AttendCase{7, 2, 64, {2, 63, 64, 65, 8192, 300, 129}},
        K3AttendCase{7, 3, 64, {3, 63, 64, 65, 8192, 300, 129}},
        K3AttendCase{7, 4, 64, {4, 63, 64, 65, 8192, 300, 129}},
        // 64 ragged requests.
        K3AttendCase{64, 1, 64, ragged64()}, K3AttendCase{64, 2, 64, ragged64()}, K3AttendCase{64, 4, 64, ragged64()},
        // Other page sizes: TMA boxes of 16 and 8 rows, a page of two tiles; 48 is not a TMA page size
        // (the mma.sync kernels).
        K3AttendCase{3, 2, 16, {65, 1000, 8192}}, K3AttendCase{2, 3, 8, {700, 64}},
        K3AttendCase{2, 1, 128, {8192, 200}}, K3AttendCase{2, 4, 48, {1000, 100}},
        // DCP shares: rank 1 of 2 and rank 3 of 4 (consecutive tokens may see the same local entries).
        K3AttendCase{3, 4, 64, {8192, 65, 130}, 2, 1}, K3AttendCase{7, 1, 64, {1, 2, 63, 64, 65, 129, 8192}, 4, 3},
        K3AttendCase{2, 3, 64, {65536, 7}, 2, 0}));

struct IndexedCase {
  int B, q, H, R, P, page_size, max_sel;
  std::vector<int> ctx;    // per request
  std::vector<int> count;  // per token: how many positions are selected
};

class MlaAttendIndexedCuda : public ::testing::TestWithParam<IndexedCase> {};

TEST_P(MlaAttendIndexedCuda, MatchesCpuOverSelectedEntries) {
  K3_REQUIRE_GPU();
  const IndexedCase& c = GetParam();
  const int B = c.B, q = c.q, H = c.H, R = c.R, P = c.P, max_sel = c.max_sel;
  const int64_t E = int64_t{R} + P, T = int64_t{B} * q;
  const float scale = 0.09f;
  const Paged cache = make_paged(c.ctx, c.page_size, E, 61, 1.0);
  std::vector<int32_t> sel(static_cast<size_t>(T * max_sel), 1 << 29), count(static_cast<size_t>(T));
  Rng r(62);
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < q; ++i) {
      const int64_t t = int64_t{b} * q + i;
      const int n = c.ctx[b] - q + 1 + i;
      std::vector<int32_t> pos(static_cast<size_t>(n));
      std::iota(pos.begin(), pos.end(), 0);
      shuffle(pos, r);  // selections in no particular order
      const int cnt = std::min(c.count[static_cast<size_t>(t)], n);
      count[static_cast<size_t>(t)] = cnt;
      std::copy_n(pos.begin(), cnt, &sel[static_cast<size_t>(t * max_sel)]);
    }
  const auto q_lat = random_bf16_values(static_cast<size_t>(T * H * E), 63, 2.0);
  auto d_q = up_bf16(q_lat);
  auto d_pool = up_bf16(cache.pool);
  auto d_tables = upload(cache.tables);
  auto d_sel = upload(sel);
  auto d_cnt = upload(count);
  const size_t scratch_bytes = ops::cuda::mla_attend_indexed_scratch_bytes(T, H, R, max_sel);
  DeviceBuffer d_scratch(scratch_bytes);
  DeviceBuffer d_o(static_cast<size_t>(T * H * R) * sizeof(float)), d_lse(static_cast<size_t>(T * H) * sizeof(float));
  K3_CU(ops::cuda::mla_attend_indexed(d_q.get<bf16>(), d_pool.get<bf16>(), d_tables.get<int32_t>(), cache.max_pages,
                                      c.page_size, d_sel.get<int32_t>(), d_cnt.get<int32_t>(), max_sel, B, q, H, R, P,
                                      scale, d_o.get<float>(), d_lse.get<float>(), d_scratch.get(), scratch_bytes,
                                      st()));
  std::vector<float> o_ref(static_cast<size_t>(T * H * R)), lse_ref(static_cast<size_t>(T * H));
  std::vector<const float*> entries;
  for (int64_t t = 0; t < T; ++t) {
    const int b = static_cast<int>(t / q), n = count[static_cast<size_t>(t)];
    entries.resize(static_cast<size_t>(n));
    for (int j = 0; j < n; ++j)
      entries[static_cast<size_t>(j)] = cache.at(b, sel[static_cast<size_t>(t * max_sel + j)]);
    ops::mla_attend(&q_lat[t * H * E], entries.data(), n, H, R, P, scale, &o_ref[t * H * R], &lse_ref[t * H]);
  }
  const auto o_got = down_f32(d_o, o_ref.size());
  const auto lse_got = down_f32(d_lse, lse_ref.size());
  expect_no_nan(o_got, "o_lat");
  expect_close(o_got, o_ref, 1e-3, 1e-6, "mla_attend_indexed o_lat");
  for (size_t i = 0; i < lse_ref.size(); ++i) {
    if (std::isinf(lse_ref[i]))
      EXPECT_EQ(lse_got[i], lse_ref[i]) << "lse at " << i;
    else
      EXPECT_NEAR(lse_got[i], lse_ref[i], 5e-4) << "lse at " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, MlaAttendIndexedCuda,
    ::testing::Values(IndexedCase{2, 2, 12, 512, 64, 64, 2048, {5000, 3000}, {2048, 17, 0, 2048}},  // K3.1 top-2048
                      IndexedCase{3, 1, 12, 512, 64, 64, 2048, {1, 700, 2048}, {2048, 2048, 2048}},
                      IndexedCase{1, 3, 3, 32, 8, 16, 37, {60}, {37, 1, 20}},  // tiny shapes
                      // 8 tokens and more: the 16-row kernel.
                      IndexedCase{8, 1, 12, 512, 64, 64, 2048, {5000, 3000, 1, 700, 2048, 9000, 64, 2100},
                                  {2048, 17, 1, 700, 0, 2048, 64, 2048}},
                      IndexedCase{4, 2, 3, 32, 8, 16, 37, {60, 50, 40, 45}, {37, 1, 20, 0, 37, 37, 5, 36}}));

// ---------------------------------------------------------------- DSA indexer + top-k

struct IndexerCase {
  int B, q, Hi, Di, page_size, k;
  std::vector<int> ctx;  // per request: the context of its last token
  bool integers;         // small integers: every sum is exact, GPU scores must equal the CPU's bit for bit
};

class DsaIndexerCuda : public ::testing::TestWithParam<IndexerCase> {};

TEST_P(DsaIndexerCuda, ScoresAndTopkMatchCpu) {
  K3_REQUIRE_GPU();
  const IndexerCase& c = GetParam();
  const int B = c.B, q = c.q, Hi = c.Hi, Di = c.Di, k = c.k;
  const int64_t T = int64_t{B} * q;
  const Paged keys = make_paged(c.ctx, c.page_size, Di, 71, 2.0, c.integers);
  std::vector<int32_t> ctx_len(static_cast<size_t>(T));
  int max_ctx = 0;
  for (int b = 0; b < B; ++b) {
    for (int i = 0; i < q; ++i) ctx_len[static_cast<size_t>(b * q + i)] = c.ctx[b] - q + 1 + i;
    max_ctx = std::max(max_ctx, c.ctx[b]);
  }
  max_ctx += 3;
  std::vector<float> q_idx(static_cast<size_t>(T * Hi * Di)), w(static_cast<size_t>(T * Hi));
  Rng r(72);
  for (auto& x : q_idx)
    x = c.integers ? static_cast<float>(static_cast<int>(r.below(5)) - 2)
                   : round_bf16(static_cast<float>(r.uniform(-1, 1)));
  const float wscale = 1.0f / std::sqrt(static_cast<float>(Di)) / std::sqrt(static_cast<float>(Hi));
  for (auto& x : w)
    x = c.integers ? static_cast<float>(static_cast<int>(r.below(7)) - 3)
                   : static_cast<float>(r.uniform(-1, 1)) * wscale;

  auto d_q = up_bf16(q_idx);
  auto d_w = upload(w);
  auto d_pool = up_bf16(keys.pool);
  auto d_tables = upload(keys.tables);
  auto d_ctx = upload(ctx_len);
  DeviceBuffer d_scores(static_cast<size_t>(T * max_ctx) * sizeof(float));
  K3_CU(ops::cuda::dsa_index_scores_paged(d_q.get<bf16>(), d_w.get<float>(), d_pool.get<bf16>(),
                                          d_tables.get<int32_t>(), keys.max_pages, c.page_size, d_ctx.get<int32_t>(), B,
                                          q, max_ctx, Hi, Di, d_scores.get<float>(), st()));
  DeviceBuffer d_idx(static_cast<size_t>(T * k) * sizeof(int32_t)), d_cnt(static_cast<size_t>(T) * sizeof(int32_t));
  K3_CU(ops::cuda::topk_indices(d_scores.get<float>(), max_ctx, d_ctx.get<int32_t>(), T, k, d_idx.get<int32_t>(),
                                d_cnt.get<int32_t>(), topk_scratch().get(), topk_scratch().bytes(), st()));
  const auto scores = down_f32(d_scores, static_cast<size_t>(T * max_ctx));
  const auto idx = down_i32(d_idx, static_cast<size_t>(T * k));
  const auto cnt = down_i32(d_cnt, static_cast<size_t>(T));

  std::vector<const float*> kp;
  for (int64_t t = 0; t < T; ++t) {
    const int b = static_cast<int>(t / q), n = ctx_len[static_cast<size_t>(t)];
    kp.resize(static_cast<size_t>(n));
    for (int p = 0; p < n; ++p) kp[static_cast<size_t>(p)] = keys.at(b, p);
    std::vector<float> ref(static_cast<size_t>(n));
    ops::dsa_index_scores(&q_idx[t * Hi * Di], &w[t * Hi], kp.data(), n, Hi, Di, ref.data());
    const std::vector<float> got(scores.begin() + t * max_ctx, scores.begin() + t * max_ctx + n);
    if (c.integers)
      expect_exact(got, ref, "indexer scores (exact integers)");
    else
      expect_close(got, ref, 1e-4, 1e-7, "indexer scores");
    for (int64_t col = n; col < max_ctx; ++col)
      ASSERT_EQ(scores[static_cast<size_t>(t * max_ctx + col)], -INFINITY) << "tail of row " << t << " at " << col;

    // Top-k: on the GPU's own scores, the GPU selection must be the CPU's exactly (set, column order); with exact
    // integer scores this is also the end-to-end answer, ties included.
    const std::vector<float>& basis = c.integers ? ref : got;
    std::vector<int64_t> want(static_cast<size_t>(std::max(n, 1)));
    const int64_t m = ops::topk_indices(basis.data(), n, k, want.data());
    ASSERT_EQ(cnt[static_cast<size_t>(t)], m) << "count of row " << t;
    for (int j = 0; j < k; ++j) {
      const int32_t expect = j < m ? static_cast<int32_t>(want[static_cast<size_t>(j)]) : -1;
      ASSERT_EQ(idx[static_cast<size_t>(t * k + j)], expect) << "row " << t << " rank " << j;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, DsaIndexerCuda,
    ::testing::Values(IndexerCase{3, 2, 32, 128, 64, 2048, {2, 1000, 3000}, false},  // K3.1 TP8, ctx < and > 2048
                      IndexerCase{2, 1, 32, 128, 64, 2048, {2049, 5000}, true},      // exact scores, heavy ties
                      IndexerCase{1, 2, 32, 128, 64, 2048, {65536}, true},           // the longest context
                      IndexerCase{2, 3, 4, 16, 16, 4, {5, 40}, false},               // tiny preset shapes
                      IndexerCase{1, 1, 20, 40, 8, 7, {333}, true}));                // Hi straddles M tiles, Di 40

// Top-k alone on crafted rows: exact agreement with the CPU, ties, NaN, -inf, -0 / +0 included.
TEST(TopkCuda, MatchesCpuExactlyOnCraftedRows) {
  K3_REQUIRE_GPU();
  const int64_t ld = 65536;
  const std::vector<int> ns = {0, 1, 17, 1000, 2047, 2048, 2049, 5000, 65536, 65536, 4096, 3000};
  const int64_t T = static_cast<int64_t>(ns.size());
  std::vector<float> scores(static_cast<size_t>(T * ld), 7.0f);  // past n: ignored even if large
  Rng r(81);
  for (int64_t t = 0; t < T; ++t) {
    float* row = &scores[static_cast<size_t>(t * ld)];
    for (int i = 0; i < ns[static_cast<size_t>(t)]; ++i) {
      switch (t % 4) {
        case 0:
          row[i] = static_cast<float>(r.uniform(-10, 10));
          break;  // distinct
        case 1:
          row[i] = static_cast<float>(static_cast<int>(r.below(9)) - 4);
          break;   // heavy ties
        case 2: {  // specials
          const uint64_t u = r.below(10);
          row[i] = u == 0   ? kNaN
                   : u == 1 ? -INFINITY
                   : u == 2 ? -0.0f
                   : u == 3 ? 0.0f
                   : u == 4 ? INFINITY
                            : static_cast<float>(r.normal());
          break;
        }
        default:
          row[i] = static_cast<float>(r.below(3)) * 1e-30f - 1e-30f;
          break;  // tiny, ties, sign changes
      }
    }
  }
  std::vector<int32_t> n32(ns.begin(), ns.end());
  auto d_scores = upload(scores);
  auto d_n = upload(n32);
  for (int k : {2048, 100, 1})
    for (int64_t ctas : {int64_t{0}, int64_t{1}}) {  // the automatic split, then one CTA per row
      DeviceBuffer d_idx(static_cast<size_t>(T * k) * sizeof(int32_t)),
          d_cnt(static_cast<size_t>(T) * sizeof(int32_t));
      K3_CU(ops::cuda::topk_indices(d_scores.get<float>(), ld, d_n.get<int32_t>(), T, k, d_idx.get<int32_t>(),
                                    d_cnt.get<int32_t>(), topk_scratch().get(), topk_scratch().bytes(), st(), ctas));
      const auto idx = down_i32(d_idx, static_cast<size_t>(T * k));
      const auto cnt = down_i32(d_cnt, static_cast<size_t>(T));
      for (int64_t t = 0; t < T; ++t) {
        const int n = ns[static_cast<size_t>(t)];
        std::vector<int64_t> want(static_cast<size_t>(std::max(n, 1)));
        const int64_t m = ops::topk_indices(&scores[static_cast<size_t>(t * ld)], n, k, want.data());
        ASSERT_EQ(cnt[static_cast<size_t>(t)], m) << "ctas " << ctas << " k " << k << " row " << t;
        for (int j = 0; j < k; ++j) {
          const int32_t expect = j < m ? static_cast<int32_t>(want[static_cast<size_t>(j)]) : -1;
          ASSERT_EQ(idx[static_cast<size_t>(t * k + j)], expect)
              << "ctas " << ctas << " k " << k << " row " << t << " rank " << j;
        }
      }
    }
}

// ---------------------------------------------------------------- split top-k

// Rows of the split top-k tests. Never all zeros; columns past a row's n hold 1e30 (ignored if the kernel
// honours n).
enum class TopkRow {
  kDistinct,    // uniform in [-10, 10)
  kFewValues,   // multiples of 0.25 in [0.25, 2.25]: ties everywhere, the threshold one of 9 values
  kEdgeTies,    // ~n/32 scores above 2, then ~n/8 copies of 1.5 scattered over the row (over every CTA
                // boundary), the rest below 1: the threshold is 1.5, taken by the lowest columns
  kAllEqual,    // one value: the tie is broken on the column bits (every histogram pass)
  kSpecials,    // mostly NaN and -inf (NaN ranks as -inf: one huge tie), some +inf, -0, +0, normals
};
constexpr int kTopkRowKinds = 5;

void fill_topk_row(float* row, int64_t n, TopkRow kind, Rng& r) {
  switch (kind) {
    case TopkRow::kDistinct:
      for (int64_t i = 0; i < n; ++i) row[i] = static_cast<float>(r.uniform(-10, 10));
      break;
    case TopkRow::kFewValues:
      for (int64_t i = 0; i < n; ++i) row[i] = 0.25f * static_cast<float>(1 + r.below(9));
      break;
    case TopkRow::kEdgeTies:
      for (int64_t i = 0; i < n; ++i) {
        const uint64_t u = r.below(32);
        row[i] = u == 0 ? static_cast<float>(r.uniform(2, 3)) : u < 5 ? 1.5f : static_cast<float>(r.uniform(-1, 1));
      }
      break;
    case TopkRow::kAllEqual:
      for (int64_t i = 0; i < n; ++i) row[i] = 0.75f;
      break;
    case TopkRow::kSpecials:
      for (int64_t i = 0; i < n; ++i) {
        const uint64_t u = r.below(20);
        row[i] = u < 8    ? kNaN
                 : u < 16 ? -INFINITY
                 : u == 16 ? INFINITY
                 : u == 17 ? -0.0f
                 : u == 18 ? 0.0f
                           : static_cast<float>(r.normal());
      }
      break;
  }
}

struct TopkOut {
  std::vector<int32_t> idx, cnt;
};

// topk_indices (ctas_per_row 0: its own split; 1: one CTA per row) on device scores (from float offset
// `shift`: shift 1 takes the scalar loads), with sentinels past idx and count that must stay untouched.
TopkOut run_topk(const DeviceBuffer& d_scores, int64_t ld, const DeviceBuffer& d_n, int64_t T, int k,
                 int64_t ctas_per_row, int64_t shift = 0) {
  constexpr int32_t kSentinel = 0x5a5a5a5a;
  constexpr size_t kGuard = 64;
  const size_t ni = static_cast<size_t>(T * k);
  auto d_idx = upload(std::vector<int32_t>(ni + kGuard, kSentinel));
  auto d_cnt = upload(std::vector<int32_t>(static_cast<size_t>(T) + kGuard, kSentinel));
  const int rc = ops::cuda::topk_indices(d_scores.get<float>() + shift, ld, d_n.get<int32_t>(), T, k,
                                        d_idx.get<int32_t>(), d_cnt.get<int32_t>(), topk_scratch().get(),
                                        topk_scratch().bytes(), st(), ctas_per_row);
  EXPECT_EQ(rc, 0) << "topk launch, ctas_per_row " << ctas_per_row;
  TopkOut o;
  o.idx = down_i32(d_idx, ni + kGuard);
  o.cnt = down_i32(d_cnt, static_cast<size_t>(T) + kGuard);
  for (size_t i = 0; i < kGuard; ++i) {
    EXPECT_EQ(o.idx[ni + i], kSentinel) << "write past idx at " << i;
    EXPECT_EQ(o.cnt[static_cast<size_t>(T) + i], kSentinel) << "write past count at " << i;
  }
  o.idx.resize(ni);
  o.cnt.resize(static_cast<size_t>(T));
  return o;
}

// The CPU topk_indices of every row, exactly (count, set, column order, -1 padding); scores from float offset
// shift. The columns must also ascend strictly on their own (the contract, whatever the CPU says).
::testing::AssertionResult topk_matches_cpu(const std::vector<float>& scores, int64_t ld,
                                            const std::vector<int32_t>& n, int k, const TopkOut& got,
                                            int64_t shift = 0) {
  const int64_t T = static_cast<int64_t>(n.size());
  std::vector<int64_t> want;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t nt = n[static_cast<size_t>(t)];
    want.assign(static_cast<size_t>(std::max<int64_t>(nt, 1)), -7);
    const int64_t m = ops::topk_indices(&scores[static_cast<size_t>(shift + t * ld)], nt, k, want.data());
    for (int64_t j = 1; j < std::min<int64_t>(m, got.cnt[static_cast<size_t>(t)]); ++j)
      if (got.idx[static_cast<size_t>(t * k + j)] <= got.idx[static_cast<size_t>(t * k + j - 1)])
        return ::testing::AssertionFailure() << "row " << t << ": columns not ascending at rank " << j;
    if (got.cnt[static_cast<size_t>(t)] != m)
      return ::testing::AssertionFailure() << "row " << t << " (n " << nt << "): count " << got.cnt[t] << ", want " << m;
    for (int j = 0; j < k; ++j) {
      const int32_t expect = j < m ? static_cast<int32_t>(want[static_cast<size_t>(j)]) : -1;
      const int32_t g = got.idx[static_cast<size_t>(t * k + j)];
      if (g != expect)
        return ::testing::AssertionFailure() << "row " << t << " (n " << nt << ") rank " << j << ": " << g
                                             << ", want " << expect;
    }
  }
  return ::testing::AssertionSuccess();
}

// Every size around the split's edges (k - 1, k, k + 1, the gather-at-once limit 4096, one CTA's chunk,
// the one-CTA limit 16384, 64k, 64k + 1: one more column bit, 128k), 1 and 8 rows (ragged n), each row kind,
// one CTA per row, the automatic split and forced ones (3 CTAs a row; 64 and 512, the most: chunks of 4 to
// 2048 columns, ties across many CTA boundaries, many empty segments); all must agree bit for bit.
TEST(TopkSplitCuda, MatchesCpuOverSizesRowsAndSplits) {
  K3_REQUIRE_GPU();
  const int k = 2048;
  for (int64_t ld : {int64_t{1}, int64_t{7}, int64_t{k - 1}, int64_t{k}, int64_t{k + 1}, int64_t{4096},
                     int64_t{4097}, int64_t{5000}, int64_t{16384}, int64_t{16385}, int64_t{65536}, int64_t{65537},
                     int64_t{131072}})
    for (int64_t T : {int64_t{1}, int64_t{8}}) {
      Rng r(static_cast<uint64_t>(ld * 31 + T));
      std::vector<float> scores(static_cast<size_t>(T * ld), 1e30f);
      std::vector<int32_t> n(static_cast<size_t>(T));
      for (int64_t t = 0; t < T; ++t) {
        // Row 0 full; the others ragged (some short of k, some of the gather-at-once limit).
        const int64_t nt = t == 0 ? ld : static_cast<int64_t>(r.below(static_cast<uint64_t>(ld) + 1));
        n[static_cast<size_t>(t)] = static_cast<int32_t>(nt);
        fill_topk_row(&scores[static_cast<size_t>(t * ld)], nt, static_cast<TopkRow>((t + ld) % kTopkRowKinds), r);
      }
      auto d_scores = upload(scores);
      auto d_n = upload(n);
      const TopkOut ref = run_topk(d_scores, ld, d_n, T, k, 1);
      ASSERT_TRUE(topk_matches_cpu(scores, ld, n, k, ref)) << "one CTA per row, ld " << ld << " T " << T;
      for (int64_t ctas : {int64_t{0}, int64_t{3}, int64_t{64}, int64_t{512}}) {
        const TopkOut got = run_topk(d_scores, ld, d_n, T, k, ctas);
        ASSERT_TRUE(topk_matches_cpu(scores, ld, n, k, got)) << "ld " << ld << " T " << T << " ctas " << ctas;
        ASSERT_EQ(got.idx, ref.idx) << "ld " << ld << " T " << T << " ctas " << ctas;
        ASSERT_EQ(got.cnt, ref.cnt) << "ld " << ld << " T " << T << " ctas " << ctas;
      }
    }
}

// Smaller k (the threshold bin then holds few of the row's ties), and every row kind alone at 64k + 1.
TEST(TopkSplitCuda, MatchesCpuAtEveryKAndRowKind) {
  K3_REQUIRE_GPU();
  const int64_t ld = 65537;
  const int64_t T = kTopkRowKinds;
  Rng r(91);
  std::vector<float> scores(static_cast<size_t>(T * ld));
  std::vector<int32_t> n(static_cast<size_t>(T), static_cast<int32_t>(ld));
  for (int64_t t = 0; t < T; ++t) fill_topk_row(&scores[static_cast<size_t>(t * ld)], ld, static_cast<TopkRow>(t), r);
  auto d_scores = upload(scores);
  auto d_n = upload(n);
  for (int k : {1, 2, 777, 2047, 2048})
    for (int64_t ctas : {int64_t{0}, int64_t{1}, int64_t{33}}) {
      const TopkOut got = run_topk(d_scores, ld, d_n, T, k, ctas);
      ASSERT_TRUE(topk_matches_cpu(scores, ld, n, k, got)) << "k " << k << " ctas " << ctas;
    }
}

// 300 rows (more than two per SM: one CTA a row by default), ragged n from 0 to 64k + 1, every row kind; the
// automatic split and 7 CTAs a row.
TEST(TopkSplitCuda, ManyRaggedRows) {
  K3_REQUIRE_GPU();
  const int k = 2048;
  const int64_t ld = 65537, T = 300;
  Rng r(92);
  std::vector<float> scores(static_cast<size_t>(T * ld), 1e30f);
  std::vector<int32_t> n(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    const uint64_t u = r.below(8);
    const int64_t nt = u == 0   ? static_cast<int64_t>(r.below(3))                // 0, 1, 2
                       : u == 1 ? static_cast<int64_t>(r.below(2 * k + 2))          // around k and 4096
                       : u == 2 ? ld
                                : static_cast<int64_t>(r.below(static_cast<uint64_t>(ld) + 1));
    n[static_cast<size_t>(t)] = static_cast<int32_t>(nt);
    fill_topk_row(&scores[static_cast<size_t>(t * ld)], nt, static_cast<TopkRow>(t % kTopkRowKinds), r);
  }
  auto d_scores = upload(scores);
  auto d_n = upload(n);
  for (int64_t ctas : {int64_t{0}, int64_t{7}}) {
    const TopkOut got = run_topk(d_scores, ld, d_n, T, k, ctas);
    ASSERT_TRUE(topk_matches_cpu(scores, ld, n, k, got)) << "ctas " << ctas;
  }
}

// The same call repeated (eager, and as a CUDA graph replayed), with calls of other shapes on the same
// scratch in between: bit-identical results every time (the scratch is left clean; nothing depends on timing).
TEST(TopkSplitCuda, RepeatedCallsAndGraphReplaysAreIdentical) {
  K3_REQUIRE_GPU();
  const int k = 2048;
  const int64_t ld = 131072, T = 8;
  Rng r(93);
  std::vector<float> scores(static_cast<size_t>(T * ld));
  std::vector<int32_t> n(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    n[static_cast<size_t>(t)] = static_cast<int32_t>(ld - t * 4099);
    fill_topk_row(&scores[static_cast<size_t>(t * ld)], ld, static_cast<TopkRow>(t % kTopkRowKinds), r);
  }
  auto d_scores = upload(scores);
  auto d_n = upload(n);
  // Another shape: 300 rows of 5000 distinct scores.
  const int64_t ld2 = 5000, T2 = 300;
  std::vector<float> other(static_cast<size_t>(T2 * ld2));
  for (auto& x : other) x = static_cast<float>(r.uniform(-1, 1));
  auto d_other = upload(other);
  auto d_n2 = upload(std::vector<int32_t>(static_cast<size_t>(T2), static_cast<int32_t>(ld2)));

  const TopkOut first = run_topk(d_scores, ld, d_n, T, k, 0);
  ASSERT_TRUE(topk_matches_cpu(scores, ld, n, k, first));
  for (int rep = 0; rep < 3; ++rep) {
    (void)run_topk(d_other, ld2, d_n2, T2, k, rep == 1 ? 5 : 0);
    const TopkOut again = run_topk(d_scores, ld, d_n, T, k, 0);
    ASSERT_EQ(again.idx, first.idx) << "repeat " << rep;
    ASSERT_EQ(again.cnt, first.cnt) << "repeat " << rep;
  }
  // Captured once, replayed three times into zeroed outputs.
  DeviceBuffer d_idx(static_cast<size_t>(T * k) * sizeof(int32_t)), d_cnt(static_cast<size_t>(T) * sizeof(int32_t));
  cudaStream_t s = stream();
  cudaGraph_t g;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const int rc = ops::cuda::topk_indices(d_scores.get<float>(), ld, d_n.get<int32_t>(), T, k, d_idx.get<int32_t>(),
                                         d_cnt.get<int32_t>(), topk_scratch().get(), topk_scratch().bytes(), st());
  ASSERT_EQ(cudaStreamEndCapture(s, &g), cudaSuccess);
  ASSERT_EQ(rc, 0);
  cudaGraphExec_t e;
  ASSERT_EQ(cudaGraphInstantiate(&e, g, 0), cudaSuccess);
  for (int rep = 0; rep < 3; ++rep) {
    ASSERT_EQ(cudaMemsetAsync(d_idx.get(), 0, d_idx.bytes(), s), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(d_cnt.get(), 0, d_cnt.bytes(), s), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(e, s), cudaSuccess);
    ASSERT_EQ(down_i32(d_idx, static_cast<size_t>(T * k)), first.idx) << "graph replay " << rep;
    ASSERT_EQ(down_i32(d_cnt, static_cast<size_t>(T)), first.cnt) << "graph replay " << rep;
  }
  cudaGraphExecDestroy(e);
  cudaGraphDestroy(g);
}

// Small enough for compute-sanitizer (memcheck, racecheck): 3 rows of 9000 (one histogram pass, every pass with
// the column bits, the NaN / -inf tie), each split 1, 3 and 40 ways, k 2048 and 5.
TEST(TopkSplitCuda, SmallRowsForTheSanitizer) {
  K3_REQUIRE_GPU();
  const int64_t ld = 9000, T = 3;
  Rng r(94);
  std::vector<float> scores(static_cast<size_t>(T * ld));
  const TopkRow kinds[3] = {TopkRow::kEdgeTies, TopkRow::kAllEqual, TopkRow::kSpecials};
  for (int64_t t = 0; t < T; ++t) fill_topk_row(&scores[static_cast<size_t>(t * ld)], ld, kinds[t], r);
  const std::vector<int32_t> n = {9000, 8999, 6000};
  auto d_scores = upload(scores);
  auto d_n = upload(n);
  for (int k : {2048, 5})
    for (int64_t ctas : {int64_t{1}, int64_t{3}, int64_t{40}}) {
      const TopkOut got = run_topk(d_scores, ld, d_n, T, k, ctas);
      ASSERT_TRUE(topk_matches_cpu(scores, ld, n, k, got)) << "k " << k << " ctas " << ctas;
    }
}

// Ties at the threshold placed over every CTA boundary: the lowest tied columns must win, whatever the split.
// Rows: 2000 scores above a sea of 1.0 (48 of the 1.0s taken); exactly k at 5.0 (the chosen bin taken whole
// at the first pass); k + 1 at 5.0 (the highest of them left out); k - 1 at 5.0 and one 4.0; -0 / +0 in a
// sea of NaN and -inf with a few +inf (the zeros tie across the sign). Then the scratch's counters, fills
// and histograms must be zero again (its layout: dsa_topk.cu, "A row's block").
TEST(TopkSplitCuda, ThresholdTiesAcrossCtaBoundaries) {
  K3_REQUIRE_GPU();
  const int k = 2048;
  const int64_t ld = 65536, T = 5;
  Rng r(95);
  std::vector<float> scores(static_cast<size_t>(T * ld), 1.0f);
  auto scatter = [&](int64_t t, int count, float v) {
    for (int c = 0; c < count;) {
      float& x = scores[static_cast<size_t>(t * ld) + r.below(static_cast<uint64_t>(ld))];
      if (x != 1.0f) continue;
      x = v;
      ++c;
    }
  };
  for (int c = 0; c < 2000; ++c) scatter(0, 1, static_cast<float>(3.0 + r.uniform(0, 1)));
  scatter(1, k, 5.0f);
  scatter(2, k + 1, 5.0f);
  scatter(3, k - 1, 5.0f);
  scatter(3, 1, 4.0f);
  for (int64_t i = 0; i < ld; ++i) {
    const uint64_t u = r.below(16);
    scores[static_cast<size_t>(4 * ld + i)] = u < 6 ? kNaN : u < 12 ? -INFINITY : u < 13 ? -0.0f : u < 14 ? 0.0f : u < 15 ? INFINITY : -5.0f;
  }
  const std::vector<int32_t> n(static_cast<size_t>(T), static_cast<int32_t>(ld));
  auto d_scores = upload(scores);
  auto d_n = upload(n);
  for (int64_t ctas : {int64_t{1}, int64_t{0}, int64_t{7}, int64_t{64}, int64_t{512}}) {
    const TopkOut got = run_topk(d_scores, ld, d_n, T, k, ctas);
    ASSERT_TRUE(topk_matches_cpu(scores, ld, n, k, got)) << "ctas " << ctas;
  }
  // Row 2: the k + 1 fives less the last one.
  std::vector<int32_t> fives;
  for (int64_t i = 0; i < ld; ++i)
    if (scores[static_cast<size_t>(2 * ld + i)] == 5.0f) fives.push_back(static_cast<int32_t>(i));
  const TopkOut got = run_topk(d_scores, ld, d_n, T, k, 64);
  fives.pop_back();
  ASSERT_EQ(std::vector<int32_t>(got.idx.begin() + 2 * k, got.idx.begin() + 3 * k), fives);

  const size_t row_bytes = ops::cuda::topk_indices_scratch_bytes(1);
  std::vector<uint32_t> sc(topk_scratch().bytes() / 4);
  ASSERT_EQ(cudaMemcpy(sc.data(), topk_scratch().get(), sc.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  for (int64_t row = 0; row < kTopkMaxRows; ++row) {
    const uint32_t* b = &sc[static_cast<size_t>(row) * row_bytes / 4];
    ASSERT_EQ(b[0], 0u) << "arrival counter of row " << row;
    ASSERT_EQ(b[1], 0u) << "buffer fill of row " << row;
    for (int i = 0; i < 4096; ++i) ASSERT_EQ(b[64 + i], 0u) << "histogram of row " << row << " bin " << i;
  }
}

// Scores 4 bytes off 16-byte alignment (and an odd ld elsewhere): the scalar loads, on every split.
TEST(TopkSplitCuda, ScalarLoadsOnUnalignedScores) {
  K3_REQUIRE_GPU();
  const int k = 2048;
  const int64_t ld = 20000, T = 4;
  Rng r(96);
  std::vector<float> scores(static_cast<size_t>(T * ld + 1), 1e30f);
  std::vector<int32_t> n = {20000, 19999, 4097, 2050};
  for (int64_t t = 0; t < T; ++t)
    fill_topk_row(&scores[static_cast<size_t>(1 + t * ld)], n[static_cast<size_t>(t)], static_cast<TopkRow>(t + 1), r);
  auto d_scores = upload(scores);
  auto d_n = upload(n);
  for (int64_t ctas : {int64_t{1}, int64_t{0}, int64_t{9}, int64_t{512}}) {
    const TopkOut got = run_topk(d_scores, ld, d_n, T, k, ctas, /*shift=*/1);
    ASSERT_TRUE(topk_matches_cpu(scores, ld, n, k, got, /*shift=*/1)) << "ctas " << ctas;
  }
}

// Bad arguments are refused before any launch.
TEST(TopkSplitCuda, RejectsBadArguments) {
  K3_REQUIRE_GPU();
  DeviceBuffer d_scores(64 * sizeof(float)), d_n(4 * sizeof(int32_t)), d_idx(4 * 2048 * sizeof(int32_t)),
      d_cnt(4 * sizeof(int32_t));
  void* sc = topk_scratch().get();
  const size_t sb = topk_scratch().bytes();
  auto call = [&](int64_t T, int k, void* scratch, size_t bytes) {
    return ops::cuda::topk_indices(d_scores.get<float>(), 16, d_n.get<int32_t>(), T, k, d_idx.get<int32_t>(),
                                   d_cnt.get<int32_t>(), scratch, bytes, st());
  };
  EXPECT_NE(call(4, 2049, sc, sb), 0);                                                   // k > 2048
  EXPECT_NE(call(4, 16, nullptr, sb), 0);                                                // no scratch
  EXPECT_NE(call(4, 16, sc, ops::cuda::topk_indices_scratch_bytes(4) - 1), 0);          // too small
  EXPECT_NE(call(kTopkMaxRows + 1, 16, sc, sb), 0);                                      // rows beyond it
  EXPECT_NE(call(4, 16, static_cast<char*>(sc) + 4, sb - 4), 0);                         // misaligned
  EXPECT_EQ(call(0, 16, sc, sb), 0);                                                     // nothing to do
}

}  // namespace
}  // namespace k3
