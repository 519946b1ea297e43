// The parallel-runtime matrix on one GPU: every layout of tests/test_parallel.cpp
// as GpuRanks on one device (LocalGpuCluster: ranks as threads, the local GPU
// comm backend), both steps, both variants, against the single-rank CPU Engine.
//   GpuParallel.MatchesCpuSingleRank/<layout>  teacher-forced scripts per DP
//       replica (prefill chunks, a q = 2 step, decode, a one-row step (rows <
//       G), verify q = 3 accepting 2 / 1 / 0, decode, verify q = 4 accepting
//       1 / 3 / 2, decode; idle replicas step with B = 0), logits within the
//       tolerance rule of test_parallel.cpp; every rank of a replica returns
//       bitwise the same logits
//   GpuParallel.GraphsAreAClearError  run_graph() on the local GPU backend is a
//       k3::Error naming the comm, on every rank (no hang)
// Every case prints one line (layout, variant, step, rows, median / p80 / p95 /
// mean / worst and where the worst row is) and, for diagnosis only, the same
// figures against the CPU LocalCluster on the same layout (GPU noise alone,
// ~0.2% of the spread; a GPU bug shows in both lines); a failure names layout,
// variant, step, replica, op and row. Ranks never assert in their threads: they record,
// and a rank that throws prints its error at once (its peers would wait in a
// collective); a watchdog ends the process if the ranks do not finish.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "../parallel_script.h"
#include "gpu_test_util.h"
#include "io/synthetic.h"
#include "ops/linear.h"
#include "runtime/cluster.h"
#include "runtime/engine.h"
#include "runtime/gpu/cluster.h"

namespace k3 {
namespace {

// The rule of tests/test_parallel.cpp (per row: max |diff| / (max - min of the reference row)).
// Worst row 0.15 (was 0.5): the CPU layouts measured 0.0148 (K3) / 0.0883 (K3.1, DSA top-k near-ties) with the
// tiny preset's router bias gap (test_parallel.cpp), the CPU engine vs float64 0.0044 / 0.0353.
constexpr double kMedianTol = 0.01, kP80Tol = 0.03, kMeanTol = 0.04, kWorstTol = 0.15;

struct Model {
  ModelConfig config;
  std::shared_ptr<const TensorSource> src;
};
const Model& tiny(const std::string& variant) {
  static std::map<std::string, Model> models;
  auto it = models.find(variant);
  if (it == models.end()) {
    ModelConfig c = preset_config("tiny", variant);
    it = models.emplace(variant, Model{c, make_synthetic(c, 0)}).first;
  }
  return it->second;
}

// ---- scripts: tests/parallel_script.h (as test_parallel.cpp)

using test::make_script;
using test::Op;
using test::Script;

// The single-rank CPU reference: [replica][op] logits.
std::vector<std::vector<std::vector<float>>> play_reference(const Model& m, const Script& s) {
  CacheOptions co;
  co.max_slots = 6;
  co.max_context = 48;
  co.max_q = 4;
  co.page_size = 4;
  Engine e(m.src, m.config, EngineOptions(co));
  std::map<int, int> slot_of;
  for (size_t i = 0; i < s.prompt_len.size(); ++i) slot_of[static_cast<int>(i)] = e.admit();
  std::vector<std::vector<std::vector<float>>> out(s.dp);
  for (int j = 0; j < s.rounds; ++j)
    for (int p = 0; p < s.dp; ++p) {
      if (j >= static_cast<int>(s.ops[p].size())) continue;
      const Op& op = s.ops[p][j];
      std::vector<int> slots;
      for (int id : op.reqs) slots.push_back(slot_of.at(id));
      out[p].push_back(e.step(slots, op.q, op.tokens));
      for (size_t b = 0; b < slots.size(); ++b) e.commit(slots[b], op.commits[b]);
    }
  return out;
}

// The same layout on the CPU (LocalCluster), for the diagnostics: [world rank][op] logits.
std::vector<std::vector<std::vector<float>>> play_cpu_layout(const Model& m, const Script& s, const Layout& L,
                                                             StepKind kind, SharedExperts shared) {
  CacheOptions co;
  co.max_slots = 6;
  co.max_context = 48;
  co.max_q = 4;
  co.page_size = 4;
  EngineOptions eo(co);
  eo.step = kind;
  eo.shared = shared;
  LocalCluster cluster(m.src, m.config, eo, L);
  std::vector<std::vector<std::vector<float>>> per_rank(L.world());
  cluster.run([&](int w, Engine& e) {
    const int p = L.replica(w);
    std::map<int, int> slot_of;
    for (int id : s.requests[p]) slot_of[id] = e.admit();
    for (int j = 0; j < s.rounds; ++j) {
      if (j >= static_cast<int>(s.ops[p].size())) {
        e.step({}, 1, {});
        continue;
      }
      const Op& op = s.ops[p][j];
      std::vector<int> slots;
      for (int id : op.reqs) slots.push_back(slot_of.at(id));
      per_rank[w].push_back(e.step(slots, op.q, op.tokens));
      for (size_t b = 0; b < slots.size(); ++b) e.commit(slots[b], op.commits[b]);
    }
  });
  return per_rank;
}

GpuRankOptions gpu_opts() {
  GpuRankOptions o;
  o.max_slots = 4;
  o.max_batch = 3;
  o.max_q = 4;
  o.max_context = 48;
  o.page_size = 4;
  return o;
}

constexpr int kWatchdogSeconds = 180;  // the tiny layouts take seconds (memcheck: tens)

// cluster.run(fn) under a watchdog; a rank's exception is printed at once and rethrown after.
void run_watched(LocalGpuCluster& cluster, const std::string& what, const std::function<void(int, GpuRank&)>& fn) {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr err;
  std::thread runner([&] {
    try {
      cluster.run([&](int w, GpuRank& r) {
        try {
          fn(w, r);
        } catch (const std::exception& e) {
          std::fprintf(stderr, "[ gpu parallel ] %s: world rank %d threw: %s\n", what.c_str(), w, e.what());
          std::fflush(stderr);
          throw;
        }
      });
    } catch (...) {
      err = std::current_exception();
    }
    std::lock_guard lk(mu);
    done = true;
    cv.notify_all();
  });
  {
    std::unique_lock lk(mu);
    if (!cv.wait_for(lk, std::chrono::seconds(kWatchdogSeconds), [&] { return done; })) {
      std::fprintf(stderr, "[ gpu parallel ] %s: ranks still running after %d s (a rank is stuck in a collective)\n",
                   what.c_str(), kWatchdogSeconds);
      std::fflush(stderr);
      std::_Exit(3);
    }
  }
  runner.join();
  if (err) std::rethrow_exception(err);
}

// Every world rank's logits per op of its replica.
std::vector<std::vector<std::vector<float>>> play_gpu(LocalGpuCluster& cluster, const Script& s, StepKind kind,
                                                      const std::string& what) {
  const Layout& L = cluster.layout();
  std::vector<std::vector<std::vector<float>>> per_rank(L.world());
  run_watched(cluster, what, [&](int w, GpuRank& g) {
    const int p = L.replica(w);
    std::map<int, int> slot_of;
    for (int id : s.requests[p]) slot_of[id] = g.admit();
    for (int j = 0; j < s.rounds; ++j) {
      if (j >= static_cast<int>(s.ops[p].size())) {
        g.prepare({}, 1, {});  // idle replica: only the EP exchanges
        g.enqueue(kind);
        continue;
      }
      const Op& op = s.ops[p][j];
      std::vector<int> slots;
      for (int id : op.reqs) slots.push_back(slot_of.at(id));
      g.prepare(slots, op.q, op.tokens);
      g.enqueue(kind);
      per_rank[w].push_back(g.logits());
      g.commit(slots, op.commits);
    }
  });
  return per_rank;
}

struct Ratio {
  std::vector<double> all;
  double worst = -1;
  std::string worst_where;
  double quantile(double f) const {
    if (all.empty()) return 0;
    std::vector<double> v = all;
    std::sort(v.begin(), v.end());
    return v[static_cast<size_t>(std::ceil(f * static_cast<double>(v.size() - 1)))];
  }
  double mean() const {
    double t = 0;
    for (double v : all) t += v;
    return all.empty() ? 0 : t / static_cast<double>(all.size());
  }
  void add(const std::vector<float>& want, const std::vector<float>& got, int64_t V, const std::string& where) {
    const int64_t n = static_cast<int64_t>(want.size()) / V;
    for (int64_t r = 0; r < n; ++r) {
      const float* a = want.data() + r * V;
      const bool have = static_cast<int64_t>(got.size()) >= (r + 1) * V;
      float lo = a[0], hi = a[0];
      double diff = have ? 0.0 : INFINITY;
      for (int64_t i = 0; i < V && have; ++i) {
        lo = std::min(lo, a[i]);
        hi = std::max(hi, a[i]);
        const double d = std::fabs(static_cast<double>(a[i]) - got[r * V + i]);
        diff = std::isnan(d) ? INFINITY : std::max(diff, d);
      }
      const double ratio = hi > lo ? diff / (hi - lo) : (diff > 0 ? INFINITY : 0.0);
      if (ratio > worst) {
        worst = ratio;
        worst_where = where + " row " + std::to_string(r);
      }
      all.push_back(ratio);
    }
  }
  std::string summary() const {
    char buf[256];
    std::snprintf(buf, sizeof buf, "rows %3zu  median %.4f  p80 %.4f  p95 %.4f  mean %.4f  worst %.4f (%s)",
                  all.size(), quantile(0.5), quantile(0.8), quantile(0.95), mean(), worst, worst_where.c_str());
    return buf;
  }
};

struct LayoutCase {
  int tp, dp, dcp;
};
std::string layout_name(const LayoutCase& c) {
  return "tp" + std::to_string(c.tp) + "_dp" + std::to_string(c.dp) + "_dcp" + std::to_string(c.dcp);
}
[[maybe_unused]] void PrintTo(const LayoutCase& c, std::ostream* os) { *os << layout_name(c); }

class GpuParallel : public ::testing::TestWithParam<LayoutCase> {};

TEST_P(GpuParallel, MatchesCpuSingleRank) {
  K3_REQUIRE_GPU();
  const Layout L{GetParam().tp, GetParam().dp, GetParam().dcp};
  for (const char* variant : {"k3", "k3.1"}) {
    const Model& m = tiny(variant);
    const int64_t V = m.config.vocab_size;
    const Script s = make_script(L.dp, static_cast<int>(V));
    const auto ref = play_reference(m, s);
    std::map<StepKind, std::vector<std::vector<std::vector<float>>>> runs;
    // Stock, hybrid, and hybrid with the shared experts / dense MLP TP-sharded (ffn tp) without the shared
    // group and the tc GLU member; with TP, ffn tp again with both (moe_shared_group, linear_glu_tc_force: the
    // defaults), each path whatever the environment says.
    for (int mode = 0; mode < 4; ++mode) {
      if (mode == 3 && L.tp == 1) continue;
      const StepKind kind = mode == 0 ? StepKind::Stock : StepKind::Hybrid;
      const SharedExperts shared = mode >= 2 ? SharedExperts::Tp : SharedExperts::Replicated;
      const std::string label = mode == 3 ? "tp-grp" : mode == 2 ? "tp-ffn" : step_kind_name(kind);
      const std::string what = layout_name(GetParam()) + " " + variant + " " + label;
      SCOPED_TRACE(what);
      GpuRankOptions go = gpu_opts();
      go.steps.shared = shared;
      go.moe_shared_group = mode == 3;
      ops::cuda::linear_glu_tc_force(mode == 3 ? 1 : mode == 2 ? 0 : -1);
      LocalGpuCluster cluster(*m.src, m.config, go, L);
      auto per_rank = play_gpu(cluster, s, kind, what);
      ops::cuda::linear_glu_tc_force(-1);
      Ratio r;
      for (int w = 0; w < L.world(); ++w) {
        const int p = L.replica(w), lead = p * L.tp;
        ASSERT_EQ(per_rank[w].size(), ref[p].size()) << what << ": world rank " << w << " ops";
        for (size_t j = 0; j < ref[p].size(); ++j) {
          const Op& op = s.ops[p][j];
          const std::string where = "replica " + std::to_string(p) + " op " + std::to_string(j) + " (" + op.what +
                                    ", B " + std::to_string(op.reqs.size()) + " q " + std::to_string(op.q) + ")";
          if (w != lead) {
            const auto& a = per_rank[w][j];
            const auto& b = per_rank[lead][j];
            EXPECT_TRUE(a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0)
                << what << ": world rank " << w << " logits differ from rank " << lead << " of its replica at "
                << where;
            continue;
          }
          ASSERT_EQ(per_rank[w][j].size(), ref[p][j].size()) << what << ": " << where;
          r.add(ref[p][j], per_rank[w][j], V, where);
        }
      }
      std::printf("[ gpu parallel ] %-13s %-4s %-6s %s\n", layout_name(GetParam()).c_str(), variant, label.c_str(),
                  r.summary().c_str());
      if (L.world() > 1) {
        // Diagnostics only: the same layout on the CPU. A GPU bug shows here as much as
        // against the single rank; layout noise (summation order, flipped near-ties) does not.
        const auto cpu = play_cpu_layout(m, s, L, kind, shared);
        Ratio rc;
        for (int p = 0; p < L.dp; ++p)
          for (size_t j = 0; j < std::min(cpu[p * L.tp].size(), per_rank[p * L.tp].size()); ++j)
            rc.add(cpu[p * L.tp][j], per_rank[p * L.tp][j], V, "replica " + std::to_string(p) + " op " + std::to_string(j));
        std::printf("[ gpu parallel ] %-13s %-4s %-6s vs the CPU on the same layout: %s\n",
                    layout_name(GetParam()).c_str(), variant, label.c_str(), rc.summary().c_str());
      }
      std::fflush(stdout);
      EXPECT_LE(r.quantile(0.5), kMedianTol) << what << ": median row ratio; " << r.summary();
      EXPECT_LE(r.quantile(0.8), kP80Tol) << what << ": 80th percentile row ratio; " << r.summary();
      EXPECT_LE(r.mean(), kMeanTol) << what << ": mean row ratio; " << r.summary();
      EXPECT_LE(r.worst, kWorstTol) << what << ": worst row; " << r.summary();
      if (mode < 2) runs[kind] = std::move(per_rank);
    }
    // Informational: stock and hybrid are bitwise equal on the CPU; on the GPU the
    // dense MLP runs on shard rows (stock) vs all rows (hybrid) and cuBLASLt may
    // pick another kernel for another row count.
    size_t same = 0, total = 0;
    for (size_t w = 0; w < runs[StepKind::Stock].size(); ++w)
      for (size_t j = 0; j < runs[StepKind::Stock][w].size(); ++j, ++total) {
        const auto& a = runs[StepKind::Stock][w][j];
        const auto& b = runs[StepKind::Hybrid][w][j];
        same += a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
      }
    std::printf("[ gpu parallel ] %-13s %-4s stock == hybrid bitwise on %zu of %zu (rank, op)\n",
                layout_name(GetParam()).c_str(), variant, same, total);
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, GpuParallel,
                         ::testing::Values(LayoutCase{1, 1, 1}, LayoutCase{2, 1, 1}, LayoutCase{2, 1, 2},
                                           LayoutCase{4, 1, 1}, LayoutCase{4, 1, 4}, LayoutCase{2, 2, 1},
                                           LayoutCase{2, 2, 2}, LayoutCase{4, 2, 2}, LayoutCase{8, 1, 8},
                                           LayoutCase{1, 2, 1}),
                         [](const ::testing::TestParamInfo<LayoutCase>& i) { return layout_name(i.param); });

TEST(GpuParallelGraphs, CaptureOnTheLocalBackendIsAClearError) {
  K3_REQUIRE_GPU();
  const Model& m = tiny("k3");
  LocalGpuCluster cluster(*m.src, m.config, gpu_opts(), Layout{2, 1, 1});
  std::vector<std::string> errors(2);
  run_watched(cluster, "graphs", [&](int w, GpuRank& g) {
    const int slot = g.admit();
    const std::vector<int32_t> tok = {3};
    g.prepare(std::vector<int>{slot}, 1, tok);
    try {
      g.run_graph(StepKind::Hybrid);
    } catch (const Error& e) {
      errors[w] = e.what();
    }
  });
  for (const auto& e : errors) EXPECT_NE(e.find("local_gpu"), std::string::npos) << "got: '" << e << "'";
}

}  // namespace
}  // namespace k3
