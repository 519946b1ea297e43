// CUDA ops, set a, each against its CPU reference on random inputs (fixed seeds): linear (every path,
// the K3 per-rank shapes; the skinny kernel against a float64 loop), rmsnorm / layernorm, attn_res,
// embedding, situ_glu, mxfp4_linear, expert_mlp, mlp, moe_experts (the K3 rank slice: 28 of 896
// experts, k = 16), route, sample_greedy.
//
// Tolerances come from the output dtype. BF16 keeps 8 significant bits: an FP32 result that the GPU
// sums in another order rounds to the CPU's value or a neighbour, at most one ulp apart, and one ulp
// is at most 2^-7 of the largest output (kOneRounding). A BF16 result computed from BF16 intermediates
// that may each sit one ulp off moves by up to one more ulp (kChained); an RMSNorm of such a result
// (attn_res's mix) by one more (kNormOfChained). FP32 results: 1e-4 relative.
// Indices (router, greedy, embedding) and copies (attn_res's prefix and blocks) must match exactly.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "core/mxfp4.h"
#include "gpu_test_util.h"
#include "ops/attn_res.h"
#include "ops/embedding.h"
#include "ops/linear.h"
#include "ops/moe.h"
#include "ops/rmsnorm.h"
#include "ops/router.h"
#include "ops/sampling.h"

namespace k3 {
namespace {

using gputest::ctx;
using gputest::download;
using gputest::expect_close;
using gputest::random_bf16_values;
using gputest::stream;
using gputest::to_bf16_vec;
using gputest::to_float_vec;
using gputest::upload;

constexpr double kBf16Ulp = 1.0 / 128;  // one bf16 ulp relative to the top of its binade
constexpr double kOneRounding = kBf16Ulp;
constexpr double kChained = 2 * kBf16Ulp;
constexpr double kNormOfChained = 3 * kBf16Ulp;
constexpr double kF32Rel = 1e-4;

CUstream_st* st() { return ctx().stream; }

DeviceBuffer upload_bf16(const std::vector<float>& v) { return upload(to_bf16_vec(v)); }
std::vector<float> download_bf16(const DeviceBuffer& d, size_t n) { return to_float_vec(download<bf16>(d, n)); }

// ---------------------------------------------------------------------------------------------
// linear

// Checks y = x W^T on the GPU against ops::linear. For large problems the CPU reference covers the
// first and last 64 output features and 128 spread between (every row); small ones are checked whole.
void check_linear(const std::vector<float>& w, int64_t rows, int64_t in, int64_t out, bool y_f32, uint64_t seed,
                  const DeviceBuffer& dw) {
  SCOPED_TRACE(testing::Message() << "linear rows " << rows << " in " << in << " out " << out
                                  << (y_f32 ? " f32" : " bf16"));
  const auto x = random_bf16_values(static_cast<size_t>(rows * in), seed);
  DeviceBuffer dx = upload_bf16(x);
  DeviceBuffer dy(static_cast<size_t>(rows * out) * (y_f32 ? 4 : 2));
  ASSERT_EQ(ops::cuda::linear(ctx(), dx.get<bf16>(), dw.get<bf16>(), dy.get(), y_f32, rows, in, out), 0);
  const std::vector<float> got = y_f32 ? download<float>(dy, static_cast<size_t>(rows * out))
                                       : download_bf16(dy, static_cast<size_t>(rows * out));

  std::vector<int64_t> feats;
  if (rows * in * out <= (int64_t{1} << 27) || out <= 256) {
    feats.resize(static_cast<size_t>(out));
    std::iota(feats.begin(), feats.end(), 0);
  } else {
    for (int64_t o = 0; o < 64; ++o) feats.push_back(o);
    for (int64_t i = 0; i < 128; ++i) feats.push_back(64 + (out - 128) * i / 128);
    for (int64_t o = out - 64; o < out; ++o) feats.push_back(o);
  }
  const auto nf = static_cast<int64_t>(feats.size());
  std::vector<bf16> wsub(static_cast<size_t>(nf * in));
  for (int64_t f = 0; f < nf; ++f) {
    for (int64_t i = 0; i < in; ++i) wsub[f * in + i] = to_bf16(w[feats[f] * in + i]);
  }
  std::vector<float> want(static_cast<size_t>(rows * nf)), have(want.size());
  ops::linear(x.data(), wsub.data(), want.data(), rows, in, nf, /*round_out=*/!y_f32);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t f = 0; f < nf; ++f) have[r * nf + f] = got[r * out + feats[f]];
  }
  expect_close(have, want, y_f32 ? kF32Rel : kOneRounding, 0.0, "linear");
}

TEST(CudaLinear, MatchesCpuOnOddShapesBothPaths) {
  K3_REQUIRE_GPU();
  struct Case {
    int64_t in, out;
  };
  // in % 8 != 0 takes the element-wise kernel (1 row) or cuBLASLt; out not a multiple of the 4 features of
  // a CTA (1 row) or of the skinny kernel's 128 (2..64 rows).
  const Case cases[] = {{8, 1}, {40, 7}, {37, 33}, {1000, 100}, {136, 250}, {1, 5}};
  uint64_t seed = 100;
  for (const auto& c : cases) {
    const auto w = random_bf16_values(static_cast<size_t>(c.in * c.out), seed++, 0.5);
    DeviceBuffer dw = upload_bf16(w);
    for (int64_t rows : {1, 2, 3, 5, 9, 64, 65, 100}) {
      check_linear(w, rows, c.in, c.out, false, seed++, dw);
      check_linear(w, rows, c.in, c.out, true, seed++, dw);
    }
  }
}

TEST(CudaLinear, UnalignedActivationsTakeTheElementwiseKernel) {
  K3_REQUIRE_GPU();
  const int64_t rows = 3, in = 64, out = 9;
  const auto w = random_bf16_values(static_cast<size_t>(in * out), 7);
  const auto x = random_bf16_values(static_cast<size_t>(rows * in + 1), 8);
  DeviceBuffer dw = upload_bf16(w), dx = upload_bf16(x), dy(static_cast<size_t>(rows * out) * 2);
  ASSERT_EQ(ops::cuda::linear(ctx(), dx.get<bf16>() + 1, dw.get<bf16>(), dy.get(), false, rows, in, out), 0);
  std::vector<bf16> wb = to_bf16_vec(w);
  std::vector<float> want(static_cast<size_t>(rows * out));
  ops::linear(x.data() + 1, wb.data(), want.data(), rows, in, out);
  expect_close(download_bf16(dy, want.size()), want, kOneRounding, 0.0, "linear unaligned x");
}

TEST(CudaLinear, MatchesCpuOnK3PerRankShapes) {
  K3_REQUIRE_GPU();
  struct Shape {
    int64_t out, in;
    bool f32;
  };
  // TP8 rank shapes: KDA in_proj (6288), q_a (1536), ..., the router (896, FP32 logits).
  const Shape shapes[] = {{6288, 7168, false}, {1536, 7168, false}, {2304, 1536, false}, {7168, 1536, false},
                          {7168, 3584, false}, {3584, 7168, false}, {896, 7168, true}};
  uint64_t seed = 500;
  for (const auto& s : shapes) {
    const auto w = random_bf16_values(static_cast<size_t>(s.out * s.in), seed++, 1.0 / std::sqrt(double(s.in)));
    DeviceBuffer dw = upload_bf16(w);
    for (int64_t rows : {1, 8, 32, 64, 65, 128}) check_linear(w, rows, s.in, s.out, s.f32, seed++, dw);
  }
}

// Skinny GEMM (2..64 rows, ops::cuda::linear_skinny) against a float64 loop written from the math.
//
// Tolerance per output: 2^-16 of the sum of the terms' magnitudes for the FP32 sum (the tensor cores
// truncate each k16 step's sum: at 7168 terms ~2^-20 of it in expectation, under 2^-18 at worst for
// these random inputs), plus for a BF16 output its rounding, at most 2^-8 of |y| (half an ulp). One
// term lost or added moves an output by ~2^-12 of that magnitude sum at in = 7168 (more at smaller in).
struct LinearF64 {
  std::vector<double> y, mag;  // [rows, out]: sum_i x[r, i] w[o, i], sum_i |x[r, i] w[o, i]|
};

LinearF64 linear_f64(const std::vector<float>& x, const std::vector<float>& w, int64_t rows, int64_t in, int64_t out) {
  const auto n = static_cast<size_t>(rows * out);
  LinearF64 ref{std::vector<double>(n), std::vector<double>(n)};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double s = 0, a = 0;
      for (int64_t i = 0; i < in; ++i) {
        const double p = static_cast<double>(x[r * in + i]) * static_cast<double>(w[o * in + i]);
        s += p;
        a += std::fabs(p);
      }
      ref.y[r * out + o] = s;
      ref.mag[r * out + o] = a;
    }
  }
  return ref;
}

// y of one linear_via call as raw bytes (y starts as all-ones bits, NaN in BF16 and FP32: an output
// left unwritten fails the comparison).
std::vector<uint8_t> linear_bytes(const ops::cuda::Context& c, ops::cuda::LinearPath path, const bf16* x,
                                  const DeviceBuffer& dw, int64_t rows, int64_t in, int64_t out, bool y_f32) {
  const size_t bytes = static_cast<size_t>(rows * out) * (y_f32 ? 4 : 2);
  DeviceBuffer dy(bytes);
  CUDA_CHECK(cudaMemsetAsync(dy.get(), 0xff, bytes, stream()));
  EXPECT_EQ(ops::cuda::linear_via(c, path, x, dw.get<bf16>(), dy.get(), y_f32, rows, in, out), 0);
  return download<uint8_t>(dy, bytes);
}

void expect_linear_f64(const std::vector<uint8_t>& got_bytes, bool y_f32, const LinearF64& ref, int64_t out,
                       const char* what) {
  ASSERT_EQ(got_bytes.size(), ref.y.size() * (y_f32 ? 4 : 2)) << what;
  size_t bad = 0, worst = 0;
  double worst_excess = -1, worst_got = 0;
  for (size_t e = 0; e < ref.y.size(); ++e) {
    float got;
    if (y_f32) {
      std::memcpy(&got, got_bytes.data() + 4 * e, 4);
    } else {
      bf16 b;
      std::memcpy(&b.bits, got_bytes.data() + 2 * e, 2);
      got = to_float(b);
    }
    const double tol = (y_f32 ? 0.0 : std::ldexp(std::fabs(ref.y[e]), -8)) + std::ldexp(ref.mag[e], -16);
    const double err = std::fabs(static_cast<double>(got) - ref.y[e]);
    if (!(err <= tol)) {
      ++bad;
      const double excess = std::isnan(err) ? HUGE_VAL : err / std::max(tol, 1e-300);
      if (excess > worst_excess) worst_excess = excess, worst = e, worst_got = got;
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " outputs off, worst at row " << worst / out << " feature "
                     << worst % out << " got " << worst_got << " want " << ref.y[worst] << " (sum of |terms| " << ref.mag[worst] << ")";
}

TEST(CudaLinearSkinny, MatchesFloat64AndRepeatsBitsForEveryRowCountAndSplit) {
  K3_REQUIRE_GPU();
  using ops::cuda::LinearPath;
  struct Shape {
    int64_t out, in;
    bool f32;
  };
  // 40 x 72: one partial feature tile and a partial last K chunk (72 = 64 + 8); 130 x 136: a second
  // tile of 2 features, 3 chunks; 2304 x 1536 (q_b) and 896 x 7168 (the router, FP32 logits): few tiles,
  // split K over many CTAs.
  const Shape shapes[] = {{40, 72, false}, {130, 136, true}, {2304, 1536, false}, {896, 7168, true}};
  // The split follows the workspace: the full one (as many splits as fill the GPU), room for 3 splits'
  // partials, none (one split: the kernel writes y itself).
  struct Variant {
    const char* name;
    int max_splits;  // 0: ctx().workspace as it is
  };
  const Variant variants[] = {{"full workspace", 0}, {"3-split workspace", 3}, {"no workspace", 1}};
  uint64_t seed = 900;
  for (const auto& s : shapes) {
    const auto w = random_bf16_values(static_cast<size_t>(s.out * s.in), seed++, 1.0 / std::sqrt(double(s.in)));
    DeviceBuffer dw = upload_bf16(w);
    for (int64_t rows : {2, 3, 8, 17, 33, 64}) {
      SCOPED_TRACE(testing::Message() << "skinny rows " << rows << " in " << s.in << " out " << s.out
                                      << (s.f32 ? " f32" : " bf16"));
      const auto x = random_bf16_values(static_cast<size_t>(rows * s.in), seed++);
      DeviceBuffer dx = upload_bf16(x);
      const LinearF64 ref = linear_f64(x, w, rows, s.in, s.out);
      std::vector<std::vector<uint8_t>> by_variant;
      for (const auto& v : variants) {
        SCOPED_TRACE(v.name);
        ops::cuda::Context c = ctx();
        if (v.max_splits == 1) {
          c.workspace = nullptr;
          c.workspace_bytes = 0;
        } else if (v.max_splits > 1) {
          c.workspace_bytes = static_cast<size_t>(v.max_splits * rows * s.out) * sizeof(float);
        }
        const auto kernel = linear_bytes(c, LinearPath::Kernel, dx.get<bf16>(), dw, rows, s.in, s.out, s.f32);
        expect_linear_f64(kernel, s.f32, ref, s.out, "kernel path");
        EXPECT_TRUE(kernel == linear_bytes(c, LinearPath::Kernel, dx.get<bf16>(), dw, rows, s.in, s.out, s.f32))
            << "a second run gave other bits";
        // Auto takes the skinny kernel at 2..64 rows once enabled: then the same bits.
        if (ops::cuda::kLinearAutoSkinny)
          EXPECT_TRUE(kernel == linear_bytes(c, LinearPath::Auto, dx.get<bf16>(), dw, rows, s.in, s.out, s.f32))
              << "auto differs from the kernel path";
        by_variant.push_back(kernel);
      }
      // The router's FP32 logits summed in another split order differ in some bits: the split really ran.
      if (s.out == 896) EXPECT_FALSE(by_variant[0] == by_variant[2]) << "full workspace did not split";
    }
  }
}

TEST(CudaLinearSkinny, ShapesItDoesNotTakeFallBack) {
  K3_REQUIRE_GPU();
  using ops::cuda::LinearPath;
  // in % 8 != 0, and x one element off 16-byte alignment: linear_rows_kernel (Kernel) or cuBLASLt (Auto).
  const int64_t rows = 5, out = 70;
  for (const int64_t in : {60, 64}) {
    const bool unaligned = in == 64;
    SCOPED_TRACE(testing::Message() << "in " << in << (unaligned ? " unaligned x" : ""));
    const auto w = random_bf16_values(static_cast<size_t>(out * in), 31);
    const auto xs = random_bf16_values(static_cast<size_t>(rows * in + 1), 32);
    const std::vector<float> x(xs.begin() + (unaligned ? 1 : 0), xs.begin() + (unaligned ? 1 : 0) + rows * in);
    DeviceBuffer dw = upload_bf16(w), dx = upload_bf16(xs);
    const bf16* xp = dx.get<bf16>() + (unaligned ? 1 : 0);
    EXPECT_FALSE(ops::cuda::linear_skinny_fits(rows, in, xp, dw.get<bf16>()));
    const LinearF64 ref = linear_f64(x, w, rows, in, out);
    for (const LinearPath p : {LinearPath::Kernel, LinearPath::Auto}) {
      expect_linear_f64(linear_bytes(ctx(), p, xp, dw, rows, in, out, false), false, ref, out,
                        p == LinearPath::Kernel ? "kernel path" : "auto");
    }
  }
  // The skinny launcher itself refuses them (nothing enqueued), and refuses 1 and 65 rows.
  DeviceBuffer dw(64 * 8 * 2), dx(65 * 64 * 2 + 16), dy(65 * 8 * 4);
  EXPECT_EQ(ops::cuda::linear_skinny(ctx(), dx.get<bf16>(), dw.get<bf16>(), dy.get(), false, 5, 60, 8),
            cudaErrorNotSupported);
  EXPECT_EQ(ops::cuda::linear_skinny(ctx(), dx.get<bf16>() + 1, dw.get<bf16>(), dy.get(), false, 5, 64, 8),
            cudaErrorNotSupported);
  EXPECT_EQ(ops::cuda::linear_skinny(ctx(), dx.get<bf16>(), dw.get<bf16>(), dy.get(), false, 1, 64, 8),
            cudaErrorNotSupported);
  EXPECT_EQ(ops::cuda::linear_skinny(ctx(), dx.get<bf16>(), dw.get<bf16>(), dy.get(), false, 65, 64, 8),
            cudaErrorNotSupported);
}

// ---------------------------------------------------------------------------------------------
// rmsnorm, layernorm

TEST(CudaNorm, RmsnormMatchesCpu) {
  K3_REQUIRE_GPU();
  struct Case {
    int64_t rows, dim;
  };
  const Case cases[] = {{1, 7168}, {5, 3584}, {3, 1536}, {2, 512}, {4, 128}, {3, 100}, {2, 37}, {64, 7168}};
  uint64_t seed = 1000;
  for (const auto& c : cases) {
    SCOPED_TRACE(testing::Message() << "rows " << c.rows << " dim " << c.dim);
    const size_t n = static_cast<size_t>(c.rows * c.dim);
    const auto x = random_bf16_values(n, seed++, 3.0);
    const auto wb = random_bf16_values(static_cast<size_t>(c.dim), seed++, 2.0);
    std::vector<float> wf(static_cast<size_t>(c.dim));
    Rng rng(seed++);
    for (auto& v : wf) v = static_cast<float>(1.0 + 0.3 * rng.normal());
    const float eps = 1e-5f;
    DeviceBuffer dx = upload_bf16(x), dwb = upload_bf16(wb), dwf = upload(wf), dy(n * 2);

    std::vector<bf16> wbb = to_bf16_vec(wb);
    std::vector<float> want(n);
    ops::rmsnorm(x.data(), wbb.data(), want.data(), c.rows, c.dim, eps);
    ASSERT_EQ(ops::cuda::rmsnorm(dx.get<bf16>(), dwb.get<bf16>(), dy.get<bf16>(), c.rows, c.dim, eps, st()), 0);
    expect_close(download_bf16(dy, n), want, kChained, 0.0, "rmsnorm bf16 weight");

    ops::rmsnorm(x.data(), wf.data(), want.data(), c.rows, c.dim, eps);
    ASSERT_EQ(ops::cuda::rmsnorm(dx.get<bf16>(), dwf.get<float>(), dy.get<bf16>(), c.rows, c.dim, eps, st()), 0);
    expect_close(download_bf16(dy, n), want, kChained, 0.0, "rmsnorm f32 weight");

    // In place (out aliases x).
    ASSERT_EQ(ops::cuda::rmsnorm(dx.get<bf16>(), dwf.get<float>(), dx.get<bf16>(), c.rows, c.dim, eps, st()), 0);
    expect_close(download_bf16(dx, n), want, kChained, 0.0, "rmsnorm in place");
  }
}

TEST(CudaNorm, LayernormMatchesCpu) {
  K3_REQUIRE_GPU();
  struct Case {
    int64_t rows, dim;
  };
  const Case cases[] = {{3, 128}, {2, 7168}, {1, 37}, {5, 100}};
  uint64_t seed = 1100;
  for (const auto& c : cases) {
    SCOPED_TRACE(testing::Message() << "rows " << c.rows << " dim " << c.dim);
    const size_t n = static_cast<size_t>(c.rows * c.dim);
    std::vector<float> x = random_bf16_values(n, seed++, 2.0);
    for (auto& v : x) v = round_bf16(v + 0.75f);  // a mean away from zero
    const auto w = random_bf16_values(static_cast<size_t>(c.dim), seed++, 2.0);
    const auto b = random_bf16_values(static_cast<size_t>(c.dim), seed++, 0.5);
    const float eps = 1e-5f;
    std::vector<bf16> wb = to_bf16_vec(w), bb = to_bf16_vec(b);
    std::vector<float> want(n);
    ops::layernorm(x.data(), wb.data(), bb.data(), want.data(), c.rows, c.dim, eps);
    DeviceBuffer dx = upload_bf16(x), dw = upload_bf16(w), db = upload_bf16(b), dy(n * 2);
    ASSERT_EQ(ops::cuda::layernorm(dx.get<bf16>(), dw.get<bf16>(), db.get<bf16>(), dy.get<bf16>(), c.rows, c.dim, eps,
                                   st()),
              0);
    expect_close(download_bf16(dy, n), want, kChained, 0.0, "layernorm");
    ASSERT_EQ(ops::cuda::layernorm(dx.get<bf16>(), dw.get<bf16>(), db.get<bf16>(), dx.get<bf16>(), c.rows, c.dim, eps,
                                   st()),
              0);
    expect_close(download_bf16(dx, n), want, kChained, 0.0, "layernorm in place");
  }
}

// ---------------------------------------------------------------------------------------------
// attn_res

struct AttnResCase {
  int64_t rows, dim;
  bool delta;
  int num_blocks, write_idx;
  bool out_norm;
};

// Runs one attn_res case on the GPU and the CPU: prefix and blocks must match exactly, out within
// the tolerance of its rounding chain.
void check_attn_res(const AttnResCase& c, int max_blocks, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << "rows " << c.rows << " dim " << c.dim << " delta " << c.delta << " blocks "
                                  << c.num_blocks << " write " << c.write_idx << " out_norm " << c.out_norm);
  const size_t n = static_cast<size_t>(c.rows * c.dim), nb = n * max_blocks;
  auto prefix = random_bf16_values(n, seed++, 2.0);
  const auto delta = random_bf16_values(n, seed++, 1.0);
  auto blocks = random_bf16_values(nb, seed++, 2.0);
  const auto norm_w = random_bf16_values(static_cast<size_t>(c.dim), seed++, 1.5);
  const auto proj_w = random_bf16_values(static_cast<size_t>(c.dim), seed++, 4.0 / std::sqrt(double(c.dim)));
  const auto out_w = random_bf16_values(static_cast<size_t>(c.dim), seed++, 1.5);
  DeviceBuffer dp = upload_bf16(prefix), dd = upload_bf16(delta), dbl = upload_bf16(blocks);
  DeviceBuffer dnw = upload_bf16(norm_w), dpw = upload_bf16(proj_w), dow = upload_bf16(out_w), dout(n * 2);

  ops::cuda::AttnResCudaArgs g;
  g.prefix = dp.get<bf16>();
  g.delta = c.delta ? dd.get<bf16>() : nullptr;
  g.blocks = dbl.get<bf16>();
  g.max_blocks = max_blocks;
  g.norm_w = dnw.get<bf16>();
  g.proj_w = dpw.get<bf16>();
  g.out_norm_w = c.out_norm ? dow.get<bf16>() : nullptr;
  g.num_blocks = c.num_blocks;
  g.block_write_idx = c.write_idx;
  g.out = dout.get<bf16>();
  g.rows = c.rows;
  g.dim = c.dim;
  ASSERT_EQ(ops::cuda::attn_res(g, st()), 0);

  std::vector<bf16> nwb = to_bf16_vec(norm_w), pwb = to_bf16_vec(proj_w), owb = to_bf16_vec(out_w);
  std::vector<float> out(n);
  ops::AttnResArgs a;
  a.prefix = prefix.data();
  a.delta = c.delta ? delta.data() : nullptr;
  a.blocks = blocks.data();
  a.max_blocks = max_blocks;
  a.norm_w = nwb.data();
  a.proj_w = pwb.data();
  a.out_norm_w = c.out_norm ? owb.data() : nullptr;
  a.num_blocks = c.num_blocks;
  a.block_write_idx = c.write_idx;
  a.out = out.data();
  a.rows = c.rows;
  a.dim = c.dim;
  ops::attn_res(a);

  EXPECT_EQ(download_bf16(dp, n), prefix) << "prefix";
  EXPECT_EQ(download_bf16(dbl, nb), blocks) << "blocks";
  expect_close(download_bf16(dout, n), out, c.out_norm ? kNormOfChained : kOneRounding, 0.0, "attn_res out");
}

TEST(CudaAttnRes, MatchesCpuInEveryMode) {
  K3_REQUIRE_GPU();
  const int max_blocks = 8;
  const AttnResCase cases[] = {
      {1, 7168, false, 0, 0, true},   // layer 0, before attention
      {3, 7168, true, 3, 3, true},    // layer 36, before attention: the block write is mixed too
      {3, 7168, false, 4, -1, true},  // after attention on a block start (prefix restarted)
      {2, 7168, true, 8, -1, false},  // the final mix: 8 blocks and p, no out norm
      {3, 100, true, 2, 5, true},     // dim % 8 != 0: element-wise kernel
      {2, 136, true, 7, -1, true},
  };
  uint64_t seed = 2000;
  for (const auto& c : cases) {
    check_attn_res(c, max_blocks, seed);
    seed += 6;
  }
}

// The decode row counts at the K3 shape (dim 7168, 8 blocks + p = 9 sources): the kernel splits a row
// over several CTAs at small row counts (a row's slices and its exchanged sums), fewer at 256.
TEST(CudaAttnRes, MatchesCpuAtDecodeRowCounts) {
  K3_REQUIRE_GPU();
  const int max_blocks = 8;
  struct Mode {
    bool delta;
    int num_blocks, write_idx;
    bool out_norm;
  };
  const Mode modes[] = {
      {true, 8, -1, true},    // 9 sources, delta, out norm
      {true, 8, -1, false},   // 9 sources, delta, no out norm (the final mix)
      {false, 8, 2, true},    // no delta, the block write is one of the mixed blocks
      {true, 8, 7, false},    // delta, writes the last mixed block
      {true, 4, 6, true},     // the block write is not a source
      {false, 0, -1, false},  // p alone
  };
  uint64_t seed = 2100;
  for (int64_t rows : {1, 3, 64, 256}) {
    for (const auto& m : modes) {
      check_attn_res({rows, 7168, m.delta, m.num_blocks, m.write_idx, m.out_norm}, max_blocks, seed);
      seed += 6;
    }
  }
  // More sources than one partial-sum pass of the kernel (8) and than a warp's lanes (32): 40 blocks + p.
  for (int64_t rows : {1, 5}) {
    check_attn_res({rows, 7168, true, 40, 17, true}, 48, seed);
    seed += 6;
    check_attn_res({rows, 7168, false, 40, 3, false}, 48, seed);
    seed += 6;
  }
  // Odd dims: a remainder slice, and the element-wise fallback kernel.
  check_attn_res({2, 7000, true, 8, 3, true}, max_blocks, seed);  // 7000 % 8 == 0: 875 chunks
  seed += 6;
  check_attn_res({3, 7001, true, 8, -1, true}, max_blocks, seed);  // element-wise
  seed += 6;
  // Many rows: fewer CTAs per row (2 and 1 on an H200), several chunks per thread at 1.
  check_attn_res({700, 7168, true, 3, 1, true}, 4, seed);
  seed += 6;
  check_attn_res({1100, 7168, true, 0, 0, true}, 1, seed);
  seed += 6;
  // Slices too large for shared memory even at 8 CTAs per row: the vectorized fallback kernel.
  check_attn_res({3, 65536, true, 40, 17, true}, 48, seed);
}

// ---------------------------------------------------------------------------------------------
// embedding

TEST(CudaEmbedding, CopiesRowsExactly) {
  K3_REQUIRE_GPU();
  struct Case {
    int64_t vocab, dim, rows;
  };
  const Case cases[] = {{1000, 7168, 5}, {50, 37, 4}, {3, 8, 7}};
  uint64_t seed = 3000;
  for (const auto& c : cases) {
    const auto table = random_bf16_values(static_cast<size_t>(c.vocab * c.dim), seed++);
    Rng rng(seed++);
    std::vector<int32_t> ids(static_cast<size_t>(c.rows));
    for (auto& id : ids) id = static_cast<int32_t>(rng.below(static_cast<uint64_t>(c.vocab)));
    ids[0] = 0;
    ids.back() = static_cast<int32_t>(c.vocab - 1);
    std::vector<bf16> tb = to_bf16_vec(table);
    std::vector<float> want(static_cast<size_t>(c.rows * c.dim));
    ops::embedding(ids.data(), c.rows, tb.data(), c.vocab, c.dim, want.data());
    DeviceBuffer dids = upload(ids), dt = upload(tb), dout(want.size() * 2);
    ASSERT_EQ(ops::cuda::embedding(dids.get<int32_t>(), c.rows, dt.get<bf16>(), c.vocab, c.dim, dout.get<bf16>(), st()),
              0);
    EXPECT_EQ(download_bf16(dout, want.size()), want) << "vocab " << c.vocab << " dim " << c.dim;
  }
}

// ---------------------------------------------------------------------------------------------
// MoE: situ_glu, mxfp4_linear, expert_mlp, mlp, moe_experts

const ops::SituParams kSitu{4.0f, 25.0f};

TEST(CudaMoe, SituGluMatchesCpu) {
  K3_REQUIRE_GPU();
  for (int64_t n : {1, 7, 1000, 3 * 3072}) {
    const auto a = random_bf16_values(static_cast<size_t>(n), 4000 + n, 8.0);
    const auto b = random_bf16_values(static_cast<size_t>(n), 5000 + n, 40.0);
    std::vector<float> want(static_cast<size_t>(n));
    ops::situ_glu(a.data(), b.data(), want.data(), n, kSitu);
    DeviceBuffer da = upload_bf16(a), db = upload_bf16(b), dout(static_cast<size_t>(n) * 2);
    ASSERT_EQ(ops::cuda::situ_glu(da.get<bf16>(), db.get<bf16>(), dout.get<bf16>(), n, kSitu, st()), 0);
    expect_close(download_bf16(dout, want.size()), want, kOneRounding, 0.0, "situ_glu");
    // out aliasing a
    ASSERT_EQ(ops::cuda::situ_glu(da.get<bf16>(), db.get<bf16>(), da.get<bf16>(), n, kSitu, st()), 0);
    expect_close(download_bf16(da, want.size()), want, kOneRounding, 0.0, "situ_glu in place");
  }
}

struct Mxfp4Host {
  int64_t N = 0, K = 0;
  std::vector<uint8_t> packed, scale;
  ops::Mxfp4Matrix view() const { return {packed.data(), scale.data()}; }
};

// Random codes (every nibble, both signs); scales 2^(smin - 127) .. 2^(smax - 127).
Mxfp4Host random_mxfp4(int64_t N, int64_t K, uint64_t seed, int smin = 118, int smax = 123) {
  Mxfp4Host m;
  m.N = N;
  m.K = K;
  m.packed.resize(static_cast<size_t>(N * K / 2));
  m.scale.resize(static_cast<size_t>(N * K / 32));
  Rng rng(seed);
  for (size_t i = 0; i < m.packed.size(); i += 8) {
    const uint64_t v = rng.next_u64();
    for (size_t j = 0; j < 8 && i + j < m.packed.size(); ++j) m.packed[i + j] = static_cast<uint8_t>(v >> (8 * j));
  }
  for (auto& s : m.scale) s = static_cast<uint8_t>(smin + static_cast<int>(rng.below(smax - smin + 1)));
  return m;
}

struct Mxfp4Device {
  DeviceBuffer packed, scale;
  explicit Mxfp4Device(const Mxfp4Host& h) : packed(upload(h.packed)), scale(upload(h.scale)) {}
  ops::Mxfp4Matrix view() const { return {packed.get<uint8_t>(), scale.get<uint8_t>()}; }
};

TEST(CudaMoe, Mxfp4LinearDecodesEveryCodeExactly) {
  K3_REQUIRE_GPU();
  // W [1, 32]: the 16 codes twice; x one-hot per row, so y[r] = W[0, r] exactly (no sums).
  for (int s : {0, 1, 64, 127, 130, 200}) {
    Mxfp4Host m;
    m.N = 1;
    m.K = 32;
    for (int i = 0; i < 16; ++i) m.packed.push_back(static_cast<uint8_t>((2 * i % 16) | (((2 * i + 1) % 16) << 4)));
    m.scale.push_back(static_cast<uint8_t>(s));
    std::vector<float> x(32 * 32, 0.f);
    for (int r = 0; r < 32; ++r) x[r * 32 + r] = 1.f;
    Mxfp4Device d(m);
    DeviceBuffer dx = upload_bf16(x), dy(32 * 2);
    ASSERT_EQ(ops::cuda::mxfp4_linear(dx.get<bf16>(), d.packed.get<uint8_t>(), d.scale.get<uint8_t>(), dy.get<bf16>(),
                                      32, 32, 1, st()),
              0);
    std::vector<float> want(32);
    ops::mxfp4_linear(x.data(), m.packed.data(), m.scale.data(), want.data(), 32, 32, 1);
    for (int r = 0; r < 32; ++r) ASSERT_EQ(want[r], round_bf16(mxfp4_at(m.packed.data(), m.scale.data(), 32, 0, r)));
    EXPECT_EQ(download_bf16(dy, 32), want) << "scale byte " << s;
  }
}

TEST(CudaMoe, Mxfp4LinearMatchesCpu) {
  K3_REQUIRE_GPU();
  struct Case {
    int64_t rows, K, N;
  };
  const Case cases[] = {{1, 32, 1}, {3, 96, 7}, {5, 3584, 100}, {9, 3072, 33}, {1, 3584, 3072}, {2, 3072, 3584}};
  uint64_t seed = 6000;
  for (const auto& c : cases) {
    SCOPED_TRACE(testing::Message() << "rows " << c.rows << " K " << c.K << " N " << c.N);
    const Mxfp4Host m = random_mxfp4(c.N, c.K, seed++);
    const auto x = random_bf16_values(static_cast<size_t>(c.rows * c.K), seed++);
    std::vector<float> want(static_cast<size_t>(c.rows * c.N));
    ops::mxfp4_linear(x.data(), m.packed.data(), m.scale.data(), want.data(), c.rows, c.K, c.N);
    Mxfp4Device d(m);
    DeviceBuffer dx = upload_bf16(x), dy(want.size() * 2);
    ASSERT_EQ(ops::cuda::mxfp4_linear(dx.get<bf16>(), d.packed.get<uint8_t>(), d.scale.get<uint8_t>(), dy.get<bf16>(),
                                      c.rows, c.K, c.N, st()),
              0);
    expect_close(download_bf16(dy, want.size()), want, kOneRounding, 0.0, "mxfp4_linear");

    // Packed weights at an odd address: the byte-wise load path.
    std::vector<uint8_t> shifted(m.packed.size() + 1);
    std::copy(m.packed.begin(), m.packed.end(), shifted.begin() + 1);
    DeviceBuffer dsh = upload(shifted);
    ASSERT_EQ(ops::cuda::mxfp4_linear(dx.get<bf16>(), dsh.get<uint8_t>() + 1, d.scale.get<uint8_t>(), dy.get<bf16>(),
                                      c.rows, c.K, c.N, st()),
              0);
    expect_close(download_bf16(dy, want.size()), want, kOneRounding, 0.0, "mxfp4_linear unaligned packed");
  }
}

TEST(CudaMoe, ExpertMlpMatchesCpu) {
  K3_REQUIRE_GPU();
  struct Case {
    int64_t rows, D, I;
  };
  const Case cases[] = {{1, 64, 96}, {4, 256, 128}, {2, 3584, 3072}};
  uint64_t seed = 7000;
  for (const auto& c : cases) {
    SCOPED_TRACE(testing::Message() << "rows " << c.rows << " D " << c.D << " I " << c.I);
    const Mxfp4Host w1 = random_mxfp4(c.I, c.D, seed++), w3 = random_mxfp4(c.I, c.D, seed++);
    const Mxfp4Host w2 = random_mxfp4(c.D, c.I, seed++);
    const auto z = random_bf16_values(static_cast<size_t>(c.rows * c.D), seed++);
    std::vector<float> want(static_cast<size_t>(c.rows * c.D)), scratch(static_cast<size_t>(2 * c.rows * c.I));
    ops::expert_mlp(z.data(), w1.view(), w3.view(), w2.view(), want.data(), c.rows, c.D, c.I, kSitu, scratch.data());
    Mxfp4Device d1(w1), d3(w3), d2(w2);
    DeviceBuffer dz = upload_bf16(z), dout(want.size() * 2), dscr(scratch.size() * 2);
    ASSERT_EQ(ops::cuda::expert_mlp(dz.get<bf16>(), d1.view(), d3.view(), d2.view(), dout.get<bf16>(), c.rows, c.D, c.I,
                                    kSitu, dscr.get<bf16>(), st()),
              0);
    expect_close(download_bf16(dout, want.size()), want, kChained, 0.0, "expert_mlp");
  }
}

TEST(CudaMoe, MlpMatchesCpu) {
  K3_REQUIRE_GPU();
  struct Case {
    int64_t rows, D, I;
  };
  // (5, 100, 36): D % 8 != 0 (element-wise kernel); 65 and 128 rows: the cuBLASLt path.
  const Case cases[] = {{1, 256, 384}, {5, 100, 36}, {64, 512, 256}, {65, 256, 128}, {128, 7168, 256}};
  uint64_t seed = 8000;
  for (const auto& c : cases) {
    SCOPED_TRACE(testing::Message() << "rows " << c.rows << " D " << c.D << " I " << c.I);
    const auto x = random_bf16_values(static_cast<size_t>(c.rows * c.D), seed++);
    const auto wg = random_bf16_values(static_cast<size_t>(c.I * c.D), seed++, 2.0 / std::sqrt(double(c.D)));
    const auto wu = random_bf16_values(static_cast<size_t>(c.I * c.D), seed++, 2.0 / std::sqrt(double(c.D)));
    const auto wd = random_bf16_values(static_cast<size_t>(c.D * c.I), seed++, 2.0 / std::sqrt(double(c.I)));
    std::vector<bf16> wgb = to_bf16_vec(wg), wub = to_bf16_vec(wu), wdb = to_bf16_vec(wd);
    std::vector<float> want(static_cast<size_t>(c.rows * c.D)), scratch(static_cast<size_t>(2 * c.rows * c.I));
    ops::mlp(x.data(), wgb.data(), wub.data(), wdb.data(), want.data(), c.rows, c.D, c.I, kSitu, scratch.data());
    DeviceBuffer dx = upload_bf16(x), dg = upload(wgb), du = upload(wub), dd = upload(wdb);
    DeviceBuffer dout(want.size() * 2), dscr(scratch.size() * 2);
    ASSERT_EQ(ops::cuda::mlp(ctx(), dx.get<bf16>(), dg.get<bf16>(), du.get<bf16>(), dd.get<bf16>(), dout.get<bf16>(),
                             c.rows, c.D, c.I, kSitu, dscr.get<bf16>()),
              0);
    expect_close(download_bf16(dout, want.size()), want, kChained, 0.0, "mlp");
  }
}

// The routed experts of one rank against the CPU model's recipe (layers.cpp moe_ffn): each local expert
// runs ops::expert_mlp on the rows that chose it, then every row sums w * output over its local j in order.
struct MoeCase {
  int64_t rows;
  int k;
  int64_t L, I;
  int num_experts, expert_begin, expert_count;
  int max_local_per_row;  // each row takes 0..max of its k experts from the local range
};

void check_moe_experts(const MoeCase& c, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << "rows " << c.rows << " k " << c.k << " L " << c.L << " I " << c.I
                                  << " local " << c.expert_count);
  Rng rng(seed);
  const int64_t pairs = c.rows * c.k;
  // Routing: k distinct experts per row, 1..max_local_per_row of them local (row 0 none when rows > 1 and
  // some experts are remote; all when every expert is local).
  std::vector<int32_t> idx(static_cast<size_t>(pairs));
  std::vector<float> w(static_cast<size_t>(pairs));
  const bool all_local = c.expert_count == c.num_experts;
  const bool empty_row0 = !all_local && c.rows > 1;
  for (int64_t r = 0; r < c.rows; ++r) {
    const int want_local = all_local    ? c.k
                           : r == 0 && empty_row0 ? 0
                                                  : std::min<int>(c.k, 1 + static_cast<int>(rng.below(c.max_local_per_row)));
    std::vector<int32_t> chosen;
    while (static_cast<int>(chosen.size()) < c.k) {
      const bool local = static_cast<int>(chosen.size()) < want_local;
      int32_t e;
      if (local) {
        e = c.expert_begin + static_cast<int32_t>(rng.below(c.expert_count));
      } else {
        e = static_cast<int32_t>(rng.below(c.num_experts - c.expert_count));
        if (e >= c.expert_begin) e += c.expert_count;  // outside the local range
      }
      if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
    }
    for (int j = c.k - 1; j > 0; --j) std::swap(chosen[j], chosen[rng.below(j + 1)]);  // local ones anywhere
    for (int j = 0; j < c.k; ++j) {
      idx[r * c.k + j] = chosen[j];
      w[r * c.k + j] = static_cast<float>(rng.uniform(0.02, 0.3));
    }
  }
  const auto z = random_bf16_values(static_cast<size_t>(c.rows * c.L), seed + 1);
  std::vector<Mxfp4Host> w1, w3, w2;
  for (int e = 0; e < c.expert_count; ++e) {
    w1.push_back(random_mxfp4(c.I, c.L, seed + 10 + 3 * e));
    w3.push_back(random_mxfp4(c.I, c.L, seed + 11 + 3 * e));
    w2.push_back(random_mxfp4(c.L, c.I, seed + 12 + 3 * e));
  }

  // CPU: each local expert on its rows (pair order), then the combine in j order.
  std::vector<float> expert_out(static_cast<size_t>(pairs * c.L), 0.f);
  for (int e = 0; e < c.expert_count; ++e) {
    std::vector<int64_t> members;
    for (int64_t p = 0; p < pairs; ++p)
      if (idx[p] == c.expert_begin + e) members.push_back(p);
    if (members.empty()) continue;
    const auto n = static_cast<int64_t>(members.size());
    std::vector<float> zin(static_cast<size_t>(n * c.L)), zout(zin.size()), scratch(static_cast<size_t>(2 * n * c.I));
    for (int64_t j = 0; j < n; ++j) std::copy_n(&z[(members[j] / c.k) * c.L], c.L, &zin[j * c.L]);
    ops::expert_mlp(zin.data(), w1[e].view(), w3[e].view(), w2[e].view(), zout.data(), n, c.L, c.I, kSitu,
                    scratch.data());
    for (int64_t j = 0; j < n; ++j) std::copy_n(&zout[j * c.L], c.L, &expert_out[members[j] * c.L]);
  }
  std::vector<float> want(static_cast<size_t>(c.rows * c.L), 0.f);
  double weighted_max = 0;  // max over rows of sum_j w |expert output|: the scale the ulps of the outputs move
  for (int64_t r = 0; r < c.rows; ++r) {
    double row_scale = 0;
    for (int j = 0; j < c.k; ++j) {
      const int64_t p = r * c.k + j;
      if (idx[p] < c.expert_begin || idx[p] >= c.expert_begin + c.expert_count) continue;
      double omax = 0;
      for (int64_t i = 0; i < c.L; ++i) {
        want[r * c.L + i] += w[p] * expert_out[p * c.L + i];
        omax = std::max(omax, std::fabs(double(expert_out[p * c.L + i])));
      }
      row_scale += w[p] * omax;
    }
    weighted_max = std::max(weighted_max, row_scale);
  }
  round_bf16_inplace(want.data(), static_cast<int64_t>(want.size()));

  // GPU: all experts' tensors in one allocation, the pointer tables beside.
  const size_t b1 = w1[0].packed.size(), s1 = w1[0].scale.size(), b2 = w2[0].packed.size(), s2 = w2[0].scale.size();
  const size_t per_expert = 2 * (b1 + s1) + b2 + s2;
  std::vector<uint8_t> blob(per_expert * c.expert_count);
  std::vector<size_t> off1(c.expert_count), off1s(c.expert_count), off3(c.expert_count), off3s(c.expert_count),
      off2(c.expert_count), off2s(c.expert_count);
  for (int e = 0; e < c.expert_count; ++e) {
    size_t at = per_expert * e;
    const auto put = [&](const std::vector<uint8_t>& v, size_t& off) {
      off = at;
      std::copy(v.begin(), v.end(), blob.begin() + static_cast<int64_t>(at));
      at += v.size();
    };
    put(w1[e].packed, off1[e]);
    put(w1[e].scale, off1s[e]);
    put(w3[e].packed, off3[e]);
    put(w3[e].scale, off3s[e]);
    put(w2[e].packed, off2[e]);
    put(w2[e].scale, off2s[e]);
  }
  DeviceBuffer dblob = upload(blob);
  const auto table = [&](const std::vector<size_t>& off) {
    std::vector<const uint8_t*> p(off.size());
    for (size_t i = 0; i < off.size(); ++i) p[i] = dblob.get<uint8_t>() + off[i];
    return upload(p);
  };
  DeviceBuffer t1 = table(off1), t1s = table(off1s), t3 = table(off3), t3s = table(off3s), t2 = table(off2),
               t2s = table(off2s);
  ops::cuda::Mxfp4ExpertTable ex;
  ex.w1_packed = t1.get<const uint8_t*>();
  ex.w1_scale = t1s.get<const uint8_t*>();
  ex.w3_packed = t3.get<const uint8_t*>();
  ex.w3_scale = t3s.get<const uint8_t*>();
  ex.w2_packed = t2.get<const uint8_t*>();
  ex.w2_scale = t2s.get<const uint8_t*>();
  DeviceBuffer dz = upload_bf16(z), didx = upload(idx), dw = upload(w), dy(want.size() * 2);
  DeviceBuffer dscr(ops::cuda::moe_experts_scratch_bytes(c.rows, c.k, c.L, c.I));
  ASSERT_EQ(ops::cuda::moe_experts(ctx(), dz.get<bf16>(), didx.get<int32_t>(), dw.get<float>(), ex, c.expert_begin,
                                   c.expert_count, dy.get<bf16>(), dscr.get(), c.rows, c.k, c.L, c.I, kSitu),
            0);
  const auto got = download_bf16(dy, want.size());
  // Each expert output may sit kChained of its own scale off; the sum rounds once more.
  expect_close(got, want, kOneRounding, kChained * weighted_max, "moe_experts");
  if (empty_row0) {
    for (int64_t i = 0; i < c.L; ++i) ASSERT_EQ(got[i], 0.f) << "row 0 has no local expert";
  }
}

TEST(CudaMoe, MoeExpertsMatchesCpuSmall) {
  K3_REQUIRE_GPU();
  // 16 experts, 8 local ([4, 12)): many pairs per expert, so pair tiles of several rows.
  for (int64_t rows : {1, 7, 33}) check_moe_experts({rows, 4, 64, 96, 16, 4, 8, 4}, 9000 + rows);
  // Every expert local, a non-power-of-two k.
  check_moe_experts({5, 3, 96, 64, 6, 0, 6, 3}, 9100);
  // 96 pairs on each of 4 experts: several passes of 24 tokens; K = 96 and 160 end inside a 128-value
  // chunk; 10 and 3 row tiles leave warps of a CTA idle.
  check_moe_experts({96, 4, 96, 160, 4, 0, 4, 4}, 9150);
  // 12 pairs per expert: two token tiles per pass.
  check_moe_experts({24, 2, 64, 96, 4, 0, 4, 2}, 9160);
}

TEST(CudaMoe, MoeExpertsMatchesCpuWholeChunks) {
  K3_REQUIRE_GPU();
  // K a multiple of 128 both ways (every chunk whole, as at the K3 shapes). 96 pairs per expert: 4 passes
  // of 24 tokens; UP 24 row tiles, DOWN 8.
  check_moe_experts({96, 4, 256, 384, 4, 0, 4, 4}, 9300);
  // 12 pairs per expert (two token tiles per pass); DOWN 4 row tiles.
  check_moe_experts({24, 2, 128, 256, 4, 0, 4, 2}, 9310);
  // 6 experts x 192 UP row tiles, more than one CTA range per slot; 32 pairs per expert: 2 passes.
  check_moe_experts({64, 3, 256, 3072, 6, 0, 6, 3}, 9320);
  // 2 pairs per expert (split K): 8 experts x 192 UP row tiles, more items than one wave of CTAs (teams of
  // 4 warps); DOWN 8 x 16 items (teams of 8).
  check_moe_experts({8, 2, 512, 3072, 8, 0, 8, 2}, 9330);
}

TEST(CudaMoe, MoeExpertsRejectsBadArguments) {
  K3_REQUIRE_GPU();
  const int64_t rows = 2, L = 64, I = 32;
  DeviceBuffer z(rows * L * 2), y(rows * L * 2 + 16), idx(rows * 4), w(rows * 4),
      scr(ops::cuda::moe_experts_scratch_bytes(rows, 1, L, I));
  const ops::cuda::Mxfp4ExpertTable ex;  // never read: every call below fails its checks first
  const auto call = [&](bf16* out, int64_t l) {
    return ops::cuda::moe_experts(ctx(), z.get<bf16>(), idx.get<int32_t>(), w.get<float>(), ex, 0, 1, out, scr.get(),
                                  rows, 1, l, I, kSitu);
  };
  EXPECT_EQ(call(y.get<bf16>() + 1, L), static_cast<int>(cudaErrorMisalignedAddress)) << "y 2 bytes off 16";
  EXPECT_EQ(call(y.get<bf16>(), 48), static_cast<int>(cudaErrorInvalidValue)) << "L not a multiple of 32";
}

TEST(CudaMoe, MoeExpertsMatchesCpuK3RankSlice) {
  K3_REQUIRE_GPU();
  // EP32: 28 of 896 experts (ids [280, 308)), k = 16, L = 3584, I = 3072.
  check_moe_experts({1, 16, 3584, 3072, 896, 280, 28, 2}, 9200);
  check_moe_experts({64, 16, 3584, 3072, 896, 280, 28, 3}, 9201);
}

// ---------------------------------------------------------------------------------------------
// router

// Logits (and bias) whose biased scores are, per row, a permutation of evenly spaced values (0.8 / E
// apart, far above FP32 rounding), so the selection is unambiguous for any correctly rounded-ish expf.
void margin_inputs(int64_t T, int E, bool with_bias, uint64_t seed, std::vector<float>& logits,
                   std::vector<float>& bias) {
  Rng rng(seed);
  logits.resize(static_cast<size_t>(T * E));
  bias.assign(static_cast<size_t>(E), 0.f);
  if (with_bias) {
    for (auto& b : bias) b = static_cast<float>(rng.uniform(-0.05, 0.05));
  }
  std::vector<int> perm(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    for (int i = E - 1; i > 0; --i) std::swap(perm[i], perm[rng.below(i + 1)]);
    for (int e = 0; e < E; ++e) {
      const double s = 0.1 + 0.8 * perm[e] / E - bias[e];  // s + bias is the spaced target
      logits[t * E + e] = static_cast<float>(std::log(s / (1 - s)));
    }
  }
}

void check_route(const std::vector<float>& logits, const std::vector<float>* bias, int64_t T, int E, int k, bool renorm,
                 float scale, const char* what) {
  SCOPED_TRACE(testing::Message() << what << ": T " << T << " E " << E << " k " << k << " renorm " << renorm
                                  << " bias " << (bias != nullptr));
  std::vector<int32_t> idx(static_cast<size_t>(T * k));
  std::vector<float> w(idx.size());
  ops::route(logits.data(), bias ? bias->data() : nullptr, T, E, k, renorm, scale, idx.data(), w.data());
  DeviceBuffer dl = upload(logits), db = bias ? upload(*bias) : DeviceBuffer(), di(idx.size() * 4), dw(w.size() * 4);
  ASSERT_EQ(ops::cuda::route(dl.get<float>(), bias ? db.get<float>() : nullptr, T, E, k, renorm, scale,
                             di.get<int32_t>(), dw.get<float>(), st()),
            0);
  EXPECT_EQ(download<int32_t>(di, idx.size()), idx);
  expect_close(download<float>(dw, w.size()), w, kF32Rel, 0.0, "route weights");
}

TEST(CudaRouter, MatchesCpuSelectionAndWeights) {
  K3_REQUIRE_GPU();
  struct Case {
    int64_t T;
    int E, k;
  };
  // The network path (k <= 32, E <= 4096) with lists of 16 (k <= 16) and of 32, one warp (E <= 128) and
  // many, E = 1, k = E, E = 4096 (32 warps); the round path for k > 32 or E > 4096 (up to the limit).
  const Case cases[] = {{1, 8, 1},     {2, 1, 1},     {5, 64, 6},     {3, 32, 32},   {3, 33, 33},
                        {7, 100, 7},   {4, 100, 20},  {1, 896, 16},   {64, 896, 16}, {4, 896, 32},
                        {5, 1000, 16}, {2, 4096, 32}, {2, 4097, 16},  {9, 2000, 40}, {1, 12032, 16}};
  uint64_t seed = 10000;
  for (const auto& c : cases) {
    for (bool with_bias : {false, true}) {
      std::vector<float> logits, bias;
      margin_inputs(c.T, c.E, with_bias, seed++, logits, bias);
      for (bool renorm : {true, false}) {
        check_route(logits, with_bias ? &bias : nullptr, c.T, c.E, c.k, renorm, 2.827f, "margins");
      }
    }
  }
}

TEST(CudaRouter, TiesGoToTheLowerIndexAndNanNeverWins) {
  K3_REQUIRE_GPU();
  const int E = 96;
  const int64_t T = 5;
  std::vector<float> logits(static_cast<size_t>(T * E));
  for (int e = 0; e < E; ++e) {
    logits[e] = 0.25f;                                              // row 0: all equal
    logits[E + e] = 0.1f * static_cast<float>(e % 5);               // row 1: groups of equal scores
    logits[2 * E + e] = e == 0 || e == 50 ? NAN : 0.01f * e;        // row 2: NaNs
    logits[3 * E + e] = e % 4 == 1 ? INFINITY : -INFINITY;          // row 3: s exactly 1 or 0, many ties
    logits[4 * E + e] = e % 2 == 0 ? -INFINITY : NAN;               // row 4: s = 0 ties above NaN's -inf
  }
  std::vector<float> bias(static_cast<size_t>(E));
  for (int e = 0; e < E; ++e) bias[e] = (e % 3 == 0) ? 0.5f : 0.f;  // the bias steers ties too
  // k = 16 and 32: the network's two list sizes; k = 48: the round path.
  for (int k : {16, 32, 48}) {
    check_route(logits, nullptr, T, E, k, true, 1.0f, "ties");
    check_route(logits, &bias, T, E, k, true, 1.0f, "ties with bias");
  }
}

// ---------------------------------------------------------------------------------------------
// greedy sampling

TEST(CudaSampling, GreedyMatchesCpuExactly) {
  K3_REQUIRE_GPU();
  const int64_t rows = 4;
  uint64_t seed = 11000;
  for (int64_t vocab : {1, 7, 1000, 20480, 20481, 163840}) {
    SCOPED_TRACE(testing::Message() << "vocab " << vocab);
    Rng rng(seed++);
    std::vector<float> logits(static_cast<size_t>(rows * vocab));
    for (auto& v : logits) v = static_cast<float>(rng.normal() * 3.0);
    if (vocab > 2) {
      // Row 1: the maximum twice (the lower id wins); row 2: NaN at id 0 (the CPU keeps id 0);
      // row 3: NaNs and -inf elsewhere, the maximum near the end.
      const int64_t a = vocab / 3, b = vocab - 2;
      logits[vocab + a] = logits[vocab + b] = 100.f;
      logits[2 * vocab] = NAN;
      logits[3 * vocab + 1] = NAN;
      logits[3 * vocab + 2] = -INFINITY;
      logits[3 * vocab + vocab - 1] = 50.f;
    }
    std::vector<int32_t> want(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) want[r] = ops::sample_greedy(logits.data() + r * vocab, vocab);
    DeviceBuffer dl = upload(logits), dout(static_cast<size_t>(rows) * 4);
    ASSERT_EQ(ops::cuda::sample_greedy(dl.get<float>(), rows, vocab, dout.get<int32_t>(), st()), 0);
    EXPECT_EQ(download<int32_t>(dout, want.size()), want);
    // An odd row offset: the scalar path.
    if (vocab % 4 == 0 && vocab > 4) {
      ASSERT_EQ(ops::cuda::sample_greedy(dl.get<float>() + 1, 1, vocab - 1, dout.get<int32_t>(), st()), 0);
      EXPECT_EQ(download<int32_t>(dout, 1)[0], ops::sample_greedy(logits.data() + 1, vocab - 1));
    }
  }
}

}  // namespace
}  // namespace k3
