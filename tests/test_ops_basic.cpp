// RMSNorm / LayerNorm, AttnRes, linear, embedding and sampling, each checked
// against an independent float64 reference written here from kimi-k3.md
// section 2 and the op headers (never from the code under test). References
// apply the bf16 roundings the spec prescribes, so bf16 outputs must agree to
// about one bf16 ulp of the output scale.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "core/bf16.h"
#include "core/error.h"
#include "core/rng.h"
#include "test_util.h"
#include "ops/attn_res.h"
#include "ops/embedding.h"
#include "ops/linear.h"
#include "ops/rmsnorm.h"
#include "ops/sampling.h"

namespace {

using k3::bf16;
using k3::Rng;

constexpr int64_t kDims[] = {1, 7, 64, 129, 300};
constexpr int64_t kRows[] = {1, 3, 17};

using k3::testing::rand_act;

// Random BF16 weights around `mean`, never zero.
std::vector<bf16> rand_w(Rng& rng, size_t n, double sd, double mean = 0.0) {
  std::vector<bf16> w(n);
  for (auto& x : w) {
    do {
      x = k3::to_bf16(static_cast<float>(mean + rng.normal() * sd));
    } while (k3::to_float(x) == 0.f);
  }
  return w;
}

using k3::testing::bf;
using k3::testing::rand_f32;
double wv(const std::vector<bf16>& w, size_t i) { return static_cast<double>(k3::to_float(w[i])); }

double rms_of(const std::vector<double>& r, size_t off, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; ++i) s += r[off + i] * r[off + i];
  return std::sqrt(s / static_cast<double>(n));
}

// BF16 outputs, row by row: bf16-representable and |got - ref| <= 2^-7 max(|ref|, rms(ref row)).
void expect_bf16_rows(const float* got, const std::vector<double>& ref, size_t rows, size_t dim, const std::string& what) {
  int bad = 0;
  for (size_t r = 0; r < rows; ++r) {
    const double scale = rms_of(ref, r * dim, dim);
    for (size_t i = 0; i < dim; ++i) {
      const size_t j = r * dim + i;
      const double tol = 0x1p-7 * std::max(std::fabs(ref[j]), scale);
      const bool ok = std::fabs(got[j] - ref[j]) <= tol && k3::round_bf16(got[j]) == got[j];
      if (!ok && bad++ < 5) {
        ADD_FAILURE() << what << ": [" << r << ", " << i << "] got " << got[j] << " expected " << ref[j] << " tol "
                      << tol;
      }
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

// ---------------------------------------------------------------------------------------------
// Float64 references.

// RMSNorm(v; w) = bf16(w * bf16(v / sqrt(mean(v^2) + eps))) per row.
std::vector<double> ref_rmsnorm(const std::vector<float>& x, const std::vector<double>& w, size_t rows, size_t dim,
                                double eps, bool inner_round = true) {
  std::vector<double> out(rows * dim);
  for (size_t r = 0; r < rows; ++r) {
    double ms = 0;
    for (size_t i = 0; i < dim; ++i) ms += static_cast<double>(x[r * dim + i]) * x[r * dim + i];
    ms /= static_cast<double>(dim);
    for (size_t i = 0; i < dim; ++i) {
      double n = x[r * dim + i] / std::sqrt(ms + eps);
      if (inner_round) n = bf(n);
      out[r * dim + i] = bf(w[i] * n);
    }
  }
  return out;
}

std::vector<double> to_double(const std::vector<bf16>& w) {
  std::vector<double> d(w.size());
  for (size_t i = 0; i < w.size(); ++i) d[i] = wv(w, i);
  return d;
}

// ---------------------------------------------------------------------------------------------
// RMSNorm / LayerNorm

TEST(OpsRmsNorm, Bf16WeightMatchesReference) {
  Rng rng(101);
  for (int64_t rows : kRows) {
    for (int64_t dim : kDims) {
      auto x = rand_act(rng, rows * dim, 1.5);
      auto w = rand_w(rng, dim, 0.3, 1.0);
      std::vector<float> out(x.size());
      k3::ops::rmsnorm(x.data(), w.data(), out.data(), rows, dim, 1e-5f);
      auto ref = ref_rmsnorm(x, to_double(w), rows, dim, 1e-5);
      expect_bf16_rows(out.data(), ref, rows, dim, "rmsnorm bf16 w rows " + std::to_string(rows) + " dim " + std::to_string(dim));
      // In place (x aliases out) gives the same bits.
      std::vector<float> inplace = x;
      k3::ops::rmsnorm(inplace.data(), w.data(), inplace.data(), rows, dim, 1e-5f);
      EXPECT_EQ(inplace, out) << "in place rows " << rows << " dim " << dim;
    }
  }
}

TEST(OpsRmsNorm, F32WeightMatchesReference) {
  Rng rng(102);
  for (int64_t rows : kRows) {
    for (int64_t dim : kDims) {
      auto x = rand_act(rng, rows * dim, 0.7);
      auto w = rand_f32(rng, dim, 0.3, 1.0);
      std::vector<float> out(x.size());
      k3::ops::rmsnorm(x.data(), w.data(), out.data(), rows, dim, 1e-5f);
      std::vector<double> wd(w.begin(), w.end());
      auto ref = ref_rmsnorm(x, wd, rows, dim, 1e-5);
      expect_bf16_rows(out.data(), ref, rows, dim, "rmsnorm f32 w rows " + std::to_string(rows) + " dim " + std::to_string(dim));
    }
  }
}

// eps matters for small inputs: with mean(v^2) ~ eps the output is visibly below w.
TEST(OpsRmsNorm, EpsIsInsideTheSquareRoot) {
  Rng rng(103);
  const int64_t dim = 64;
  auto x = rand_act(rng, dim, 3e-3);
  auto w = rand_w(rng, dim, 0.2, 1.0);
  std::vector<float> out(dim);
  k3::ops::rmsnorm(x.data(), w.data(), out.data(), 1, dim, 1e-5f);
  expect_bf16_rows(out.data(), ref_rmsnorm(x, to_double(w), 1, dim, 1e-5), 1, dim, "rmsnorm small input");
  // Without eps the result would be larger by sqrt(1 + eps / mean(v^2)) > 1.05 here.
  auto no_eps = ref_rmsnorm(x, to_double(w), 1, dim, 0.0);
  double ratio = 0;
  for (int64_t i = 0; i < dim; ++i) ratio += no_eps[i] / out[i];
  EXPECT_GT(ratio / dim, 1.05);
}

// The inner bf16 of RMSNorm(v; w) = w * bf16(v / rms): outputs equal the reference that rounds
// there bit for bit almost everywhere, while the variant without it disagrees often.
TEST(OpsRmsNorm, InnerBf16RoundingIsApplied) {
  Rng rng(104);
  const int64_t rows = 16, dim = 300;
  auto x = rand_act(rng, rows * dim);
  auto w = rand_w(rng, dim, 0.5, 1.0);
  std::vector<float> out(x.size());
  k3::ops::rmsnorm(x.data(), w.data(), out.data(), rows, dim, 1e-5f);
  auto with = ref_rmsnorm(x, to_double(w), rows, dim, 1e-5, true);
  auto without = ref_rmsnorm(x, to_double(w), rows, dim, 1e-5, false);
  size_t eq_with = 0, eq_without = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    eq_with += out[i] == with[i];
    eq_without += out[i] == without[i];
  }
  EXPECT_GE(eq_with, out.size() * 995 / 1000);
  EXPECT_LT(eq_without, out.size() * 95 / 100);
}

TEST(OpsLayerNorm, MatchesReference) {
  Rng rng(105);
  for (int64_t rows : kRows) {
    for (int64_t dim : kDims) {
      auto x = rand_act(rng, rows * dim, 2.0);
      for (auto& v : x) v = k3::round_bf16(v + 0.75f);  // a non-zero mean to remove
      auto w = rand_w(rng, dim, 0.3, 1.0);
      auto b = rand_w(rng, dim, 0.2);
      std::vector<float> out(x.size());
      k3::ops::layernorm(x.data(), w.data(), b.data(), out.data(), rows, dim, 1e-5f);
      std::vector<double> ref(x.size());
      for (int64_t r = 0; r < rows; ++r) {
        double mu = 0, var = 0;
        for (int64_t i = 0; i < dim; ++i) mu += x[r * dim + i];
        mu /= dim;
        for (int64_t i = 0; i < dim; ++i) var += (x[r * dim + i] - mu) * (x[r * dim + i] - mu);
        var /= dim;
        for (int64_t i = 0; i < dim; ++i) {
          ref[r * dim + i] = bf(wv(w, i) * (x[r * dim + i] - mu) / std::sqrt(var + 1e-5) + wv(b, i));
        }
      }
      expect_bf16_rows(out.data(), ref, rows, dim, "layernorm rows " + std::to_string(rows) + " dim " + std::to_string(dim));
      std::vector<float> inplace = x;
      k3::ops::layernorm(inplace.data(), w.data(), b.data(), inplace.data(), rows, dim, 1e-5f);
      EXPECT_EQ(inplace, out);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// AttnRes

struct ArCase {
  int64_t rows, dim;
  int max_blocks, num_blocks, write_idx;
  bool with_delta, with_out_norm;
};

struct ArData {
  std::vector<float> prefix, delta, blocks, out;
  std::vector<bf16> norm_w, proj_w, out_norm_w;
};

ArData make_ar(Rng& rng, const ArCase& c) {
  ArData d;
  d.prefix = rand_act(rng, c.rows * c.dim);
  d.delta = rand_act(rng, c.rows * c.dim, 0.5);
  d.blocks = rand_act(rng, c.rows * c.max_blocks * c.dim);
  // Give every block its own scale so that raw and normalized sources differ.
  for (int64_t r = 0; r < c.rows; ++r) {
    for (int b = 0; b < c.max_blocks; ++b) {
      const float s = std::ldexp(1.0f, (b % 5) - 2);  // 1/4 .. 4, exact
      for (int64_t i = 0; i < c.dim; ++i) d.blocks[(r * c.max_blocks + b) * c.dim + i] *= s;
    }
  }
  d.norm_w = rand_w(rng, c.dim, 0.3, 1.0);
  d.proj_w = rand_w(rng, c.dim, 1.5 / std::sqrt(static_cast<double>(c.dim)));
  d.out_norm_w = rand_w(rng, c.dim, 0.3, 1.0);
  d.out.assign(c.rows * c.dim, -7.0f);
  return d;
}

k3::ops::AttnResArgs args_of(ArData& d, const ArCase& c, float eps = 1e-5f) {
  k3::ops::AttnResArgs a;
  a.prefix = d.prefix.data();
  a.delta = c.with_delta ? d.delta.data() : nullptr;
  a.blocks = d.blocks.data();
  a.max_blocks = c.max_blocks;
  a.norm_w = d.norm_w.data();
  a.proj_w = d.proj_w.data();
  a.out_norm_w = c.with_out_norm ? d.out_norm_w.data() : nullptr;
  a.num_blocks = c.num_blocks;
  a.block_write_idx = c.write_idx;
  a.eps = eps;
  a.out_eps = 1e-5f;
  a.out = d.out.data();
  a.rows = c.rows;
  a.dim = c.dim;
  return a;
}

struct ArRef {
  std::vector<double> prefix, blocks, out;
};

// The header's math in float64, from copies of the inputs.
ArRef ref_attn_res(const ArData& d, const ArCase& c, double eps = 1e-5) {
  const size_t D = c.dim;
  ArRef r;
  r.prefix.assign(d.prefix.begin(), d.prefix.end());
  r.blocks.assign(d.blocks.begin(), d.blocks.end());
  r.out.assign(c.rows * D, 0.0);
  for (int64_t row = 0; row < c.rows; ++row) {
    double* p = &r.prefix[row * D];
    if (c.with_delta) {
      for (size_t i = 0; i < D; ++i) p[i] = bf(p[i] + d.delta[row * D + i]);
    }
    double* blk = &r.blocks[row * c.max_blocks * D];
    if (c.write_idx >= 0) std::copy(p, p + D, blk + c.write_idx * D);
    std::vector<const double*> src;
    for (int b = 0; b < c.num_blocks; ++b) src.push_back(blk + b * D);
    src.push_back(p);
    std::vector<double> score;
    for (const double* V : src) {
      double ms = 0;
      for (size_t i = 0; i < D; ++i) ms += V[i] * V[i];
      ms /= static_cast<double>(D);
      double s = 0;
      for (size_t i = 0; i < D; ++i) s += wv(d.norm_w, i) * V[i] / std::sqrt(ms + eps) * wv(d.proj_w, i);
      score.push_back(s);
    }
    const double mx = *std::max_element(score.begin(), score.end());
    double z = 0;
    for (double s : score) z += std::exp(s - mx);
    std::vector<float> mix(D);
    for (size_t i = 0; i < D; ++i) {
      double m = 0;
      for (size_t s = 0; s < src.size(); ++s) m += std::exp(score[s] - mx) / z * src[s][i];
      mix[i] = static_cast<float>(bf(m));
    }
    if (c.with_out_norm) {
      auto n = ref_rmsnorm(mix, to_double(d.out_norm_w), 1, D, 1e-5);
      std::copy(n.begin(), n.end(), &r.out[row * D]);
    } else {
      std::copy(mix.begin(), mix.end(), &r.out[row * D]);
    }
  }
  return r;
}

void expect_exact(const std::vector<float>& got, const std::vector<double>& ref, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size());
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != ref[i] && bad++ < 5) ADD_FAILURE() << what << "[" << i << "] got " << got[i] << " expected " << ref[i];
  }
  EXPECT_EQ(bad, 0) << what;
}

void check_ar(Rng& rng, const ArCase& c) {
  const std::string what = "attn_res rows " + std::to_string(c.rows) + " dim " + std::to_string(c.dim) + " blocks " +
                           std::to_string(c.num_blocks) + " write " + std::to_string(c.write_idx) +
                           (c.with_delta ? " delta" : "") + (c.with_out_norm ? " out_norm" : "");
  ArData d = make_ar(rng, c);
  ArRef ref = ref_attn_res(d, c);
  k3::ops::attn_res(args_of(d, c));
  expect_exact(d.prefix, ref.prefix, what + " prefix");
  expect_exact(d.blocks, ref.blocks, what + " blocks");
  expect_bf16_rows(d.out.data(), ref.out, c.rows, c.dim, what + " out");
}

TEST(OpsAttnRes, NoBlocksReturnsP) {
  Rng rng(201);
  for (int64_t rows : kRows) {
    for (int64_t dim : kDims) {
      // Raw: the single source gets weight 1, so out == p = bf16(prefix + delta) exactly,
      // p is written back to prefix and stored in blocks[:, 0]; blocks[:, 1] is untouched.
      ArCase c{rows, dim, 2, 0, 0, true, false};
      ArData d = make_ar(rng, c);
      const auto prefix0 = d.prefix;
      const auto blocks0 = d.blocks;
      k3::ops::attn_res(args_of(d, c));
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t i = 0; i < dim; ++i) {
          const size_t j = r * dim + i;
          const float p = k3::round_bf16(prefix0[j] + d.delta[j]);
          ASSERT_EQ(d.out[j], p) << r << "," << i;
          ASSERT_EQ(d.prefix[j], p);
          ASSERT_EQ(d.blocks[(r * 2 + 0) * dim + i], p);
          ASSERT_EQ(d.blocks[(r * 2 + 1) * dim + i], blocks0[(r * 2 + 1) * dim + i]);
        }
      }
      // With the out norm: RMSNorm(p; out_norm_w).
      ArCase cn{rows, dim, 2, 0, -1, true, true};
      ArData dn = make_ar(rng, cn);
      std::vector<float> p(rows * dim);
      for (size_t j = 0; j < p.size(); ++j) p[j] = k3::round_bf16(dn.prefix[j] + dn.delta[j]);
      const auto blocks_n = dn.blocks;
      k3::ops::attn_res(args_of(dn, cn));
      EXPECT_EQ(dn.prefix, p);
      EXPECT_EQ(dn.blocks, blocks_n);  // no write
      expect_bf16_rows(dn.out.data(), ref_rmsnorm(p, to_double(dn.out_norm_w), rows, dim, 1e-5), rows, dim,
                       "attn_res no blocks, out norm");
    }
  }
  // Without delta: p is the prefix itself, unchanged.
  ArCase c{3, 64, 1, 0, -1, false, false};
  ArData d = make_ar(rng, c);
  const auto prefix0 = d.prefix;
  k3::ops::attn_res(args_of(d, c));
  EXPECT_EQ(d.prefix, prefix0);
  EXPECT_EQ(d.out, prefix0);
}

TEST(OpsAttnRes, SeveralBlocksMatchReference) {
  Rng rng(202);
  for (int64_t rows : kRows) {
    for (int64_t dim : kDims) {
      for (int nb : {1, 3, 8}) {
        check_ar(rng, ArCase{rows, dim, 9, nb, -1, true, true});
        check_ar(rng, ArCase{rows, dim, 9, nb, -1, true, false});
        check_ar(rng, ArCase{rows, dim, 9, nb, -1, false, true});
      }
    }
  }
}

// block_write_idx stores p = bf16(prefix + delta), leaving the other blocks alone; when the
// written block is among the mixed ones the mix sees the new value (write before mix).
TEST(OpsAttnRes, BlockWriteStoresP) {
  Rng rng(203);
  for (int64_t rows : kRows) {
    for (int64_t dim : {int64_t{7}, int64_t{129}}) {
      for (int wi : {0, 2, 4}) {
        // wi == num_blocks: the layer-start pattern (the snapshot is not mixed in this call).
        check_ar(rng, ArCase{rows, dim, 9, wi, wi, true, true});
        check_ar(rng, ArCase{rows, dim, 9, 3, wi, true, false});
      }
      ArCase c{rows, dim, 5, 2, 3, true, false};
      ArData d = make_ar(rng, c);
      const auto blocks0 = d.blocks;
      std::vector<float> p(rows * dim);
      for (size_t j = 0; j < p.size(); ++j) p[j] = k3::round_bf16(d.prefix[j] + d.delta[j]);
      k3::ops::attn_res(args_of(d, c));
      for (int64_t r = 0; r < rows; ++r) {
        for (int b = 0; b < 5; ++b) {
          for (int64_t i = 0; i < dim; ++i) {
            const size_t j = (r * 5 + b) * dim + i;
            ASSERT_EQ(d.blocks[j], b == 3 ? p[r * dim + i] : blocks0[j]) << "row " << r << " block " << b;
          }
        }
      }
    }
  }
}

// The softmax weights multiply the raw sources, not the normalized ones.
TEST(OpsAttnRes, MixUsesRawSources) {
  Rng rng(204);
  const int64_t dim = 129;
  const auto u = rand_act(rng, dim);
  const auto norm_w = rand_w(rng, dim, 0.3, 1.0);
  const auto proj_w = rand_w(rng, dim, 0.2);
  // Sources 4u, 2u, u (blocks) and u (p); with eps = 0 all normalize to the same vector,
  // so the scores tie, alpha = 1/4 each, and the mix is exactly (4 + 2 + 1 + 1) / 4 u = 2u.
  {
    std::vector<float> prefix = u, blocks(3 * dim), out(dim);
    for (int64_t i = 0; i < dim; ++i) {
      blocks[i] = 4 * u[i];
      blocks[dim + i] = 2 * u[i];
      blocks[2 * dim + i] = u[i];
    }
    k3::ops::AttnResArgs a;
    a.prefix = prefix.data();
    a.blocks = blocks.data();
    a.max_blocks = 3;
    a.num_blocks = 3;
    a.norm_w = norm_w.data();
    a.proj_w = proj_w.data();
    a.eps = 0.0f;
    a.out = out.data();
    a.rows = 1;
    a.dim = dim;
    k3::ops::attn_res(a);
    for (int64_t i = 0; i < dim; ++i) ASSERT_EQ(out[i], 2 * u[i]) << i;
  }
  // Sources 4u (block) and -u (p): scores z and -z with z = dot(norm_w u / rms(u), proj_w),
  // alpha_0 = e^z / (e^z + e^-z), mix = (4 alpha_0 - (1 - alpha_0)) u.
  {
    std::vector<float> prefix(dim), blocks(dim), out(dim);
    double ms = 0, z = 0;
    for (int64_t i = 0; i < dim; ++i) ms += static_cast<double>(u[i]) * u[i];
    ms /= dim;
    for (int64_t i = 0; i < dim; ++i) {
      prefix[i] = -u[i];
      blocks[i] = 4 * u[i];
      z += wv(norm_w, i) * u[i] / std::sqrt(ms) * wv(proj_w, i);
    }
    ASSERT_GT(std::fabs(z), 0.2);  // a non-trivial softmax
    const double a0 = std::exp(z) / (std::exp(z) + std::exp(-z));
    k3::ops::AttnResArgs a;
    a.prefix = prefix.data();
    a.blocks = blocks.data();
    a.max_blocks = 1;
    a.num_blocks = 1;
    a.norm_w = norm_w.data();
    a.proj_w = proj_w.data();
    a.eps = 0.0f;
    a.out = out.data();
    a.rows = 1;
    a.dim = dim;
    k3::ops::attn_res(a);
    std::vector<double> ref(dim);
    for (int64_t i = 0; i < dim; ++i) ref[i] = bf((4 * a0 - (1 - a0)) * u[i]);
    expect_bf16_rows(out.data(), ref, 1, dim, "attn_res two opposite sources");
  }
}

TEST(OpsAttnRes, BadIndicesThrow) {
  Rng rng(205);
  ArCase c{1, 7, 2, 3, -1, true, false};
  ArData d = make_ar(rng, c);
  EXPECT_THROW(k3::ops::attn_res(args_of(d, c)), k3::Error);  // num_blocks > max_blocks
  ArCase c2{1, 7, 2, 1, 2, true, false};
  EXPECT_THROW(k3::ops::attn_res(args_of(d, c2)), k3::Error);  // write index out of range
}

// ---------------------------------------------------------------------------------------------
// Linear

TEST(OpsLinear, RoundOutFalseVsTrue) {
  Rng rng(301);
  size_t not_bf16 = 0, total = 0;
  for (int64_t rows : kRows) {
    for (int64_t in : kDims) {
      for (int64_t out : {int64_t{1}, int64_t{7}, int64_t{64}, int64_t{129}}) {
        auto x = rand_act(rng, rows * in);
        auto w = rand_w(rng, out * in, 1.0 / std::sqrt(static_cast<double>(in)));
        std::vector<float> y32(rows * out), y16(rows * out);
        k3::ops::linear(x.data(), w.data(), y32.data(), rows, in, out, false);
        k3::ops::linear(x.data(), w.data(), y16.data(), rows, in, out, true);
        std::vector<double> ref(rows * out), mag(rows * out);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t o = 0; o < out; ++o) {
            double s = 0, m = 0;
            for (int64_t i = 0; i < in; ++i) {
              s += static_cast<double>(x[r * in + i]) * wv(w, o * in + i);
              m += std::fabs(static_cast<double>(x[r * in + i]) * wv(w, o * in + i));
            }
            ref[r * out + o] = s;
            mag[r * out + o] = m;
          }
        }
        const std::string what = "linear rows " + std::to_string(rows) + " in " + std::to_string(in) + " out " +
                                 std::to_string(out);
        int bad = 0;
        for (size_t j = 0; j < ref.size(); ++j) {
          // FP32 accumulation: within 1e-5 of the sum of |terms| (cancellation-proof).
          const double tol32 = 1e-5 * mag[j] + 1e-30;
          if (std::fabs(y32[j] - ref[j]) > tol32 && bad++ < 5) {
            ADD_FAILURE() << what << " fp32 [" << j << "] got " << y32[j] << " expected " << ref[j];
          }
          // The rounded output is the bf16 rounding of the FP32 output.
          if (y16[j] != k3::round_bf16(y32[j]) && bad++ < 5) {
            ADD_FAILURE() << what << " bf16 [" << j << "] got " << y16[j] << " fp32 " << y32[j];
          }
          not_bf16 += k3::round_bf16(y32[j]) != y32[j];
          ++total;
        }
        EXPECT_EQ(bad, 0) << what;
        // And the rounded output is within a bf16 ulp of the exact result.
        std::vector<double> ref16(ref.size());
        for (size_t j = 0; j < ref.size(); ++j) ref16[j] = bf(ref[j]);
        expect_bf16_rows(y16.data(), ref16, rows, out, what + " rounded");
      }
    }
  }
  // round_out = false really keeps FP32: most outputs are not bf16-representable.
  EXPECT_GT(not_bf16, total * 9 / 10);
}

// linear_add: y = bf16(x W^T + y), the FP32 sum and y's BF16 value rounded once. Against a float64 loop
// (within a BF16 rounding of the exact sum plus y), bitwise against the definition on the FP32 linear, and
// the single rounding seen: some outputs differ from adding the BF16-rounded projection to y.
TEST(OpsLinear, AddRoundsTheSumAndYOnce) {
  Rng rng(303);
  size_t differs = 0, total = 0;
  for (int64_t rows : kRows) {
    for (int64_t in : kDims) {
      for (int64_t out : {int64_t{1}, int64_t{7}, int64_t{129}}) {
        auto x = rand_act(rng, rows * in);
        auto w = rand_w(rng, out * in, 1.0 / std::sqrt(static_cast<double>(in)));
        std::vector<float> y0 = rand_act(rng, rows * out);
        for (auto& v : y0) v = k3::round_bf16(v);
        std::vector<float> y = y0, y32(rows * out);
        k3::ops::linear_add(x.data(), w.data(), y.data(), rows, in, out);
        k3::ops::linear(x.data(), w.data(), y32.data(), rows, in, out, false);
        std::vector<double> ref(rows * out);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t o = 0; o < out; ++o) {
            double sum = y0[r * out + o];
            for (int64_t i = 0; i < in; ++i) sum += static_cast<double>(x[r * in + i]) * wv(w, o * in + i);
            ref[r * out + o] = sum;
          }
        const std::string what = "linear_add rows " + std::to_string(rows) + " in " + std::to_string(in) + " out " +
                                 std::to_string(out);
        expect_bf16_rows(y.data(), ref, rows, out, what);
        int bad = 0;
        for (size_t j = 0; j < y.size(); ++j) {
          if (y[j] != k3::round_bf16(y32[j] + y0[j]) && bad++ < 5)
            ADD_FAILURE() << what << " [" << j << "] got " << y[j] << " want bf16(" << y32[j] << " + " << y0[j] << ")";
          differs += y[j] != k3::round_bf16(k3::round_bf16(y32[j]) + y0[j]);
          ++total;
        }
        EXPECT_EQ(bad, 0) << what;
      }
    }
  }
  EXPECT_GT(differs, 0u) << "of " << total << ": rounding the projection first never changed an output";
  EXPECT_THROW(k3::ops::linear_add(nullptr, nullptr, nullptr, 1, 0, 1), k3::Error);
}

// Rows are independent and each output uses its own weight row (catches transposed indexing).
TEST(OpsLinear, OneHotInputsPickWeightColumns) {
  Rng rng(302);
  const int64_t in = 129, out = 7;
  auto w = rand_w(rng, out * in, 1.0);
  std::vector<float> x(3 * in, 0.0f);
  const int64_t cols[3] = {0, 64, 128};
  for (int r = 0; r < 3; ++r) x[r * in + cols[r]] = 1.0f;
  std::vector<float> y(3 * out);
  k3::ops::linear(x.data(), w.data(), y.data(), 3, in, out, true);
  for (int r = 0; r < 3; ++r) {
    for (int64_t o = 0; o < out; ++o) EXPECT_EQ(y[r * out + o], k3::to_float(w[o * in + cols[r]])) << r << "," << o;
  }
}

// ---------------------------------------------------------------------------------------------
// Embedding

TEST(OpsEmbedding, LooksUpRows) {
  Rng rng(401);
  for (int64_t dim : kDims) {
    const int64_t vocab = 37;
    auto vals = rand_act(rng, vocab * dim);
    std::vector<bf16> table(vals.size());
    for (size_t i = 0; i < vals.size(); ++i) table[i] = k3::to_bf16(vals[i]);
    std::vector<int32_t> ids = {0, 36, 5, 5, 17, 1, 36};
    std::vector<float> out(ids.size() * dim, -1.0f);
    k3::ops::embedding(ids.data(), static_cast<int64_t>(ids.size()), table.data(), vocab, dim, out.data());
    for (size_t r = 0; r < ids.size(); ++r) {
      for (int64_t i = 0; i < dim; ++i) ASSERT_EQ(out[r * dim + i], vals[ids[r] * dim + i]) << r << "," << i;
    }
  }
}

TEST(OpsEmbedding, OutOfRangeIdThrowsAndLeavesOutUntouched) {
  Rng rng(402);
  const int64_t vocab = 50, dim = 7;
  auto table = rand_w(rng, vocab * dim, 1.0);
  for (int32_t bad : {50, -1, 1000}) {
    std::vector<int32_t> ids = {3, 49, bad};  // the bad id comes last: nothing may be written before the check
    std::vector<float> out(ids.size() * dim, 12.5f);
    try {
      k3::ops::embedding(ids.data(), 3, table.data(), vocab, dim, out.data());
      ADD_FAILURE() << "id " << bad << " accepted";
    } catch (const k3::Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(std::to_string(bad)), std::string::npos) << msg;
      EXPECT_NE(msg.find(std::to_string(vocab)), std::string::npos) << msg;
    }
    for (float v : out) ASSERT_EQ(v, 12.5f) << "id " << bad;
  }
}

// ---------------------------------------------------------------------------------------------
// Sampling

namespace sampling_ref {

using k3::ops::SampleResult;
using k3::ops::SampleSpec;

SampleResult one(const std::vector<float>& logits, const SampleSpec& s) {
  SampleResult r;
  k3::ops::sample_rows(logits.data(), 1, static_cast<int64_t>(logits.size()), &s, &r);
  return r;
}

SampleSpec spec(float T, float top_p, int32_t draft = -1, double ua = 0.0, double ud = 0.0, bool lp = false) {
  SampleSpec s;
  s.temperature = T;
  s.top_p = top_p;
  s.draft = draft;
  s.u_accept = ua;
  s.u_draw = ud;
  s.logprob = lp;
  return s;
}

// The kept distribution from the math, in float64: p = softmax(l / T); sort by (p desc, id asc); the smallest
// prefix whose mass reaches top_p (top_p = 1: all); renormalized. Zero outside the kept set.
std::vector<double> kept_probs(const std::vector<float>& l, double T, double top_p) {
  const size_t V = l.size();
  const double mx = *std::max_element(l.begin(), l.end());
  std::vector<double> p(V);
  double z = 0;
  for (size_t i = 0; i < V; ++i) z += p[i] = std::exp((l[i] - mx) / T);
  std::vector<size_t> order(V);
  for (size_t i = 0; i < V; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return p[a] > p[b]; });
  std::vector<double> q(V, 0.0);
  double kept = 0;
  size_t k = 0;
  if (top_p >= 1.0) {
    k = V;
    kept = z;
  } else {
    while (k < V && kept < top_p * z) kept += p[order[k++]];
  }
  for (size_t j = 0; j < k; ++j) q[order[j]] = p[order[j]] / kept;
  return q;
}

// The first id (in id order) of positive q whose cumulative exceeds u * sum(q); the last such id if none.
int32_t walk(const std::vector<double>& q, double u) {
  double total = 0;
  for (double v : q) total += v;
  double cum = 0;
  int32_t last = -1;
  for (size_t i = 0; i < q.size(); ++i) {
    if (q[i] <= 0) continue;
    cum += q[i];
    last = static_cast<int32_t>(i);
    if (cum > u * total) break;
  }
  return last;
}

}  // namespace sampling_ref

TEST(OpsSampling, GreedyArgmaxTiesToLowerId) {
  using namespace sampling_ref;
  Rng rng(501);
  for (int64_t vocab : {int64_t{1}, int64_t{7}, int64_t{300}, int64_t{4097}}) {
    auto logits = rand_f32(rng, vocab, 3.0);
    int64_t best = 0;
    for (int64_t i = 0; i < vocab; ++i) best = logits[i] > logits[best] ? i : best;
    EXPECT_EQ(one(logits, spec(0, 1)).token, best);
    // A greedy draft is accepted iff it is the argmax; the uniforms do not matter.
    EXPECT_EQ(one(logits, spec(0, 1, static_cast<int32_t>(best), 0.99, 0.5)).accepted, 1);
    if (vocab > 1) EXPECT_EQ(one(logits, spec(0, 1, static_cast<int32_t>((best + 1) % vocab), 0.0, 0.0)).accepted, 0);
  }
  EXPECT_EQ(one({0.5f, 2.0f, -1.0f, 2.0f, 2.0f, 1.9f}, spec(0, 1)).token, 1);
  EXPECT_EQ(one({-3.0f, -2.0f, -1.0f}, spec(0, 1)).token, 2);
  EXPECT_EQ(one({-5.0f, -4.0f, -4.0f}, spec(0, 1)).token, 1);
  // NaN is -inf (never chosen, also at id 0); +inf is the largest; all -inf gives 0, sampled or not.
  EXPECT_EQ(one({NAN, -4.0f, -3.0f}, spec(0, 1)).token, 2);
  EXPECT_EQ(one({NAN, -4.0f, -3.0f}, spec(1, 1, -1, 0, 0.999)).token, 2);
  EXPECT_EQ(one({1.0f, INFINITY, 3.0f, INFINITY}, spec(0, 1)).token, 1);
  EXPECT_EQ(one({-INFINITY, -INFINITY}, spec(0.7f, 0.5f, -1, 0, 0.9)).token, 0);
}

TEST(OpsSampling, TinyTopPReturnsArgmax) {
  using namespace sampling_ref;
  Rng data(502);
  for (int64_t vocab : {int64_t{2}, int64_t{7}, int64_t{300}}) {
    auto logits = rand_f32(data, vocab, 2.0);
    const int32_t best = one(logits, spec(0, 1)).token;
    for (int i = 0; i < 50; ++i)
      for (float t : {0.3f, 1.0f, 5.0f}) EXPECT_EQ(one(logits, spec(t, 1e-6f, -1, 0, data.uniform())).token, best);
  }
  for (int i = 0; i < 50; ++i)  // a tie for the maximum goes to the lower id
    EXPECT_EQ(one({0.1f, 3.0f, 3.0f, -1.0f}, spec(1.0f, 1e-6f, -1, 0, data.uniform())).token, 1);
}

// sample_rows against the float64 reference written from the math above: random logits (some with many
// ties), several T / top_p, no draft, a random draft, the argmax as the draft; ids and flags exact, the
// log-prob against the log-softmax. Several rows per call (each row its own spec).
TEST(OpsSampling, MatchesFloat64Reference) {
  using namespace sampling_ref;
  Rng data(505);
  int sampled = 0, accepted = 0, rejected = 0;
  for (int64_t V : {int64_t{7}, int64_t{300}, int64_t{5003}}) {
    for (bool ties : {false, true}) {
      std::vector<float> l(static_cast<size_t>(V));
      for (auto& x : l) {
        x = static_cast<float>(data.normal() * 3.0);
        if (ties) x = std::round(x * 4.0f) / 4.0f;
      }
      const int32_t best = static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
      double mx = l[best], z1 = 0;
      for (float x : l) z1 += std::exp(x - mx);
      std::vector<SampleSpec> specs;
      std::vector<int32_t> want_tok, want_acc;
      for (float T : {0.0f, 0.6f, 1.3f}) {
        for (float top_p : {0.05f, 0.3f, 0.9f, 1.0f}) {
          const std::vector<double> q = T > 0 ? kept_probs(l, T, top_p) : std::vector<double>{};
          for (int rep = 0; rep < 12; ++rep) {
            const int32_t draft = rep % 3 == 0 ? -1 : rep % 3 == 1 ? static_cast<int32_t>(data.below(V)) : best;
            const double ua = data.uniform(), ud = data.uniform();
            specs.push_back(spec(T, top_p, draft, ua, ud, true));
            int32_t tok;
            int32_t acc = 0;
            if (T == 0) {
              tok = best;
              acc = draft == best;
            } else if (draft >= 0 && ua < q[draft]) {
              tok = draft;
              acc = 1;
            } else {
              std::vector<double> res = q;
              if (draft >= 0) res[draft] = 0;
              tok = walk(res, ud);
            }
            want_tok.push_back(tok);
            want_acc.push_back(acc);
          }
        }
      }
      std::vector<SampleResult> got(specs.size());
      k3::ops::sample_rows(nullptr, 0, V, nullptr, nullptr);  // zero rows: nothing read
      std::vector<float> rows;
      for (size_t i = 0; i < specs.size(); ++i) rows.insert(rows.end(), l.begin(), l.end());
      k3::ops::sample_rows(rows.data(), static_cast<int64_t>(specs.size()), V, specs.data(), got.data());
      for (size_t i = 0; i < specs.size(); ++i) {
        SCOPED_TRACE(testing::Message() << "V " << V << " ties " << ties << " T " << specs[i].temperature << " top_p "
                                        << specs[i].top_p << " draft " << specs[i].draft << " row " << i);
        ASSERT_EQ(got[i].token, want_tok[i]);
        ASSERT_EQ(got[i].accepted, want_acc[i]);
        EXPECT_NEAR(got[i].logprob, l[want_tok[i]] - mx - std::log(z1), 1e-5);
        sampled += specs[i].temperature > 0;
        accepted += specs[i].draft >= 0 && want_acc[i];
        rejected += specs[i].draft >= 0 && !want_acc[i];
      }
    }
  }
  EXPECT_GT(sampled, 400);
  EXPECT_GT(accepted, 50);  // both branches of the rule are exercised
  EXPECT_GT(rejected, 50);
}

// The rejection rule keeps the distribution: whatever the draft (none, inside or outside the kept set), the
// output token's frequencies over many (u_accept, u_draw) pairs match p_kept (chi-square, df = |K| - 1), tokens
// outside K never appear, and a draft is accepted at rate p_kept(draft).
TEST(OpsSampling, RejectionRulePreservesTheDistribution) {
  using namespace sampling_ref;
  const std::vector<float> logits = {1.0f, 0.2f, 1.9f, -1.0f, 0.0f, 1.6f, -0.5f};
  const int V = static_cast<int>(logits.size());
  const int N = 100000;
  Rng rng(506);
  for (float top_p : {1.0f, 0.8f}) {
    const float T = 0.8f;
    const std::vector<double> q = kept_probs(logits, T, top_p);
    int kept = 0;
    for (double v : q) kept += v > 0;
    ASSERT_EQ(kept, top_p < 1 ? 3 : V);
    for (int32_t draft = -1; draft < V; ++draft) {
      std::vector<int> count(V, 0);
      int acc = 0;
      for (int n = 0; n < N; ++n) {
        const SampleSpec s = spec(T, top_p, draft, rng.uniform(), rng.uniform());
        const SampleResult r = one(logits, s);
        ASSERT_TRUE(r.token >= 0 && r.token < V);
        ++count[r.token];
        acc += r.accepted;
      }
      double chi2 = 0;
      for (int i = 0; i < V; ++i) {
        if (q[i] == 0) {
          EXPECT_EQ(count[i], 0) << "draft " << draft << ": token " << i << " is outside the kept set";
          continue;
        }
        const double e = q[i] * N;
        chi2 += (count[i] - e) * (count[i] - e) / e;
      }
      // df <= 6: P(chi2 > 40) < 1e-6.
      EXPECT_LT(chi2, 40.0) << "top_p " << top_p << " draft " << draft;
      if (draft >= 0) {
        const double pa = q[draft], sigma = std::sqrt(pa * (1 - pa) / N) + 1e-12;
        EXPECT_LE(std::fabs(static_cast<double>(acc) / N - pa), 5 * sigma + 1e-9) << "draft " << draft;
      }
    }
  }
  // The test can fail: a rule that always accepts an outside-K draft's neighbour would skew the counts; here a
  // biased stream (u_draw in [0, 0.5)) must be caught by the same statistic.
  const std::vector<double> q = kept_probs(logits, 0.8f, 1.0f);
  std::vector<int> count(V, 0);
  for (int n = 0; n < N; ++n) ++count[one(logits, spec(0.8f, 1.0f, -1, 0, 0.5 * rng.uniform())).token];
  double chi2 = 0;
  for (int i = 0; i < V; ++i) chi2 += (count[i] - q[i] * N) * (count[i] - q[i] * N) / (q[i] * N);
  EXPECT_GT(chi2, 40.0);
}

TEST(OpsSampling, BadSpecsThrow) {
  using namespace sampling_ref;
  const std::vector<float> logits = {0.5f, 1.0f, -0.25f};
  for (float t : {-1.0f, NAN, INFINITY, -INFINITY}) EXPECT_THROW(one(logits, spec(t, 0.9f)), k3::Error) << t;
  for (float tp : {0.0f, -0.1f, 1.0001f, NAN, INFINITY}) EXPECT_THROW(one(logits, spec(1, tp)), k3::Error) << tp;
  for (int32_t d : {-2, 3, 100}) EXPECT_THROW(one(logits, spec(1, 1, d)), k3::Error) << d;
  for (double u : {-0.1, 1.0, 2.0, double(NAN)}) {
    EXPECT_THROW(one(logits, spec(1, 1, 0, u, 0.5)), k3::Error) << u;
    EXPECT_THROW(one(logits, spec(1, 1, 0, 0.5, u)), k3::Error) << u;
  }
  EXPECT_NO_THROW(one(logits, spec(1e-3f, 1.0f, 2, 0.999, 0.999)));
}

// The phases a batch needs on the device (ops::sample_needs): exactly what its rows ask for; a top-p below 1 on a
// greedy row needs nothing; no rows need nothing.
TEST(OpsSampling, SampleNeeds) {
  using namespace sampling_ref;
  auto needs = [](std::vector<SampleSpec> v) {
    const k3::ops::SampleNeeds n = k3::ops::sample_needs(v.data(), static_cast<int64_t>(v.size()));
    return std::string(n.sampled ? "s" : "-") + (n.top_p ? "p" : "-") + (n.logprob ? "l" : "-");
  };
  EXPECT_EQ(needs({}), "---");
  EXPECT_EQ(needs({spec(0, 1), spec(0, 0.5f, 3)}), "---");
  EXPECT_EQ(needs({spec(0, 1), spec(0, 0.5f, -1, 0, 0, true)}), "--l");
  EXPECT_EQ(needs({spec(0, 0.5f), spec(0.7f, 1)}), "s--");
  EXPECT_EQ(needs({spec(0.7f, 1), spec(0, 1), spec(1.0f, 0.9f)}), "sp-");
  EXPECT_EQ(needs({spec(1.0f, 0.9f, -1, 0, 0, true)}), "spl");
  const k3::ops::SampleNeeds all;  // the default: every phase
  EXPECT_TRUE(all.sampled && all.top_p && all.logprob);
}

// The parameters as a caller (the CLI) gives them: temperature 0 is greedy, so allowed there; NaN, inf and
// negative temperatures and top-p outside (0, 1] are refused with one line naming the parameter.
// top_logprobs against a float64 reference written from its contract: random rows (some with many ties, some
// with NaN, +inf and -inf entries), each n; the ids by logit descending, ties to the lower id, the log p
// against the float64 log-softmax, and bit for bit sample_rows' log-prob of the argmax.
TEST(OpsSampling, TopLogprobsMatchFloat64Reference) {
  using namespace sampling_ref;
  Rng data(606);
  for (int64_t V : {int64_t{1}, int64_t{9}, int64_t{300}, int64_t{4099}}) {
    for (int kind = 0; kind < 3; ++kind) {  // plain, ties, special values
      std::vector<float> l(static_cast<size_t>(V));
      for (auto& x : l) {
        x = static_cast<float>(data.normal() * 3.0);
        if (kind == 1) x = std::round(x * 2.0f) / 2.0f;
      }
      if (kind == 2 && V > 3) {
        l[static_cast<size_t>(data.below(V))] = NAN;
        l[static_cast<size_t>(data.below(V))] = -INFINITY;
        l[static_cast<size_t>(data.below(V))] = INFINITY;
      }
      // The reference: NaN as -inf, +inf as the largest float; order by (value desc, id asc).
      std::vector<double> c(l.size());
      for (size_t i = 0; i < l.size(); ++i)
        c[i] = std::isnan(l[i]) ? -INFINITY : l[i] == INFINITY ? static_cast<double>(FLT_MAX) : l[i];
      std::vector<int32_t> order(l.size());
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return c[a] > c[b]; });
      const double mx = c[order[0]];
      double z = 0;
      for (double x : c) z += std::exp(x - mx);
      SampleSpec greedy;
      greedy.logprob = 1;
      SampleResult arg;
      k3::ops::sample_rows(l.data(), 1, V, &greedy, &arg);
      for (int n : {0, 1, 5, static_cast<int>(std::min<int64_t>(V, 20))}) {
        if (n > V) continue;
        SCOPED_TRACE(testing::Message() << "V " << V << " kind " << kind << " n " << n);
        const auto got = k3::ops::top_logprobs(l.data(), V, n);
        ASSERT_EQ(got.size(), static_cast<size_t>(n));
        for (int k = 0; k < n; ++k) {
          EXPECT_EQ(got[k].token, order[k]) << k;
          EXPECT_NEAR(got[k].logprob, c[order[k]] - mx - std::log(z), 1e-5) << k;
        }
        if (n > 0) {
          EXPECT_EQ(got[0].token, arg.token);
          EXPECT_EQ(std::memcmp(&got[0].logprob, &arg.logprob, sizeof(float)), 0) << got[0].logprob << " " << arg.logprob;
        }
      }
    }
  }
  EXPECT_THROW(k3::ops::top_logprobs(nullptr, 4, 5), k3::Error);  // more than the vocabulary
  EXPECT_THROW(k3::ops::top_logprobs(nullptr, 4, -1), k3::Error);
}

TEST(OpsSampling, CheckSamplingParams) {
  EXPECT_NO_THROW(k3::ops::check_sampling_params(0.0f, 1.0f));
  EXPECT_NO_THROW(k3::ops::check_sampling_params(0.7f, 0.9f));
  EXPECT_NO_THROW(k3::ops::check_sampling_params(1e30f, 1e-6f));
  auto message = [](float t, float tp) {
    try {
      k3::ops::check_sampling_params(t, tp);
    } catch (const k3::Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  for (float t : {NAN, INFINITY, -INFINITY, -1.0f, -1e-30f}) {
    const std::string m = message(t, 0.9f);
    EXPECT_NE(m.find("temperature"), std::string::npos) << t << ": " << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
  for (float tp : {NAN, INFINITY, -INFINITY, 0.0f, -0.5f, 1.0001f}) {
    const std::string m = message(0.7f, tp);
    EXPECT_NE(m.find("top-p"), std::string::npos) << tp << ": " << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
}

}  // namespace
