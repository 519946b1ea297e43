// KDA's pieces (short causal conv + SiLU, gate, beta, per-head l2 norm, the delta-rule
// recurrence, the gated output norm), each checked against an independent float64
// reference written here from kimi-k3.md section 2 and kda.h / short_conv.h, plus the
// verify-step contract: T tokens at once equal T chained single-token calls, and the
// per-token state history equals the chained states.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "core/bf16.h"
#include "core/rng.h"
#include "test_util.h"
#include "ops/kda.h"
#include "ops/kda_prep.h"
#include "ops/short_conv.h"

namespace {

using k3::Rng;

constexpr int64_t kTs[] = {1, 3, 17};

using k3::testing::rand_act;

using k3::testing::bf;
using k3::testing::rand_f32;
double sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }

// |got - ref| <= rel * max(|ref|, rms(ref over each block of `block` values)); with
// bf16 = true the outputs must also be bf16-representable.
void expect_close(const float* got, const std::vector<double>& ref, size_t block, double rel, bool bf16_out,
                  const std::string& what) {
  int bad = 0;
  double worst = 0;
  for (size_t b0 = 0; b0 < ref.size(); b0 += block) {
    double ss = 0;
    for (size_t i = b0; i < b0 + block; ++i) ss += ref[i] * ref[i];
    const double scale = std::sqrt(ss / static_cast<double>(block));
    for (size_t i = b0; i < b0 + block; ++i) {
      const double tol = rel * std::max(std::fabs(ref[i]), scale);
      const double err = std::fabs(got[i] - ref[i]);
      worst = std::max(worst, err / std::max(tol, 1e-300));
      const bool ok = err <= tol && (!bf16_out || k3::round_bf16(got[i]) == got[i]);
      if (!ok && bad++ < 5) ADD_FAILURE() << what << " [" << i << "] got " << got[i] << " expected " << ref[i] << " tol " << tol;
    }
  }
  EXPECT_EQ(bad, 0) << what << " (worst error / tol " << worst << ")";
}

constexpr double kBf16Tol = 0x1p-7;  // about one bf16 ulp of the output scale
constexpr double kF32Tol = 1e-5;

// ---------------------------------------------------------------------------------------------
// Short conv

struct ConvRef {
  std::vector<double> y, state, hist;
};

// seq(c) = [state(c, 0..K-2), x(0..T-1, c)]; y[t, c] = bf16(silu(sum_j w[c, j] seq(c)[t + j])).
ConvRef ref_conv(const std::vector<float>& x, const std::vector<float>& w, const std::vector<float>& state, int64_t T,
                 int64_t C, int K) {
  ConvRef r;
  r.y.resize(T * C);
  r.state.resize(C * (K - 1));
  r.hist.resize(T * C * (K - 1));
  for (int64_t c = 0; c < C; ++c) {
    std::vector<double> seq;
    for (int j = 0; j < K - 1; ++j) seq.push_back(state[c * (K - 1) + j]);
    for (int64_t t = 0; t < T; ++t) seq.push_back(x[t * C + c]);
    for (int64_t t = 0; t < T; ++t) {
      double a = 0;
      for (int j = 0; j < K; ++j) a += static_cast<double>(w[c * K + j]) * seq[t + j];
      r.y[t * C + c] = bf(a * sigmoid(a));
      for (int j = 0; j < K - 1; ++j) r.hist[(t * C + c) * (K - 1) + j] = seq[t + 1 + j];
    }
    for (int j = 0; j < K - 1; ++j) r.state[c * (K - 1) + j] = seq[T + j];
  }
  return r;
}

void expect_exact(const std::vector<float>& got, const std::vector<double>& ref, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], ref[i]) << what << " [" << i << "]";
}

TEST(OpsShortConv, MatchesReference) {
  Rng rng(601);
  for (int K : {1, 2, 4}) {
    for (int64_t C : {1, 7, 64, 129, 300}) {
      for (int64_t T : kTs) {
        const std::string what = "short_conv K " + std::to_string(K) + " C " + std::to_string(C) + " T " + std::to_string(T);
        auto x = rand_act(rng, T * C, 1.5);
        auto w = rand_f32(rng, C * K, 0.6);
        auto state = rand_act(rng, C * (K - 1), 1.5);
        ConvRef ref = ref_conv(x, w, state, T, C, K);
        const std::vector<float> state0 = state;
        std::vector<float> y(T * C);
        k3::ops::short_conv_silu(x.data(), w.data(), state.data(), y.data(), T, C, K);
        expect_close(y.data(), ref.y, static_cast<size_t>(C), kBf16Tol, true, what + " y");
        // The state holds past inputs: exact copies, after the chunk and after each token of it fed alone.
        expect_exact(state, ref.state, what + " state");
        std::vector<float> s1 = state0, y1(C);
        for (int64_t t = 0; t < T; ++t) {
          k3::ops::short_conv_silu(x.data() + t * C, w.data(), s1.data(), y1.data(), 1, C, K);
          expect_exact(s1, std::vector<double>(ref.hist.begin() + t * C * (K - 1),
                                               ref.hist.begin() + (t + 1) * C * (K - 1)),
                       what + " state after token " + std::to_string(t));
        }
      }
    }
  }
}

// A chunk of T tokens equals T single-token calls chaining the state, bit for bit.
TEST(OpsShortConv, ChunkEqualsTokenByToken) {
  Rng rng(602);
  const int K = 4;
  for (int64_t C : {7, 129}) {
    const int64_t T = 17;
    auto x = rand_act(rng, T * C);
    auto w = rand_f32(rng, C * K, 0.6);
    const auto state0 = rand_act(rng, C * (K - 1));
    std::vector<float> state = state0, y(T * C);
    k3::ops::short_conv_silu(x.data(), w.data(), state.data(), y.data(), T, C, K);

    std::vector<float> s1 = state0, y1(C);
    for (int64_t t = 0; t < T; ++t) {
      k3::ops::short_conv_silu(x.data() + t * C, w.data(), s1.data(), y1.data(), 1, C, K);
      for (int64_t c = 0; c < C; ++c) ASSERT_EQ(y[t * C + c], y1[c]) << "t " << t << " c " << c;
    }
    EXPECT_EQ(state, s1);
  }
}

// The conv commit: advancing the state by the first n pre-conv inputs equals the state the conv
// itself leaves after those n tokens, for every n (shorter and longer than K-1) and K.
TEST(OpsShortConv, AdvanceEqualsTheConvState) {
  Rng rng(603);
  for (int K : {1, 2, 4, 8}) {
    const int64_t C = 37, T = 9;
    auto x = rand_act(rng, T * C, 1.5);
    auto w = rand_f32(rng, C * K, 0.6);
    const auto state0 = rand_act(rng, C * (K - 1), 1.5);
    for (int64_t n = 0; n <= T; ++n) {
      SCOPED_TRACE("K " + std::to_string(K) + " n " + std::to_string(n));
      std::vector<float> conv = state0, y(static_cast<size_t>(std::max<int64_t>(n, 1) * C));
      k3::ops::short_conv_silu(x.data(), w.data(), conv.data(), y.data(), n, C, K);
      std::vector<float> adv = state0;
      k3::ops::short_conv_advance(x.data(), adv.data(), n, C, K);
      EXPECT_EQ(adv, conv);
      ConvRef ref = ref_conv(x, w, state0, n, C, K);
      expect_exact(adv, ref.state, "advanced state");
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Gate, beta, l2 norm

TEST(OpsKdaGate, MatchesReferenceAndStaysInOpenInterval) {
  Rng rng(701);
  const float lower = -5.0f;
  for (int H : {1, 3}) {
    for (int dk : {1, 7, 16, 64, 129}) {
      for (int64_t T : kTs) {
        auto u = rand_act(rng, T * H * dk);
        for (auto& v : u) v = std::clamp(v, -4.0f, 4.0f);
        // A_log as stored: padded beyond H (here with NaN, which must not be read).
        std::vector<float> A_log(H + 5, std::numeric_limits<float>::quiet_NaN());
        for (int h = 0; h < H; ++h) A_log[h] = static_cast<float>(rng.uniform(-0.7, 1.0));
        std::vector<float> dt_bias(H * dk);
        for (auto& b : dt_bias) b = static_cast<float>(rng.uniform(-1.0, 1.0));
        std::vector<float> g(u.size());
        k3::ops::kda_gate(u.data(), A_log.data(), dt_bias.data(), lower, g.data(), T, H, dk);
        std::vector<double> ref(u.size());
        for (int64_t t = 0; t < T; ++t) {
          for (int h = 0; h < H; ++h) {
            for (int j = 0; j < dk; ++j) {
              const size_t i = (t * H + h) * dk + j;
              ref[i] = lower * sigmoid(std::exp(static_cast<double>(A_log[h])) * (u[i] + dt_bias[h * dk + j]));
            }
          }
        }
        const std::string what = "kda_gate H " + std::to_string(H) + " dk " + std::to_string(dk) + " T " + std::to_string(T);
        expect_close(g.data(), ref, 1, kF32Tol, false, what);
        for (float v : g) {
          ASSERT_GT(v, lower) << what;
          ASSERT_LT(v, 0.0f) << what;
        }
      }
    }
  }
}

TEST(OpsKdaBeta, IsSigmoid) {
  Rng rng(702);
  for (int H : {1, 3, 96}) {
    for (int64_t T : kTs) {
      auto b = rand_act(rng, T * H, 2.0);
      std::vector<float> beta(b.size());
      k3::ops::kda_beta(b.data(), beta.data(), T, H);
      std::vector<double> ref(b.size());
      for (size_t i = 0; i < b.size(); ++i) ref[i] = sigmoid(b[i]);
      expect_close(beta.data(), ref, 1, kF32Tol, false, "kda_beta");
      // In place (b aliases beta).
      k3::ops::kda_beta(b.data(), b.data(), T, H);
      EXPECT_EQ(b, beta);
    }
  }
}

TEST(OpsL2NormHeads, MatchesReference) {
  Rng rng(703);
  for (int H : {1, 3}) {
    for (int d : {1, 7, 64, 128, 129}) {
      for (int64_t T : kTs) {
        for (double sd : {1.0, 2e-4}) {  // at 2e-4 the 1e-6 inside the root is visible
          const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
          auto x = rand_act(rng, T * H * d, sd);
          std::vector<double> ref(x.size());
          for (int64_t r = 0; r < T * H; ++r) {
            double ss = 0;
            for (int j = 0; j < d; ++j) ss += static_cast<double>(x[r * d + j]) * x[r * d + j];
            for (int j = 0; j < d; ++j) ref[r * d + j] = x[r * d + j] / std::sqrt(ss + 1e-6) * scale;
          }
          k3::ops::l2norm_heads(x.data(), T, H, d, scale);
          expect_close(x.data(), ref, static_cast<size_t>(d), kF32Tol, false,
                       "l2norm H " + std::to_string(H) + " d " + std::to_string(d) + " sd " + std::to_string(sd));
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Recurrence

struct KdaInputs {
  std::vector<float> q, k, v, g, beta, S0;
};

// Realistic inputs: q, k l2-normalized per head (q also scaled by dk^-0.5), bf16 v,
// gates g in (-5, 0) mostly near 0, beta in (0, 1), a non-zero initial state.
KdaInputs make_kda(Rng& rng, int64_t T, int H, int dk, int dv) {
  KdaInputs in;
  auto unit = [&](std::vector<float>& dst, double scale) {
    dst.resize(T * H * dk);
    for (int64_t r = 0; r < T * H; ++r) {
      std::vector<double> x(dk);
      double ss = 0;
      for (auto& e : x) {
        e = rng.normal();
        ss += e * e;
      }
      for (int j = 0; j < dk; ++j) dst[r * dk + j] = static_cast<float>(x[j] / std::sqrt(ss) * scale);
    }
  };
  unit(in.q, 1.0 / std::sqrt(static_cast<double>(dk)));
  unit(in.k, 1.0);
  in.v = rand_act(rng, T * H * dv);
  in.g.resize(T * H * dk);
  for (auto& g : in.g) g = static_cast<float>(-5.0 * std::pow(rng.uniform(0.01, 1.0), 3.0));
  in.beta.resize(T * H);
  for (auto& b : in.beta) b = static_cast<float>(sigmoid(rng.normal()));
  in.S0 = rand_f32(rng, static_cast<size_t>(H) * dv * dk, 0.3);
  return in;
}

struct KdaRef {
  std::vector<double> o, S_hist, S;
};

// S' = S diag(alpha); delta = beta (v - S' k); S = S' + delta k^T; o = S q; per head, float64.
KdaRef ref_kda(const KdaInputs& in, int64_t T, int H, int dk, int dv) {
  KdaRef r;
  r.o.resize(T * H * dv);
  r.S_hist.resize(T * H * dv * dk);
  r.S.resize(static_cast<size_t>(H) * dv * dk);
  for (int h = 0; h < H; ++h) {
    std::vector<double> S(in.S0.begin() + h * dv * dk, in.S0.begin() + (h + 1) * dv * dk);
    for (int64_t t = 0; t < T; ++t) {
      const size_t kb = (t * H + h) * dk, vb = (t * H + h) * dv;
      for (int i = 0; i < dv; ++i) {
        for (int j = 0; j < dk; ++j) S[i * dk + j] *= std::exp(static_cast<double>(in.g[kb + j]));
      }
      std::vector<double> delta(dv);
      for (int i = 0; i < dv; ++i) {
        double sk = 0;
        for (int j = 0; j < dk; ++j) sk += S[i * dk + j] * in.k[kb + j];
        delta[i] = in.beta[t * H + h] * (in.v[vb + i] - sk);
      }
      for (int i = 0; i < dv; ++i) {
        for (int j = 0; j < dk; ++j) S[i * dk + j] += delta[i] * in.k[kb + j];
      }
      for (int i = 0; i < dv; ++i) {
        double o = 0;
        for (int j = 0; j < dk; ++j) o += S[i * dk + j] * in.q[kb + j];
        r.o[vb + i] = o;
      }
      std::copy(S.begin(), S.end(), r.S_hist.begin() + (t * H + h) * dv * dk);
    }
    std::copy(S.begin(), S.end(), r.S.begin() + h * dv * dk);
  }
  return r;
}

struct KdaDims {
  int H, dk, dv;
};

TEST(OpsKdaRecurrence, MatchesFloat64DeltaRule) {
  Rng rng(801);
  const KdaDims dims[] = {{1, 16, 8}, {3, 16, 8}, {2, 7, 7}, {1, 1, 1}, {3, 8, 16}, {2, 64, 64}, {2, 128, 128}};
  for (const auto& d : dims) {
    for (int64_t T : kTs) {
      const std::string what = "kda H " + std::to_string(d.H) + " dk " + std::to_string(d.dk) + " dv " +
                               std::to_string(d.dv) + " T " + std::to_string(T);
      KdaInputs in = make_kda(rng, T, d.H, d.dk, d.dv);
      KdaRef ref = ref_kda(in, T, d.H, d.dk, d.dv);
      std::vector<float> S = in.S0, o(T * d.H * d.dv);
      k3::ops::kda_recurrence(in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), S.data(), o.data(),
                              T, d.H, d.dk, d.dv);
      expect_close(o.data(), ref.o, static_cast<size_t>(d.dv), kF32Tol, false, what + " o");
      expect_close(S.data(), ref.S, static_cast<size_t>(d.dv) * d.dk, kF32Tol, false, what + " S");
      // The state after each token, the tokens fed one at a time.
      const int64_t kw = d.H * d.dk, vw = d.H * d.dv, sw = static_cast<int64_t>(d.H) * d.dv * d.dk;
      std::vector<float> S1 = in.S0, o1(vw);
      for (int64_t t = 0; t < T; ++t) {
        k3::ops::kda_recurrence(in.q.data() + t * kw, in.k.data() + t * kw, in.v.data() + t * vw,
                                in.g.data() + t * kw, in.beta.data() + t * d.H, S1.data(), o1.data(), 1, d.H, d.dk,
                                d.dv);
        expect_close(S1.data(), std::vector<double>(ref.S_hist.begin() + t * sw, ref.S_hist.begin() + (t + 1) * sw),
                     static_cast<size_t>(d.dv) * d.dk, kF32Tol, false, what + " S after token " + std::to_string(t));
      }
    }
  }
}

// T tokens at once equal T single-token calls chaining the state (bit for bit).
TEST(OpsKdaRecurrence, ChunkEqualsTokenByToken) {
  Rng rng(802);
  const KdaDims dims[] = {{3, 16, 8}, {2, 128, 128}};
  for (const auto& d : dims) {
    const int64_t T = 17;
    const int64_t kw = d.H * d.dk, vw = d.H * d.dv;
    KdaInputs in = make_kda(rng, T, d.H, d.dk, d.dv);
    std::vector<float> S = in.S0, o(T * vw);
    k3::ops::kda_recurrence(in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), S.data(), o.data(),
                            T, d.H, d.dk, d.dv);
    std::vector<float> S1 = in.S0, o1(vw);
    for (int64_t t = 0; t < T; ++t) {
      k3::ops::kda_recurrence(in.q.data() + t * kw, in.k.data() + t * kw, in.v.data() + t * vw, in.g.data() + t * kw,
                              in.beta.data() + t * d.H, S1.data(), o1.data(), 1, d.H, d.dk, d.dv);
      for (int64_t i = 0; i < vw; ++i) ASSERT_EQ(o[t * vw + i], o1[i]) << "t " << t << " i " << i;
    }
    EXPECT_EQ(S, S1);
  }
}

// The commit of a partial accept replays the kept inputs of the first n tokens: for every n in
// 0..T the replayed state equals, bit for bit, the recurrence's state over those n tokens (the
// step's arithmetic), and it does move (n > 0 changes the state).
TEST(OpsKdaRecurrence, ReplayEqualsTheRecurrenceBitForBit) {
  Rng rng(803);
  const KdaDims dims[] = {{3, 16, 8}, {2, 7, 9}, {2, 128, 128}};
  for (const auto& d : dims) {
    const int64_t T = 6, vw = d.H * d.dv;
    KdaInputs in = make_kda(rng, T, d.H, d.dk, d.dv);
    for (int64_t n = 0; n <= T; ++n) {
      SCOPED_TRACE("H " + std::to_string(d.H) + " dk " + std::to_string(d.dk) + " n " + std::to_string(n));
      std::vector<float> S = in.S0, o(static_cast<size_t>(std::max<int64_t>(n, 1) * vw));
      k3::ops::kda_recurrence(in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), S.data(), o.data(),
                              n, d.H, d.dk, d.dv);
      std::vector<float> R = in.S0;
      k3::ops::kda_replay(in.k.data(), in.v.data(), in.g.data(), in.beta.data(), R.data(), n, d.H, d.dk, d.dv);
      EXPECT_EQ(R, S);
      if (n > 0) EXPECT_NE(R, in.S0);
      // And against the float64 delta rule.
      if (n > 0) {
        KdaRef ref = ref_kda(in, n, d.H, d.dk, d.dv);
        expect_close(R.data(), ref.S, static_cast<size_t>(d.dv) * d.dk, kF32Tol, false, "replayed S");
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Gated output norm

TEST(OpsKdaGatedNorm, MatchesReference) {
  Rng rng(901);
  const float eps = 1e-5f;
  for (int H : {1, 3}) {
    for (int dv : {1, 7, 8, 64, 128, 129}) {
      for (int64_t T : kTs) {
        auto o = rand_f32(rng, T * H * dv, 0.5);  // FP32 recurrence output
        auto gate = rand_act(rng, T * H * dv, 2.0);
        auto w = rand_f32(rng, dv, 0.2, 1.0);
        std::vector<float> out(o.size());
        k3::ops::kda_gated_norm(o.data(), gate.data(), w.data(), eps, out.data(), T, H, dv);
        // bf16(RMSNorm(o_h; w) * sigmoid(gate_h)), RMSNorm(v; w) = bf16(w * bf16(v / sqrt(mean(v^2) + eps))).
        std::vector<double> ref(o.size());
        for (int64_t r = 0; r < T * H; ++r) {
          double ms = 0;
          for (int j = 0; j < dv; ++j) ms += static_cast<double>(o[r * dv + j]) * o[r * dv + j];
          ms /= dv;
          for (int j = 0; j < dv; ++j) {
            const double n = bf(w[j] * bf(o[r * dv + j] / std::sqrt(ms + eps)));
            ref[r * dv + j] = bf(n * sigmoid(gate[r * dv + j]));
          }
        }
        const std::string what = "kda_gated_norm H " + std::to_string(H) + " dv " + std::to_string(dv) + " T " +
                                 std::to_string(T);
        expect_close(out.data(), ref, static_cast<size_t>(dv), kBf16Tol, true, what);
      }
    }
  }
}

// The norm is per head: scaling one head's o leaves the other heads' outputs unchanged and
// this head's output (nearly) unchanged too (scale invariance of RMSNorm, eps aside).
TEST(OpsKdaGatedNorm, NormIsPerHead) {
  Rng rng(902);
  const int H = 3, dv = 64;
  auto o = rand_f32(rng, H * dv, 0.5);
  auto gate = rand_act(rng, H * dv);
  auto w = rand_f32(rng, dv, 0.2, 1.0);
  std::vector<float> a(H * dv), b(H * dv);
  k3::ops::kda_gated_norm(o.data(), gate.data(), w.data(), 1e-5f, a.data(), 1, H, dv);
  for (int j = 0; j < dv; ++j) o[dv + j] *= 64.0f;  // head 1 only, exact scaling
  k3::ops::kda_gated_norm(o.data(), gate.data(), w.data(), 1e-5f, b.data(), 1, H, dv);
  for (int j = 0; j < dv; ++j) {
    EXPECT_EQ(a[j], b[j]);
    EXPECT_EQ(a[2 * dv + j], b[2 * dv + j]);
    EXPECT_NEAR(a[dv + j], b[dv + j], 0x1p-7 * std::max(1.0f, std::fabs(a[dv + j])));
  }
}

// ---------------------------------------------------------------------------------------------
// kda_prep: the ops above composed (the CPU reference of the fused CUDA op), bit for bit; beta may alias b.

TEST(OpsKdaPrep, IsTheComposedOpsBitForBit) {
  Rng rng(661);
  for (auto [H, d, K] : {std::tuple{3, 7, 4}, std::tuple{2, 128, 4}, std::tuple{1, 5, 1}}) {
    for (int64_t T : kTs) {
      const int64_t C = int64_t{H} * d;
      const std::string what = "kda_prep H " + std::to_string(H) + " d " + std::to_string(d) + " T " + std::to_string(T);
      std::vector<float> x[3], w[3], state[3];
      for (int j = 0; j < 3; ++j) {
        x[j] = rand_act(rng, T * C, 1.5);
        w[j] = rand_f32(rng, C * K, 0.6);
        state[j] = rand_act(rng, C * (K - 1), 1.5);
      }
      const auto u = rand_act(rng, T * C, 2.0), b = rand_act(rng, T * H, 2.0);
      const auto A_log = rand_f32(rng, H, 0.5), dt_bias = rand_f32(rng, C, 0.5);
      // The composition, op by op.
      std::vector<float> want_y[3], want_state[3] = {state[0], state[1], state[2]};
      for (int j = 0; j < 3; ++j) {
        want_y[j].resize(T * C);
        k3::ops::short_conv_silu(x[j].data(), w[j].data(), want_state[j].data(), want_y[j].data(), T, C, K);
      }
      k3::ops::l2norm_heads(want_y[0].data(), T, H, d, 1.0f / std::sqrt(static_cast<float>(d)));
      k3::ops::l2norm_heads(want_y[1].data(), T, H, d, 1.0f);
      std::vector<float> want_g(T * C), want_beta(T * H);
      k3::ops::kda_gate(u.data(), A_log.data(), dt_bias.data(), -5.0f, want_g.data(), T, H, d);
      k3::ops::kda_beta(b.data(), want_beta.data(), T, H);
      // kda_prep, beta written over b.
      k3::ops::KdaPrepWeights pw;
      for (int j = 0; j < 3; ++j) pw.conv[j] = w[j].data();
      pw.A_log = A_log.data();
      pw.dt_bias = dt_bias.data();
      pw.lower_bound = -5.0f;
      std::vector<float> y[3] = {std::vector<float>(T * C), std::vector<float>(T * C), std::vector<float>(T * C)};
      std::vector<float> g(T * C), beta = b;
      const float* xs[3] = {x[0].data(), x[1].data(), x[2].data()};
      float* ss[3] = {state[0].data(), state[1].data(), state[2].data()};
      float* ys[3] = {y[0].data(), y[1].data(), y[2].data()};
      k3::ops::kda_prep(xs, u.data(), beta.data(), pw, ss, ys, g.data(), beta.data(), T, H, d, K);
      for (int j = 0; j < 3; ++j) {
        EXPECT_EQ(y[j], want_y[j]) << what << " y" << j;
        EXPECT_EQ(state[j], want_state[j]) << what << " state" << j;
      }
      EXPECT_EQ(g, want_g) << what << " g";
      EXPECT_EQ(beta, want_beta) << what << " beta";
    }
  }
}

}  // namespace
