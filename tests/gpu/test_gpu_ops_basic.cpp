// GPU tests of the basic CUDA ops, each against its CPU reference on random inputs (fixed seeds): linear
// (every path, the K3 per-rank shapes; the skinny kernel against a float64 loop; projection groups bitwise
// against the separate calls), rmsnorm / layernorm, attn_res, embedding, sample_rows (the CPU tests:
// tests/test_ops_basic.cpp).
//
// Tolerances come from the output dtype. BF16 keeps 8 significant bits: an FP32 result that the GPU
// sums in another order rounds to the CPU's value or a neighbour, at most one ulp apart, and one ulp
// is at most 2^-7 of the largest output (kOneRounding). A BF16 result computed from BF16 intermediates
// that may each sit one ulp off moves by up to one more ulp (kChained); an RMSNorm of such a result
// (attn_res's mix) by one more (kNormOfChained). FP32 results: 1e-4 relative.
// Indices (greedy, embedding) and copies (attn_res's prefix and blocks) must match exactly.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <cstdlib>
#include <cstdio>
#include <numeric>
#include <utility>
#include <vector>

#include "gpu_test_util.h"
#include "ops/attn_res.h"
#include "ops/embedding.h"
#include "ops/linear.h"
#include "ops/rmsnorm.h"
#include "ops/sampling.h"

namespace k3 {
namespace {

using namespace gputest;

// The output features a linear test compares with the CPU: all of them (small shapes), else the first and last
// 64 and 128 spread between.
std::vector<int64_t> checked_features(bool small, int64_t out) {
  std::vector<int64_t> feats;
  if (small || out <= 256) {
    feats.resize(static_cast<size_t>(out));
    std::iota(feats.begin(), feats.end(), 0);
  } else {
    for (int64_t o = 0; o < 64; ++o) feats.push_back(o);
    for (int64_t i = 0; i < 128; ++i) feats.push_back(64 + (out - 128) * i / 128);
    for (int64_t o = out - 64; o < out; ++o) feats.push_back(o);
  }
  return feats;
}

constexpr double kNormOfChained = 3 * kBf16Ulp;
constexpr double kF32Rel = 1e-4;


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

  const std::vector<int64_t> feats = checked_features(rows * in * out <= (int64_t{1} << 27), out);
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

// linear_ld: x's rows x_ld apart (KDA's f_b reads f_a in place from the packed projection). Every path on
// the strided rows against the CPU on the compacted rows; at 1 row Auto gives linear()'s bits on the
// compacted rows (the same kernel).
TEST(CudaLinear, StridedRowsMatchTheCompactedRows) {
  K3_REQUIRE_GPU();
  struct Case {
    int64_t in, out, x_ld;
  };
  // KDA's f_b at K3 TP8 (d 128 -> 1536 of the 6288-wide projection), an unaligned stride, odd in.
  const Case cases[] = {{128, 1536, 6288}, {64, 40, 64 + 3}, {37, 33, 50}};
  uint64_t seed = 900;
  for (const auto& c : cases) {
    const auto w = random_bf16_values(static_cast<size_t>(c.in * c.out), seed++, 0.5);
    DeviceBuffer dw = upload_bf16(w);
    for (int64_t rows : {1, 2, 5, 64, 65}) {
      SCOPED_TRACE(testing::Message() << "linear_ld rows " << rows << " in " << c.in << " out " << c.out << " x_ld "
                                      << c.x_ld);
      const auto xs = random_bf16_values(static_cast<size_t>(rows * c.x_ld), seed++);
      std::vector<float> xc(static_cast<size_t>(rows * c.in));
      for (int64_t r = 0; r < rows; ++r) std::copy_n(&xs[r * c.x_ld], c.in, &xc[r * c.in]);
      std::vector<float> want(static_cast<size_t>(rows * c.out));
      const std::vector<bf16> wb = to_bf16_vec(w);
      ops::linear(xc.data(), wb.data(), want.data(), rows, c.in, c.out);
      DeviceBuffer dxs = upload_bf16(xs), dxc = upload_bf16(xc);
      const size_t bytes = static_cast<size_t>(rows * c.out) * 2;
      for (auto path : {ops::cuda::LinearPath::Auto, ops::cuda::LinearPath::Kernel, ops::cuda::LinearPath::Rows,
                        ops::cuda::LinearPath::CublasLt, ops::cuda::LinearPath::RowsTc}) {
        DeviceBuffer dy(bytes);
        ASSERT_EQ(ops::cuda::linear_ld_via(ctx(), path, dxs.get<bf16>(), c.x_ld, dw.get<bf16>(), dy.get(), false,
                                           rows, c.in, c.out),
                  0);
        expect_close(download_bf16(dy, want.size()), want, kOneRounding, 0.0, "linear_ld");
        if (path == ops::cuda::LinearPath::Auto && rows == 1) {
          DeviceBuffer dyc(bytes);
          ASSERT_EQ(ops::cuda::linear(ctx(), dxc.get<bf16>(), dw.get<bf16>(), dyc.get(), false, rows, c.in, c.out), 0);
          EXPECT_EQ(download<uint16_t>(dy, want.size()), download<uint16_t>(dyc, want.size()))
              << "1 row: linear()'s bits";
        }
      }
    }
  }
  DeviceBuffer dummy(64);
  EXPECT_NE(ops::cuda::linear_ld(ctx(), dummy.get<bf16>(), 7, dummy.get<bf16>(), dummy.get(), false, 1, 8, 1), 0)
      << "x_ld < in";
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

// linear_add (y = bf16(x W^T + y), rounded once) on every path against the CPU linear_add, y starting as
// random BF16 values as large as the products (an add left out, or y read after being written, fails):
// odd shapes and the MoE's latent up at the rank's shape (7168 x 3584), 1 to 100 rows.
TEST(CudaLinear, AddMatchesCpuOnEveryPath) {
  K3_REQUIRE_GPU();
  using ops::cuda::LinearPath;
  struct Case {
    int64_t in, out;
  };
  const Case cases[] = {{37, 33}, {136, 250}, {3584, 7168}};
  uint64_t seed = 900;
  for (const auto& c : cases) {
    const auto w = random_bf16_values(static_cast<size_t>(c.in * c.out), seed++, 1.0 / std::sqrt(double(c.in)));
    DeviceBuffer dw = upload_bf16(w);
    const std::vector<bf16> wb = to_bf16_vec(w);
    for (int64_t rows : {1, 2, 5, 64, 100}) {
      const auto x = random_bf16_values(static_cast<size_t>(rows * c.in), seed++);
      const auto y0 = random_bf16_values(static_cast<size_t>(rows * c.out), seed++);
      std::vector<float> want = y0;
      ops::linear_add(x.data(), wb.data(), want.data(), rows, c.in, c.out);
      DeviceBuffer dx = upload_bf16(x);
      for (LinearPath path : {LinearPath::Auto, LinearPath::Kernel, LinearPath::Rows, LinearPath::CublasLt,
                              LinearPath::RowsTc}) {
        SCOPED_TRACE(testing::Message() << "linear_add rows " << rows << " in " << c.in << " out " << c.out
                                        << " path " << static_cast<int>(path));
        DeviceBuffer dy = upload_bf16(y0);
        ASSERT_EQ(ops::cuda::linear_add_via(ctx(), path, dx.get<bf16>(), dw.get<bf16>(), dy.get<bf16>(), rows, c.in,
                                            c.out),
                  0);
        expect_close(download_bf16(dy, want.size()), want, kOneRounding, 0.0, "linear_add");
      }
    }
  }
  DeviceBuffer dummy(64);
  EXPECT_NE(ops::cuda::linear_add(ctx(), dummy.get<bf16>(), dummy.get<bf16>(), dummy.get<bf16>(), 1, 0, 1), 0)
      << "in = 0";
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
// linear_group: several projections of the same rows in one launch (1 row), bitwise the separate calls

struct GroupProj {
  int64_t out;
  bool f32;
  int w_offset = 0;  // elements the weight starts past a 16-byte boundary (1: the element-wise width)
};

// y_j of one linear_group_via call, as raw bytes per projection (outputs start as NaN bits).
std::vector<std::vector<uint8_t>> group_bytes(ops::cuda::LinearGroupPath path, const bf16* x,
                                              const std::vector<const bf16*>& ws,
                                              const std::vector<GroupProj>& projs, int64_t rows, int64_t in) {
  std::vector<DeviceBuffer> ys;
  std::vector<ops::cuda::LinearOut> outs;
  for (size_t j = 0; j < projs.size(); ++j) {
    const size_t bytes = static_cast<size_t>(rows * projs[j].out) * (projs[j].f32 ? 4 : 2);
    ys.emplace_back(bytes);
    CUDA_CHECK(cudaMemsetAsync(ys.back().get(), 0xff, bytes, stream()));
    outs.push_back({ws[j], ys.back().get(), projs[j].out, projs[j].f32});
  }
  EXPECT_EQ(ops::cuda::linear_group_via(ctx(), path, x, rows, in, outs.data(), static_cast<int>(outs.size())), 0);
  std::vector<std::vector<uint8_t>> got;
  for (size_t j = 0; j < projs.size(); ++j)
    got.push_back(download<uint8_t>(ys[j], static_cast<size_t>(rows * projs[j].out) * (projs[j].f32 ? 4 : 2)));
  return got;
}

// y of one linear_via call at pointer w (linear_bytes takes a buffer).
std::vector<uint8_t> linear_bytes_at(ops::cuda::LinearPath path, const bf16* x, const bf16* w, int64_t rows,
                                     int64_t in, int64_t out, bool y_f32) {
  const size_t bytes = static_cast<size_t>(rows * out) * (y_f32 ? 4 : 2);
  DeviceBuffer dy(bytes);
  CUDA_CHECK(cudaMemsetAsync(dy.get(), 0xff, bytes, stream()));
  EXPECT_EQ(ops::cuda::linear_via(ctx(), path, x, w, dy.get(), y_f32, rows, in, out), 0);
  return download<uint8_t>(dy, bytes);
}

// got (raw bytes of [rows, out]) against the CPU linear on all features (small shapes) or the first and last
// 64 and 128 spread between.
void expect_linear_cpu(const std::vector<uint8_t>& bytes, const std::vector<float>& x, const std::vector<float>& w,
                       int64_t rows, int64_t in, int64_t out, bool y_f32, const char* what) {
  const std::vector<int64_t> feats = checked_features(rows * in * out <= (int64_t{1} << 25), out);
  const auto nf = static_cast<int64_t>(feats.size());
  std::vector<bf16> wsub(static_cast<size_t>(nf * in));
  for (int64_t f = 0; f < nf; ++f)
    for (int64_t i = 0; i < in; ++i) wsub[f * in + i] = to_bf16(w[feats[f] * in + i]);
  std::vector<float> want(static_cast<size_t>(rows * nf)), have(want.size());
  ops::linear(x.data(), wsub.data(), want.data(), rows, in, nf, /*round_out=*/!y_f32);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t f = 0; f < nf; ++f) {
      const size_t e = static_cast<size_t>(r * out + feats[f]);
      if (y_f32) {
        std::memcpy(&have[r * nf + f], bytes.data() + 4 * e, 4);
      } else {
        bf16 b;
        std::memcpy(&b.bits, bytes.data() + 2 * e, 2);
        have[r * nf + f] = to_float(b);
      }
    }
  expect_close(have, want, y_f32 ? kF32Rel : kOneRounding, 0.0, what);
}

// One group: Auto bitwise the grouped kernel where linear_group_takes the rows, else the separate linear()
// calls; the grouped kernel at any row count bitwise linear_rows_kernel (LinearPath::Rows); every
// projection against the CPU.
void check_linear_group(const std::vector<GroupProj>& projs, int64_t in, const std::vector<int64_t>& row_counts,
                        uint64_t seed, int x_offset = 0) {
  using ops::cuda::LinearGroupPath;
  using ops::cuda::LinearPath;
  std::vector<std::vector<float>> w;
  std::vector<DeviceBuffer> dw;
  std::vector<const bf16*> wp;
  for (const auto& p : projs) {
    w.push_back(random_bf16_values(static_cast<size_t>(p.out * in), seed++, 1.0 / std::sqrt(double(in))));
    std::vector<float> padded(static_cast<size_t>(p.w_offset), 0.5f);
    padded.insert(padded.end(), w.back().begin(), w.back().end());
    dw.push_back(upload_bf16(padded));
    wp.push_back(dw.back().get<bf16>() + p.w_offset);
  }
  for (const int64_t rows : row_counts) {
    SCOPED_TRACE(testing::Message() << "group of " << projs.size() << " in " << in << " rows " << rows
                                    << " x offset " << x_offset);
    const auto xs = random_bf16_values(static_cast<size_t>(rows * in + x_offset), seed++);
    const std::vector<float> x(xs.begin() + x_offset, xs.end());
    DeviceBuffer dx = upload_bf16(xs);
    const bf16* xp = dx.get<bf16>() + x_offset;
    const auto autos = group_bytes(LinearGroupPath::Auto, xp, wp, projs, rows, in);
    const auto grouped = group_bytes(LinearGroupPath::Grouped, xp, wp, projs, rows, in);
    std::vector<ops::cuda::LinearOut> outs;
    for (size_t j = 0; j < projs.size(); ++j)  // y unused: only the choice is asked
      outs.push_back({wp[j], const_cast<bf16*>(xp), projs[j].out, projs[j].f32});
    const bool takes = ops::cuda::linear_group_takes(rows, xp, in, outs.data(), static_cast<int>(outs.size()));
    const bool takes_tc =
        ops::cuda::linear_rows_tc_takes(rows, xp, in, in, outs.data(), static_cast<int>(outs.size()));
    for (size_t j = 0; j < projs.size(); ++j) {
      const auto& p = projs[j];
      SCOPED_TRACE(testing::Message() << "projection " << j << " out " << p.out << (p.f32 ? " f32" : " bf16")
                                      << " w offset " << p.w_offset
                                      << (takes_tc ? " tc" : takes ? " grouped" : " separate"));
      const LinearPath named = takes_tc ? LinearPath::RowsTc : takes ? LinearPath::Rows : LinearPath::Auto;
      EXPECT_TRUE(autos[j] == linear_bytes_at(named, xp, wp[j], rows, in, p.out, p.f32))
          << "auto group differs from the path the group rules name";
      EXPECT_TRUE(grouped[j] == linear_bytes_at(LinearPath::Rows, xp, wp[j], rows, in, p.out, p.f32))
          << "grouped kernel differs from linear_rows_kernel";
      expect_linear_cpu(autos[j], x, w[j], rows, in, p.out, p.f32, "auto group");
      expect_linear_cpu(grouped[j], x, w[j], rows, in, p.out, p.f32, "grouped kernel");
    }
  }
}

TEST(CudaLinearGroup, MatchesSeparateCallsBitwiseOnOddShapes) {
  K3_REQUIRE_GPU();
  const std::vector<int64_t> rows = {1, 2, 3, 5, 9};
  // in % 8 != 0: the element-wise width; outputs not a multiple of a CTA's 4 features, one of 1 feature.
  check_linear_group({{7, false}, {33, true}, {1, false}, {250, false}}, 37, rows, 3000);
  check_linear_group({{5, true}, {130, false}, {4, false}}, 136, rows, 3100);
  check_linear_group({{100, false}, {3, true}}, 1000, rows, 3200);
  // x one element off alignment: every projection element-wise, still one launch.
  check_linear_group({{9, false}, {70, true}}, 64, rows, 3300, /*x_offset=*/1);
  // One weight off alignment: its width differs from the others', so separate calls (still bitwise).
  check_linear_group({{40, false}, {12, false, 1}, {24, true}}, 64, rows, 3400);
  // The most projections a group takes, and a group of one.
  check_linear_group({{8, false}, {13, true}, {2, false}, {31, false}, {4, true}, {17, false}}, 72, rows, 3500);
  check_linear_group({{66, false}}, 72, rows, 3600);
}

// The rows kernels' weight preload (linear_rows_preload_force; K3_LINEAR_PRELOAD): each thread's first
// weight chunks loaded before the PDL wait. Its input is the output of the kernel just before it on the
// stream (no synchronization between: NaN-filled until that kernel writes it), so a read of x before the
// wait would show; on and off give the same bits, and the result matches the CPU on the x the GPU made.
// Shapes where threads own 0, 1, 2 and 7 chunks; one projection and a group.
TEST(CudaLinear, WeightPreloadWaitsForItsInputAndKeepsTheBits) {
  K3_REQUIRE_GPU();
  using ops::cuda::LinearGroupPath;
  using ops::cuda::LinearPath;
  struct Case {
    int64_t in, out;
  };
  const Case cases[] = {{8, 5}, {1000, 7}, {1032, 250}, {2048, 64}, {7168, 300}};
  const int64_t in0 = 64;  // the first kernel: x [rows, in] = x0 [rows, 64] W0^T
  uint64_t seed = 7100;
  for (const auto& c : cases)
    for (const int64_t rows : {1, 2, 3, 5, 8}) {
      SCOPED_TRACE(testing::Message() << "in " << c.in << " out " << c.out << " rows " << rows);
      const auto x0 = random_bf16_values(static_cast<size_t>(rows * in0), seed++);
      const auto w0 = random_bf16_values(static_cast<size_t>(c.in * in0), seed++, 0.125);
      const auto w1 = random_bf16_values(static_cast<size_t>(c.out * c.in), seed++, 1.0 / std::sqrt(double(c.in)));
      const auto w2 = random_bf16_values(static_cast<size_t>(3 * c.in), seed++, 1.0 / std::sqrt(double(c.in)));
      DeviceBuffer dx0 = upload_bf16(x0), dw0 = upload_bf16(w0), dw1 = upload_bf16(w1), dw2 = upload_bf16(w2);
      const size_t nx = static_cast<size_t>(rows * c.in) * 2, ny = static_cast<size_t>(rows * c.out) * 2,
                   na = static_cast<size_t>(rows * c.out) * 4, nb = static_cast<size_t>(rows * 3) * 2;
      DeviceBuffer dx(nx), dy(ny), dya(na), dyb(nb);
      // NaN bits in x and every output, then the producer of x and its consumer back to back.
      auto nan_all = [&] {
        for (auto [b, n] : {std::pair{&dx, nx}, {&dy, ny}, {&dya, na}, {&dyb, nb}})
          ASSERT_EQ(cudaMemsetAsync(b->get(), 0xff, n, stream()), cudaSuccess);
      };
      auto make_x = [&] {
        ASSERT_EQ(ops::cuda::linear_via(ctx(), LinearPath::Rows, dx0.get<bf16>(), dw0.get<bf16>(), dx.get(), false,
                                        rows, in0, c.in),
                  0);
      };
      std::vector<std::vector<uint8_t>> single, group_a, group_b;
      std::vector<float> x_made;
      for (const int preload : {0, 1}) {
        ops::cuda::linear_rows_preload_force(preload);
        nan_all();
        make_x();
        ASSERT_EQ(ops::cuda::linear_via(ctx(), LinearPath::Rows, dx.get<bf16>(), dw1.get<bf16>(), dy.get(), false,
                                        rows, c.in, c.out),
                  0);
        single.push_back(download<uint8_t>(dy, ny));
        nan_all();
        make_x();
        std::vector<ops::cuda::LinearOut> outs = {{dw1.get<bf16>(), dya.get(), c.out, true},
                                                  {dw2.get<bf16>(), dyb.get(), 3, false}};
        ASSERT_EQ(ops::cuda::linear_group_via(ctx(), LinearGroupPath::Grouped, dx.get<bf16>(), rows, c.in,
                                              outs.data(), 2),
                  0);
        group_a.push_back(download<uint8_t>(dya, na));
        group_b.push_back(download<uint8_t>(dyb, nb));
        x_made = down_bf16(dx, static_cast<size_t>(rows * c.in));
      }
      ops::cuda::linear_rows_preload_force(-1);
      EXPECT_TRUE(single[0] == single[1]) << "one projection: preload changed the bits";
      EXPECT_TRUE(group_a[0] == group_a[1] && group_b[0] == group_b[1]) << "group: preload changed the bits";
      for (float v : x_made) ASSERT_TRUE(std::isfinite(v)) << "the first kernel left x unwritten";
      expect_linear_cpu(single[1], x_made, w1, rows, c.in, c.out, false, "preload, one projection");
      expect_linear_cpu(group_a[1], x_made, w1, rows, c.in, c.out, true, "preload, group member 0");
      expect_linear_cpu(group_b[1], x_made, w2, rows, c.in, 3, false, "preload, group member 1");
    }
}

TEST(CudaLinearGroup, MatchesSeparateCallsBitwiseOnK3PerRankShapes) {
  K3_REQUIRE_GPU();
  // TP8 rank shapes of the groups the GPU rank runs: MLA q_a, kv_a, g_proj and the DSA indexer's wk and
  // head weights (FP32) of x; q_b and the indexer's wq_b of the q latent; the router (FP32 logits) and the
  // latent down; the shared experts' gate and up (TP-sharded), the dense MLP's.
  const std::vector<int64_t> rows = {1, 2, 4, 8};
  check_linear_group({{1536, false}, {576, false}, {1536, false}, {128, false}, {32, true}}, 7168, rows, 3700);
  check_linear_group({{2304, false}, {4096, false}}, 1536, rows, 3800);
  check_linear_group({{896, true}, {3584, false}}, 7168, rows, 3900);
  check_linear_group({{896, true}, {448, false}}, 7168, rows, 3950);  // router and latent down, sliced
  check_linear_group({{768, false}, {768, false}}, 7168, rows, 4000);
  check_linear_group({{4224, false}, {4224, false}}, 7168, {1}, 4100);
}

// The tensor-core row-tile kernel (linear_rows_tc) against the float64 loop, one projection and groups: k not a
// multiple of its 32-value chunk, features not a multiple of its 16, rows not of its 8 (and past one tile),
// FP32 and BF16 outputs, the per-rank K3 groups; the same bits on a second run.
void check_linear_rows_tc(const std::vector<GroupProj>& projs, int64_t in, const std::vector<int64_t>& row_counts,
                          uint64_t seed) {
  std::vector<std::vector<float>> w;
  std::vector<DeviceBuffer> dw;
  std::vector<const bf16*> wp;
  for (const auto& p : projs) {
    w.push_back(random_bf16_values(static_cast<size_t>(p.out * in), seed++, 1.0 / std::sqrt(double(in))));
    dw.push_back(upload_bf16(w.back()));
    wp.push_back(dw.back().get<bf16>());
  }
  for (const int64_t rows : row_counts) {
    SCOPED_TRACE(testing::Message() << "group of " << projs.size() << " in " << in << " rows " << rows);
    const auto x = random_bf16_values(static_cast<size_t>(rows * in), seed++);
    DeviceBuffer dx = upload_bf16(x);
    std::vector<ops::cuda::LinearOut> outs;
    for (size_t j = 0; j < projs.size(); ++j) outs.push_back({wp[j], dx.get(), projs[j].out, projs[j].f32});
    ASSERT_TRUE(ops::cuda::linear_rows_tc_fits(dx.get<bf16>(), in, in, outs.data(), static_cast<int>(outs.size())));
    const auto got = group_bytes(ops::cuda::LinearGroupPath::GroupedTc, dx.get<bf16>(), wp, projs, rows, in);
    const auto again = group_bytes(ops::cuda::LinearGroupPath::GroupedTc, dx.get<bf16>(), wp, projs, rows, in);
    for (size_t j = 0; j < projs.size(); ++j) {
      SCOPED_TRACE(testing::Message() << "projection " << j << " out " << projs[j].out);
      expect_linear_f64(got[j], projs[j].f32, linear_f64(x, w[j], rows, in, projs[j].out), projs[j].out,
                        "rows tc kernel");
      EXPECT_TRUE(got[j] == again[j]) << "two runs differ";
    }
  }
}

TEST(CudaLinearRowsTc, MatchesFloat64OnOddShapes) {
  K3_REQUIRE_GPU();
  const std::vector<int64_t> rows = {1, 2, 3, 5, 8, 9, 17, 31, 70};
  check_linear_rows_tc({{7, false}, {33, true}, {1, false}, {250, false}}, 40, rows, 5000);
  check_linear_rows_tc({{17, true}, {130, false}}, 136, rows, 5100);
  check_linear_rows_tc({{100, false}}, 1000, rows, 5200);
  check_linear_rows_tc({{8, false}, {13, true}, {2, false}, {31, false}, {4, true}, {17, false}}, 264, rows, 5300);
}

TEST(CudaLinearRowsTc, MatchesFloat64OnK3PerRankShapes) {
  K3_REQUIRE_GPU();
  const std::vector<int64_t> rows = {2, 8, 32};
  check_linear_rows_tc({{1536, false}, {576, false}, {1536, false}, {128, false}, {32, true}}, 7168, rows, 5400);
  check_linear_rows_tc({{2304, false}, {4096, false}}, 1536, rows, 5500);
  check_linear_rows_tc({{896, true}, {448, false}}, 7168, rows, 5600);
  check_linear_rows_tc({{768, false}, {768, false}}, 7168, rows, 5700);
  check_linear_rows_tc({{7168, false}}, 3584, {8}, 5800);
}

// Both forms of the kernel, whatever the GPU's SM count: a grid above kLinearRowsTcPipeCtasPerSm CTAs per SM
// (loads within their stage) and one of a few CTAs (loads one stage ahead), odd rows and a k tail.
TEST(CudaLinearRowsTc, MatchesFloat64WithAndWithoutLoadsAhead) {
  K3_REQUIRE_GPU();
  const int sms = ctx().sm_count;
  ASSERT_GT(sms, 0);
  const int64_t big = 16 * (ops::cuda::kLinearRowsTcPipeCtasPerSm + 1) * sms;  // features: 16 per CTA
  ASSERT_FALSE(ops::cuda::linear_rows_tc_pipelined(big / 16, sms));
  ASSERT_TRUE(ops::cuda::linear_rows_tc_pipelined(3, sms));
  check_linear_rows_tc({{big / 2 + 5, false}, {big / 2, true}}, 1064, {3, 8}, 5900);
  check_linear_rows_tc({{40, false}, {9, true}}, 1064, {3, 8}, 6000);
}

TEST(CudaLinearRowsTc, TakesOnlyWhatItFits) {
  K3_REQUIRE_GPU();
  DeviceBuffer dx(4 * 64 * 2 + 16), dw(64 * 16 * 2 + 16), dy(4 * 16 * 4);
  fill_nan_bf16(dy, 4 * 16);
  const bf16* x = dx.get<bf16>();
  ops::cuda::LinearOut o{dw.get<bf16>(), dy.get(), 16, false};
  // k not a multiple of 8, x one element off its 16-byte alignment: nothing enqueued.
  EXPECT_EQ(ops::cuda::linear_rows_tc(ctx(), x, 60, 4, 60, &o, 1), cudaErrorNotSupported);
  EXPECT_EQ(ops::cuda::linear_rows_tc(ctx(), x + 1, 64, 4, 64, &o, 1), cudaErrorNotSupported);
  CUDA_CHECK(cudaStreamSynchronize(stream()));
  for (const float v : down_bf16(dy, 4 * 16)) EXPECT_TRUE(std::isnan(v)) << "written though not supported";
  EXPECT_EQ(ops::cuda::linear_rows_tc(ctx(), x, 64, -1, 64, &o, 1), cudaErrorInvalidValue);
  EXPECT_EQ(ops::cuda::linear_rows_tc(ctx(), x, 64, 4, 64, &o, ops::cuda::kLinearGroupMax + 1), cudaErrorInvalidValue);
}

// The rule's cases as measured (docs/PERF.md, "Projection groups at 2-8 rows"), host logic only (no GPU):
// one launch at 1 and 2 rows on every per-rank group, at 4 rows on MLA's (3648 x 7168) but not on the router
// and latent down's (4480 x 7168), never at 8; never for one projection.
TEST(CudaLinearGroup, TakesTheRowsAndGroupsItWasMeasuredToWin) {
  for (const char* knob :
       {"K3_LINEAR_GROUP", "K3_LINEAR_GROUP_ROWS_MAX", "K3_LINEAR_ROWS_MAX", "K3_LINEAR_TC_ROWS_MAX",
        "K3_LINEAR_GLU_TC"})
    if (std::getenv(knob) != nullptr) GTEST_SKIP() << knob << " is set";
  alignas(16) static bf16 x[8], w[8], y[8];
  auto group = [](std::vector<int64_t> outs) {
    std::vector<ops::cuda::LinearOut> g;
    for (const int64_t out : outs) g.push_back({w, y, out, false});
    return g;
  };
  const auto mla = group({1536, 576, 1536}), router_down = group({896, 3584}), sliced = group({896, 448}),
             dense = group({4224, 4224}), one = group({4096});
  auto takes = [](int64_t rows, const std::vector<ops::cuda::LinearOut>& g, int64_t in = 7168) {
    return ops::cuda::linear_group_takes(rows, x, in, g.data(), static_cast<int>(g.size()));
  };
  for (const auto* g : {&mla, &router_down, &sliced, &dense}) {
    EXPECT_TRUE(takes(1, *g));
    EXPECT_TRUE(takes(2, *g));
    EXPECT_FALSE(takes(8, *g));
  }
  EXPECT_TRUE(takes(4, mla));
  EXPECT_TRUE(takes(4, sliced));
  EXPECT_FALSE(takes(4, router_down));
  EXPECT_FALSE(takes(4, dense));
  EXPECT_FALSE(takes(1, one));
  EXPECT_FALSE(takes(0, mla));
  // The tensor-core row-tile kernel: groups of kLinearRowsTcMinRows to kLinearRowsTcMaxRows rows (fewer are
  // the rows kernel's); never one projection; not where it does not fit (x off its 16-byte alignment, k not a
  // multiple of 8).
  using ops::cuda::kLinearRowsTcMaxRows;
  using ops::cuda::kLinearRowsTcMinRows;
  auto tc = [](int64_t rows, const std::vector<ops::cuda::LinearOut>& g, int xoff = 0, int64_t in = 7168) {
    const bf16* xp = x + xoff;
    return ops::cuda::linear_rows_tc_takes(rows, xp, in, in, g.data(), static_cast<int>(g.size()));
  };
  for (const auto* g : {&mla, &router_down, &sliced, &dense}) {
    for (int64_t rows = 1; rows < kLinearRowsTcMinRows; ++rows) EXPECT_FALSE(tc(rows, *g)) << rows;
    for (int64_t rows = kLinearRowsTcMinRows; rows <= kLinearRowsTcMaxRows; ++rows) EXPECT_TRUE(tc(rows, *g)) << rows;
    EXPECT_FALSE(tc(std::max(kLinearRowsTcMinRows, kLinearRowsTcMaxRows + 1), *g));
    EXPECT_FALSE(tc(kLinearRowsTcMaxRows, *g, 1));
    EXPECT_FALSE(tc(kLinearRowsTcMaxRows, *g, 0, 7164));
    // What it fits, asked directly (the checks above hold trivially while the default takes no rows).
    const int n = static_cast<int>(g->size());
    EXPECT_TRUE(ops::cuda::linear_rows_tc_fits(x, 7168, 7168, g->data(), n));
    EXPECT_TRUE(ops::cuda::linear_rows_tc_fits(x, 7176, 7168, g->data(), n));  // strided rows
    EXPECT_FALSE(ops::cuda::linear_rows_tc_fits(x + 1, 7168, 7168, g->data(), n));
    EXPECT_FALSE(ops::cuda::linear_rows_tc_fits(x, 7164, 7164, g->data(), n));
    EXPECT_FALSE(ops::cuda::linear_rows_tc_fits(x, 7172, 7168, g->data(), n));  // x_ld % 8 != 0
  }
  for (int64_t rows = 1; rows <= 64; ++rows) EXPECT_FALSE(tc(rows, one)) << rows;
  // linear_glu's GLU member (and the MoE's shared group): the tc group's rows, measured to win at 4 and 8
  // (docs/PERF.md, "Projection groups across backend calls").
  for (int64_t rows = 1; rows <= 64; ++rows)
    EXPECT_EQ(ops::cuda::linear_glu_tc_takes(rows), rows >= kLinearRowsTcMinRows && rows <= kLinearRowsTcMaxRows)
        << rows;
  // Loads one stage ahead where that was measured to win alone (bench --ops linear, H100, 132 SMs, 8 rows):
  // MLA's group (228 CTAs) and the sliced router + latent down (84) and the TP shared experts' gate/up (96);
  // not the router + latent down (280), DSA's q_b + wq_b (400) or the dense MLP's gate/up (528).
  for (const int64_t ctas : {84, 96, 228}) EXPECT_TRUE(ops::cuda::linear_rows_tc_pipelined(ctas, 132)) << ctas;
  for (const int64_t ctas : {280, 400, 528}) EXPECT_FALSE(ops::cuda::linear_rows_tc_pipelined(ctas, 132)) << ctas;
}

TEST(CudaLinearGroup, RejectsBadGroups) {
  K3_REQUIRE_GPU();
  DeviceBuffer dx(64 * 2), dw(64 * 8 * 2), dy(8 * 4);
  std::vector<ops::cuda::LinearOut> outs(ops::cuda::kLinearGroupMax + 1,
                                         {dw.get<bf16>(), dy.get(), 8, false});
  EXPECT_NE(ops::cuda::linear_group(ctx(), dx.get<bf16>(), 1, 64, outs.data(), ops::cuda::kLinearGroupMax + 1), 0);
  outs[1].out = 0;
  EXPECT_NE(ops::cuda::linear_group(ctx(), dx.get<bf16>(), 1, 64, outs.data(), 2), 0);
  EXPECT_EQ(ops::cuda::linear_group(ctx(), dx.get<bf16>(), 1, 64, outs.data(), 0), 0);  // nothing to do
  EXPECT_FALSE(ops::cuda::linear_group_fits(dx.get<bf16>(), 64, outs.data(), 2));       // out 0
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
// sample_rows

// Prints a result line, and appends it to $OUT/sampling_timing.txt when OUT is set (the device runner's
// result folder: the lines come back even when the console output is cut).
void report(const char* line) {
  std::fputs(line, stdout);
  if (const char* dir = std::getenv("OUT"))
    if (FILE* f = std::fopen((std::string(dir) + "/sampling_timing.txt").c_str(), "a")) {
      std::fputs(line, f);
      std::fclose(f);
    }
}

// Whether a row's outcome sits within `eps` of a boundary of the CPU's float64 sums (where the kernel's FP32
// masses may decide otherwise): the top-p mass at the kept set's edge vs top_p, the draft's p_kept vs
// u_accept, or a cumulative (id order, over the kept set or its residual) vs u_draw.
bool near_boundary(const float* raw, int64_t V, const ops::SampleSpec& s, double eps) {
  if (s.temperature == 0) return false;
  std::vector<double> l(static_cast<size_t>(V));
  for (int64_t i = 0; i < V; ++i) l[i] = std::isnan(raw[i]) ? -INFINITY : std::min<double>(raw[i], FLT_MAX);
  const double mx = *std::max_element(l.begin(), l.end());
  std::vector<double> p(static_cast<size_t>(V));
  double z = 0;
  for (int64_t i = 0; i < V; ++i) z += p[i] = std::exp((l[i] - mx) / s.temperature);
  std::vector<char> kept(static_cast<size_t>(V), 1);
  double kept_mass = z;
  bool near = false;
  if (s.top_p < 1) {
    std::vector<int64_t> order(static_cast<size_t>(V));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return l[a] > l[b]; });
    std::fill(kept.begin(), kept.end(), 0);
    kept_mass = 0;
    for (int64_t k = 0; k < V && kept_mass < s.top_p * z; ++k) {
      if (std::fabs(kept_mass / z - s.top_p) < eps) near = true;
      kept[order[k]] = 1;
      kept_mass += p[order[k]];
    }
    if (std::fabs(kept_mass / z - s.top_p) < eps) near = true;
  }
  double mass = kept_mass;
  if (s.draft >= 0 && kept[s.draft]) {
    if (std::fabs(p[s.draft] / kept_mass - s.u_accept) < eps) near = true;
    mass -= p[s.draft];
  }
  double cum = 0;
  for (int64_t i = 0; i < V && mass > 0; ++i) {
    if (!kept[i] || i == s.draft) continue;
    cum += p[i];
    if (std::fabs(cum / mass - s.u_draw) < eps) near = true;
  }
  return near;
}

// A scratch for ops::cuda::sample_rows, zeroed as its contract asks (once, before the first call).
DeviceBuffer sample_scratch(int64_t rows, int64_t vocab, int64_t ctas = 0) {
  DeviceBuffer b(std::max<size_t>(ops::cuda::sample_rows_scratch_bytes(rows, vocab, ctas), 256));
  CUDA_CHECK(cudaMemsetAsync(b.get(), 0, b.bytes(), stream()));
  return b;
}

// The split kernel on device logits and specs; a row it leaves unwritten reads token -1.
std::vector<ops::SampleResult> run_split(const DeviceBuffer& dl, const DeviceBuffer& ds, int64_t rows, int64_t vocab,
                                         const DeviceBuffer& scratch, int64_t ctas = 0, ops::SampleNeeds needs = {}) {
  DeviceBuffer dout(std::max<size_t>(rows * sizeof(ops::SampleResult), 16));
  CUDA_CHECK(cudaMemsetAsync(dout.get(), 0xff, dout.bytes(), stream()));
  EXPECT_EQ(ops::cuda::sample_rows(dl.get<float>(), rows, vocab, ds.get<ops::SampleSpec>(), dout.get<ops::SampleResult>(),
                                   scratch.get(), scratch.bytes(), st(), needs, ctas),
            0);
  return download<ops::SampleResult>(dout, static_cast<size_t>(rows));
}

bool same_results(const std::vector<ops::SampleResult>& a, const std::vector<ops::SampleResult>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(ops::SampleResult)) == 0;
}

// log p(token) under the softmax of the raw row at temperature 1, in float64 (NaN as -inf, +inf as FLT_MAX).
double logprob_f64(const float* row, int64_t V, int32_t token) {
  auto cl = [](float v) { return std::isnan(v) ? -INFINITY : std::min<double>(v, FLT_MAX); };
  double mx = -INFINITY, z = 0;
  for (int64_t i = 0; i < V; ++i) mx = std::max(mx, cl(row[i]));
  if (mx == -INFINITY) return -INFINITY;
  for (int64_t i = 0; i < V; ++i) z += std::exp(cl(row[i]) - mx);
  return cl(row[token]) - mx - std::log(z);
}

// Counts of a checked batch.
struct Tally {
  int rows = 0, boundary = 0, accepted = 0, rejected = 0;
};

// The kernel's results `got` for logits [rows, V] under spec against the CPU op's (`cpu`: ids and flags equal
// except within 1e-5 of a boundary of its float64 sums; log-probs within rounding of the float64 log-softmax,
// integer z1: ~1e-6).
void check_rows(const std::vector<float>& logits, const std::vector<ops::SampleSpec>& spec, int64_t V,
                const std::vector<ops::SampleResult>& got, const std::vector<ops::SampleResult>& cpu, Tally& t) {
  ASSERT_EQ(got.size(), spec.size());
  for (size_t r = 0; r < spec.size(); ++r) {
    const ops::SampleSpec& s = spec[r];
    const float* row = logits.data() + static_cast<int64_t>(r) * V;
    SCOPED_TRACE(testing::Message() << "row " << r << " T " << s.temperature << " top_p " << s.top_p << " draft "
                                    << s.draft << " u " << s.u_accept << " " << s.u_draw);
    ++t.rows;
    ASSERT_TRUE(got[r].token >= 0 && got[r].token < V) << "token " << got[r].token;
    if (s.draft >= 0) (got[r].accepted ? t.accepted : t.rejected)++;
    if (got[r].token != cpu[r].token || got[r].accepted != cpu[r].accepted) {
      ++t.boundary;
      EXPECT_TRUE(near_boundary(row, V, s, 1e-5))
          << "gpu " << got[r].token << "/" << got[r].accepted << " cpu " << cpu[r].token << "/" << cpu[r].accepted;
    }
    if (s.logprob) {
      const double want = logprob_f64(row, V, got[r].token);
      if (want == -INFINITY) {
        EXPECT_EQ(got[r].logprob, -INFINITY);
      } else {
        EXPECT_NEAR(got[r].logprob, want, 1e-5 + 1e-6 * std::fabs(want));
      }
    } else {
      EXPECT_EQ(got[r].logprob, 0.0f);
    }
  }
}

// The kernel against the CPU op: vocab 1000 / 4099 / 163840, 1..256 rows, T in {0, 0.7,
// 1.3}, top_p in {1, 0.9, 0.5}, no draft / a random draft / the argmax as draft, log-probs asked. Ids and
// accepted flags equal the CPU's except at boundary rows (counted, bounded); log-probs
// near the float64 log-softmax; the kernel is deterministic (two runs, equal bytes). Special rows: ties for the
// maximum, NaN at id 0, NaN / -inf / +inf.
TEST(CudaSampling, MatchesCpuOp) {
  K3_REQUIRE_GPU();
  uint64_t seed = 11000;
  Tally t;
  for (int64_t vocab : {int64_t{1000}, int64_t{4099}, int64_t{163840}}) {
    for (int64_t rows : {int64_t{1}, int64_t{37}, int64_t{256}}) {
      SCOPED_TRACE(testing::Message() << "vocab " << vocab << " rows " << rows);
      Rng rng(seed++);
      std::vector<float> logits(static_cast<size_t>(rows * vocab));
      for (auto& v : logits) v = static_cast<float>(rng.normal() * 3.0);
      if (rows > 4) {
        const int64_t a = vocab / 3, b = vocab - 2;
        logits[vocab + a] = logits[vocab + b] = 100.f;
        logits[2 * vocab] = NAN;
        logits[3 * vocab + 1] = NAN;
        logits[3 * vocab + 2] = -INFINITY;
        logits[3 * vocab + vocab - 1] = 50.f;
        logits[4 * vocab + 5] = INFINITY;
        for (int64_t i = 0; i < vocab; ++i) logits[5 * vocab + i] = std::round(logits[5 * vocab + i]);  // many ties
      }
      std::vector<ops::SampleSpec> spec(static_cast<size_t>(rows));
      const float Ts[] = {0.0f, 0.7f, 1.3f}, Ps[] = {1.0f, 0.9f, 0.5f};
      for (int64_t r = 0; r < rows; ++r) {
        ops::SampleSpec& s = spec[r];
        const int64_t k = r + static_cast<int64_t>(rng.below(27));
        s.temperature = Ts[k % 3];
        s.top_p = Ps[(k / 3) % 3];
        const float* row = logits.data() + r * vocab;
        const int64_t best = std::max_element(row, row + vocab, [](float x, float y) {
                               return (std::isnan(x) ? -INFINITY : x) < (std::isnan(y) ? -INFINITY : y);
                             }) - row;
        s.draft = k / 9 % 3 == 0 ? -1 : k / 9 % 3 == 1 ? static_cast<int32_t>(rng.below(vocab)) : static_cast<int32_t>(best);
        s.logprob = 1;
        s.u_accept = rng.uniform();
        s.u_draw = rng.uniform();
      }
      std::vector<ops::SampleResult> want(spec.size());
      ops::sample_rows(logits.data(), rows, vocab, spec.data(), want.data());
      DeviceBuffer dl = upload(logits), ds = upload(spec), scratch = sample_scratch(rows, vocab);
      const auto got = run_split(dl, ds, rows, vocab, scratch);
      const auto again = run_split(dl, ds, rows, vocab, scratch);
      ASSERT_TRUE(same_results(got, again)) << "not deterministic";
      check_rows(logits, spec, vocab, got, want, t);
    }
  }
  char line[200];
  std::snprintf(line, sizeof line, "[ gpu ] sample_rows: %d rows, %d drafts accepted, %d differ from the CPU\n", t.rows,
                t.accepted, t.boundary);
  report(line);
  EXPECT_LE(t.boundary * 100, t.rows);  // at most 1%
  EXPECT_GT(t.accepted, 20);
}

// Rows built against the split: for vocab V and chunk boundaries b (multiples of the chunk of the given split,
// else V / 2), over a random background (normal x 3, never zero):
//   0: the maximum tied across a boundary (b - 1 and b: the lower id wins)   1: the maximum alone at b
//   2: the maximum at the last id   3: equal maxima at every chunk start but the first
//   4: every logit equal (the top-p cut falls inside a run of equal masses)
//   5: a run of 2 * w equal logits from b - 0.9 w holding the top-p edge (top_p 0.5 ends inside it, within a
//      few ids of b for T 0.7 .. 1.3), three larger tokens after it, the rest far below
//   6: every logit NaN or -inf (token 0)   7: the background (the edge bin spans chunks)
//   8: the background rounded (many equal logits at every level)
std::vector<float> split_row(Rng& rng, int64_t V, int kind, int64_t chunk, int64_t b) {
  std::vector<float> l(static_cast<size_t>(V));
  for (auto& x : l) x = static_cast<float>(rng.normal() * 3.0);
  switch (kind) {
    case 0:
      if (b >= 1) l[b - 1] = 20.f;
      l[b] = 20.f;
      break;
    case 1:
      l[b] = 20.f;
      break;
    case 2:
      l[V - 1] = 20.f;
      break;
    case 3:
      for (int64_t i = chunk; i < V; i += chunk) l[i] = 20.f;
      if (chunk >= V) l[V - 1] = 20.f;
      break;
    case 4:
      for (auto& x : l) x = 0.37f;
      break;
    case 5: {
      for (auto& x : l) x = static_cast<float>(rng.normal() * 0.5 - 12.0);
      const int64_t w = std::max<int64_t>(1, std::min<int64_t>(50, V / 4));
      const int64_t start = std::max<int64_t>(0, b - 9 * w / 10), end = std::min(V, start + 2 * w);
      for (int64_t i = start; i < end; ++i) l[i] = 2.0f;
      for (int k = 0; k < 3 && V > 2 * w + 3; ++k) l[(end + 1 + k * 7) % V] = 3.0f;
      break;
    }
    case 6:
      for (int64_t i = 0; i < V; ++i) l[i] = i % 3 == 0 ? NAN : -INFINITY;
      break;
    case 7:
      break;
    case 8:
      for (auto& x : l) x = std::round(x);
      break;
  }
  return l;
}

// The split's boundary cases: vocab 7 / 1000 / 163840 / 1000003 (odd: scalar loads, a short last chunk), the rows
// of split_row under T in {0, 0.7, 1, 1.3}, top_p in {1, 0.9, 0.5, 0.05}, drafts (none, the argmax, a token of
// the row's equal run, a random one), log-probs on and off. Each batch runs under several splits (auto, 1, 2, 3,
// 7 CTAs per row and the most: a CTA per 64 ids), whose results must be equal byte for byte (log-probs too: every
// sum is an integer); they are checked against the CPU op (check_rows). Then 300 rows (the
// batch repeated with new uniforms) and each of the first rows alone.
TEST(CudaSampling, SplitBoundaries) {
  K3_REQUIRE_GPU();
  Tally t;
  uint64_t seed = 11200;
  for (int64_t V : {int64_t{7}, int64_t{1000}, int64_t{163840}, int64_t{1000003}}) {
    SCOPED_TRACE(testing::Message() << "vocab " << V);
    Rng rng(seed++);
    // Boundaries of a 3-CTA split (the rows are the same for every split; other splits cut elsewhere).
    const ops::cuda::SampleSplit sp = ops::cuda::sample_split(1, V, 3);
    const int64_t b = sp.ctas > 1 ? sp.chunk : V / 2;
    std::vector<float> logits;
    std::vector<ops::SampleSpec> spec;
    const float Ts[] = {0.0f, 0.7f, 1.0f, 1.3f}, Ps[] = {1.0f, 0.9f, 0.5f, 0.05f};
    for (int kind = 0; kind < 9; ++kind) {
      for (int v = 0; v < 6; ++v) {
        const std::vector<float> l = split_row(rng, V, kind, sp.chunk, v % 2 ? b : std::min(V - 1, b + sp.segment));
        ops::SampleSpec s;
        s.temperature = Ts[(kind + v) % 4];
        s.top_p = kind == 5 ? 0.5f : Ps[(kind + 3 * v) % 4];
        int32_t best = 0;
        for (int64_t i = 1; i < V; ++i)
          if ((std::isnan(l[i]) ? -INFINITY : l[i]) > (std::isnan(l[best]) ? -INFINITY : l[best])) best = static_cast<int32_t>(i);
        const int32_t run = static_cast<int32_t>(std::min(V - 1, b));  // in the equal run of kinds 4 and 5
        s.draft = v % 4 == 0 ? -1 : v % 4 == 1 ? best : v % 4 == 2 ? run : static_cast<int32_t>(rng.below(V));
        s.logprob = v != 5;
        s.u_accept = rng.uniform();
        s.u_draw = rng.uniform();
        logits.insert(logits.end(), l.begin(), l.end());
        spec.push_back(s);
      }
    }
    const int64_t rows = static_cast<int64_t>(spec.size());
    std::vector<ops::SampleResult> cpu(spec.size());
    ops::sample_rows(logits.data(), rows, V, spec.data(), cpu.data());
    DeviceBuffer dl = upload(logits), ds = upload(spec);
    std::vector<ops::SampleResult> first;
    const int64_t most = (V + 63) / 64;
    for (int64_t ctas : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{3}, int64_t{7}, most}) {
      SCOPED_TRACE(testing::Message() << "ctas per row " << ctas << " (" << ops::cuda::sample_split(rows, V, ctas).ctas
                                      << ")");
      DeviceBuffer scratch = sample_scratch(rows, V, ctas);
      const auto got = run_split(dl, ds, rows, V, scratch, ctas);
      if (first.empty()) {
        first = got;
        check_rows(logits, spec, V, got, cpu, t);
      } else {
        EXPECT_TRUE(same_results(got, first)) << "the split changed a result";
      }
    }
    // 300 rows: the batch repeated with new uniforms.
    std::vector<float> many;
    std::vector<ops::SampleSpec> many_spec;
    const int64_t n = V > 200000 ? 60 : 300;  // (1000003 x 300 floats would be 1.2 GB on the host)
    for (int64_t r = 0; r < n; ++r) {
      const int64_t src = r % rows;
      many.insert(many.end(), logits.begin() + src * V, logits.begin() + (src + 1) * V);
      ops::SampleSpec s = spec[src];
      s.u_accept = rng.uniform();
      s.u_draw = rng.uniform();
      many_spec.push_back(s);
    }
    std::vector<ops::SampleResult> many_cpu(many_spec.size());
    ops::sample_rows(many.data(), n, V, many_spec.data(), many_cpu.data());
    DeviceBuffer dml = upload(many), dms = upload(many_spec), mscratch = sample_scratch(n, V);
    check_rows(many, many_spec, V, run_split(dml, dms, n, V, mscratch), many_cpu, t);
    // Single rows: the widest automatic split.
    DeviceBuffer one_scratch = sample_scratch(1, V);
    for (int64_t r = 0; r < std::min<int64_t>(rows, 12); ++r) {
      SCOPED_TRACE(testing::Message() << "alone: row " << r);
      const std::vector<float> l(logits.begin() + r * V, logits.begin() + (r + 1) * V);
      const std::vector<ops::SampleSpec> s1 = {spec[r]};
      DeviceBuffer d1 = upload(l), ds1 = upload(s1);
      const auto got = run_split(d1, ds1, 1, V, one_scratch);
      EXPECT_TRUE(same_results(got, {first[r]})) << "alone " << got[0].token << " in the batch " << first[r].token;
    }
  }
  char line[200];
  std::snprintf(line, sizeof line, "[ gpu ] sample_rows split cases: %d rows, %d drafts accepted, %d rejected, %d differ from the CPU\n",
                t.rows, t.accepted, t.rejected, t.boundary);
  report(line);
  EXPECT_LE(t.boundary * 50, t.rows);
  EXPECT_GT(t.accepted, 20);
  EXPECT_GT(t.rejected, 20);
}

// The launcher's phase skipping (ops::sample_needs from the host specs) changes no result: greedy rows without
// log-probs (one launch), greedy with log-probs, sampled with top_p = 1, and a mix, against every phase launched.
TEST(CudaSampling, NeedsSkipOnlyUnusedPhases) {
  K3_REQUIRE_GPU();
  const int64_t V = 163840, rows = 64;
  Rng rng(11300);
  std::vector<float> logits(static_cast<size_t>(rows * V));
  for (auto& v : logits) v = static_cast<float>(rng.normal() * 3.0);
  DeviceBuffer dl = upload(logits), scratch = sample_scratch(rows, V);
  for (int mode = 0; mode < 4; ++mode) {
    SCOPED_TRACE(testing::Message() << "mode " << mode);
    std::vector<ops::SampleSpec> spec(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) {
      ops::SampleSpec& s = spec[r];
      s.temperature = mode <= 1 ? 0.0f : mode == 2 ? 0.8f : (r % 3 == 0 ? 0.0f : 0.8f);
      s.top_p = mode == 3 && r % 2 ? 0.9f : 1.0f;
      s.logprob = mode == 1 || (mode >= 2 && r % 4 == 1);
      s.draft = r % 3 == 2 ? static_cast<int32_t>(rng.below(V)) : -1;
      s.u_accept = rng.uniform();
      s.u_draw = rng.uniform();
    }
    const ops::SampleNeeds needs = ops::sample_needs(spec.data(), rows);
    EXPECT_EQ(needs.sampled, mode >= 2);
    EXPECT_EQ(needs.top_p, mode == 3);
    EXPECT_EQ(needs.logprob, mode >= 1);
    DeviceBuffer ds = upload(spec);
    const auto all = run_split(dl, ds, rows, V, scratch);
    const auto skipped = run_split(dl, ds, rows, V, scratch, 0, needs);
    EXPECT_TRUE(same_results(all, skipped));
    std::vector<ops::SampleResult> cpu(spec.size());
    ops::sample_rows(logits.data(), rows, V, spec.data(), cpu.data());
    Tally t;
    check_rows(logits, spec, V, skipped, cpu, t);
  }
}

// Captured in a CUDA graph (default needs: the replays' specs are unknown at capture) and replayed with new specs
// between replays, interleaved with eager calls of other row counts on the same scratch: each replay gives the
// eager results of its specs (the counters come back to zero after every call).
TEST(CudaSampling, GraphReplayMatchesEager) {
  K3_REQUIRE_GPU();
  const int64_t V = 4099, rows = 37;
  Rng rng(11400);
  std::vector<float> logits(static_cast<size_t>(rows * V));
  for (auto& v : logits) v = static_cast<float>(rng.normal() * 3.0);
  DeviceBuffer dl = upload(logits), scratch = sample_scratch(rows, V);
  DeviceBuffer ds(rows * sizeof(ops::SampleSpec)), dout(rows * sizeof(ops::SampleResult));
  ASSERT_EQ(cudaStreamSynchronize(stream()), cudaSuccess);  // (the scratch's memset before the capture)
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream(), cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const int rc = ops::cuda::sample_rows(dl.get<float>(), rows, V, ds.get<ops::SampleSpec>(), dout.get<ops::SampleResult>(),
                                        scratch.get(), scratch.bytes(), st());
  ASSERT_EQ(cudaStreamEndCapture(stream(), &graph), cudaSuccess);
  ASSERT_EQ(rc, 0);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int replay = 0; replay < 4; ++replay) {
    SCOPED_TRACE(testing::Message() << "replay " << replay);
    std::vector<ops::SampleSpec> spec(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) {
      ops::SampleSpec& s = spec[r];
      s.temperature = (r + replay) % 3 == 0 ? 0.0f : 0.9f;
      s.top_p = (r + replay) % 2 ? 0.8f : 1.0f;
      s.logprob = r % 2;
      s.draft = r % 4 == 3 ? static_cast<int32_t>(rng.below(V)) : -1;
      s.u_accept = rng.uniform();
      s.u_draw = rng.uniform();
    }
    ASSERT_EQ(cudaMemcpyAsync(ds.get(), spec.data(), rows * sizeof(ops::SampleSpec), cudaMemcpyHostToDevice, stream()),
              cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream()), cudaSuccess);
    const auto replayed = download<ops::SampleResult>(dout, static_cast<size_t>(rows));
    const int64_t fewer = 1 + replay * 11;  // an eager call of other rows on the same scratch in between
    run_split(dl, ds, fewer, V, scratch);
    const auto eager = run_split(dl, ds, rows, V, scratch);
    EXPECT_TRUE(same_results(replayed, eager));
    std::vector<ops::SampleResult> cpu(spec.size());
    ops::sample_rows(logits.data(), rows, V, spec.data(), cpu.data());
    Tally t;
    check_rows(logits, spec, V, replayed, cpu, t);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// The split's shape (host only, runs without a GPU: the SM count falls back to 132): chunks of whole segments
// (multiples of 4 ids) that cover the row with no empty CTA; the automatic split gives a chunk >= 2048 ids and
// one CTA per row from SMs + 1 rows on; the scratch grows with the rows; a launch with too little scratch is
// refused before anything runs.
TEST(CudaSampling, SplitGeometry) {
  for (int64_t V : {int64_t{1}, int64_t{7}, int64_t{64}, int64_t{1000}, int64_t{4099}, int64_t{163840},
                    int64_t{1000003}, int64_t{1} << 23}) {
    for (int64_t rows : {int64_t{1}, int64_t{2}, int64_t{8}, int64_t{64}, int64_t{255}, int64_t{300}, int64_t{5000}}) {
      for (int64_t ctas : {int64_t{0}, int64_t{1}, int64_t{3}, int64_t{1000}, int64_t{1} << 20}) {
        SCOPED_TRACE(testing::Message() << "V " << V << " rows " << rows << " ctas " << ctas);
        const ops::cuda::SampleSplit sp = ops::cuda::sample_split(rows, V, ctas);
        ASSERT_GE(sp.ctas, 1);
        EXPECT_EQ(sp.segment % 4, 0);
        EXPECT_EQ(sp.chunk, 16 * sp.segment);
        EXPECT_GE(sp.ctas * sp.chunk, V);
        EXPECT_LT((sp.ctas - 1) * sp.chunk, V);
        if (ctas == 0) {
          if (sp.ctas > 1) {
            EXPECT_GE(sp.chunk, 2048);
          }
          if (rows >= 5000) {
            EXPECT_EQ(sp.ctas, 1);
          }
        } else {
          EXPECT_LE(sp.ctas, ctas);
          EXPECT_GE(sp.segment, 4);
        }
      }
      EXPECT_LT(ops::cuda::sample_rows_scratch_bytes(rows, V), ops::cuda::sample_rows_scratch_bytes(rows + 1, V));
    }
  }
  EXPECT_EQ(ops::cuda::sample_split(1, 163840).ctas, 80);  // 2048 ids per CTA: the widest automatic split
  const size_t need = ops::cuda::sample_rows_scratch_bytes(4, 1000);
  EXPECT_EQ(ops::cuda::sample_rows(nullptr, 4, 1000, nullptr, nullptr, nullptr, 0, nullptr), cudaErrorInvalidValue);
  alignas(16) static char small[64];
  EXPECT_EQ(ops::cuda::sample_rows(nullptr, 4, 1000, nullptr, nullptr, small, need - 1, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(ops::cuda::sample_rows(nullptr, 4, (int64_t{1} << 23) + 1, nullptr, nullptr, small, need, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(ops::cuda::sample_rows(nullptr, 0, 1000, nullptr, nullptr, nullptr, 0, nullptr), cudaSuccess);
}

// Time per call at K3's vocab for 1, 8, 64 and 256 rows against the bytes read once: greedy without log-probs
// (the launches the host specs need: one), greedy with log-probs, and T 0.7 top-p 0.9 with a draft and
// log-probs.
TEST(CudaSampling, Timing) {
  K3_REQUIRE_GPU();
  const int64_t V = 163840;
  Rng rng(11100);
  for (int64_t rows : {int64_t{1}, int64_t{8}, int64_t{64}, int64_t{256}}) {
    std::vector<float> logits(static_cast<size_t>(rows * V));
    for (auto& v : logits) v = static_cast<float>(rng.normal() * 3.0);
    DeviceBuffer dl = upload(logits), scratch = sample_scratch(rows, V), dout(rows * sizeof(ops::SampleResult));
    for (int mode = 0; mode < 3; ++mode) {
      std::vector<ops::SampleSpec> spec(static_cast<size_t>(rows));
      for (auto& s : spec) {
        s.temperature = mode == 2 ? 0.7f : 0.0f;
        s.top_p = 0.9f;
        s.draft = static_cast<int32_t>(rng.below(V));
        s.logprob = mode >= 1;
        s.u_accept = rng.uniform();
        s.u_draw = rng.uniform();
      }
      const ops::SampleNeeds needs = ops::sample_needs(spec.data(), rows);
      DeviceBuffer ds = upload(spec);
      cudaEvent_t e0, e1;
      cudaEventCreate(&e0);
      cudaEventCreate(&e1);
      auto call = [&] {
        return ops::cuda::sample_rows(dl.get<float>(), rows, V, ds.get<ops::SampleSpec>(), dout.get<ops::SampleResult>(),
                                      scratch.get(), scratch.bytes(), st(), needs);
      };
      for (int i = 0; i < 3; ++i) ASSERT_EQ(call(), 0);
      const int iters = 20;
      cudaEventRecord(e0, st());
      for (int i = 0; i < iters; ++i) call();
      cudaEventRecord(e1, st());
      cudaEventSynchronize(e1);
      float ms = 0;
      cudaEventElapsedTime(&ms, e0, e1);
      const double us = 1e3 * ms / iters;
      const double floor_us = 1e6 * rows * V * 4.0 / 4.4e12;
      const char* what = mode == 0 ? "greedy" : mode == 1 ? "greedy logprob" : "T 0.7 top_p 0.9 draft logprob";
      char line[240];
      std::snprintf(line, sizeof line,
                    "[ gpu ] sample_rows V %lld rows %lld %s: %.1f us (HBM floor of one read %.2f us, %.1fx)\n",
                    static_cast<long long>(V), static_cast<long long>(rows), what, us, floor_us, us / floor_us);
      report(line);
      cudaEventDestroy(e0);
      cudaEventDestroy(e1);
    }
  }
}

}  // namespace
}  // namespace k3
