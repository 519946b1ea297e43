// MoE router, SiTU-GLU, MXFP4 linears, the routed expert MLP and the BF16 MLP, each checked
// against an independent float64 reference written here from kimi-k3.md section 2 (the E2M1
// decoding too is written from its bit definition, not taken from core/mxfp4.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <numeric>
#include <vector>

#include "core/bf16.h"
#include "core/error.h"
#include "core/rng.h"
#include "test_util.h"
#include "ops/moe.h"
#include "ops/router.h"

namespace {

using k3::bf16;
using k3::Rng;

using k3::testing::kBf16Rel;

using k3::testing::rand_act;

double bf16_of(double x) { return static_cast<double>(k3::round_bf16(static_cast<float>(x))); }

// ---------------------------------------------------------------------------------------------
// Router

double sigmoid_d(double x) { return 1.0 / (1.0 + std::exp(-x)); }

struct RouteRef {
  std::vector<int32_t> idx;
  std::vector<double> w;
  double gap;  // biased score of the k-th chosen minus the best unchosen (inf when k == E)
};

RouteRef ref_route(const float* logits, const float* bias, int E, int k, bool renorm, double scale) {
  std::vector<double> s(E), b(E);
  for (int e = 0; e < E; ++e) {
    s[e] = sigmoid_d(logits[e]);
    b[e] = s[e] + bias[e];
  }
  std::vector<int32_t> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t x, int32_t y) { return b[x] > b[y]; });
  RouteRef r;
  r.idx.assign(order.begin(), order.begin() + k);
  r.gap = k < E ? b[order[k - 1]] - b[order[k]] : INFINITY;
  double sum = 0;
  for (int32_t e : r.idx) sum += s[e];
  for (int32_t e : r.idx) r.w.push_back(renorm ? s[e] / (sum + 1e-20) * scale : s[e] * scale);
  return r;
}

TEST(OpsRouter, MatchesFloat64Reference) {
  struct Case {
    int64_t T;
    int E, k;
  };
  const Case cases[] = {{1, 8, 1}, {3, 8, 2}, {17, 33, 4}, {3, 64, 8}, {3, 7, 7}, {1, 896, 16}};
  uint64_t seed = 1000;
  for (const auto& c : cases) {
    for (bool renorm : {true, false}) {
      Rng rng(seed++);
      std::vector<float> logits(static_cast<size_t>(c.T) * c.E), bias(c.E);
      for (auto& x : logits) x = static_cast<float>(rng.normal() * 2.0);
      for (auto& x : bias) x = static_cast<float>(rng.normal() * 0.1);
      const float scale = 2.827f;
      std::vector<int32_t> idx(static_cast<size_t>(c.T) * c.k, -1);
      std::vector<float> w(static_cast<size_t>(c.T) * c.k, NAN);
      k3::ops::route(logits.data(), bias.data(), c.T, c.E, c.k, renorm, scale, idx.data(), w.data());
      for (int64_t t = 0; t < c.T; ++t) {
        auto ref = ref_route(logits.data() + t * c.E, bias.data(), c.E, c.k, renorm, scale);
        ASSERT_GT(ref.gap, 1e-5) << "test data puts the top-k cut inside FP32 noise";
        double wsum = 0;
        for (int i = 0; i < c.k; ++i) {
          ASSERT_EQ(idx[t * c.k + i], ref.idx[i]) << "E=" << c.E << " k=" << c.k << " t=" << t << " i=" << i;
          ASSERT_NEAR(w[t * c.k + i], ref.w[i], 2e-6 * std::fabs(ref.w[i])) << "t=" << t << " i=" << i;
          wsum += w[t * c.k + i];
        }
        if (renorm) {
          EXPECT_NEAR(wsum, scale, 1e-5 * scale);
        }
      }
    }
  }
}

TEST(OpsRouter, BiasSteersChoiceButWeightsUseUnbiasedScores) {
  // Sigmoid scores 0.9, 0.8, 0.3, 0.2; the bias lifts expert 2 above experts 0 and 1.
  const double s[4] = {0.9, 0.8, 0.3, 0.2};
  float logits[4];
  for (int e = 0; e < 4; ++e) logits[e] = static_cast<float>(std::log(s[e] / (1 - s[e])));
  const float no_bias[4] = {0, 0, 0, 0};
  const float bias[4] = {0.f, 0.f, 0.7f, 0.f};  // biased: 0.9, 0.8, 1.0, 0.2
  const float scale = 2.5f;
  int32_t idx[2];
  float w[2];

  k3::ops::route(logits, no_bias, 1, 4, 2, true, scale, idx, w);
  EXPECT_EQ(idx[0], 0);
  EXPECT_EQ(idx[1], 1);
  EXPECT_NEAR(w[0], 0.9 / 1.7 * 2.5, 1e-5);
  EXPECT_NEAR(w[1], 0.8 / 1.7 * 2.5, 1e-5);

  k3::ops::route(logits, bias, 1, 4, 2, true, scale, idx, w);
  EXPECT_EQ(idx[0], 2);  // chosen by the biased score, listed by it descending
  EXPECT_EQ(idx[1], 0);
  EXPECT_NEAR(w[0], 0.3 / 1.2 * 2.5, 1e-5);  // the unbiased 0.3, not the biased 1.0
  EXPECT_NEAR(w[1], 0.9 / 1.2 * 2.5, 1e-5);

  k3::ops::route(logits, bias, 1, 4, 2, false, scale, idx, w);
  EXPECT_EQ(idx[0], 2);
  EXPECT_EQ(idx[1], 0);
  EXPECT_NEAR(w[0], 0.3 * 2.5, 1e-5);
  EXPECT_NEAR(w[1], 0.9 * 2.5, 1e-5);
}

TEST(OpsRouter, TiesGoToLowerExpertIndex) {
  {
    const float logits[5] = {1.f, 1.f, 2.f, 2.f, 0.f};
    const float bias[5] = {0, 0, 0, 0, 0};
    int32_t idx[3];
    float w[3];
    k3::ops::route(logits, bias, 1, 5, 3, true, 1.f, idx, w);
    EXPECT_EQ(idx[0], 2);
    EXPECT_EQ(idx[1], 3);
    EXPECT_EQ(idx[2], 0);
    const double s1 = sigmoid_d(1), s2 = sigmoid_d(2);
    EXPECT_NEAR(w[0], s2 / (2 * s2 + s1), 1e-6);
    EXPECT_NEAR(w[2], s1 / (2 * s2 + s1), 1e-6);
  }
  {
    // Equal unbiased scores (0.5); the bias makes exact ties of the biased score (all values exact in FP32).
    const float logits[5] = {0, 0, 0, 0, 0};
    const float bias[5] = {0.25f, 0.5f, 0.25f, 0.5f, 0.f};
    int32_t idx[3];
    float w[3];
    k3::ops::route(logits, bias, 1, 5, 3, true, 3.f, idx, w);
    EXPECT_EQ(idx[0], 1);
    EXPECT_EQ(idx[1], 3);
    EXPECT_EQ(idx[2], 0);
    for (float x : w) EXPECT_NEAR(x, 1.0, 1e-6);
  }
}

// ---------------------------------------------------------------------------------------------
// SiTU-GLU

double situ_ref(double a, double b, double beta, double lbeta) {
  return beta * std::tanh(a / beta) * sigmoid_d(a) * lbeta * std::tanh(b / lbeta);
}

TEST(OpsMoe, SituGluMatchesFormulaIncludingSaturation) {
  const float vals[] = {0.001f, -0.37f, 0.5f, 1.f, -1.f, 2.5f, -3.f, 4.f, 7.5f, -12.f, 25.f, -30.f,
                        60.f,   -88.f,  89.f, -100.f, 300.f, -1e4f, 1e4f, 1e30f, -1e30f};
  for (const k3::ops::SituParams p : {k3::ops::SituParams{}, k3::ops::SituParams{2.f, 10.f}}) {
    std::vector<float> a, b;
    for (float x : vals)
      for (float y : vals) {
        a.push_back(x);
        b.push_back(y);
      }
    const int64_t n = static_cast<int64_t>(a.size());
    std::vector<float> out(n, NAN);
    k3::ops::situ_glu(a.data(), b.data(), out.data(), n, p);
    for (int64_t i = 0; i < n; ++i) {
      const double ref = situ_ref(a[i], b[i], p.beta, p.linear_beta);
      ASSERT_FALSE(std::isnan(out[i])) << "a=" << a[i] << " b=" << b[i];
      // Half a BF16 ulp plus FP32 slop; the absolute 1e-37 covers FP32 subnormals (sigmoid(-100) ~ 4e-44).
      ASSERT_NEAR(out[i], ref, kBf16Rel * std::fabs(ref) * 1.01 + 1e-37) << "a=" << a[i] << " b=" << b[i];
      ASSERT_EQ(out[i], k3::round_bf16(out[i]));
      ASSERT_LE(std::fabs(out[i]), p.beta * p.linear_beta);
    }
    // Saturation: huge a and b give exactly +-beta * lbeta (sigmoid -> 1, both tanh -> +-1).
    const float big_a[2] = {1e4f, 1e4f}, big_b[2] = {1e4f, -1e4f};
    float o2[2];
    k3::ops::situ_glu(big_a, big_b, o2, 2, p);
    EXPECT_EQ(o2[0], p.beta * p.linear_beta);
    EXPECT_EQ(o2[1], -p.beta * p.linear_beta);

    // out may alias a or b.
    std::vector<float> in_a = a, in_b = b;
    k3::ops::situ_glu(in_a.data(), b.data(), in_a.data(), n, p);
    k3::ops::situ_glu(a.data(), in_b.data(), in_b.data(), n, p);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(in_a[i], out[i]);
      ASSERT_EQ(in_b[i], out[i]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// MXFP4

// E2M1 from its bit definition: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0;
// exponent bits 0 is subnormal: 0.5 * m.
double e2m1_ref(unsigned nib) {
  const unsigned sign = (nib >> 3) & 1u, e = (nib >> 1) & 3u, m = nib & 1u;
  const double mag = e == 0 ? 0.5 * m : std::ldexp(1.0 + 0.5 * m, static_cast<int>(e) - 1);
  return sign ? -mag : mag;
}

struct Mx {
  std::vector<uint8_t> packed, scale;
  int64_t N, K;
  // W[n, k] from the bytes: low nibble first, one E8M0 scale 2^(s - 127) per 32 values along k.
  double at(int64_t n, int64_t k) const {
    const uint8_t byte = packed[n * (K / 2) + k / 2];
    const unsigned nib = (k % 2 == 0) ? (byte & 0xfu) : (byte >> 4);
    return e2m1_ref(nib) * std::ldexp(1.0, static_cast<int>(scale[n * (K / 32) + k / 32]) - 127);
  }
  k3::ops::Mxfp4Matrix view() const { return {packed.data(), scale.data()}; }
};

Mx rand_mx(Rng& rng, int64_t N, int64_t K, int smin, int smax) {
  Mx m{std::vector<uint8_t>(N * K / 2), std::vector<uint8_t>(N * K / 32), N, K};
  for (auto& b : m.packed) b = static_cast<uint8_t>(rng.below(256));
  for (auto& s : m.scale) s = static_cast<uint8_t>(smin + static_cast<int>(rng.below(smax - smin + 1)));
  return m;
}

TEST(OpsMoe, Mxfp4LinearMatchesBitLevelReference) {
  uint64_t seed = 1100;
  for (int64_t rows : {1, 3, 17}) {
    for (int64_t K : {32, 96, 256}) {
      for (int64_t N : {1, 7, 33}) {
        Rng rng(seed++);
        auto W = rand_mx(rng, N, K, 120, 130);
        auto x = rand_act(rng, static_cast<size_t>(rows * K));
        std::vector<float> y(static_cast<size_t>(rows * N), NAN);
        k3::ops::mxfp4_linear(x.data(), W.packed.data(), W.scale.data(), y.data(), rows, K, N);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t n = 0; n < N; ++n) {
            double ref = 0, mag = 0;
            for (int64_t k = 0; k < K; ++k) {
              const double term = x[r * K + k] * W.at(n, k);
              ref += term;
              mag += std::fabs(term);
            }
            const float got = y[r * N + n];
            ASSERT_NEAR(got, ref, kBf16Rel * std::fabs(ref) + 1e-6 * mag)
                << "rows=" << rows << " K=" << K << " N=" << N << " r=" << r << " n=" << n;
            ASSERT_EQ(got, k3::round_bf16(got));
          }
        }
      }
    }
  }
}

TEST(OpsMoe, Mxfp4LinearSingleNibbles) {
  // One row of K = 32 with a single nonzero code at position k: y = x_k * e2m1(code) * 2^(s - 127);
  // checks the nibble order and every code including the subnormal 0.5 and negative zero.
  const int64_t K = 32;
  for (int64_t k : {0, 1, 2, 17, 30, 31}) {
    for (unsigned code = 0; code < 16; ++code) {
      std::vector<uint8_t> packed(K / 2, 0);
      packed[k / 2] = static_cast<uint8_t>((k % 2 == 0) ? code : (code << 4));
      const uint8_t scale[1] = {129};  // 2^2
      std::vector<float> x(K, 1.f);
      x[k] = 1.5f;
      float y = NAN;
      k3::ops::mxfp4_linear(x.data(), packed.data(), scale, &y, 1, K, 1);
      EXPECT_EQ(y, 1.5 * e2m1_ref(code) * 4.0) << "k=" << k << " code=" << code;
    }
  }
}

TEST(OpsMoe, Mxfp4LinearRejectsKNotMultipleOf32) {
  std::vector<uint8_t> packed(64, 0x11), scale(4, 127);
  std::vector<float> x(64, 1.f), y(2);
  EXPECT_THROW(k3::ops::mxfp4_linear(x.data(), packed.data(), scale.data(), y.data(), 1, 48, 1), k3::Error);
  EXPECT_THROW(k3::ops::mxfp4_linear(x.data(), packed.data(), scale.data(), y.data(), 1, 16, 1), k3::Error);
}

// ---------------------------------------------------------------------------------------------
// Expert MLP and BF16 MLP. The references apply the BF16 rounding that moe.h documents (W1 z, W3 z
// and the activation are BF16) in float64; the output is compared at ~1 BF16 ulp of its scale
// (a rare midpoint case may round an intermediate to the neighbouring BF16 value).

template <typename WAt>
void check_glu_mlp_ref(const std::vector<float>& x, const std::vector<float>& out, int64_t rows, int64_t D, int64_t I,
                       WAt gate_at, WAt up_at, WAt down_at, k3::ops::SituParams p, const char* what) {
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<double> h(I);
    int saturated = 0;
    for (int64_t i = 0; i < I; ++i) {
      double a = 0, b = 0;
      for (int64_t d = 0; d < D; ++d) {
        a += gate_at(i, d) * x[r * D + d];
        b += up_at(i, d) * x[r * D + d];
      }
      a = bf16_of(a);
      b = bf16_of(b);
      if (std::fabs(a) > 2 * p.beta || std::fabs(b) > p.linear_beta) ++saturated;
      h[i] = bf16_of(situ_ref(a, b, p.beta, p.linear_beta));
    }
    EXPECT_LT(saturated, I) << what << ": the test data should not saturate everything";
    for (int64_t n = 0; n < D; ++n) {
      double ref = 0, mag = 0;
      for (int64_t i = 0; i < I; ++i) {
        ref += down_at(n, i) * h[i];
        mag += std::fabs(down_at(n, i) * h[i]);
      }
      const float got = out[r * D + n];
      ASSERT_NEAR(got, ref, kBf16Rel * std::fabs(ref) + (1.0 / 1024.0) * mag)
          << what << " rows=" << rows << " D=" << D << " I=" << I << " r=" << r << " n=" << n;
      ASSERT_EQ(got, k3::round_bf16(got));
    }
  }
}

TEST(OpsMoe, ExpertMlpMatchesFloat64Reference) {
  struct Case {
    int64_t rows, D, I;
  };
  const Case cases[] = {{1, 32, 64}, {3, 96, 32}, {17, 64, 96}, {3, 256, 128}};
  uint64_t seed = 1200;
  for (const auto& c : cases) {
    for (const k3::ops::SituParams p : {k3::ops::SituParams{}, k3::ops::SituParams{2.f, 10.f}}) {
      Rng rng(seed++);
      // Scales 2^-6 .. 2^-2 keep W1 z and W3 z of order 1 (the activation's interesting range).
      auto w1 = rand_mx(rng, c.I, c.D, 121, 125);
      auto w3 = rand_mx(rng, c.I, c.D, 121, 125);
      auto w2 = rand_mx(rng, c.D, c.I, 121, 125);
      auto z = rand_act(rng, static_cast<size_t>(c.rows * c.D));
      std::vector<float> out(static_cast<size_t>(c.rows * c.D), NAN), scratch(static_cast<size_t>(2 * c.rows * c.I));
      k3::ops::expert_mlp(z.data(), w1.view(), w3.view(), w2.view(), out.data(), c.rows, c.D, c.I, p, scratch.data());
      auto g = [&](int64_t i, int64_t d) { return w1.at(i, d); };
      auto u = [&](int64_t i, int64_t d) { return w3.at(i, d); };
      auto dn = [&](int64_t n, int64_t i) { return w2.at(n, i); };
      std::function<double(int64_t, int64_t)> G = g, U = u, DN = dn;
      check_glu_mlp_ref(z, out, c.rows, c.D, c.I, G, U, DN, p, "expert_mlp");
    }
  }
}

TEST(OpsMoe, MlpMatchesFloat64Reference) {
  struct Case {
    int64_t rows, D, I;
  };
  const Case cases[] = {{1, 7, 33}, {3, 33, 7}, {17, 64, 96}, {3, 256, 1}, {1, 96, 256}};
  uint64_t seed = 1300;
  for (const auto& c : cases) {
    for (const k3::ops::SituParams p : {k3::ops::SituParams{}, k3::ops::SituParams{2.f, 10.f}}) {
      Rng rng(seed++);
      auto mk = [&](int64_t out, int64_t in) {
        std::vector<bf16> w(static_cast<size_t>(out * in));
        for (auto& v : w) {
          do {
            v = k3::to_bf16(static_cast<float>(rng.normal() * 1.5 / std::sqrt(static_cast<double>(in))));
          } while (k3::to_float(v) == 0.f);
        }
        return w;
      };
      auto wg = mk(c.I, c.D), wu = mk(c.I, c.D), wd = mk(c.D, c.I);
      auto x = rand_act(rng, static_cast<size_t>(c.rows * c.D));
      std::vector<float> out(static_cast<size_t>(c.rows * c.D), NAN), scratch(static_cast<size_t>(2 * c.rows * c.I));
      k3::ops::mlp(x.data(), wg.data(), wu.data(), wd.data(), out.data(), c.rows, c.D, c.I, p, scratch.data());
      auto at = [](const std::vector<bf16>& w, int64_t cols) {
        return std::function<double(int64_t, int64_t)>(
            [&w, cols](int64_t o, int64_t i) { return static_cast<double>(k3::to_float(w[o * cols + i])); });
      };
      check_glu_mlp_ref(x, out, c.rows, c.D, c.I, at(wg, c.D), at(wu, c.D), at(wd, c.I), p, "mlp");
    }
  }
}

}  // namespace
