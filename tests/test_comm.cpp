// The local comm backend (ranks as threads): every collective on every group
// of several layouts, through the checks of tests/comm_checks.h (shared with
// the mpi backend's k3_comm_mpi_test), plus Layout validation, CountingComm,
// barrier semantics, and two checks that the checks themselves can fail.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>
#include <regex>
#include <thread>

#include "comm/local.h"
#include "comm_checks.h"

namespace k3 {
// gtest prints a Layout parameter as this (internal linkage: no clash with other tests).
[[maybe_unused]] static void PrintTo(const Layout& L, std::ostream* os) {
  *os << "tp" << L.tp << "_dp" << L.dp << "_dcp" << L.dcp;
}
}  // namespace k3

namespace {

using k3::DType;
using k3::Layout;
using k3test::Checker;

// One thread per world rank, each running body(w, groups[w], checker[w]).
// A rank that throws is recorded; if the ranks do not all finish within the
// deadline (a rank left its peers waiting in a collective), the process
// reports and exits rather than hanging ctest.
std::vector<Checker> run_ranks(std::vector<k3::RankGroups>& groups,
                               const std::function<void(int, k3::RankGroups&, Checker&)>& body) {
  const int W = static_cast<int>(groups.size());
  std::vector<Checker> cks(W);
  std::mutex m;
  std::condition_variable cv;
  int done = 0;
  std::vector<std::thread> threads;
  for (int w = 0; w < W; ++w) {
    cks[w].where = fmt::format("world rank {}", w);
    threads.emplace_back([&, w] {
      try {
        body(w, groups[w], cks[w]);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "world rank %d threw: %s\n", w, e.what());
        cks[w].fail("threw: {}", e.what());
      }
      std::lock_guard lk(m);
      ++done;
      cv.notify_all();
    });
  }
  {
    std::unique_lock lk(m);
    if (!cv.wait_for(lk, std::chrono::seconds(120), [&] { return done == W; })) {
      std::fprintf(stderr, "FATAL: only %d of %d rank threads finished within 120 s: a collective hangs\n", done, W);
      std::fflush(stderr);
      std::_Exit(3);
    }
  }
  for (auto& t : threads) t.join();
  return cks;
}

void report(const std::vector<Checker>& cks, int64_t min_checks) {
  int shown = 0;
  for (const auto& ck : cks) {
    EXPECT_GE(ck.checks, min_checks) << ck.where << " ran too few checks";
    for (const auto& f : ck.failures)
      if (shown++ < 40) ADD_FAILURE() << f;
  }
  if (shown > 40) ADD_FAILURE() << shown - 40 << " more failures";
}

std::string layout_name(const Layout& L) { return fmt::format("tp{}_dp{}_dcp{}", L.tp, L.dp, L.dcp); }

class CommLocal : public ::testing::TestWithParam<Layout> {};

TEST_P(CommLocal, EveryCollectiveOnEveryGroup) {
  const Layout L = GetParam();
  auto groups = k3::make_local_world(L);
  ASSERT_EQ(static_cast<int>(groups.size()), L.tp * L.dp);
  k3test::SuiteOptions o;
  auto cks = run_ranks(groups, [&](int w, k3::RankGroups& g, Checker& ck) { k3test::run_rank_suite(ck, L, w, g, o); });
  report(cks, 100);
}

TEST_P(CommLocal, NamesSayGroupAndBackend) {
  const Layout L = GetParam();
  auto groups = k3::make_local_world(L);
  for (auto& g : groups) {
    EXPECT_EQ(g.tp->name(), "tp/local");
    EXPECT_EQ(g.dcp->name(), "dcp/local");
    EXPECT_EQ(g.world->name(), "world/local");
  }
}

// After a barrier every member has done what it did before it.
TEST_P(CommLocal, BarrierOrdersEveryMember) {
  const Layout L = GetParam();
  auto groups = k3::make_local_world(L);
  const int W = L.tp * L.dp;
  // one counter per group instance, keyed by (kind, first member)
  std::vector<std::atomic<int>> counters(3 * W);
  for (auto& c : counters) c = 0;
  auto cks = run_ranks(groups, [&](int w, k3::RankGroups& g, Checker& ck) {
    const std::vector<int> first = {k3test::tp_members(L, w)[0], k3test::dcp_members(L, w)[0], 0};
    k3::Comm* comms[3] = {g.tp.get(), g.dcp.get(), g.world.get()};
    for (int round = 0; round < 20; ++round)
      for (int k = 0; k < 3; ++k) {
        std::atomic<int>& c = counters[k * W + first[k]];
        const int n = comms[k]->size();
        c.fetch_add(1);
        comms[k]->barrier();
        const int seen = c.load();
        ck.expect(seen == n * (round + 1), "{} barrier round {}: counter {}, expected {}", comms[k]->name(), round,
                  seen, n * (round + 1));
        comms[k]->barrier();
      }
  });
  report(cks, 60);
}

INSTANTIATE_TEST_SUITE_P(CommLayouts, CommLocal,
                         ::testing::Values(Layout{1, 1, 1}, Layout{2, 1, 1}, Layout{3, 1, 1}, Layout{4, 1, 2},
                                           Layout{2, 2, 2}, Layout{4, 2, 2}, Layout{8, 1, 8}),
                         [](const auto& info) { return layout_name(info.param); });

// A count mismatch in all_to_all_v: the receiver gets a k3::Error naming both
// counts, every rank returns (no hang), and the group still works afterwards.
TEST(CommLocalErrors, AllToAllVCountMismatchIsAnErrorNotAHang) {
  auto groups = k3::make_local_world(Layout{3, 1, 1});
  std::vector<std::string> errs(3);
  std::vector<float> after(3);
  auto cks = run_ranks(groups, [&](int w, k3::RankGroups& g, Checker&) {
    // rank 2 sends 5 elements to rank 1, which expects 9; all else 1.
    std::vector<int64_t> sc(3, 1), rc(3, 1);
    if (w == 2) sc[1] = 5;
    if (w == 1) rc[2] = 9;
    std::vector<int32_t> send(8, w), recv(16, -1);
    try {
      g.world->all_to_all_v(send.data(), sc.data(), recv.data(), rc.data(), DType::I32);
    } catch (const k3::Error& e) {
      errs[w] = e.what();
    }
    float x = static_cast<float>(w + 1);
    g.world->all_reduce(&x, 1, DType::F32);
    after[w] = x;
  });
  report(cks, 0);
  EXPECT_TRUE(std::regex_search(errs[1], std::regex("rank 2 sends 5 elements to rank 1, which expects 9"))) << errs[1];
  for (int w = 0; w < 3; ++w) EXPECT_EQ(after[w], 6.f) << "world rank " << w;
}

TEST(CommLayoutValidate, ErrorsNameTheBadValue) {
  struct Case {
    Layout L;
    const char* pattern;
  };
  const Case cases[] = {
      {{4, 1, 3}, "dcp 3.*tp 4"},  {{6, 2, 4}, "dcp 4.*tp 6"}, {{0, 1, 1}, "tp 0"},   {{-2, 1, 1}, "tp -2"},
      {{2, 0, 1}, "dp 0"},         {{2, -1, 1}, "dp -1"},      {{2, 1, 0}, "dcp 0"},  {{2, 1, -1}, "dcp -1"},
  };
  for (const auto& c : cases) {
    const std::string what = layout_name(c.L);
    std::string e = k3test::error_of([&] { c.L.validate(); });
    EXPECT_TRUE(std::regex_search(e, std::regex(c.pattern))) << what << ": '" << e << "'";
    e = k3test::error_of([&] { k3::make_local_world(c.L); });
    EXPECT_TRUE(std::regex_search(e, std::regex(c.pattern))) << what << " (make_local_world): '" << e << "'";
  }
  for (const Layout L : {Layout{1, 1, 1}, Layout{8, 3, 4}, Layout{6, 1, 3}, Layout{5, 2, 5}})
    EXPECT_NO_THROW(L.validate()) << layout_name(L);
  EXPECT_EQ((Layout{4, 3, 2}.world()), 12);
}

// The layout formula of comm.h on a few ranks, written out by hand.
TEST(CommLayoutValidate, RankFormula) {
  const Layout L{4, 3, 2};
  // w = 9: replica 2, tp rank 1, dcp rank 1, dcp group = world ranks {8, 9}
  EXPECT_EQ(L.replica(9), 2);
  EXPECT_EQ(L.tp_rank(9), 1);
  EXPECT_EQ(L.dcp_rank(9), 1);
  EXPECT_EQ(k3test::dcp_members(L, 9), (std::vector<int>{8, 9}));
  EXPECT_EQ(k3test::tp_members(L, 9), (std::vector<int>{8, 9, 10, 11}));
  EXPECT_EQ(k3test::dcp_members(L, 7), (std::vector<int>{6, 7}));
  EXPECT_EQ(L.dcp_rank(6), 0);
}

// The rounding data does tell orders apart (else the rank-order checks could
// not fail): for 3 and 8 ranks, the FP32 rank-order sum differs from the
// reverse-order sum on many elements, also after rounding to BF16.
TEST(CommChecks, RoundingDataDependsOnTheOrder) {
  for (int n : {3, 8}) {
    std::vector<int> M(n), R(n);
    for (int p = 0; p < n; ++p) M[p] = p, R[p] = n - 1 - p;
    int diff_f32 = 0, diff_bf16 = 0;
    auto rf = [](int w, int64_t i) { return k3test::round_f32(7, w, i); };
    auto rb = [](int w, int64_t i) { return k3test::bf16_to_float(k3test::round_bf16(7, w, i)); };
    for (int64_t i = 0; i < 1023; ++i) {
      diff_f32 += k3test::rank_order_sum(M, rf, i) != k3test::rank_order_sum(R, rf, i);
      diff_bf16 += k3test::float_to_bf16_rne(k3test::rank_order_sum(M, rb, i)) !=
                   k3test::float_to_bf16_rne(k3test::rank_order_sum(R, rb, i));
    }
    EXPECT_GT(diff_f32, 100) << n << " ranks";
    EXPECT_GT(diff_bf16, 50) << n << " ranks";
  }
  // The test's own BF16 rounding: ties to even, carries into the exponent.
  EXPECT_EQ(k3test::float_to_bf16_rne(1.f + 0x1p-8f), 0x3f80);                // tie, even stays
  EXPECT_EQ(k3test::float_to_bf16_rne(1.f + 0x1p-7f + 0x1p-8f), 0x3f82);      // tie, odd rounds up
  EXPECT_EQ(k3test::float_to_bf16_rne(1.f + 0x1p-8f + 0x1p-20f), 0x3f81);     // above the tie
  EXPECT_EQ(k3test::float_to_bf16_rne(-(2.f - 0x1p-9f)), 0xc000);             // carry
  EXPECT_EQ(k3test::bf16_to_float(0x4040), 3.f);
}

// A backend that sums in reverse rank order and writes one element past the
// end of all_gather: the suite must report both.
class MutantComm : public k3::Comm {
 public:
  explicit MutantComm(std::unique_ptr<k3::Comm> in) : in_(std::move(in)) {}
  int rank() const override { return in_->rank(); }
  int size() const override { return in_->size(); }
  std::string name() const override { return in_->name() + "/mutant"; }
  void all_reduce(void* data, int64_t count, DType dt) override {
    const size_t es = k3::dtype_size(dt), n = static_cast<size_t>(size());
    buf_.assign(n * count * es, 0);
    in_->all_gather(data, buf_.data(), count, dt);
    std::vector<const void*> parts(n);
    for (size_t p = 0; p < n; ++p) parts[p] = buf_.data() + (n - 1 - p) * count * es;
    k3::reduce_sum(parts.data(), static_cast<int>(n), data, count, dt);
  }
  void all_gather(const void* send, void* recv, int64_t count, DType dt) override {
    in_->all_gather(send, recv, count, dt);
    if (count > 0) std::memset(static_cast<char*>(recv) + size() * count * k3::dtype_size(dt), 0, 1);
  }
  void reduce_scatter(const void* s, void* r, int64_t c, DType dt) override { in_->reduce_scatter(s, r, c, dt); }
  void all_to_all_v(const void* s, const int64_t* sc, void* r, const int64_t* rc, DType dt) override {
    in_->all_to_all_v(s, sc, r, rc, dt);
  }
  void broadcast(void* d, int64_t c, DType dt, int root) override { in_->broadcast(d, c, dt, root); }
  void barrier() override { in_->barrier(); }

 private:
  std::unique_ptr<k3::Comm> in_;
  std::vector<char> buf_;
};

TEST(CommChecks, SuiteCatchesAWrongBackend) {
  const Layout L{4, 1, 1};
  auto groups = k3::make_local_world(L);
  for (auto& g : groups) g.world = std::make_unique<MutantComm>(std::move(g.world));
  k3test::SuiteOptions o;
  auto cks = run_ranks(groups, [&](int w, k3::RankGroups& g, Checker& ck) { k3test::run_rank_suite(ck, L, w, g, o); });
  for (const auto& ck : cks) {
    bool order = false, past_end = false, tp_clean = true;
    for (const auto& f : ck.failures) {
      order = order || k3test::contains(f, "world count 1023 all_reduce F32 rank order");
      past_end = past_end || k3test::contains(f, "world count 7 all_gather F32: wrote past the end");
      tp_clean = tp_clean && !k3test::contains(f, ": tp ");
    }
    EXPECT_TRUE(order) << ck.where << ": reverse-order sum not caught";
    EXPECT_TRUE(past_end) << ck.where << ": write past the end not caught";
    EXPECT_TRUE(tp_clean) << ck.where << ": the unchanged tp group failed";
  }
}

}  // namespace
