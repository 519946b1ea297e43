// Gated MLA (absorbed decode form), DCP lse merge and the DSA indexer / top-k,
// each checked against an independent float64 reference written here from the
// math of kimi-k3.md section 2 (never from the code under test).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "core/bf16.h"
#include "core/rng.h"
#include "test_util.h"
#include "ops/dsa.h"
#include "ops/mla.h"

namespace {

using k3::bf16;
using k3::Rng;

using k3::testing::kBf16Rel;

using k3::testing::rand_act;

std::vector<bf16> rand_weight(Rng& rng, size_t n, double sd) {
  std::vector<bf16> w(n);
  for (auto& x : w) {
    do {
      x = k3::to_bf16(static_cast<float>(rng.normal() * sd));
    } while (k3::to_float(x) == 0.f);
  }
  return w;
}

double wf(const std::vector<bf16>& w, size_t i) { return static_cast<double>(k3::to_float(w[i])); }

// MLA dimensions. dn != dv in the small cases so that a row-layout mistake in W_kvb shows.
struct MlaDims {
  int H, dn, P, dv, R;
};

// ---------------------------------------------------------------------------------------------
// Float64 references.

// W_uk_h^T q_nope (no rounding): the R-vector sum_i W_kvb[h (dn + dv) + i, r] q_nope[i].
std::vector<double> ref_absorb(const float* q_nope, const std::vector<bf16>& w, const MlaDims& d, int h) {
  std::vector<double> out(static_cast<size_t>(d.R), 0.0);
  for (int i = 0; i < d.dn; ++i) {
    const size_t row = static_cast<size_t>(h) * (d.dn + d.dv) + i;
    for (int r = 0; r < d.R; ++r) out[r] += wf(w, row * d.R + r) * q_nope[i];
  }
  return out;
}

struct AttendRef {
  std::vector<double> o;    // [H, R]
  std::vector<double> lse;  // [H]
};

// Softmax attention in the latent space, float64, over the given entries.
AttendRef ref_attend(const std::vector<float>& q_lat, const std::vector<const float*>& entries, int H, int R, int P,
                     double scale) {
  AttendRef out{std::vector<double>(static_cast<size_t>(H) * R, 0.0), std::vector<double>(H, -INFINITY)};
  const size_t n = entries.size();
  if (n == 0) return out;
  for (int h = 0; h < H; ++h) {
    std::vector<double> s(n);
    for (size_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int c = 0; c < R + P; ++c) acc += static_cast<double>(q_lat[h * (R + P) + c]) * entries[j][c];
      s[j] = scale * acc;
    }
    const double m = *std::max_element(s.begin(), s.end());
    double sum = 0;
    for (double x : s) sum += std::exp(x - m);
    out.lse[h] = m + std::log(sum);
    for (size_t j = 0; j < n; ++j) {
      const double p = std::exp(s[j] - out.lse[h]);
      for (int r = 0; r < R; ++r) out.o[h * R + r] += p * entries[j][r];
    }
  }
  return out;
}

// A cache of n entries [c_kv (R), k_pe (P)], BF16 values (c_kv is an RMSNorm output, k_pe a linear output).
std::vector<float> make_cache(Rng& rng, int64_t n, int R, int P) { return rand_act(rng, static_cast<size_t>(n) * (R + P)); }

// ---------------------------------------------------------------------------------------------
// mla_absorb_q

TEST(OpsMla, AbsorbQMatchesFloat64) {
  const MlaDims dims[] = {{1, 8, 4, 8, 16}, {3, 16, 8, 12, 32}, {8, 128, 64, 128, 512}};
  const int64_t Ts[] = {1, 3, 17};
  uint64_t seed = 100;
  for (const auto& d : dims) {
    for (int64_t T : Ts) {
      if (d.R == 512 && T == 17) continue;  // keep the full-size case short
      Rng rng(seed++);
      auto q = rand_act(rng, static_cast<size_t>(T) * d.H * (d.dn + d.P));
      auto w = rand_weight(rng, static_cast<size_t>(d.H) * (d.dn + d.dv) * d.R, 0.05);
      std::vector<float> q_lat(static_cast<size_t>(T) * d.H * (d.R + d.P), NAN);
      k3::ops::mla_absorb_q(q.data(), w.data(), q_lat.data(), T, d.H, d.dn, d.P, d.dv, d.R);
      for (int64_t t = 0; t < T; ++t) {
        for (int h = 0; h < d.H; ++h) {
          const float* qh = q.data() + (t * d.H + h) * (d.dn + d.P);
          const float* got = q_lat.data() + (t * d.H + h) * (d.R + d.P);
          auto ref = ref_absorb(qh, w, d, h);
          for (int r = 0; r < d.R; ++r) {
            double mag = 0;  // sum of |terms|: bounds the FP32 accumulation error
            for (int i = 0; i < d.dn; ++i) mag += std::fabs(wf(w, (static_cast<size_t>(h) * (d.dn + d.dv) + i) * d.R + r) * qh[i]);
            const double tol = kBf16Rel * std::fabs(ref[r]) + 1e-6 * mag;
            ASSERT_NEAR(got[r], ref[r], tol) << "T=" << T << " H=" << d.H << " t=" << t << " h=" << h << " r=" << r;
            ASSERT_EQ(got[r], k3::round_bf16(got[r])) << "q_lat must be BF16-rounded";
          }
          for (int p = 0; p < d.P; ++p) ASSERT_EQ(got[d.R + p], qh[d.dn + p]) << "q_pe copied unchanged";
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// mla_attend

TEST(OpsMla, AttendMatchesFloat64) {
  struct Case {
    int H, R, P;
    int64_t n;
    double scale;
  };
  const Case cases[] = {
      {1, 16, 8, 1, 0.2},   {3, 32, 8, 5, 0.2},      {8, 64, 16, 64, 0.1}, {3, 17, 3, 5, 0.3},
      {8, 512, 64, 64, 1.0 / std::sqrt(192.0)},
      {3, 32, 8, 64, 40.0},  // scores in the hundreds: overflows exp() without the max subtraction
  };
  uint64_t seed = 200;
  for (const auto& c : cases) {
    Rng rng(seed++);
    // Entries live in a larger buffer and are passed in a shuffled order: the op must follow the pointers.
    auto cache = make_cache(rng, c.n + 7, c.R, c.P);
    std::vector<const float*> entries;
    for (int64_t j = 0; j < c.n; ++j) entries.push_back(cache.data() + ((j * 5 + 3) % (c.n + 7)) * (c.R + c.P));
    auto q_lat = rand_act(rng, static_cast<size_t>(c.H) * (c.R + c.P), 0.5);
    std::vector<float> o(static_cast<size_t>(c.H) * c.R, NAN), lse(c.H, NAN);
    k3::ops::mla_attend(q_lat.data(), entries.data(), c.n, c.H, c.R, c.P, static_cast<float>(c.scale), o.data(),
                        lse.data());
    auto ref = ref_attend(q_lat, entries, c.H, c.R, c.P, static_cast<float>(c.scale));
    for (int h = 0; h < c.H; ++h) {
      // FP32 scores carry a relative error ~1e-7 of sum |q c| * scale; the tolerance is a small multiple of that.
      double smag = 0;
      for (const float* e : entries) {
        double m = 0;
        for (int i = 0; i < c.R + c.P; ++i) m += std::fabs(static_cast<double>(q_lat[h * (c.R + c.P) + i]) * e[i]);
        smag = std::max(smag, m * c.scale);
      }
      const double serr = 1e-6 * smag + 1e-6;
      ASSERT_NEAR(lse[h], ref.lse[h], serr + 1e-6 * std::fabs(ref.lse[h])) << "H=" << c.H << " n=" << c.n;
      // o is a convex combination of c_kv rows with |c| <= cmax; score errors <= serr move each
      // softmax weight by a factor within exp(+-2 serr).
      double cmax = 0;
      for (const float* e : entries)
        for (int r = 0; r < c.R; ++r) cmax = std::max(cmax, static_cast<double>(std::fabs(e[r])));
      const double otol = (std::exp(2 * serr) - 1) * cmax + 1e-6 * cmax;
      for (int r = 0; r < c.R; ++r) {
        ASSERT_NEAR(o[h * c.R + r], ref.o[h * c.R + r], otol) << "H=" << c.H << " n=" << c.n << " h=" << h << " r=" << r;
      }
    }
  }
}

TEST(OpsMla, AttendNoEntriesGivesZerosAndMinusInf) {
  Rng rng(250);
  const int H = 3, R = 16, P = 8;
  auto q_lat = rand_act(rng, static_cast<size_t>(H) * (R + P));
  std::vector<float> o(static_cast<size_t>(H) * R, NAN), lse(H, NAN);
  k3::ops::mla_attend(q_lat.data(), nullptr, 0, H, R, P, 0.1f, o.data(), lse.data());
  for (float x : o) EXPECT_EQ(x, 0.f);
  for (float l : lse) EXPECT_TRUE(std::isinf(l) && l < 0) << l;
}

// ---------------------------------------------------------------------------------------------
// mla_unabsorb

TEST(OpsMla, UnabsorbMatchesFloat64) {
  const MlaDims dims[] = {{1, 8, 4, 8, 16}, {3, 16, 8, 12, 32}, {8, 128, 64, 128, 512}};
  const int64_t Ts[] = {1, 3, 17};
  uint64_t seed = 300;
  for (const auto& d : dims) {
    for (int64_t T : Ts) {
      Rng rng(seed++);
      // o_lat is an FP32 convex combination of cache rows: not BF16-representable in general.
      std::vector<float> o_lat(static_cast<size_t>(T) * d.H * d.R);
      for (auto& x : o_lat) x = static_cast<float>(rng.normal() * 0.3 + 0.01);
      auto w = rand_weight(rng, static_cast<size_t>(d.H) * (d.dn + d.dv) * d.R, 0.05);
      std::vector<float> o(static_cast<size_t>(T) * d.H * d.dv, NAN);
      k3::ops::mla_unabsorb(o_lat.data(), w.data(), o.data(), T, d.H, d.dn, d.dv, d.R);
      for (int64_t t = 0; t < T; ++t) {
        for (int h = 0; h < d.H; ++h) {
          for (int v = 0; v < d.dv; ++v) {
            const size_t row = static_cast<size_t>(h) * (d.dn + d.dv) + d.dn + v;  // value rows follow the key rows
            double ref = 0, mag = 0;
            for (int r = 0; r < d.R; ++r) {
              const double term = wf(w, row * d.R + r) * o_lat[(t * d.H + h) * d.R + r];
              ref += term;
              mag += std::fabs(term);
            }
            const float got = o[(t * d.H + h) * d.dv + v];
            ASSERT_NEAR(got, ref, kBf16Rel * std::fabs(ref) + 1e-6 * mag) << "t=" << t << " h=" << h << " v=" << v;
            ASSERT_EQ(got, k3::round_bf16(got));
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The composition absorb -> attend -> unabsorb against the NON-absorbed attention of the spec:
//   k_h(s) = [W_uk_h c_kv(s), k_pe(s)],  v_h(s) = W_uv_h c_kv(s),
//   p = softmax_s(scale * q_h . k_h(s)),  o_h = sum_s p_s v_h(s)   (causal: token t sees s <= pos(t)).
// The only approximation of the absorbed form is the BF16 rounding of q_lat. "exact" cases draw q_nope
// from {+-1, +-2, +-3}/4 and W_kvb from {+-1, +-2}/8 with dn <= 32, so that W_uk^T q_nope is a multiple
// of 1/32 below 8 in magnitude: 8 significant bits, exactly BF16. There the tolerance is FP32 slop plus
// the final BF16 rounding; the full-size random case carries a bound of the q_lat rounding effect.

TEST(OpsMla, AbsorbedDecodeMatchesNonAbsorbedAttention) {
  struct Case {
    MlaDims d;
    int64_t T, n;  // T query tokens at the last T positions of an n-entry cache
    bool exact;
  };
  const Case cases[] = {
      {{1, 8, 4, 8, 16}, 1, 1, true},     {{3, 16, 8, 12, 32}, 3, 5, true},    {{3, 16, 8, 24, 40}, 2, 64, true},
      {{8, 32, 16, 24, 64}, 3, 64, true}, {{3, 16, 8, 12, 32}, 3, 5, false},   {{8, 128, 64, 128, 512}, 2, 64, false},
  };
  uint64_t seed = 400;
  for (const auto& c : cases) {
    const auto& d = c.d;
    const double scale = 1.0 / std::sqrt(static_cast<double>(d.dn + d.P));
    Rng rng(seed++);
    auto cache = make_cache(rng, c.n, d.R, d.P);
    auto q = rand_act(rng, static_cast<size_t>(c.T) * d.H * (d.dn + d.P));
    auto w = rand_weight(rng, static_cast<size_t>(d.H) * (d.dn + d.dv) * d.R, 1.0 / std::sqrt(static_cast<double>(d.R)));
    if (c.exact) {
      ASSERT_LE(d.dn, 32);
      auto pick = [&rng](int maxv, double unit) {
        const double m = 1 + static_cast<double>(rng.below(maxv));
        return static_cast<float>((rng.below(2) ? m : -m) * unit);
      };
      for (int64_t th = 0; th < c.T * d.H; ++th)
        for (int i = 0; i < d.dn; ++i) q[th * (d.dn + d.P) + i] = pick(3, 0.25);
      for (auto& x : w) x = k3::to_bf16(pick(2, 0.125));
    }
    std::vector<const float*> all;
    for (int64_t j = 0; j < c.n; ++j) all.push_back(cache.data() + j * (d.R + d.P));

    // Code under test: absorb, attend per token over its causal prefix, unabsorb.
    std::vector<float> q_lat(static_cast<size_t>(c.T) * d.H * (d.R + d.P));
    k3::ops::mla_absorb_q(q.data(), w.data(), q_lat.data(), c.T, d.H, d.dn, d.P, d.dv, d.R);
    std::vector<float> o_lat(static_cast<size_t>(c.T) * d.H * d.R), lse(d.H);
    for (int64_t t = 0; t < c.T; ++t) {
      const int64_t visible = c.n - c.T + t + 1;
      k3::ops::mla_attend(q_lat.data() + t * d.H * (d.R + d.P), all.data(), visible, d.H, d.R, d.P,
                          static_cast<float>(scale), o_lat.data() + t * d.H * d.R, lse.data());
    }
    std::vector<float> o(static_cast<size_t>(c.T) * d.H * d.dv);
    k3::ops::mla_unabsorb(o_lat.data(), w.data(), o.data(), c.T, d.H, d.dn, d.dv, d.R);

    // Reference: expand keys and values per head, float64.
    for (int h = 0; h < d.H; ++h) {
      const size_t k0 = static_cast<size_t>(h) * (d.dn + d.dv), v0 = k0 + d.dn;
      std::vector<double> K(static_cast<size_t>(c.n) * d.dn), V(static_cast<size_t>(c.n) * d.dv);
      for (int64_t s = 0; s < c.n; ++s) {
        const float* ckv = all[s];
        for (int i = 0; i < d.dn; ++i) {
          double acc = 0;
          for (int r = 0; r < d.R; ++r) acc += wf(w, (k0 + i) * d.R + r) * ckv[r];
          K[s * d.dn + i] = acc;
        }
        for (int v = 0; v < d.dv; ++v) {
          double acc = 0;
          for (int r = 0; r < d.R; ++r) acc += wf(w, (v0 + v) * d.R + r) * ckv[r];
          V[s * d.dv + v] = acc;
        }
      }
      for (int64_t t = 0; t < c.T; ++t) {
        const float* qh = q.data() + (t * d.H + h) * (d.dn + d.P);
        const int64_t visible = c.n - c.T + t + 1;
        std::vector<double> sc(visible), err(visible);
        // Error bound of the absorbed scores: q_lat is rounded to BF16 (rel <= 2^-8 per latent coordinate).
        auto qabs = ref_absorb(qh, w, d, h);
        if (c.exact) {
          for (double x : qabs) ASSERT_EQ(x, static_cast<double>(k3::round_bf16(static_cast<float>(x)))) << "data not exact";
        }
        for (int64_t s = 0; s < visible; ++s) {
          double acc = 0;
          for (int i = 0; i < d.dn; ++i) acc += qh[i] * K[s * d.dn + i];
          for (int p = 0; p < d.P; ++p) acc += static_cast<double>(qh[d.dn + p]) * all[s][d.R + p];
          sc[s] = scale * acc;
          // Rounding q_lat to BF16 moves the latent score by sum_r delta_r c_r with |delta_r| <= 2^-8 |q_lat_r|:
          // at most kBf16Rel * L1, and with independent rounding errors (uniform, sd <= half-ulp / sqrt 3)
          // far below 4 kBf16Rel * L2 (~7 sd). The bound used is the smaller of the two.
          double l1 = 0, l2 = 0, pe = 0;
          for (int r = 0; r < d.R; ++r) {
            const double term = qabs[r] * all[s][r];
            l1 += std::fabs(term);
            l2 += term * term;
          }
          for (int p = 0; p < d.P; ++p) pe += std::fabs(static_cast<double>(qh[d.dn + p]) * all[s][d.R + p]);
          err[s] = scale * ((c.exact ? 0.0 : kBf16Rel * std::min(l1, 4 * std::sqrt(l2))) + 1e-5 * (l1 + pe));
        }
        const double m = *std::max_element(sc.begin(), sc.end());
        double sum = 0;
        for (double x : sc) sum += std::exp(x - m);
        const double emax = *std::max_element(err.begin(), err.end());
        const double prel = std::exp(2 * emax) - 1;  // |dp_s| <= p_s * prel
        for (int v = 0; v < d.dv; ++v) {
          double ref = 0, pv = 0;
          for (int64_t s = 0; s < visible; ++s) {
            const double p = std::exp(sc[s] - m) / sum;
            ref += p * V[s * d.dv + v];
            pv += p * std::fabs(V[s * d.dv + v]);
          }
          const double dev = prel * pv + 1e-5 * pv;  // softmax perturbation + FP32 accumulation
          const double tol = dev + kBf16Rel * (std::fabs(ref) + dev);  // + final BF16 rounding
          ASSERT_NEAR(o[(t * d.H + h) * d.dv + v], ref, tol)
              << "H=" << d.H << " n=" << c.n << " t=" << t << " h=" << h << " v=" << v;
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// lse_merge: DCP shards of a set of entries, merged, equal attending all of them at once.

TEST(OpsMla, LseMergeOfShardsEqualsAttendingAll) {
  struct Case {
    int H, R, P;
    std::vector<int64_t> shards;  // shard sizes, including an empty shard and a one-entry shard
  };
  const Case cases[] = {
      {1, 16, 8, {0, 1, 4}},
      {3, 32, 8, {3, 0, 1, 13, 0}},
      {8, 64, 16, {1, 30, 0, 33}},
      {3, 17, 3, {1}},
      {8, 512, 64, {0, 20, 1, 43}},
  };
  uint64_t seed = 500;
  for (const auto& c : cases) {
    Rng rng(seed++);
    const int D = static_cast<int>(c.shards.size());
    const int64_t n = std::accumulate(c.shards.begin(), c.shards.end(), int64_t{0});
    auto cache = make_cache(rng, n, c.R, c.P);
    // Interleaved assignment of entries to shards (as DCP splits tokens round-robin-ish), not contiguous.
    std::vector<std::vector<const float*>> parts(D);
    {
      std::vector<int64_t> left = c.shards;
      int64_t j = 0;
      while (j < n) {
        for (int dd = 0; dd < D && j < n; ++dd) {
          if (left[dd] > 0) {
            parts[dd].push_back(cache.data() + j * (c.R + c.P));
            --left[dd];
            ++j;
          }
        }
      }
    }
    std::vector<const float*> all;
    for (const auto& p : parts) all.insert(all.end(), p.begin(), p.end());
    auto q_lat = rand_act(rng, static_cast<size_t>(c.H) * (c.R + c.P), 0.7);
    const float scale = 0.25f;
    std::vector<float> o_parts(static_cast<size_t>(D) * c.H * c.R), lse_parts(static_cast<size_t>(D) * c.H);
    for (int dd = 0; dd < D; ++dd) {
      k3::ops::mla_attend(q_lat.data(), parts[dd].data(), static_cast<int64_t>(parts[dd].size()), c.H, c.R, c.P,
                          scale, o_parts.data() + dd * c.H * c.R, lse_parts.data() + dd * c.H);
    }
    std::vector<float> o(static_cast<size_t>(c.H) * c.R, NAN), lse(c.H, NAN);
    k3::ops::lse_merge(o_parts.data(), lse_parts.data(), D, c.H, c.R, o.data(), lse.data());
    std::vector<float> o_all(static_cast<size_t>(c.H) * c.R), lse_all(c.H);
    k3::ops::mla_attend(q_lat.data(), all.data(), n, c.H, c.R, c.P, scale, o_all.data(), lse_all.data());
    auto ref = ref_attend(q_lat, all, c.H, c.R, c.P, scale);
    for (int h = 0; h < c.H; ++h) {
      ASSERT_NEAR(lse[h], lse_all[h], 1e-5 * (1 + std::fabs(lse_all[h])));
      ASSERT_NEAR(lse[h], ref.lse[h], 1e-4 * (1 + std::fabs(ref.lse[h])));
      for (int r = 0; r < c.R; ++r) {
        ASSERT_NEAR(o[h * c.R + r], o_all[h * c.R + r], 2e-5) << "D=" << D << " h=" << h << " r=" << r;
        ASSERT_NEAR(o[h * c.R + r], ref.o[h * c.R + r], 1e-4) << "D=" << D << " h=" << h << " r=" << r;
      }
    }
  }
}

TEST(OpsMla, LseMergeFormulaLargeLseAndIgnoredEmptyParts) {
  // Hand-made partials: lse values near 1000 overflow exp() unless the merge subtracts the maximum;
  // parts with lse = -inf must be ignored even if their o carries garbage (NaN).
  const int D = 4, H = 2, R = 3;
  Rng rng(550);
  std::vector<float> o_parts(static_cast<size_t>(D) * H * R);
  for (auto& x : o_parts) x = static_cast<float>(rng.normal());
  const float lse_parts[D * H] = {-INFINITY, 0.5f, 1000.f, -INFINITY, 1001.5f, -3.f, 998.25f, -INFINITY};
  for (int r = 0; r < R; ++r) {
    o_parts[(0 * H + 0) * R + r] = NAN;
    o_parts[(1 * H + 1) * R + r] = NAN;
    o_parts[(3 * H + 1) * R + r] = NAN;
  }
  std::vector<float> o(H * R), lse(H);
  k3::ops::lse_merge(o_parts.data(), lse_parts, D, H, R, o.data(), lse.data());
  for (int h = 0; h < H; ++h) {
    double L = 0, m = -INFINITY;
    for (int d = 0; d < D; ++d) m = std::max(m, static_cast<double>(lse_parts[d * H + h]));
    for (int d = 0; d < D; ++d) L += std::exp(static_cast<double>(lse_parts[d * H + h]) - m);
    L = m + std::log(L);
    EXPECT_NEAR(lse[h], L, 2e-6 * (1 + std::fabs(L)));
    for (int r = 0; r < R; ++r) {
      double ref = 0;
      for (int d = 0; d < D; ++d) {
        const double l = lse_parts[d * H + h];
        if (std::isinf(l)) continue;
        ref += std::exp(l - L) * o_parts[(d * H + h) * R + r];
      }
      EXPECT_NEAR(o[h * R + r], ref, 1e-5) << "h=" << h << " r=" << r;
    }
  }
}

TEST(OpsMla, LseMergeAllEmptyGivesZerosNoNaN) {
  for (int D : {1, 3}) {
    const int H = 3, R = 5;
    // Exactly what mla_attend produces for empty shards.
    std::vector<float> o_parts(static_cast<size_t>(D) * H * R, 0.f), lse_parts(static_cast<size_t>(D) * H, -INFINITY);
    std::vector<float> o(H * R, NAN), lse(H, NAN);
    k3::ops::lse_merge(o_parts.data(), lse_parts.data(), D, H, R, o.data(), lse.data());
    for (float x : o) EXPECT_EQ(x, 0.f);
    for (float l : lse) EXPECT_TRUE(std::isinf(l) && l < 0) << l;
  }
}

// ---------------------------------------------------------------------------------------------
// DSA indexer scores and top-k.

TEST(OpsDsa, IndexScoresMatchFloat64) {
  struct Case {
    int Hi, Di;
    int64_t n;
  };
  const Case cases[] = {{1, 16, 1}, {3, 16, 5}, {3, 33, 64}, {32, 128, 64}, {8, 128, 5}};
  uint64_t seed = 600;
  for (const auto& c : cases) {
    Rng rng(seed++);
    auto q = rand_act(rng, static_cast<size_t>(c.Hi) * c.Di);
    std::vector<float> w(c.Hi);
    for (auto& x : w) x = static_cast<float>(rng.normal() * 0.1 + 0.02);  // signed per-head weights, FP32
    auto keys = rand_act(rng, static_cast<size_t>(c.n) * c.Di);
    std::vector<const float*> kp;
    for (int64_t s = c.n - 1; s >= 0; --s) kp.push_back(keys.data() + s * c.Di);  // reversed: follow the pointers
    std::vector<float> scores(c.n, NAN);
    k3::ops::dsa_index_scores(q.data(), w.data(), kp.data(), c.n, c.Hi, c.Di, scores.data());
    int positive = 0, negative = 0;
    for (int64_t s = 0; s < c.n; ++s) {
      double ref = 0, mag = 0;
      for (int h = 0; h < c.Hi; ++h) {
        double d = 0, dm = 0;
        for (int i = 0; i < c.Di; ++i) {
          d += static_cast<double>(q[h * c.Di + i]) * kp[s][i];
          dm += std::fabs(static_cast<double>(q[h * c.Di + i]) * kp[s][i]);
        }
        (d > 0 ? positive : negative)++;
        ref += w[h] * std::max(d, 0.0);
        mag += std::fabs(w[h]) * dm;
      }
      ASSERT_NEAR(scores[s], ref, 1e-6 * mag + 1e-7) << "Hi=" << c.Hi << " n=" << c.n << " s=" << s;
    }
    if (c.n * c.Hi >= 15) {
      EXPECT_GT(positive, 0);
      EXPECT_GT(negative, 0) << "the relu must be exercised";
    }
  }
}

// Brute-force reference in float64: i is selected iff fewer than k candidates rank before it (a larger score,
// or an equal one at a lower index; NaN as -inf, so -0 == +0 falls out of the comparison); listed by index.
std::vector<int64_t> ref_topk(const std::vector<float>& scores, int64_t n, int64_t k) {
  auto key = [&](int64_t i) {
    const double s = scores[static_cast<size_t>(i)];
    return std::isnan(s) ? -std::numeric_limits<double>::infinity() : s;
  };
  std::vector<int64_t> idx;
  for (int64_t i = 0; i < n; ++i) {
    int64_t before = 0;
    for (int64_t j = 0; j < n; ++j) before += key(j) > key(i) || (key(j) == key(i) && j < i);
    if (before < k) idx.push_back(i);
  }
  return idx;
}

TEST(OpsDsa, TopkMatchesBruteForceReference) {
  uint64_t seed = 700;
  for (int64_t n : {0, 1, 5, 64, 300}) {
    for (int kind = 0; kind < 4; ++kind) {
      Rng rng(seed++);
      std::vector<float> scores(static_cast<size_t>(std::max<int64_t>(n, 1)), 0.f);
      for (int64_t i = 0; i < n; ++i) {
        float& s = scores[static_cast<size_t>(i)];
        if (kind == 0) s = static_cast<float>(rng.normal());                           // distinct
        if (kind == 1) s = static_cast<float>(static_cast<int>(rng.below(4))) - 1.5f;  // many ties
        if (kind == 2) s = 0.75f;                                                      // all tied
        if (kind == 3) {                                                               // specials
          const uint64_t u = rng.below(7);
          s = u == 0   ? std::numeric_limits<float>::quiet_NaN()
              : u == 1 ? -INFINITY
              : u == 2 ? INFINITY
              : u == 3 ? -0.0f
              : u == 4 ? 0.0f
                       : static_cast<float>(rng.normal());
        }
      }
      for (int64_t k : {int64_t{0}, int64_t{1}, int64_t{3}, n - 1, n, n + 5, int64_t{2048}}) {
        if (k < 0) continue;
        std::vector<int64_t> idx(static_cast<size_t>(std::max<int64_t>(k, 1)), -7);
        const int64_t cnt = k3::ops::topk_indices(scores.data(), n, k, idx.data());
        const auto ref = ref_topk(scores, n, k);
        ASSERT_EQ(cnt, static_cast<int64_t>(ref.size())) << "n=" << n << " k=" << k << " kind=" << kind;
        for (int64_t i = 0; i < cnt; ++i)
          ASSERT_EQ(idx[i], ref[i]) << "n=" << n << " k=" << k << " kind=" << kind << " i=" << i;
        for (size_t i = static_cast<size_t>(cnt); i < idx.size(); ++i) ASSERT_EQ(idx[i], -7) << "write past count";
      }
    }
  }
}

TEST(OpsDsa, TopkTiesGoToLowerIndexListedByIndex) {
  const std::vector<float> scores = {1.f, 3.f, 2.f, 3.f, 1.f, 2.f, 3.f};
  std::vector<int64_t> idx(7);
  // The 4 best: the three 3s and the first 2 (index 2, not 5); by index.
  ASSERT_EQ(k3::ops::topk_indices(scores.data(), 7, 4, idx.data()), 4);
  const int64_t want4[4] = {1, 2, 3, 6};
  for (int i = 0; i < 4; ++i) EXPECT_EQ(idx[i], want4[i]) << i;
  ASSERT_EQ(k3::ops::topk_indices(scores.data(), 7, 100, idx.data()), 7);
  for (int i = 0; i < 7; ++i) EXPECT_EQ(idx[i], i) << i;
  // NaN below -inf's tie, -0 tied with +0 (the lower index wins).
  const std::vector<float> specials = {-0.0f, std::numeric_limits<float>::quiet_NaN(), -INFINITY, 0.0f, -1.f};
  ASSERT_EQ(k3::ops::topk_indices(specials.data(), 5, 1, idx.data()), 1);
  EXPECT_EQ(idx[0], 0);
  ASSERT_EQ(k3::ops::topk_indices(specials.data(), 5, 4, idx.data()), 4);
  const int64_t want_s[4] = {0, 1, 3, 4};  // -0, +0, -1, then the lower of the NaN / -inf tie (index 1)
  for (int i = 0; i < 4; ++i) EXPECT_EQ(idx[i], want_s[i]) << i;
}

// Indexer + top-k + mla_attend over the selected entries vs a float64 reference that computes every
// causal score, selects the top-k itself and masks the other tokens with -inf in a full softmax.
TEST(OpsDsa, SparseAttentionMatchesMaskedReference) {
  struct Case {
    int Hi, Di, H, R, P;
    int64_t n, T, k;
  };
  const Case cases[] = {
      {3, 16, 3, 32, 8, 5, 2, 8},     // k > context: every visible token is selected
      {4, 32, 3, 32, 8, 64, 3, 16},
      {8, 64, 8, 64, 16, 64, 1, 1},   // a single selected token
      {32, 128, 8, 512, 64, 64, 2, 20},
  };
  uint64_t seed = 800;
  for (const auto& c : cases) {
    Rng rng(seed++);
    auto cache = make_cache(rng, c.n, c.R, c.P);
    auto keys = rand_act(rng, static_cast<size_t>(c.n) * c.Di);
    const double scale = 1.0 / std::sqrt(192.0);
    for (int64_t t = 0; t < c.T; ++t) {
      const int64_t pos = c.n - c.T + t, visible = pos + 1;
      auto q_idx = rand_act(rng, static_cast<size_t>(c.Hi) * c.Di);
      std::vector<float> w(c.Hi);
      for (auto& x : w) x = static_cast<float>(rng.normal() * 0.2 + 0.1);
      auto q_lat = rand_act(rng, static_cast<size_t>(c.H) * (c.R + c.P), 0.5);

      // Code under test.
      std::vector<const float*> kp, ep;
      for (int64_t s = 0; s < visible; ++s) kp.push_back(keys.data() + s * c.Di);
      std::vector<float> scores(visible);
      k3::ops::dsa_index_scores(q_idx.data(), w.data(), kp.data(), visible, c.Hi, c.Di, scores.data());
      std::vector<int64_t> sel(static_cast<size_t>(c.k));
      const int64_t ns = k3::ops::topk_indices(scores.data(), visible, c.k, sel.data());
      for (int64_t i = 0; i < ns; ++i) ep.push_back(cache.data() + sel[i] * (c.R + c.P));
      std::vector<float> o(static_cast<size_t>(c.H) * c.R), lse(c.H);
      k3::ops::mla_attend(q_lat.data(), ep.data(), ns, c.H, c.R, c.P, static_cast<float>(scale), o.data(), lse.data());

      // Reference: float64 scores over the causal window, own top-k, masked dense softmax.
      std::vector<double> rs(visible);
      for (int64_t s = 0; s < visible; ++s) {
        double acc = 0;
        for (int h = 0; h < c.Hi; ++h) {
          double d = 0;
          for (int i = 0; i < c.Di; ++i) d += static_cast<double>(q_idx[h * c.Di + i]) * keys[s * c.Di + i];
          acc += w[h] * std::max(d, 0.0);
        }
        rs[s] = acc;
      }
      std::vector<int64_t> order(visible);
      std::iota(order.begin(), order.end(), int64_t{0});
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return rs[a] > rs[b]; });
      const int64_t kk = std::min(c.k, visible);
      if (kk < visible) {  // the data must not put the cut inside FP32 noise
        ASSERT_GT(rs[order[kk - 1]] - rs[order[kk]], 1e-4 * (1 + std::fabs(rs[order[kk]]))) << "test data too tight";
      }
      std::vector<bool> keep(visible, false);
      for (int64_t i = 0; i < kk; ++i) keep[order[i]] = true;
      for (int h = 0; h < c.H; ++h) {
        std::vector<double> s(visible, -INFINITY);
        for (int64_t j = 0; j < visible; ++j) {
          if (!keep[j]) continue;  // masked
          double acc = 0;
          for (int i = 0; i < c.R + c.P; ++i) acc += static_cast<double>(q_lat[h * (c.R + c.P) + i]) * cache[j * (c.R + c.P) + i];
          s[j] = scale * acc;
        }
        const double m = *std::max_element(s.begin(), s.end());
        double sum = 0;
        for (double x : s) sum += std::exp(x - m);
        const double L = m + std::log(sum);
        ASSERT_NEAR(lse[h], L, 1e-5 * (1 + std::fabs(L))) << "n=" << c.n << " t=" << t << " h=" << h;
        for (int r = 0; r < c.R; ++r) {
          double ref = 0;
          for (int64_t j = 0; j < visible; ++j) ref += std::exp(s[j] - L) * cache[j * (c.R + c.P) + r];
          ASSERT_NEAR(o[h * c.R + r], ref, 2e-5) << "n=" << c.n << " t=" << t << " h=" << h << " r=" << r;
        }
      }
    }
  }
}

}  // namespace
