// The parallel runtime (StockStep / HybridStep over TP x DP x DCP layouts, EP
// over the world) against the single-rank Engine, on the tiny presets:
//   ParallelEquivalence  every layout x step x variant, teacher-forced scripts
//                        (prefill chunks, decode, verify with partial accept,
//                        B = 0 steps of idle replicas) give the single-rank
//                        logits within the tolerance rule below; every rank of
//                        a replica returns bitwise the same logits; stock and
//                        hybrid bitwise the same on one layout; tp 1 layouts
//                        bitwise the single rank
//   ParallelControl      the rule reports wrong head slices, shifted experts,
//                        another model
//   ParallelMoe          the hybrid MoE (sp_shard, moe_ffn, sp_all_gather) == stock SP MoE == single-rank
//                        moe_ffn, bitwise (and that check sees one negated expert)
//   ParallelCounts       collectives and bytes per step, derived from the layer plan
//   ParallelLayout       bad layouts are k3::Errors naming the quantity, before
//                        any weight is read
//   ParallelAux          aux hidden states [aux, rows, D] across steps and layouts
//   ParallelGenerate     generate() over DP replicas equals single-rank generate()
//
// Nothing asserts inside a rank's thread (an early return there would leave the
// other ranks waiting in a collective): ranks record, the test thread checks.
// A watchdog ends the process if the ranks do not finish (a hang is a failure).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "comm/local.h"
#include "config/model_config.h"
#include "core/bf16.h"
#include "core/error.h"
#include "core/rng.h"
#include "io/checkpoint.h"
#include "io/synthetic.h"
#include "model/layers.h"
#include "model/weights.h"
#include "runtime/cluster.h"
#include "runtime/engine.h"
#include "runtime/generate.h"
#include "runtime/steps.h"
#include "parallel_script.h"

namespace {

using Logits = std::vector<float>;
using k3::CollKind;
using k3::Layout;
using k3::StepKind;

const char* const kVariants[] = {"k3", "k3.1"};
const StepKind kSteps[] = {StepKind::Stock, StepKind::Hybrid};

// The tolerance rule. Per row of logits: ratio = max |diff| / (max - min of the
// reference row). Layouts with G > 1 change the summation order of the
// attention's o_proj (per-head-slice partial sums rounded to BF16, then summed)
// and, with DCP, of the softmax (log-sum-exp merge of position shards);
// everything else is row-local and bitwise identical. The typical row then
// differs by ~0.3-0.5% of its spread. The model makes discrete choices (the
// router's top-k, DSA's top-k positions): where two candidates are within that
// noise, a layout picks the other one and the row moves by up to ~60% of its
// spread (and its request's later rows through the caches). The tiny preset's
// router has no near-ties (a bias gap, src/io/synthetic.cpp); DSA's top-k
// still has rare ones, so K3.1's worst-row bound is looser.
// Measured on the tiny presets (every layout of the matrix, printed below; the
// numbers move when the synthetic weights change):
//   median <= 0.0049, 80th percentile <= 0.0072, mean <= 0.0051,
//   worst row 0.0148 (K3; 0.52 before the router's bias gap) and 0.0883 (K3.1).
// Bugs (ParallelControl, emulated by wrong weights in the reference): the weakest,
// one full-attention layer's head halves swapped, gives median >= 0.019;
// shifted experts / another seed: median >= 0.21 / 0.75.
constexpr double kMedianTol = 0.01;  // median row: the discriminating bound
constexpr double kP80Tol = 0.03;     // 80% of the rows
constexpr double kMeanTol = 0.04;    // mean over all rows (outlier rows included)
constexpr double kWorstTol = 0.03;      // any row, K3 (measured 0.0148)
constexpr double kWorstTolDsa = 0.15;   // any row, K3.1: a DSA top-k near-tie (measured 0.0883)
double worst_tol(const std::string& variant) { return variant == "k3.1" ? kWorstTolDsa : kWorstTol; }
constexpr double kAuxWorstTol = 1.0; // any hidden-state row (aux): a flipped expert moves it more (measured 0.6)

// ---------------------------------------------------------------- helpers

struct Model {
  k3::ModelConfig config;
  std::shared_ptr<const k3::TensorSource> src;
};

const Model& tiny(const std::string& variant, uint64_t seed = 0) {
  static std::mutex mu;
  static std::map<std::pair<std::string, uint64_t>, Model> models;
  std::lock_guard lock(mu);
  auto key = std::make_pair(variant, seed);
  auto it = models.find(key);
  if (it == models.end()) {
    k3::ModelConfig c = k3::preset_config("tiny", variant);
    std::shared_ptr<const k3::TensorSource> src = k3::make_synthetic(c, seed);
    it = models.emplace(key, Model{c, src}).first;
  }
  return it->second;
}

k3::EngineOptions engine_opts(StepKind step, std::vector<int> aux = {},
                              k3::SharedExperts shared = k3::SharedExperts::Replicated) {
  k3::CacheOptions c;
  c.max_slots = 6;  // the single-rank reference holds every replica's requests
  c.max_context = 48;
  c.max_q = 4;
  c.page_size = 4;  // requests span several pages; with DCP a page holds 4 of a rank's positions
  k3::EngineOptions o(c);
  o.step = step;
  o.aux_layers = std::move(aux);
  o.shared = shared;
  return o;
}

std::string layout_name(const Layout& L) {
  return "tp" + std::to_string(L.tp) + "_dp" + std::to_string(L.dp) + "_dcp" + std::to_string(L.dcp);
}

constexpr int kWatchdogSeconds = 600;  // generous: the suite also runs under ASan

// Runs body(i) on n threads; rethrows the first exception. If the threads do not
// all finish in time (a rank left the others waiting in a collective), reports
// and ends the process instead of hanging the test run.
void run_threads(int n, const std::function<void(int)>& body) {
  std::mutex mu;
  std::condition_variable cv;
  int done = 0;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i)
    threads.emplace_back([&, i] {
      try {
        body(i);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d threw: %s\n", i, e.what());
        std::lock_guard lock(mu);
        if (!first) first = std::current_exception();
      } catch (...) {
        std::lock_guard lock(mu);
        if (!first) first = std::current_exception();
      }
      std::lock_guard lock(mu);
      ++done;
      cv.notify_all();
    });
  {
    std::unique_lock lock(mu);
    if (!cv.wait_for(lock, std::chrono::seconds(kWatchdogSeconds), [&] { return done == n; })) {
      std::fprintf(stderr, "test_parallel: %d of %d ranks still running after %d s (a rank is stuck in a collective)\n",
                   n - done, n, kWatchdogSeconds);
      std::fflush(stderr);
      std::_Exit(3);
    }
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

// cluster.run(fn) under the watchdog.
void run_cluster(k3::LocalCluster& cluster, const std::function<void(int, k3::Engine&)>& fn) {
  run_threads(1, [&](int) { cluster.run(fn); });
}

// Per-row ratios max |got - want| / (max - min of want) over rows of width V.
struct Ratio {
  std::vector<double> all;  // every row's ratio
  double worst = 0;
  std::string worst_where;
  int64_t rows() const { return static_cast<int64_t>(all.size()); }
  double mean() const {
    double s = 0;
    for (double v : all) s += v;
    return all.empty() ? 0.0 : s / static_cast<double>(all.size());
  }
  double quantile(double f) const {
    if (all.empty()) return 0;
    std::vector<double> v = all;
    std::sort(v.begin(), v.end());
    return v[static_cast<size_t>(std::ceil(f * static_cast<double>(v.size() - 1)))];
  }
  void add(const std::vector<float>& want, const std::vector<float>& got, int64_t V, const std::string& where = "") {
    const int64_t n = static_cast<int64_t>(want.size()) / V;
    for (int64_t r = 0; r < n; ++r) {
      const float* a = want.data() + r * V;
      const float* b = static_cast<int64_t>(got.size()) >= (r + 1) * V ? got.data() + r * V : nullptr;
      float lo = a[0], hi = a[0];
      double diff = b ? 0.0 : INFINITY;  // a missing row is as bad as it gets
      for (int64_t i = 0; i < V && b; ++i) {
        lo = std::min(lo, a[i]);
        hi = std::max(hi, a[i]);
        const double d = std::fabs(static_cast<double>(a[i]) - static_cast<double>(b[i]));
        diff = std::isnan(d) ? INFINITY : std::max(diff, d);
      }
      const double ratio = hi > lo ? diff / (hi - lo) : (diff > 0 ? INFINITY : 0.0);
      if (all.empty() || ratio > worst) {
        worst = ratio;
        worst_where = where + " row " + std::to_string(r);
      }
      all.push_back(ratio);
    }
  }
  // The tolerance rule (above).
  bool passes(double worst_tol = kWorstTol) const {
    return quantile(0.5) <= kMedianTol && quantile(0.8) <= kP80Tol && mean() <= kMeanTol && worst <= worst_tol;
  }
  std::string summary() const {
    char buf[200];
    std::snprintf(buf, sizeof buf, "rows %3lld  median %.4f  p80 %.4f  mean %.4f  worst %.4f", static_cast<long long>(rows()),
                  quantile(0.5), quantile(0.8), mean(), worst);
    return buf;
  }
};

// Each criterion of the rule as its own expectation (clear failure messages).
void expect_within_tolerance(const Ratio& r, const std::string& what, double worst_tol = kWorstTol) {
  EXPECT_GT(r.rows(), 0) << what;
  EXPECT_LE(r.quantile(0.5), kMedianTol) << what << ": median row ratio";
  EXPECT_LE(r.quantile(0.8), kP80Tol) << what << ": 80th percentile row ratio";
  EXPECT_LE(r.mean(), kMeanTol) << what << ": mean row ratio";
  EXPECT_LE(r.worst, worst_tol) << what << ": worst row (" << r.worst_where << ")";
}

bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

using k3::test::Op;
using k3::test::random_tokens;
using k3::test::Script;
using k3::test::make_script;

struct StepRecord {
  Logits logits;           // [B q, V]
  std::vector<float> aux;  // [aux layers, B q, D]
  StepKind kind = StepKind::Auto;
};

// Applies op on engine e (slots of the request ids in slot_of), records the output.
StepRecord apply(k3::Engine& e, std::map<int, int>& slot_of, const Op& op) {
  std::vector<int> slots;
  for (int id : op.reqs) slots.push_back(slot_of.at(id));
  StepRecord rec;
  rec.logits = e.step(slots, op.q, op.tokens);
  rec.aux = e.last_aux();
  rec.kind = e.last_step();
  for (size_t b = 0; b < slots.size(); ++b) e.commit(slots[b], op.commits[b]);
  return rec;
}

// A replica rank's whole script: per op, its record (B = 0 steps not recorded).
std::vector<StepRecord> play_replica(k3::Engine& e, const Script& s) {
  const int p = e.layout().replica(e.world_rank());
  std::map<int, int> slot_of;
  for (int id : s.requests[p]) slot_of[id] = e.admit();
  std::vector<StepRecord> out;
  for (int j = 0; j < s.rounds; ++j) {
    if (j < static_cast<int>(s.ops[p].size())) {
      out.push_back(apply(e, slot_of, s.ops[p][j]));
    } else {
      e.step({}, 1, {});  // idle replica: an empty step, the MoE exchange spans every rank
    }
  }
  return out;
}

// The single-rank reference: the same ops, replica by replica within a round.
// Result [replica][op].
std::vector<std::vector<StepRecord>> play_reference(const Model& m, const k3::EngineOptions& o, const Script& s) {
  k3::Engine e(m.src, m.config, o);
  std::map<int, int> slot_of;
  for (size_t i = 0; i < s.prompt_len.size(); ++i) slot_of[static_cast<int>(i)] = e.admit();
  std::vector<std::vector<StepRecord>> out(s.dp);
  for (int j = 0; j < s.rounds; ++j)
    for (int p = 0; p < s.dp; ++p)
      if (j < static_cast<int>(s.ops[p].size())) out[p].push_back(apply(e, slot_of, s.ops[p][j]));
  return out;
}

// Every world rank's records.
std::vector<std::vector<StepRecord>> play_layout(const Model& m, const k3::EngineOptions& o, const Layout& L,
                                                 const Script& s) {
  k3::LocalCluster cluster(m.src, m.config, o, L);
  std::vector<std::vector<StepRecord>> per_rank(L.world());
  run_cluster(cluster, [&](int w, k3::Engine& e) { per_rank[w] = play_replica(e, s); });
  return per_rank;
}

// Compares a layout's records against the reference: ranks of a replica bitwise
// identical (failures added), logits ratios accumulated.
Ratio compare_layout(const std::vector<std::vector<StepRecord>>& per_rank,
                     const std::vector<std::vector<StepRecord>>& ref, const Layout& L, int64_t V,
                     const std::string& what) {
  Ratio ratio;
  for (int w = 0; w < L.world(); ++w) {
    const int p = L.replica(w), lead = p * L.tp;
    const auto& got = per_rank[w];
    EXPECT_EQ(got.size(), ref[p].size()) << what << ": rank " << w;
    if (w != lead) {
      for (size_t j = 0; j < std::min(got.size(), per_rank[lead].size()); ++j)
        EXPECT_TRUE(bit_equal(got[j].logits, per_rank[lead][j].logits))
            << what << ": rank " << w << " op " << j << " logits differ from rank " << lead << " of its replica";
      continue;
    }
    for (size_t j = 0; j < std::min(got.size(), ref[p].size()); ++j) {
      EXPECT_EQ(got[j].logits.size(), ref[p][j].logits.size()) << what << ": replica " << p << " op " << j;
      ratio.add(ref[p][j].logits, got[j].logits, V, "replica " + std::to_string(p) + " op " + std::to_string(j));
    }
  }
  return ratio;
}

// ---------------------------------------------------------------- equivalence matrix

struct LayoutCase {
  int tp, dp, dcp;
};
[[maybe_unused]] void PrintTo(const LayoutCase& c, std::ostream* os) {
  *os << layout_name(Layout{c.tp, c.dp, c.dcp});
}

class ParallelEquivalence : public ::testing::TestWithParam<LayoutCase> {};

// The single-rank references, shared by the layouts (key: variant, dp, step).
const std::vector<std::vector<StepRecord>>& reference(const std::string& variant, int dp, StepKind step) {
  static std::map<std::tuple<std::string, int, StepKind>, std::vector<std::vector<StepRecord>>> cache;
  auto key = std::make_tuple(variant, dp, step);
  auto it = cache.find(key);
  if (it == cache.end()) {
    const Model& m = tiny(variant);
    it = cache.emplace(key, play_reference(m, engine_opts(step), make_script(dp, m.config.vocab_size))).first;
  }
  return it->second;
}

TEST_P(ParallelEquivalence, MatchesSingleRank) {
  const Layout L{GetParam().tp, GetParam().dp, GetParam().dcp};
  for (const char* variant : kVariants) {
    const Model& m = tiny(variant);
    const int64_t V = m.config.vocab_size;
    const Script s = make_script(L.dp, m.config.vocab_size);
    std::map<StepKind, std::vector<std::vector<StepRecord>>> runs;
    for (StepKind step : kSteps) {
      const std::string what = layout_name(L) + " " + variant + " " + k3::step_kind_name(step);
      SCOPED_TRACE(what);
      const auto& ref = reference(variant, L.dp, step);
      auto per_rank = play_layout(m, engine_opts(step), L, s);
      // The step kind that ran is the forced one, on every rank and every step.
      for (const auto& rank : per_rank)
        for (const auto& rec : rank) EXPECT_EQ(rec.kind, step);
      const Ratio r = compare_layout(per_rank, ref, L, V, what);
      std::printf("[ parallel ] %-14s %-4s %-6s %s\n", layout_name(L).c_str(), variant, k3::step_kind_name(step),
                  r.summary().c_str());
      expect_within_tolerance(r, what, worst_tol(variant));
      if (L.tp == 1) {
        // One rank holds every head: the same sums in the same order as the
        // single rank (EP moves BF16 losslessly), so bitwise identical.
        EXPECT_EQ(r.worst, 0.0) << what << ": a tp 1 layout must be bitwise the single rank";
      }
      runs[step] = std::move(per_rank);
    }
    {
      // The hybrid step with the shared experts and the dense MLP TP-sharded: the same rule against the single
      // rank. Their output is now a sum of G BF16 partials over intermediate slices, reduced in rank order with
      // FP32 accumulation (the o_proj's kind of noise, once more per FFN layer); on tp 1 nothing is split and
      // the single rank's sums come back bitwise.
      const std::string what = layout_name(L) + " " + variant + " hybrid, shared experts tp";
      SCOPED_TRACE(what);
      const auto& ref = reference(variant, L.dp, StepKind::Hybrid);
      auto per_rank = play_layout(m, engine_opts(StepKind::Hybrid, {}, k3::SharedExperts::Tp), L, s);
      for (const auto& rank : per_rank)
        for (const auto& rec : rank) EXPECT_EQ(rec.kind, StepKind::Hybrid);
      const Ratio r = compare_layout(per_rank, ref, L, V, what);
      std::printf("[ parallel ] %-14s %-4s %-6s %s\n", layout_name(L).c_str(), variant, "tp-ffn", r.summary().c_str());
      expect_within_tolerance(r, what, worst_tol(variant));
      if (L.tp == 1) EXPECT_EQ(r.worst, 0.0) << what << ": a tp 1 layout must be bitwise the single rank";
    }
    // Stock and hybrid on the same layout: the attention input rows are the same
    // BF16 values and both reduce the o_proj partials in rank order with FP32
    // accumulation (reduce_scatter vs all_reduce): bitwise identical logits.
    const auto& a = runs[StepKind::Stock];
    const auto& b = runs[StepKind::Hybrid];
    ASSERT_EQ(a.size(), b.size());
    for (size_t w = 0; w < a.size(); ++w) {
      ASSERT_EQ(a[w].size(), b[w].size());
      for (size_t j = 0; j < a[w].size(); ++j)
        EXPECT_TRUE(bit_equal(a[w][j].logits, b[w][j].logits))
            << layout_name(L) << " " << variant << ": rank " << w << " op " << j << " stock != hybrid";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(ParallelLayouts, ParallelEquivalence,
                         ::testing::Values(LayoutCase{1, 1, 1}, LayoutCase{2, 1, 1}, LayoutCase{2, 1, 2},
                                           LayoutCase{4, 1, 1}, LayoutCase{4, 1, 4}, LayoutCase{2, 2, 1},
                                           LayoutCase{2, 2, 2}, LayoutCase{4, 2, 2}, LayoutCase{8, 1, 8}),
                         [](const ::testing::TestParamInfo<LayoutCase>& i) {
                           return layout_name(Layout{i.param.tp, i.param.dp, i.param.dcp});
                         });

// ---------------------------------------------------------------- negative controls

// A copy of the tiny model (seed 0) changed by `mutate`: what a rank computing with
// the wrong shard of the weights would compute.
std::shared_ptr<const k3::TensorSource> mutated(const k3::ModelConfig& c,
                                                const std::function<void(k3::MemoryCheckpoint&)>& mutate) {
  std::unique_ptr<k3::MemoryCheckpoint> ck = k3::make_synthetic(c, 0);
  mutate(*ck);
  return std::shared_ptr<const k3::TensorSource>(std::move(ck));
}

std::string layer_name(int l, const std::string& rest) {
  return "language_model.model.layers." + std::to_string(l) + "." + rest;
}

// Expert x of layer l negated (the sign bit of every E2M1 value of its w2 flipped).
void negate_expert(k3::MemoryCheckpoint& ck, int l, int x) {
  k3::Tensor& t = ck.mutable_tensor(layer_name(l, "block_sparse_moe.experts." + std::to_string(x) + ".w2.weight_packed"));
  auto* p = static_cast<uint8_t*>(t.data());
  for (size_t i = 0; i < t.nbytes(); ++i) p[i] ^= 0x88;
}

// Every MoE layer's experts shifted by one (expert e computes with e + 1's weights):
// an off-by-one in expert ownership / dispatch.
void shift_experts(k3::MemoryCheckpoint& ck, const k3::ModelConfig& c) {
  const k3::LayerPlan plan = k3::LayerPlan::from(c);
  const int E = c.moe.num_experts;
  for (int l = 0; l < c.num_layers; ++l) {
    if (plan.layers[l].ffn != k3::FfnKind::MoE) continue;
    for (const char* part : {"w1.weight_packed", "w1.weight_scale", "w3.weight_packed", "w3.weight_scale",
                             "w2.weight_packed", "w2.weight_scale"}) {
      std::vector<std::vector<uint8_t>> bytes(E);
      auto name = [&](int x) { return layer_name(l, "block_sparse_moe.experts." + std::to_string(x) + "." + part); };
      for (int x = 0; x < E; ++x) {
        const k3::Tensor& t = ck.mutable_tensor(name(x));
        const auto* p = static_cast<const uint8_t*>(t.data());
        bytes[x].assign(p, p + t.nbytes());
      }
      for (int x = 0; x < E; ++x) {
        k3::Tensor& t = ck.mutable_tensor(name(x));
        std::memcpy(t.data(), bytes[(x + 1) % E].data(), t.nbytes());
      }
    }
  }
}

// Layer l's o_proj with the column blocks of its two head halves swapped: the
// output projection of a TP-2 rank applied to the other rank's heads.
void swap_head_halves(k3::MemoryCheckpoint& ck, int l) {
  k3::Tensor& t = ck.mutable_tensor(layer_name(l, "self_attn.o_proj.weight"));
  const int64_t rows = t.shape()[0], cols = t.shape()[1], half = cols / 2;
  auto* p = static_cast<k3::bf16*>(t.data());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < half; ++j) std::swap(p[r * cols + j], p[r * cols + half + j]);
}

// The tolerance rule of the equivalence matrix reports bugs: a layout's logits
// against references whose weights differ the way a bug would make a rank
// compute (wrong head slice, wrong expert ownership, another model). One
// expert of one layer negated is NOT caught end to end (routing flips look the
// same: it moves ~10% of the rows); ParallelMoe's bitwise check catches it.
TEST(ParallelControl, ToleranceRuleCatchesWrongWeights) {
  const Layout L{2, 2, 2};
  for (const char* variant : kVariants) {
    const Model& m = tiny(variant);
    const k3::ModelConfig& c = m.config;
    const int64_t V = c.vocab_size;
    const Script s = make_script(L.dp, c.vocab_size);
    const auto per_rank = play_layout(m, engine_opts(StepKind::Hybrid), L, s);
    // Against the right model it passes.
    const Ratio good = compare_layout(per_rank, reference(variant, L.dp, StepKind::Hybrid), L, V, "control");
    std::printf("[ parallel ] control %-4s %-44s %s\n", variant, "right weights", good.summary().c_str());
    EXPECT_TRUE(good.passes(worst_tol(variant))) << good.summary();

    const k3::LayerPlan plan = k3::LayerPlan::from(c);
    int full = -1;  // the last full-attention layer (MLA / DSA)
    for (int l = 0; l < c.num_layers; ++l)
      if (plan.layers[l].attn != k3::AttnKind::KDA) full = l;
    ASSERT_GE(full, 0);
    auto with = [&](const std::function<void(k3::MemoryCheckpoint&)>& f) { return Model{c, mutated(c, f)}; };
    struct Bad {
      std::string name;
      Model model;
    };
    const std::vector<Bad> bads = {
        {"another seed", tiny(variant, 1)},
        {"experts shifted by one (every MoE layer)", with([&](k3::MemoryCheckpoint& ck) { shift_experts(ck, c); })},
        {"layer 0 (KDA) o_proj head halves swapped", with([&](k3::MemoryCheckpoint& ck) { swap_head_halves(ck, 0); })},
        {"layer " + std::to_string(full) + " (full attn) o_proj head halves swapped",
         with([&](k3::MemoryCheckpoint& ck) { swap_head_halves(ck, full); })},
        {"expert 5 negated in every MoE layer", with([&](k3::MemoryCheckpoint& ck) {
           for (int l = 0; l < c.num_layers; ++l)
             if (plan.layers[l].ffn == k3::FfnKind::MoE) negate_expert(ck, l, 5);
         })},
    };
    for (const Bad& bad : bads) {
      const Ratio r =
          compare_layout(per_rank, play_reference(bad.model, engine_opts(StepKind::Hybrid), s), L, V, "control");
      std::printf("[ parallel ] control %-4s %-44s %s\n", variant, bad.name.c_str(), r.summary().c_str());
      EXPECT_FALSE(r.passes(worst_tol(variant))) << variant << " " << bad.name << ": the rule must report it (" << r.summary() << ")";
      EXPECT_GT(r.quantile(0.5), kMedianTol) << variant << " " << bad.name << ": the median alone must report it";
    }
    {
      const Ratio r = compare_layout(
          per_rank,
          play_reference(with([&](k3::MemoryCheckpoint& ck) { negate_expert(ck, 4, 5); }), engine_opts(StepKind::Hybrid),
                         s),
          L, V, "control");
      std::printf("[ parallel ] control %-4s %-44s %s (not caught end to end)\n", variant,
                  "expert 5 of layer 4 negated", r.summary().c_str());
    }
  }
}

// ---------------------------------------------------------------- stock vs hybrid MoE, bitwise

std::vector<float> random_rows(uint64_t seed, int64_t m, int64_t D) {
  k3::Rng rng(seed);
  std::vector<float> x(static_cast<size_t>(m * D));
  for (float& v : x) v = k3::round_bf16(static_cast<float>(rng.normal()));
  return x;
}

TEST(ParallelMoe, StockAndHybridPathsAreBitwiseTheSingleRankMoe) {
  for (const char* variant : kVariants) {
    const Model& m = tiny(variant);
    const k3::ModelConfig& c = m.config;
    const int64_t D = c.hidden_size;
    const k3::LayerPlan plan = k3::LayerPlan::from(c);
    std::vector<int> moe_layers;
    for (int l = 0; l < c.num_layers; ++l)
      if (plan.layers[l].ffn == k3::FfnKind::MoE) moe_layers.push_back(l);
    ASSERT_GE(moe_layers.size(), 2u);
    const int layers[2] = {moe_layers.front(), moe_layers.back()};

    // The single-rank moe_ffn on all rows: the whole model, a world of one.
    const k3::ModelWeights whole = k3::load_weights(c, *m.src);
    auto solo = k3::make_local_world(Layout{});
    auto single = [&](int layer, const std::vector<float>& x, int64_t rows) {
      std::vector<float> y(x.size());
      k3::moe_ffn(c, whole.layers[layer].moe, x.data(), rows, rows, *solo[0].world, y.data());
      return y;
    };
    // Its routed part alone: W_up y added into zeros.
    auto single_routed = [&](int layer, const std::vector<float>& x, int64_t rows) {
      std::vector<float> y(x.size(), 0.0f);
      k3::moe_ffn(c, whole.layers[layer].moe, x.data(), rows, rows, *solo[0].world, y.data(), false);
      return y;
    };

    for (const Layout L : {Layout{4, 1, 1}, Layout{2, 2, 1}}) {
      for (int64_t rows : {int64_t{7}, int64_t{3}, int64_t{1}, int64_t{0}, int64_t{12}}) {
        const std::string what = std::string(variant) + " " + layout_name(L) + " m=" + std::to_string(rows);
        SCOPED_TRACE(what);
        const int G = L.tp, W = L.world();
        // Replica p's rows (the same on its ranks); replica 1 has other rows, and a different count.
        std::vector<int64_t> m_of(L.dp);
        std::vector<std::vector<float>> x_of(L.dp);
        for (int p = 0; p < L.dp; ++p) {
          m_of[p] = p == 0 ? rows : rows + 2;
          x_of[p] = random_rows(100 + 7 * p + static_cast<uint64_t>(rows), m_of[p], D);
        }
        auto groups = k3::make_local_world(L);
        std::vector<k3::ModelWeights> weights(W), sliced_weights(W);
        for (int w = 0; w < W; ++w) {
          weights[w] = k3::load_weights(c, *m.src, k3::ShardSpec{G, L.tp_rank(w), W, w});
          sliced_weights[w] = k3::load_weights(c, *m.src, k3::ShardSpec{G, L.tp_rank(w), W, w, true});
        }
        // [layer][rank]
        std::vector<std::vector<std::vector<float>>> hybrid(2, std::vector<std::vector<float>>(W)),
            stock_shard(2, std::vector<std::vector<float>>(W)), sliced(2, std::vector<std::vector<float>>(W));
        run_threads(W, [&](int w) {
          const int p = L.replica(w), t = L.tp_rank(w);
          const int64_t mm = m_of[p], cw = k3::sp_shard_rows(mm, G);
          for (int i = 0; i < 2; ++i) {
            // The hybrid step's MoE: sp_shard -> moe_ffn -> sp_all_gather -> trim.
            {
              std::vector<float> shard(static_cast<size_t>(cw * D)), y(shard.size()), all(G * shard.size());
              const int64_t real = k3::sp_shard(x_of[p].data(), mm, D, G, t, shard.data());
              k3::moe_ffn(c, weights[w].layers[layers[i]].moe, shard.data(), cw, real, *groups[w].world, y.data());
              k3::sp_all_gather(*groups[w].tp, y.data(), cw, D, all.data());
              hybrid[i][w].assign(all.begin(), all.begin() + mm * D);
            }
            // The hybrid step with TP-sharded FFNs: the group's m rows routed by every member, each sending
            // its latent columns; member t's own rows get the routed output, the others stay zero.
            sliced[i][w].assign(static_cast<size_t>(mm * D), 0.0f);
            k3::moe_ffn(c, sliced_weights[w].layers[layers[i]].moe, x_of[p].data(), mm, mm, *groups[w].world,
                        sliced[i][w].data(), false, k3::MoeSlice{G, t, cw});
            // The stock step's MoE: moe_ffn on this rank's shard (gathered by the test).
            std::vector<float> shard(static_cast<size_t>(cw * D));
            const int64_t real = k3::sp_shard(x_of[p].data(), mm, D, G, t, shard.data());
            stock_shard[i][w].assign(static_cast<size_t>(cw * D), -1.0f);
            k3::moe_ffn(c, weights[w].layers[layers[i]].moe, shard.data(), cw, real, *groups[w].world,
                        stock_shard[i][w].data());
          }
        });
        for (int i = 0; i < 2; ++i)
          for (int p = 0; p < L.dp; ++p) {
            const int64_t mm = m_of[p], cw = k3::sp_shard_rows(mm, G);
            const std::vector<float> want = single(layers[i], x_of[p], mm);
            std::vector<float> stock;
            for (int t = 0; t < G; ++t) {
              const auto& sh = stock_shard[i][p * G + t];
              // Padding rows of a shard come back zero.
              const int64_t r0 = std::min(mm, t * cw), real = std::min(mm, r0 + cw) - r0;
              for (int64_t j = real * D; j < cw * D; ++j) ASSERT_EQ(sh[j], 0.0f) << "padding row of tp rank " << t;
              stock.insert(stock.end(), sh.begin(), sh.begin() + real * D);
            }
            EXPECT_TRUE(bit_equal(stock, want)) << "layer " << layers[i] << " replica " << p << ": stock SP MoE";
            for (int t = 0; t < G; ++t)
              EXPECT_TRUE(bit_equal(hybrid[i][p * G + t], want))
                  << "layer " << layers[i] << " replica " << p << " tp rank " << t << ": hybrid MoE";
            const std::vector<float> routed = single_routed(layers[i], x_of[p], mm);
            for (int t = 0; t < G; ++t) {
              const int64_t r0 = std::min(mm, t * cw), real = std::min(mm, r0 + cw) - r0;
              std::vector<float> want_t(static_cast<size_t>(mm * D), 0.0f);
              std::copy_n(routed.data() + r0 * D, real * D, want_t.data() + r0 * D);
              EXPECT_TRUE(bit_equal(sliced[i][p * G + t], want_t))
                  << "layer " << layers[i] << " replica " << p << " tp rank " << t << ": sliced latent down";
            }
            if (mm > 0) {
              // Not vacuous: the MoE changed the rows.
              double norm = 0;
              for (float v : want) norm += std::fabs(v);
              EXPECT_GT(norm, 0.0);
            }
          }
      }
    }
  }
}

// The bitwise MoE check is sensitive to one expert of one layer (which the
// end-to-end tolerance rule is not, see ParallelControl): the rows routed to a
// negated expert change, the others stay bitwise the same.
TEST(ParallelMoe, BitwiseCheckCatchesOneNegatedExpert) {
  const Model& m = tiny("k3");
  const k3::ModelConfig& c = m.config;
  const int64_t D = c.hidden_size, rows = 32;
  const int layer = 4;
  // The tiny preset routes every row of a layer to the k experts of highest gate bias (the k highest are
  // raised by 1, more than any two sigmoid scores differ: src/io/synthetic.cpp), read here from the bias itself.
  const k3::ModelWeights good = k3::load_weights(c, *m.src);
  const float* bias = good.layers[layer].moe.gate_bias;
  std::vector<int> order(static_cast<size_t>(c.moe.num_experts));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return bias[a] > bias[b]; });
  auto solo = k3::make_local_world(Layout{});
  const std::vector<float> x = random_rows(7, rows, D);
  std::vector<float> a(x.size());
  k3::moe_ffn(c, good.layers[layer].moe, x.data(), rows, rows, *solo[0].world, a.data());
  auto changed_rows = [&](int expert) {
    const auto bad_src = mutated(c, [&](k3::MemoryCheckpoint& ck) { negate_expert(ck, layer, expert); });
    const k3::ModelWeights bad = k3::load_weights(c, *bad_src);
    std::vector<float> b(x.size());
    k3::moe_ffn(c, bad.layers[layer].moe, x.data(), rows, rows, *solo[0].world, b.data());
    int changed = 0;
    for (int64_t r = 0; r < rows; ++r)
      changed += std::memcmp(&a[r * D], &b[r * D], static_cast<size_t>(D) * sizeof(float)) != 0;
    return changed;
  };
  const int routed = order[0], unrouted = order[static_cast<size_t>(c.moe.experts_per_token)];
  const int with_routed = changed_rows(routed), with_unrouted = changed_rows(unrouted);
  std::printf("[ parallel ] moe control: layer %d, expert %d (routed to) negated changes %d of %lld rows, expert %d "
              "(not routed to) %d\n", layer, routed, with_routed, static_cast<long long>(rows), unrouted, with_unrouted);
  EXPECT_EQ(with_routed, rows);  // every row goes through it
  EXPECT_EQ(with_unrouted, 0);   // only the rows routed to an expert see it
}

// ---------------------------------------------------------------- collective counts

struct Counts {
  int64_t calls[3][6] = {};
  int64_t bytes[3][6] = {};
  void take(const k3::Engine& e) {
    const k3::CountingComm* g[3] = {&e.tp_comm(), &e.dcp_comm(), &e.world_comm()};
    for (int i = 0; i < 3; ++i)
      for (int k = 0; k < 6; ++k) {
        calls[i][k] = g[i]->calls(static_cast<CollKind>(k));
        bytes[i][k] = g[i]->bytes(static_cast<CollKind>(k));
      }
  }
};
enum { kTp = 0, kDcp = 1, kWorld = 2 };
constexpr int idx(CollKind k) { return static_cast<int>(k); }

TEST(ParallelCounts, CollectivesPerStepFollowTheLayerPlan) {
  for (const char* variant : kVariants)
    for (const Layout L : {Layout{1, 1, 1}, Layout{4, 1, 2}, Layout{2, 2, 2}, Layout{4, 2, 4}})
      for (int mode = 0; mode < 3; ++mode) {  // stock, hybrid, hybrid with the FFNs TP-sharded
        const StepKind step = mode == 0 ? StepKind::Stock : StepKind::Hybrid;
        const bool ffn_tp = mode == 2, sliced = ffn_tp && L.tp > 1;
        const std::string what = std::string(variant) + " " + layout_name(L) + " " + k3::step_kind_name(step) +
                                 (ffn_tp ? " ffn tp" : "");
        SCOPED_TRACE(what);
        const Model& m = tiny(variant);
        const k3::ModelConfig& c = m.config;
        const k3::LayerPlan plan = k3::LayerPlan::from(c);
        int n_moe = 0, n_full = 0, n_dsa = 0;
        for (const k3::LayerInfo& li : plan.layers) {
          n_moe += li.ffn == k3::FfnKind::MoE;
          n_full += li.attn != k3::AttnKind::KDA;
          n_dsa += li.attn == k3::AttnKind::DSA;
        }
        const int n_layers = c.num_layers;
        const int G = L.tp, W = L.world(), Dc = L.dcp;
        const int64_t D = c.hidden_size, V = c.vocab_size, Lat = c.moe.latent_size, k = c.moe.experts_per_token;
        const int64_t Hl = c.mla.num_heads / G, E = c.mla.cache_dim(), R = c.mla.kv_lora_rank;
        const int64_t topk = c.is_dsa() ? c.dsa->index_topk : 0;

        // Two requests per replica (prompts of 5 + p and 3), prefilled; then a decode
        // step (m = 2) and a verify step (q = 3, m = 6), each counted on its own.
        k3::LocalCluster cluster(
            m.src, c, engine_opts(step, {}, ffn_tp ? k3::SharedExperts::Tp : k3::SharedExperts::Replicated), L);
        const int kSteps2 = 2;
        const int64_t rows_of[kSteps2] = {2, 6};
        std::vector<std::vector<Counts>> got(kSteps2, std::vector<Counts>(W));
        run_cluster(cluster, [&](int w, k3::Engine& e) {
          const int p = L.replica(w);
          k3::Rng rng(9 + p);
          const int a = e.admit(), b = e.admit();
          e.prefill(a, random_tokens(rng, 5 + p, c.vocab_size));
          e.prefill(b, random_tokens(rng, 3, c.vocab_size));
          const int slots[2] = {a, b};
          for (int i = 0; i < kSteps2; ++i) {
            const int q = i == 0 ? 1 : 3;
            e.reset_counts();
            e.step(slots, q, random_tokens(rng, 2 * q, c.vocab_size));
            got[i][w].take(e);
            e.commit(a, 1);
            e.commit(b, q);
          }
        });
        for (int i = 0; i < kSteps2; ++i) {
          const int64_t rows = rows_of[i], cs = k3::sp_shard_rows(rows, G);
          SCOPED_TRACE("rows " + std::to_string(rows));
          int64_t a2a_bytes_sum = 0;
          for (int w = 0; w < W; ++w) {
            const Counts& n = got[i][w];
            const auto& tp = n.calls[kTp];
            const auto& tpb = n.bytes[kTp];
            if (ffn_tp) {
              // One all-reduce per attention and per FFN (the routed rows meet the shared partial).
              EXPECT_EQ(tp[idx(CollKind::AllReduce)], 2 * n_layers);
              EXPECT_EQ(tpb[idx(CollKind::AllReduce)], 2 * n_layers * rows * D * 2);
              EXPECT_EQ(tp[idx(CollKind::AllGather)], 1);  // lm_head only
              EXPECT_EQ(tpb[idx(CollKind::AllGather)], rows * (V / G) * 4);
              EXPECT_EQ(tp[idx(CollKind::ReduceScatter)], 0);
            } else if (step == StepKind::Hybrid) {
              EXPECT_EQ(tp[idx(CollKind::AllReduce)], n_layers);  // one per attention layer
              EXPECT_EQ(tpb[idx(CollKind::AllReduce)], n_layers * rows * D * 2);
              EXPECT_EQ(tp[idx(CollKind::AllGather)], n_moe + 1);  // MoE rows back + lm_head
              EXPECT_EQ(tpb[idx(CollKind::AllGather)], n_moe * cs * D * 2 + rows * (V / G) * 4);
              EXPECT_EQ(tp[idx(CollKind::ReduceScatter)], 0);
            } else {
              EXPECT_EQ(tp[idx(CollKind::AllGather)], n_layers + 2);  // per layer + hidden rows + lm_head
              EXPECT_EQ(tpb[idx(CollKind::AllGather)], (n_layers + 1) * cs * D * 2 + rows * (V / G) * 4);
              EXPECT_EQ(tp[idx(CollKind::ReduceScatter)], n_layers);
              EXPECT_EQ(tpb[idx(CollKind::ReduceScatter)], n_layers * G * cs * D * 2);
              EXPECT_EQ(tp[idx(CollKind::AllReduce)], 0);
            }
            EXPECT_EQ(tp[idx(CollKind::AllToAllV)], 0);
            EXPECT_EQ(tp[idx(CollKind::Broadcast)] + tp[idx(CollKind::Barrier)], 0);

            const auto& wc = n.calls[kWorld];
            EXPECT_EQ(wc[idx(CollKind::AllReduce)], W > 1 ? 1 : 0);  // the step's input agreement
            EXPECT_EQ(n.bytes[kWorld][idx(CollKind::AllReduce)], W > 1 ? 4 : 0);
            // counts, ids, latent rows, outputs; sliced (the latent down TP-sharded) also the rows' owners
            EXPECT_EQ(wc[idx(CollKind::AllToAllV)], (sliced ? 5 : 4) * n_moe);
            EXPECT_EQ(wc[idx(CollKind::AllGather)] + wc[idx(CollKind::ReduceScatter)], 0);
            a2a_bytes_sum += n.bytes[kWorld][idx(CollKind::AllToAllV)];

            const auto& dc = n.calls[kDcp];
            if (Dc > 1) {
              EXPECT_EQ(dc[idx(CollKind::AllGather)], n_full + 2 * n_dsa);  // queries (+ DSA scores, positions)
              EXPECT_EQ(n.bytes[kDcp][idx(CollKind::AllGather)],
                        n_full * rows * Hl * E * 2 + n_dsa * 2 * rows * topk * 4);
              EXPECT_EQ(dc[idx(CollKind::AllToAllV)], 2 * n_full);  // o, lse
              EXPECT_EQ(n.bytes[kDcp][idx(CollKind::AllToAllV)], n_full * (Dc * rows * Hl * R * 4 + Dc * rows * Hl * 4));
            } else {
              EXPECT_EQ(dc[idx(CollKind::AllGather)] + dc[idx(CollKind::AllToAllV)], 0);
            }
            EXPECT_EQ(dc[idx(CollKind::AllReduce)] + dc[idx(CollKind::ReduceScatter)], 0);
          }
          // EP bytes over the world, per MoE layer: W counts (I32) from every rank, and
          // every real row's k choices as an id (I32) + a latent row (BF16) out and the
          // latent output (BF16) back. Every replica has `rows` rows. Sliced: each of the
          // G members sends every pair's id, owner (I32) and Lat / G columns.
          const int64_t items = int64_t{L.dp} * rows * k;
          const int64_t out_bytes = sliced ? G * (4 + 4 + Lat / G * 2) : 4 + Lat * 2;
          EXPECT_EQ(a2a_bytes_sum, n_moe * (int64_t{W} * W * 4 + items * out_bytes + items * Lat * 2));
        }
      }
}

// ---------------------------------------------------------------- bad layouts

class CountingSource : public k3::TensorSource {
 public:
  explicit CountingSource(std::shared_ptr<const k3::TensorSource> inner) : inner_(std::move(inner)) {}
  bool has(const std::string& name) const override { return inner_->has(name); }
  k3::TensorView get(const std::string& name) const override {
    ++gets_;
    return inner_->get(name);
  }
  std::vector<std::string> names() const override { return inner_->names(); }
  int64_t gets() const { return gets_; }

 private:
  std::shared_ptr<const k3::TensorSource> inner_;
  mutable std::atomic<int64_t> gets_{0};
};

// The k3::Error message of fn, or "" when it does not throw one.
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const k3::Error& e) {
    return e.what();
  }
  return "";
}

TEST(ParallelLayout, BadLayoutsAreErrorsBeforeAnyWeightIsRead) {
  const Model& m = tiny("k3");
  const k3::EngineOptions o = engine_opts(StepKind::Auto);
  struct Case {
    std::string name;
    k3::ModelConfig config;
    Layout layout;
    std::vector<std::string> words;  // the message names these
  };
  k3::ModelConfig odd_vocab = m.config;
  odd_vocab.vocab_size = 250;  // 250 % 4 != 0
  const std::vector<Case> cases = {
      {"heads (tp 3 on 8 heads)", m.config, Layout{3, 1, 1}, {"heads", "8", "--tp 3"}},
      {"experts (world 32 on 16 experts)", m.config, Layout{4, 8, 1}, {"16 experts", "32 ranks"}},
      {"dcp does not divide tp", m.config, Layout{4, 1, 3}, {"--dcp 3", "--tp 4"}},
      {"vocabulary (250 on tp 4)", odd_vocab, Layout{4, 1, 1}, {"vocabulary 250", "--tp 4"}},
      {"tp 0", m.config, Layout{0, 1, 1}, {"--tp 0"}},
  };
  for (const Case& cs : cases) {
    SCOPED_TRACE(cs.name);
    // Through LocalCluster (the whole layout) and through one rank's Engine.
    auto src = std::make_shared<CountingSource>(m.src);
    const std::string msg = error_of([&] { k3::LocalCluster cl(src, cs.config, o, cs.layout); });
    ASSERT_FALSE(msg.empty()) << "no k3::Error";
    for (const auto& w : cs.words) EXPECT_NE(msg.find(w), std::string::npos) << "message: " << msg;
    EXPECT_EQ(src->gets(), 0) << "weights were read before the error: " << msg;

    auto src2 = std::make_shared<CountingSource>(m.src);
    const std::string msg2 = error_of([&] {
      // Groups of the right sizes where they can be made (they are not what fails).
      Layout g = cs.layout;
      if (g.tp < 1 || g.tp % std::max(1, g.dcp) != 0) g = Layout{};
      auto groups = k3::make_local_world(g);
      k3::Engine e(src2, cs.config, o, cs.layout, 0, std::move(groups[0]));
    });
    ASSERT_FALSE(msg2.empty()) << "no k3::Error from Engine";
    for (const auto& w : cs.words) EXPECT_NE(msg2.find(w), std::string::npos) << "message: " << msg2;
    EXPECT_EQ(src2->gets(), 0) << "weights were read before the error: " << msg2;
  }
  {
    // Groups of the wrong size: layout (2,1,1) with the groups of a single rank.
    SCOPED_TRACE("groups of the wrong size");
    auto src = std::make_shared<CountingSource>(m.src);
    const std::string msg = error_of([&] {
      auto groups = k3::make_local_world(Layout{1, 1, 1});
      k3::Engine e(src, m.config, o, Layout{2, 1, 1}, 0, std::move(groups[0]));
    });
    ASSERT_FALSE(msg.empty()) << "no k3::Error";
    EXPECT_NE(msg.find("tp 1"), std::string::npos) << msg;
    EXPECT_NE(msg.find("--tp 2"), std::string::npos) << msg;
    EXPECT_EQ(src->gets(), 0) << "weights were read before the error: " << msg;
  }
  {
    // A world rank outside the layout.
    SCOPED_TRACE("rank outside the layout");
    auto src = std::make_shared<CountingSource>(m.src);
    const std::string msg = error_of([&] {
      auto groups = k3::make_local_world(Layout{2, 1, 1});
      k3::Engine e(src, m.config, o, Layout{2, 1, 1}, 2, std::move(groups[0]));
    });
    ASSERT_FALSE(msg.empty()) << "no k3::Error";
    EXPECT_NE(msg.find("rank 2"), std::string::npos) << msg;
    EXPECT_EQ(src->gets(), 0) << msg;
  }
  {
    // TP-sharded shared experts: not with the stock step, and only where the intermediate rows divide.
    SCOPED_TRACE("shared experts tp");
    k3::EngineOptions stock_tp = engine_opts(StepKind::Stock, {}, k3::SharedExperts::Tp);
    auto src = std::make_shared<CountingSource>(m.src);
    std::string msg = error_of([&] { k3::LocalCluster cl(src, m.config, stock_tp, Layout{2, 1, 1}); });
    EXPECT_NE(msg.find("--step stock"), std::string::npos) << msg;
    EXPECT_NE(msg.find("--shared-experts replicated"), std::string::npos) << msg;
    k3::ModelConfig odd_dense = m.config;
    odd_dense.dense_intermediate_size = 130;  // 130 % 4 != 0
    msg = error_of([&] {
      k3::LocalCluster cl(src, odd_dense, engine_opts(StepKind::Hybrid, {}, k3::SharedExperts::Tp), Layout{4, 1, 1});
    });
    EXPECT_NE(msg.find("130 intermediate rows"), std::string::npos) << msg;
    EXPECT_NE(msg.find("--tp 4"), std::string::npos) << msg;
    EXPECT_EQ(src->gets(), 0) << "weights were read before the error: " << msg;
  }
  {
    // Control: a good layout does read weights through the wrapper.
    auto src = std::make_shared<CountingSource>(m.src);
    k3::LocalCluster ok(src, m.config, o, Layout{2, 1, 1});
    EXPECT_GT(src->gets(), 0);
  }
}

// ---------------------------------------------------------------- aux hidden states

TEST(ParallelAux, AuxStatesAgreeAcrossStepsAndLayouts) {
  const std::vector<int> aux = {0, 3, 8};
  for (const char* variant : kVariants) {
    const Model& m = tiny(variant);
    const k3::ModelConfig& c = m.config;
    const int64_t D = c.hidden_size;
    const k3::TensorView embed = m.src->get("language_model.model.embed_tokens.weight");
    const k3::bf16* E = embed.as<k3::bf16>();
    for (const Layout L : {Layout{1, 1, 1}, Layout{4, 1, 2}, Layout{2, 2, 2}}) {
      const Script s = make_script(L.dp, c.vocab_size);
      std::map<StepKind, std::vector<std::vector<StepRecord>>> runs;
      for (StepKind step : kSteps) {
        const std::string what = std::string(variant) + " " + layout_name(L) + " " + k3::step_kind_name(step);
        SCOPED_TRACE(what);
        const auto ref = play_reference(m, engine_opts(step, aux), s);
        runs[step] = play_layout(m, engine_opts(step, aux), L, s);
        Ratio r;
        for (int w = 0; w < L.world(); w += L.tp) {  // the first rank of each replica
          const int p = L.replica(w);
          const auto& got = runs[step][w];
          ASSERT_EQ(got.size(), s.ops[p].size());
          for (size_t j = 0; j < got.size(); ++j) {
            const Op& op = s.ops[p][j];
            const int64_t rows = static_cast<int64_t>(op.reqs.size()) * op.q;
            ASSERT_EQ(got[j].aux.size(), static_cast<size_t>(3 * rows * D)) << "op " << j;
            // aux[0]: the embeddings of the step's tokens, exactly.
            for (int64_t row = 0; row < rows; ++row)
              for (int64_t i = 0; i < D; ++i)
                ASSERT_EQ(got[j].aux[row * D + i], k3::to_float(E[op.tokens[row] * D + i]))
                    << "op " << j << " row " << row;
            // Against the single rank, per hidden row (spread of the reference row).
            r.add(ref[p][j].aux, got[j].aux, D, "replica " + std::to_string(p) + " op " + std::to_string(j));
          }
        }
        std::printf("[ parallel ] aux %-4s %-14s %-6s %s\n", variant, layout_name(L).c_str(),
                    k3::step_kind_name(step), r.summary().c_str());
        // A flipped expert moves a hidden row more, relative to its spread, than it
        // moves the logits (measured up to 0.37): a looser bound on the worst row.
        expect_within_tolerance(r, what, kAuxWorstTol);
      }
      // Stock and hybrid: bitwise the same aux states on every rank.
      for (int w = 0; w < L.world(); ++w)
        for (size_t j = 0; j < runs[StepKind::Stock][w].size(); ++j)
          EXPECT_TRUE(bit_equal(runs[StepKind::Stock][w][j].aux, runs[StepKind::Hybrid][w][j].aux))
              << variant << " " << layout_name(L) << " rank " << w << " op " << j;
    }
  }
}

// ---------------------------------------------------------------- generate over DP replicas

TEST(ParallelGenerate, DpReplicasGiveTheSingleRankResults) {
  const std::vector<std::vector<int32_t>> prompts = {
      {5, 17, 200, 3, 99, 41, 7, 250, 12}, {1, 2, 3}, {60, 61, 62, 63, 64, 65}, {128}, {9, 8}};
  const int max_new = 8;
  k3::SamplingParams sp;
  sp.greedy = true;
  sp.stop_at_eos = false;
  for (const char* variant : kVariants) {
    const Model& m = tiny(variant);
    const int64_t V = m.config.vocab_size;
    k3::Engine single(m.src, m.config, engine_opts(StepKind::Auto));
    const std::vector<k3::GenerateResult> want = k3::generate(single, prompts, max_new, sp, true);
    ASSERT_EQ(want.size(), prompts.size());
    for (const Layout L : {Layout{1, 2, 1}, Layout{2, 2, 1}, Layout{2, 2, 2}, Layout{1, 4, 1}}) {
      const std::string what = std::string(variant) + " " + layout_name(L);
      SCOPED_TRACE(what);
      k3::LocalCluster cluster(m.src, m.config, engine_opts(StepKind::Auto), L);
      std::vector<std::vector<k3::GenerateResult>> per_rank(L.world());
      run_cluster(cluster, [&](int w, k3::Engine& e) { per_rank[w] = k3::generate(e, prompts, max_new, sp, true); });
      // Every rank assembles every request's tokens.
      for (int w = 1; w < L.world(); ++w)
        for (size_t i = 0; i < prompts.size(); ++i)
          EXPECT_EQ(per_rank[w][i].tokens, per_rank[0][i].tokens) << "rank " << w << " request " << i;
      const auto& got = per_rank[0];
      int agree_total = 0, total = 0;
      for (size_t i = 0; i < prompts.size(); ++i) {
        ASSERT_EQ(got[i].tokens.size(), static_cast<size_t>(max_new)) << "request " << i;
        ASSERT_EQ(want[i].tokens.size(), static_cast<size_t>(max_new)) << "request " << i;
        int agree = 0;
        while (agree < max_new && got[i].tokens[agree] == want[i].tokens[agree]) ++agree;
        agree_total += agree;
        total += max_new;
        EXPECT_GE(agree, 1) << "request " << i << ": the first generated token differs";
        if (L.tp == 1) EXPECT_EQ(agree, max_new) << "request " << i << " (tp 1: bitwise the single rank)";
      }
      // Request 0's logits (replica 0): the rows whose inputs agree.
      ASSERT_EQ(got[0].positions, want[0].positions);
      int agree0 = 0;
      while (agree0 < max_new && got[0].tokens[agree0] == want[0].tokens[agree0]) ++agree0;
      const int64_t cmp_rows = static_cast<int64_t>(prompts[0].size()) + std::min(agree0, max_new - 1);
      const Logits a(want[0].logits.begin(), want[0].logits.begin() + cmp_rows * V);
      const Logits b(got[0].logits.begin(), got[0].logits.begin() + cmp_rows * V);
      Ratio r;
      r.add(a, b, V, "request 0");
      std::printf("[ parallel ] generate %-4s %-14s tokens agreeing with the single rank %d / %d; request 0 logits: %s\n",
                  variant, layout_name(L).c_str(), agree_total, total, r.summary().c_str());
      // One request's rows are not independent (a flipped choice carries into its
      // later rows through the caches): only the median and the worst row.
      EXPECT_LE(r.quantile(0.5), kMedianTol) << what << " request 0 logits: " << r.summary();
      EXPECT_LE(r.worst, worst_tol(variant)) << what << " request 0 logits: " << r.summary();
      if (L.tp == 1) EXPECT_TRUE(bit_equal(got[0].logits, want[0].logits)) << "tp 1: bitwise the single rank";
    }
  }
}

}  // namespace
