// LayoutDecoder (runtime/layout_decoder.h): a layout's ranks behind one Decoder, driven by the Scheduler; its ranks
// as threads (ThreadRanks) or as followers of a command channel (ChannelRanks, the mpirun form, played by threads).
//   LayoutScheduler   greedy tokens of staggered requests (more than the slots, drafting off and on, threads and
//                     channel) equal generate() on the same layout (LocalCluster), bit for bit, and the single
//                     rank's within the near-tie rule (tests/test_parallel.cpp)
//   LayoutDecoder     the slot mapping (replica p's slot s = p * slots_per_replica + s), the logits' order, idle
//                     replicas, errors (the facade stays usable; both runners), the Scheduler's refusal of one
//                     rank of a layout
//   RankCommand       the byte encoding's round trip and its refusal of malformed messages
// A watchdog ends the process if the rank threads do not finish (a hang is a failure).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "comm/local.h"
#include "core/rng.h"
#include "io/synthetic.h"
#include "runtime/cluster.h"
#include "runtime/layout_decoder.h"
#include "runtime/rank_channel.h"
#include "runtime/scheduler.h"

namespace {

using namespace k3;

struct Model {
  ModelConfig config;
  std::shared_ptr<const TensorSource> src;
};

const Model& model(const std::string& variant) {
  static std::map<std::string, Model> cache;
  auto it = cache.find(variant);
  if (it == cache.end()) {
    ModelConfig c = preset_config("tiny", variant);
    it = cache.emplace(variant, Model{c, make_synthetic(c, 3)}).first;
  }
  return it->second;
}

EngineOptions opts(int slots, int64_t context = 64, int max_q = 4) {
  CacheOptions c;
  c.max_slots = slots;
  c.max_context = context;
  c.max_q = max_q;
  c.page_size = 4;  // requests span several pages; with DCP a page holds 4 of a rank's positions
  return EngineOptions(c);
}

std::string name(const Layout& L) {
  return "tp" + std::to_string(L.tp) + "_dp" + std::to_string(L.dp) + "_dcp" + std::to_string(L.dcp);
}

// Ends the process when a test body does not finish in time (a rank left waiting in a collective).
class Watchdog {
 public:
  explicit Watchdog(int seconds = 600) {
    t_ = std::thread([this, seconds] {
      std::unique_lock<std::mutex> lock(mu_);
      if (!cv_.wait_for(lock, std::chrono::seconds(seconds), [&] { return done_; })) {
        std::fprintf(stderr, "test_layout_decoder: still running after %d s (a rank is stuck in a collective)\n",
                     seconds);
        std::fflush(stderr);
        std::_Exit(3);
      }
    });
  }
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    t_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread t_;
};

std::vector<std::vector<int32_t>> prompts() {
  // Lengths 1..13 (several prefill chunks of max_q 4), some repetitive (drafts have something to match).
  std::vector<std::vector<int32_t>> p = {{1, 2, 3}, {7}, {5, 6, 7, 8, 9, 10, 11, 12, 13}};
  p.push_back({});
  for (int i = 0; i < 13; ++i) p.back().push_back(static_cast<int32_t>((i * 37 + 11) % 250));
  p.push_back({100, 101, 102, 103, 100, 101, 102, 103, 100, 101});
  p.push_back({40, 41, 42, 40, 41, 42, 40});
  p.push_back({200, 17, 3, 99, 45});
  return p;
}

// generate() of every prompt on `L` (ranks as threads): rank 0's results (every rank assembles them all).
std::vector<GenerateResult> generate_on(const Model& m, const Layout& L, const std::vector<std::vector<int32_t>>& ps,
                                        int max_new, bool keep_logits = false) {
  LocalCluster cluster(m.src, m.config, opts(static_cast<int>(ps.size())), L);
  std::vector<std::vector<GenerateResult>> per_rank(static_cast<size_t>(L.world()));
  SamplingParams sp;
  cluster.run([&](int w, Engine& e) { per_rank[w] = generate(e, ps, max_new, sp, keep_logits); });
  return per_rank[0];
}

// Tokens that differ from the single rank's must start at a near-tie of the single rank's logits (test_parallel.cpp's
// worst-row bounds: 0.03 of the row's spread for K3, 0.15 for K3.1's DSA top-k near-ties).
void expect_single_rank_or_near_tie(const Model& m, const std::vector<int32_t>& prompt,
                                    const std::vector<int32_t>& got, int max_new, const std::string& what) {
  Engine single(m.src, m.config, opts(1));
  const GenerateResult want = generate(single, {prompt}, max_new, SamplingParams{}, true)[0];
  size_t same = 0;
  while (same < got.size() && same < want.tokens.size() && got[same] == want.tokens[same]) ++same;
  if (same == got.size() && same == want.tokens.size()) return;
  ASSERT_LT(same, got.size()) << what << ": " << got.size() << " tokens for the single rank's " << want.tokens.size();
  ASSERT_LT(same, want.tokens.size()) << what << ": " << got.size() << " tokens for " << want.tokens.size();
  const int64_t V = m.config.vocab_size;
  const int64_t row = static_cast<int64_t>(prompt.size() + same) - 1;
  const float* w = want.logits.data() + row * V;
  const auto [lo, hi] = std::minmax_element(w, w + V);
  const double margin = std::fabs(double(w[want.tokens[same]]) - w[got[same]]) / (*hi - *lo);
  std::printf("[ layout ] %s: diverges from the single rank at token %zu, margin %.4f of the spread\n", what.c_str(),
              same, margin);
  EXPECT_LT(margin, m.config.is_dsa() ? 0.15 : 0.03) << what << ": token " << same << " single rank "
                                                     << want.tokens[same] << ", layout " << got[same];
}

struct Outcome {
  std::vector<int32_t> tokens;
  FinishReason reason = FinishReason::None;
};

// The facade over ChannelRanks (runtime/rank_channel.h), as an mpirun job runs it: world rank 0 on the caller's
// thread, every other rank a follower thread in follow_commands(), the commands on a channel of its own
// (make_local_world's world groups, not the engines').
struct ChannelFacade {
  std::vector<RankGroups> channel;
  std::vector<std::unique_ptr<EngineDecoder>> ranks;
  std::vector<std::thread> followers;
  std::vector<int64_t> commands;  // each follower's count of commands run
  std::unique_ptr<LayoutDecoder> dec;
  explicit ChannelFacade(LocalCluster& cluster) : channel(make_local_world(cluster.layout())) {
    const int W = cluster.layout().world();
    commands.assign(static_cast<size_t>(W), 0);
    for (int w = 0; w < W; ++w) ranks.push_back(std::make_unique<EngineDecoder>(cluster.engine(w)));
    for (int w = 1; w < W; ++w)
      followers.emplace_back([this, w] { commands[w] = follow_commands(*ranks[w], *channel[w].world); });
    dec = std::make_unique<LayoutDecoder>(std::make_unique<ChannelRanks>(*ranks[0], *channel[0].world));
  }
  // Ends the followers (the facade's destruction sends Quit); returns how many commands each ran.
  std::vector<int64_t> finish() {
    dec.reset();
    for (auto& t : followers) t.join();
    followers.clear();
    return commands;
  }
  ~ChannelFacade() { finish(); }
};

// The Scheduler over a LayoutDecoder over a LocalCluster: rank threads, or followers of a command channel.
struct Harness {
  LocalCluster cluster;
  std::unique_ptr<LayoutDecoder> threads;
  std::unique_ptr<ChannelFacade> chan;
  LayoutDecoder* dec;
  Scheduler sched;
  std::map<int64_t, std::unique_ptr<Outcome>> out;
  Harness(const Model& m, const Layout& L, int slots_per_replica, const SchedulerOptions& so, bool channel = false)
      : cluster(m.src, m.config, opts(slots_per_replica), L),
        threads(channel ? nullptr : make_layout_decoder(cluster)),
        chan(channel ? std::make_unique<ChannelFacade>(cluster) : nullptr),
        dec(channel ? chan->dec.get() : threads.get()),
        sched(*dec, so) {}
  int64_t submit(std::vector<int32_t> prompt, int max_tokens) {
    Request r;
    r.prompt = std::move(prompt);
    r.max_tokens = max_tokens;
    auto box = std::make_unique<Outcome>();
    Outcome* b = box.get();
    const int64_t id = sched.submit(std::move(r), [b](const RequestEvent& ev) {
      b->tokens.insert(b->tokens.end(), ev.tokens.begin(), ev.tokens.end());
      if (ev.done) b->reason = ev.reason;
    });
    out[id] = std::move(box);
    return id;
  }
  void drain() {
    for (int guard = 0; guard < 100000 && sched.iterate(); ++guard) {
    }
  }
};

class LayoutScheduler : public ::testing::TestWithParam<std::tuple<std::string, Layout>> {};

TEST_P(LayoutScheduler, GreedyTokensEqualGenerateOnTheSameLayout) {
  Watchdog dog;
  const auto& [variant, L] = GetParam();
  const Model& m = model(variant);
  const auto ps = prompts();
  const int max_new = 24;
  const std::vector<GenerateResult> ref = generate_on(m, L, ps, max_new);
  for (size_t i = 0; i < ps.size(); ++i)
    expect_single_rank_or_near_tie(m, ps[i], ref[i].tokens, max_new,
                                   variant + " " + name(L) + " generate request " + std::to_string(i));
  // Rank threads without and with drafts; then drafts over a command channel (the mpirun form of serve).
  for (const auto& [draft, channel] : {std::pair{0, false}, std::pair{3, false}, std::pair{3, true}}) {
    SCOPED_TRACE(variant + " " + name(L) + " draft " + std::to_string(draft) + (channel ? " channel" : " threads"));
    SchedulerOptions so;
    so.draft_tokens = draft;
    Harness h(m, L, 2, so, channel);  // 2 slots per replica: fewer than the requests, which wait
    EXPECT_EQ(h.dec->max_slots(), 2 * L.dp);
    std::vector<int64_t> ids;
    int most_running = 0;
    for (size_t i = 0; i < ps.size(); ++i) {
      ids.push_back(h.submit(ps[i], max_new));
      if (i % 2 == 1) {  // arrivals while others run
        h.sched.iterate();
        most_running = std::max<int>(most_running, static_cast<int>(h.sched.metrics().running));
      }
    }
    h.drain();
    for (size_t i = 0; i < ps.size(); ++i) {
      EXPECT_EQ(h.out.at(ids[i])->tokens, ref[i].tokens) << "request " << i;
      EXPECT_NE(h.out.at(ids[i])->reason, FinishReason::None) << "request " << i;
    }
    const SchedulerMetrics m2 = h.sched.metrics();
    EXPECT_EQ(m2.requests_finished, static_cast<int64_t>(ps.size()));
    EXPECT_EQ(m2.free_slots, 2 * L.dp);
    EXPECT_GT(m2.batch_requests, m2.steps);  // some steps batched several requests
    if (L.dp > 1) EXPECT_GT(most_running, 2) << "the requests never spread over both replicas";
    if (draft > 0) EXPECT_GT(m2.draft_accepted, 0) << "drafting accepted nothing: the comparison is vacuous";
    for (int p = 0; p < L.dp; ++p) EXPECT_EQ(h.dec->free_slots(p), 2) << "replica " << p;
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, LayoutScheduler,
                         ::testing::Combine(::testing::Values("k3", "k3.1"),
                                            ::testing::Values(Layout{2, 1, 1}, Layout{2, 2, 1}, Layout{2, 2, 2})),
                         [](const auto& info) {
                           std::string v = std::get<0>(info.param);
                           std::replace(v.begin(), v.end(), '.', '_');
                           return v + "_" + name(std::get<1>(info.param));
                         });

bool bit_equal(const std::vector<float>& a, const float* b, size_t n) {
  return a.size() == n && std::memcmp(a.data(), b, n * sizeof(float)) == 0;
}

// Slot mapping, the logits' order and idle replicas against generate() of each prompt alone on the same layout
// (its logits: the prompt's positions, then the first generated token fed back): each prompt fed by itself (the other
// replica idle, B = 0), then one decode step of both given in the order (replica 1, replica 0).
TEST(LayoutDecoder, SlotMappingOrderAndIdleReplicas) {
  Watchdog dog;
  const Model& m = model("k3");
  const Layout L{2, 2, 1};
  const int64_t V = m.config.vocab_size;
  const std::vector<int32_t> pa = {5, 17, 200, 3}, pb = {9, 8, 60};
  const auto ra = generate_on(m, L, {pa}, 2, true)[0];
  const auto rb = generate_on(m, L, {pb}, 2, true)[0];
  ASSERT_EQ(ra.logits.size(), (pa.size() + 1) * V);
  ASSERT_EQ(rb.logits.size(), (pb.size() + 1) * V);
  LocalCluster cluster(m.src, m.config, opts(3), L);
  auto dec = make_layout_decoder(cluster);
  EXPECT_EQ(dec->slots_per_replica(), 3);
  EXPECT_EQ(dec->max_slots(), 6);
  EXPECT_TRUE(dec->whole_world());
  // The replica with the most free slots, ties to the lowest.
  const int a = dec->admit(0), b = dec->admit(0), c = dec->admit(0);
  EXPECT_EQ(a, 0);
  EXPECT_EQ(b, 3);
  EXPECT_EQ(c, 1);
  EXPECT_EQ(dec->replica_of(b), 1);
  EXPECT_EQ(dec->free_slots(0), 1);
  EXPECT_EQ(dec->free_slots(1), 2);
  dec->release(c);
  EXPECT_EQ(dec->free_slots(0), 2);
  const std::vector<float> lb = dec->step(std::vector<int>{b}, 3, pb);
  dec->commit(std::vector<int>{b}, 3);
  EXPECT_TRUE(bit_equal(lb, rb.logits.data(), pb.size() * V)) << "replica 1 alone (replica 0 idle)";
  const std::vector<float> la = dec->step(std::vector<int>{a}, 4, pa);
  dec->commit(std::vector<int>{a}, 4);
  EXPECT_TRUE(bit_equal(la, ra.logits.data(), pa.size() * V)) << "replica 0 alone (replica 1 idle)";
  const std::vector<float> both =
      dec->step(std::vector<int>{b, a}, 1, std::vector<int32_t>{rb.tokens[0], ra.tokens[0]});
  dec->commit(std::vector<int>{b, a}, 1);
  ASSERT_EQ(both.size(), static_cast<size_t>(2 * V));
  const std::vector<float> row_b(both.begin(), both.begin() + V), row_a(both.begin() + V, both.end());
  EXPECT_TRUE(bit_equal(row_b, rb.logits.data() + pb.size() * V, static_cast<size_t>(V))) << "row 0 is slot b's";
  EXPECT_TRUE(bit_equal(row_a, ra.logits.data() + pa.size() * V, static_cast<size_t>(V))) << "row 1 is slot a's";
  EXPECT_FALSE(bit_equal(row_a, row_b.data(), static_cast<size_t>(V))) << "the rows must differ for the test to bite";
}

template <class F>
void expect_error(F&& fn, const std::string& part) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one naming \"" << part << "\"";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

// Errors: facade input refused before any rank is called; a rank's error (a token outside the vocabulary, raised by
// every rank together) rethrown after all finished; the facade goes on serving with unchanged results.
TEST(LayoutDecoder, ErrorsLeaveItUsable) {
  Watchdog dog;
  const Model& m = model("k3");
  const Layout L{2, 2, 1};
  const std::vector<int32_t> pa = {5, 17, 200, 3};
  const auto ra = generate_on(m, L, {pa}, 1, true)[0];
  for (bool channel : {false, true}) {
    SCOPED_TRACE(channel ? "command channel" : "rank threads");
    LocalCluster cluster(m.src, m.config, opts(1), L);
    std::unique_ptr<LayoutDecoder> threads = channel ? nullptr : make_layout_decoder(cluster);
    std::unique_ptr<ChannelFacade> chan = channel ? std::make_unique<ChannelFacade>(cluster) : nullptr;
    LayoutDecoder* dec = channel ? chan->dec.get() : threads.get();
    const int a = dec->admit(0), b = dec->admit(0);
    EXPECT_EQ(b, 1);
    expect_error([&] { dec->admit(0); }, "taken");
    expect_error([&] { dec->step(std::vector<int>{7}, 1, std::vector<int32_t>{1}); }, "outside");
    expect_error([&] { dec->step(std::vector<int>{a}, 2, std::vector<int32_t>{1}); }, "tokens");
    const int32_t bad = static_cast<int32_t>(m.config.vocab_size);
    // Rank errors: raised by the ranks (every rank together), carried back as the lowest rank's own message.
    expect_error([&] { dec->step(std::vector<int>{a, b}, 1, std::vector<int32_t>{1, bad}); }, "token id");
    expect_error([&] { dec->step(std::vector<int>{b}, 1, std::vector<int32_t>{-1}); }, "token id");
    dec->release(b);
    expect_error([&] { dec->release(b); }, "not admitted");
    expect_error([&] { dec->step(std::vector<int>{b}, 1, std::vector<int32_t>{1}); }, "not admitted");
    std::vector<float> la = dec->step(std::vector<int>{a}, 4, pa);
    dec->commit(std::vector<int>{a}, 4);
    EXPECT_TRUE(bit_equal(la, ra.logits.data(), ra.logits.size())) << "after the errors";
    EXPECT_EQ(dec->admit(0), 1);
    if (channel) {  // every follower left its loop at Quit, after the same commands
      const std::vector<int64_t> n = chan->finish();
      EXPECT_GT(n[1], 10);
      for (int w = 2; w < L.world(); ++w) EXPECT_EQ(n[w], n[1]) << "follower " << w;
    }
  }
}

// The Scheduler on a facade refuses a bad request and keeps serving the others with generate()'s tokens; it refuses
// to drive one rank of a multi-rank layout.
// Admission with pages set aside: a replica whose pages are reserved is passed over for one that has them, and
// DCP ranks count only their share of the positions.
TEST(LayoutDecoder, AdmitSetsPagesAside) {
  const Model& m = model("k3");
  for (const Layout& L : {Layout{2, 2, 1}, Layout{2, 2, 2}}) {
    SCOPED_TRACE(name(L));
    EngineOptions o = opts(3);
    o.cache.num_pages = 6;  // per rank, 4 positions a page: 24 positions, or 48 of a request split over DCP 2
    LocalCluster cluster(m.src, m.config, o, L);
    auto dec = make_layout_decoder(cluster);
    const int64_t big = L.dcp == 1 ? 20 : 40;  // 5 pages on each rank
    EXPECT_TRUE(dec->fits(big));
    EXPECT_FALSE(dec->fits(L.dcp == 1 ? 25 : 49));
    EXPECT_TRUE(dec->fits(L.dcp == 1 ? 24 : 48));
    const int a = dec->admit(big);
    EXPECT_EQ(dec->replica_of(a), 0);
    EXPECT_TRUE(dec->can_admit(big));  // replica 1 has its pages
    const int b = dec->admit(big);
    EXPECT_EQ(dec->replica_of(b), 1) << "replica 0 has a free slot but its pages are set aside";
    EXPECT_FALSE(dec->can_admit(big));
    EXPECT_TRUE(dec->can_admit(4));  // one page left on every rank
    expect_error([&] { dec->admit(big); }, "KV pages");
    // The reserved request grows into its own pages; a small one takes the spare page.
    const int c = dec->admit(4);
    const std::vector<int32_t> prompt = {5, 17, 200, 3, 9, 8, 60, 1};
    dec->step(std::vector<int>{a, c}, 4, std::vector<int32_t>{5, 17, 200, 3, 9, 8, 60, 1});
    dec->commit(std::vector<int>{a, c}, 4);
    dec->step(std::vector<int>{a}, 4, std::vector<int32_t>(prompt.begin(), prompt.begin() + 4));
    dec->commit(std::vector<int>{a}, 4);
    EXPECT_EQ(dec->replica_of(c), 0);
    const int d = dec->admit(4);  // replica 1's spare page
    EXPECT_EQ(dec->replica_of(d), 1);
    EXPECT_FALSE(dec->can_admit(4)) << "every page is held or set aside";
    expect_error([&] { dec->admit(1); }, "KV pages");
    dec->release(b);
    EXPECT_TRUE(dec->can_admit(big));
    for (int s : {a, c, d}) dec->release(s);
  }
}

TEST(LayoutDecoder, SchedulerRefusesABadRequestAndKeepsServing) {
  Watchdog dog;
  const Model& m = model("k3");
  const Layout L{2, 2, 1};
  const auto ps = prompts();
  const std::vector<std::vector<int32_t>> some(ps.begin(), ps.begin() + 3);
  const auto ref = generate_on(m, L, some, 8);
  Harness h(m, L, 2, {});
  const int64_t i0 = h.submit(some[0], 8);
  EXPECT_THROW(h.submit({1, static_cast<int32_t>(m.config.vocab_size)}, 4), SubmitError);
  h.sched.iterate();
  const int64_t i1 = h.submit(some[1], 8);
  const int64_t i2 = h.submit(some[2], 8);
  h.drain();
  EXPECT_EQ(h.out.at(i0)->tokens, ref[0].tokens);
  EXPECT_EQ(h.out.at(i1)->tokens, ref[1].tokens);
  EXPECT_EQ(h.out.at(i2)->tokens, ref[2].tokens);
  EXPECT_EQ(h.sched.metrics().requests_rejected, 1);

  EngineDecoder one_rank(h.cluster.engine(0));
  EXPECT_FALSE(one_rank.whole_world());
  expect_error([&] { Scheduler s(one_rank); }, "LayoutDecoder");
}

// The command and reply encodings: every field survives the round trip; a truncated, padded or malformed message is
// an Error naming what is wrong.
TEST(RankCommand, BytesRoundTripAndMalformedMessagesAreRefused) {
  Rng rng(11);
  RankCommand c(RankCommand::Op::StepSample);
  c.replica = 1;
  c.slot = 3;
  c.q = 4;
  c.reserve = int64_t{1} << 40;
  c.slots = {{2, 0}, {}, {1}};
  for (const auto& s : c.slots) {
    c.tokens.emplace_back();
    c.specs.emplace_back();
    for (size_t i = 0; i < s.size() * 4; ++i) {
      c.tokens.back().push_back(static_cast<int32_t>(rng.uniform() * 1000));
      ops::SampleSpec sp;
      sp.temperature = static_cast<float>(rng.uniform());
      sp.draft = static_cast<int32_t>(rng.uniform() * 100) - 1;
      sp.u_accept = rng.uniform();
      sp.u_draw = rng.uniform();
      c.specs.back().push_back(sp);
    }
  }
  c.counts = {{4, 1}, {}, {2}};
  const std::vector<char> bytes = encode(c);
  const RankCommand d = decode_command(bytes);
  EXPECT_EQ(d.op, c.op);
  EXPECT_EQ(d.replica, c.replica);
  EXPECT_EQ(d.slot, c.slot);
  EXPECT_EQ(d.q, c.q);
  EXPECT_EQ(d.reserve, c.reserve);
  EXPECT_EQ(d.slots, c.slots);
  EXPECT_EQ(d.tokens, c.tokens);
  EXPECT_EQ(d.counts, c.counts);
  ASSERT_EQ(d.specs.size(), c.specs.size());
  for (size_t p = 0; p < c.specs.size(); ++p) {
    ASSERT_EQ(d.specs[p].size(), c.specs[p].size());
    for (size_t i = 0; i < c.specs[p].size(); ++i) {
      EXPECT_EQ(d.specs[p][i].temperature, c.specs[p][i].temperature);
      EXPECT_EQ(d.specs[p][i].draft, c.specs[p][i].draft);
      EXPECT_EQ(d.specs[p][i].u_accept, c.specs[p][i].u_accept);
      EXPECT_EQ(d.specs[p][i].u_draw, c.specs[p][i].u_draw);
    }
  }
  RankReply r = RankReply::failure(RankReply::Status::PeerRejected, "step: aborted");
  r.value = -7;
  r.info = {1, 2, 3};
  r.logits = {0.5f, -1.25f};
  r.samples = {ops::SampleResult{17, 1, -0.5f}};
  const RankReply e = decode_reply(encode(r));
  EXPECT_EQ(e.status, r.status);
  EXPECT_EQ(e.message, r.message);
  EXPECT_EQ(e.value, r.value);
  EXPECT_EQ(e.info, r.info);
  EXPECT_EQ(e.logits, r.logits);
  ASSERT_EQ(e.samples.size(), 1u);
  EXPECT_EQ(e.samples[0].token, 17);
  EXPECT_EQ(e.samples[0].logprob, -0.5f);

  expect_error([&] { decode_command(std::span<const char>(bytes.data(), 20)); }, "truncated");
  expect_error([&] { decode_command(std::span<const char>(bytes.data(), bytes.size() - 1)); }, "rank command");
  std::vector<char> longer = bytes;
  longer.push_back(0);
  expect_error([&] { decode_command(longer); }, "left over");
  std::vector<char> bad_op = bytes;
  bad_op[0] = 99;
  expect_error([&] { decode_command(bad_op); }, "unknown op");
  std::vector<char> bad_len = bytes;
  const int64_t huge = int64_t{1} << 50;  // the length of c.slots, after op, replica, slot, q and reserve
  std::memcpy(bad_len.data() + 4 * 4 + 8, &huge, sizeof(huge));
  expect_error([&] { decode_command(bad_len); }, "bad length");
}

}  // namespace

