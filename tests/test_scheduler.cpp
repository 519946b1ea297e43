// The Scheduler (runtime/scheduler.h) against generate(): each request's tokens
// are those generate() gives it alone, whatever else is batched with it, with
// and without n-gram drafting; admission errors, cancel, stop sequences, eos,
// seeded sampling and logprobs.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <numeric>
#include <thread>

#include "io/synthetic.h"
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

EngineOptions opts(int slots = 4, int64_t context = 128, int max_q = 8) {
  CacheOptions c;
  c.max_slots = slots;
  c.max_context = context;
  c.max_q = max_q;
  return EngineOptions(c);
}

// generate() of one prompt alone on a fresh engine: the independent reference.
GenerateResult alone(const ModelConfig& c, const std::vector<int32_t>& prompt, int max_new, const SamplingParams& sp,
                     bool keep_logits = false, const std::string& variant = "k3") {
  Engine e(model(variant).src, c, opts(1));
  return generate(e, {prompt}, max_new, sp, keep_logits)[0];
}

struct Outcome {
  std::vector<int32_t> tokens;   // the concatenated stream
  std::vector<float> logprobs;
  std::vector<std::vector<ops::TokenLogprob>> top_logprobs;
  FinishReason reason = FinishReason::None;
  int events = 0;
};

struct Harness {
  Engine engine;
  EngineDecoder dec;
  Scheduler sched;
  Harness(const ModelConfig& c, const EngineOptions& o, const SchedulerOptions& so, const std::string& variant = "k3")
      : engine(model(variant).src, c, o), dec(engine), sched(dec, so) {}
  int64_t submit(Request r) {
    auto owned = std::make_unique<Outcome>();  // kept in `pending` once the id is known (freed if refused)
    Outcome* box = owned.get();
    int64_t id = sched.submit(std::move(r), [box](const RequestEvent& ev) {
      box->tokens.insert(box->tokens.end(), ev.tokens.begin(), ev.tokens.end());
      box->logprobs.insert(box->logprobs.end(), ev.logprobs.begin(), ev.logprobs.end());
      box->top_logprobs.insert(box->top_logprobs.end(), ev.top_logprobs.begin(), ev.top_logprobs.end());
      ++box->events;
      if (ev.done) box->reason = ev.reason;
    });
    pending[id] = std::move(owned);
    return id;
  }
  void drain() {
    for (int guard = 0; guard < 100000 && sched.iterate(); ++guard) {
    }
  }
  const Outcome& get(int64_t id) { return *pending.at(id); }
  std::map<int64_t, std::unique_ptr<Outcome>> pending;
};

Request greedy(std::vector<int32_t> prompt, int max_tokens) {
  Request r;
  r.prompt = std::move(prompt);
  r.max_tokens = max_tokens;
  return r;
}

std::vector<std::vector<int32_t>> prompts() {
  // Lengths 1..21 (several prefill chunks of max_q 8), some repetitive (drafts have something to match).
  std::vector<std::vector<int32_t>> p = {{1, 2, 3}, {7}, {5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}};
  p.push_back({});
  for (int i = 0; i < 21; ++i) p.back().push_back(static_cast<int32_t>((i * 37 + 11) % 250));
  p.push_back({});
  for (int i = 0; i < 18; ++i) p.back().push_back(static_cast<int32_t>(40 + i % 3));
  p.push_back({100, 101, 102, 103, 100, 101, 102, 103, 100, 101});
  p.push_back({9, 9, 9, 9});
  p.push_back({200, 17, 3, 99, 45});
  p.push_back({12, 34, 56, 78, 90, 12, 34, 56});
  return p;
}

class SchedulerVariant : public ::testing::TestWithParam<std::string> {};

// Same prompts: alone through generate(), then all at once (more requests than slots, staggered arrivals) through
// the scheduler, with and without drafting: identical tokens.
TEST_P(SchedulerVariant, GreedyTokensDoNotDependOnTheBatch) {
  const std::string v = GetParam();
  const ModelConfig& c = model(v).config;
  const auto ps = prompts();
  const int max_new = 24;
  SamplingParams sp;
  std::vector<std::vector<int32_t>> ref;
  for (const auto& p : ps) ref.push_back(alone(c, p, max_new, sp, false, v).tokens);
  for (int draft : {0, 4}) {
    SchedulerOptions so;
    so.draft_tokens = draft;
    Harness h(c, opts(4), so, v);
    std::vector<int64_t> ids;
    for (size_t i = 0; i < ps.size(); ++i) {
      ids.push_back(h.submit(greedy(ps[i], max_new)));
      if (i % 3 == 2) h.sched.iterate();  // arrivals while others run
    }
    h.drain();
    for (size_t i = 0; i < ps.size(); ++i) {
      EXPECT_EQ(h.get(ids[i]).tokens, ref[i]) << "request " << i << " draft " << draft;
      EXPECT_NE(h.get(ids[i]).reason, FinishReason::None);
    }
    const SchedulerMetrics m = h.sched.metrics();
    EXPECT_EQ(m.requests_finished, static_cast<int64_t>(ps.size()));
    EXPECT_EQ(m.running, 0);
    EXPECT_EQ(m.free_slots, 4);
    EXPECT_GT(m.batch_requests, m.steps);  // some steps batched several requests
    if (draft > 0) {
      EXPECT_GT(m.draft_accepted, 0) << "drafting accepted nothing: the comparison is vacuous";
      EXPECT_GT(m.decode_tokens, m.decode_request_steps) << "tokens per request step must exceed 1";
    } else {
      EXPECT_EQ(m.draft_proposed, 0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, SchedulerVariant, ::testing::Values("k3", "k3.1"));

TEST(Scheduler, RefusesWhatCanNeverFit) {
  const ModelConfig& c = model("k3").config;
  Harness h(c, opts(2, 32), {});
  auto kind = [&](Request r) {
    try {
      h.submit(std::move(r));
    } catch (const SubmitError& e) {
      EXPECT_GT(std::string(e.what()).size(), 10u);
      return static_cast<int>(e.kind);
    }
    return -1;
  };
  const int invalid = static_cast<int>(SubmitError::Kind::Invalid);
  EXPECT_EQ(kind(greedy({}, 4)), invalid);
  EXPECT_EQ(kind(greedy({1, static_cast<int32_t>(c.vocab_size)}, 4)), invalid);
  EXPECT_EQ(kind(greedy({1, -1}, 4)), invalid);
  EXPECT_EQ(kind(greedy({1, 2}, 0)), invalid);
  EXPECT_EQ(kind(greedy(std::vector<int32_t>(30, 1), 4)), invalid);  // 30 + 4 - 1 > 32
  EXPECT_EQ(kind(greedy(std::vector<int32_t>(29, 1), 4)), -1);       // 29 + 4 - 1 = 32 fits
  Request bad = greedy({1}, 2);
  bad.sampling.greedy = false;
  bad.sampling.temperature = NAN;
  EXPECT_EQ(kind(bad), invalid);
  Request badstop = greedy({1}, 2);
  badstop.stop = {{}};
  EXPECT_EQ(kind(badstop), invalid);
  h.drain();
  EXPECT_EQ(h.sched.metrics().requests_rejected, 7);
  EXPECT_EQ(h.sched.metrics().requests_finished, 1);
}

// Fewer KV pages than slots x context: requests wait for pages (not refused), every one finishes with the
// tokens it gets alone, and no two admitted requests ever need more pages than exist; a request whose worst case
// exceeds the whole cache is refused.
TEST(Scheduler, WaitsForPages) {
  const ModelConfig& c = model("k3").config;
  EngineOptions o = opts(4, 128);
  o.cache.page_size = 8;
  o.cache.num_pages = 10;  // 80 tokens: room for two requests of 3 + 30 - 1 positions (5 pages each), not four
  const auto ps = prompts();
  const int max_new = 30;
  for (int draft : {0, 3}) {
    SchedulerOptions so;
    so.draft_tokens = draft;
    Harness h(c, o, so);
    try {
      h.submit(greedy(std::vector<int32_t>(60, 1), 30));  // 89 positions: 12 pages > 10
      FAIL() << "a request larger than the whole cache was accepted";
    } catch (const SubmitError& e) {
      EXPECT_EQ(e.kind, SubmitError::Kind::Invalid);
      EXPECT_NE(std::string(e.what()).find("KV pages"), std::string::npos) << e.what();
    }
    std::vector<int64_t> ids;
    std::vector<std::vector<int32_t>> used;
    for (size_t i = 0; i < 6; ++i) {
      used.push_back(std::vector<int32_t>(ps[i].begin(), ps[i].begin() + std::min<size_t>(ps[i].size(), 8)));
      ids.push_back(h.submit(greedy(used.back(), max_new)));
    }
    int64_t most_running = 0;
    for (int guard = 0; guard < 100000 && h.sched.iterate(); ++guard) {
      const SchedulerMetrics m = h.sched.metrics();
      most_running = std::max(most_running, m.running);
    }
    // Worst cases of 4-5 pages each: two fit in 10 pages, never three.
    EXPECT_EQ(most_running, 2);
    for (size_t i = 0; i < ids.size(); ++i) {
      EXPECT_EQ(h.get(ids[i]).reason, FinishReason::Length) << "request " << i << " draft " << draft;
      EXPECT_EQ(h.get(ids[i]).tokens, alone(c, used[i], max_new, {}).tokens) << "request " << i << " draft " << draft;
    }
    EXPECT_EQ(h.sched.metrics().requests_rejected, 1);
  }
}

TEST(Scheduler, BoundedQueue) {
  const ModelConfig& c = model("k3").config;
  SchedulerOptions so;
  so.max_queue = 3;
  Harness h(c, opts(1), so);
  std::vector<int64_t> ids;
  for (int i = 0; i < 3; ++i) ids.push_back(h.submit(greedy({1, 2, static_cast<int32_t>(i)}, 3)));
  try {
    h.submit(greedy({1, 2}, 3));
    FAIL() << "a fourth request fit a queue of 3";
  } catch (const SubmitError& e) {
    EXPECT_EQ(e.kind, SubmitError::Kind::QueueFull);
  }
  h.sched.iterate();  // one admitted into the one slot: room for one more
  ids.push_back(h.submit(greedy({1, 2}, 3)));
  h.drain();
  for (int64_t id : ids) EXPECT_EQ(h.get(id).tokens.size(), 3u);
}

TEST(Scheduler, CancelFreesTheSlot) {
  const ModelConfig& c = model("k3").config;
  Harness h(c, opts(1), {});
  const int64_t a = h.submit(greedy({1, 2, 3}, 60));
  const int64_t waiting = h.submit(greedy({4, 5}, 60));
  for (int i = 0; i < 5; ++i) h.sched.iterate();
  EXPECT_EQ(h.sched.metrics().free_slots, 0);
  EXPECT_TRUE(h.sched.cancel(waiting));
  EXPECT_TRUE(h.sched.cancel(a));
  h.sched.iterate();
  EXPECT_EQ(h.get(a).reason, FinishReason::Cancelled);
  EXPECT_EQ(h.get(waiting).reason, FinishReason::Cancelled);
  EXPECT_LT(h.get(a).tokens.size(), 60u);
  EXPECT_TRUE(h.get(waiting).tokens.empty());
  EXPECT_EQ(h.sched.metrics().free_slots, 1);
  EXPECT_EQ(h.sched.metrics().finished_cancelled, 2);
  EXPECT_FALSE(h.sched.cancel(a));  // already finished
  // The freed slot serves the next request, with the tokens it gets alone.
  const int64_t b = h.submit(greedy({9, 8, 7}, 10));
  h.drain();
  EXPECT_EQ(h.get(b).tokens, alone(c, {9, 8, 7}, 10, {}).tokens);
}

TEST(Scheduler, StopSequences) {
  const ModelConfig& c = model("k3").config;
  const std::vector<int32_t> prompt = {3, 1, 4, 1, 5};
  const std::vector<int32_t> ref = alone(c, prompt, 30, {}).tokens;
  ASSERT_GE(ref.size(), 12u);
  for (size_t at : {0u, 4u, 9u}) {
    for (size_t len : {1u, 2u, 3u}) {
      const std::vector<int32_t> stop(ref.begin() + at, ref.begin() + at + len);
      const std::vector<std::vector<int32_t>> stops = {{ref[1], ref[0], ref[1]}, stop};
      // The expected cut: the first end position in the reference where a stop sequence completes.
      size_t first = ref.size();
      for (size_t end = 1; end <= ref.size() && first == ref.size(); ++end)
        for (const auto& s : stops)
          if (s.size() <= end && std::equal(s.begin(), s.end(), ref.begin() + (end - s.size()))) {
            first = end - s.size();
            break;
          }
      ASSERT_LE(first, at);
      Harness h(c, opts(2), {});
      Request r = greedy(prompt, 30);
      r.stop = stops;
      const int64_t id = h.submit(r);
      h.submit(greedy({7, 7}, 20));  // a neighbour
      h.drain();
      EXPECT_EQ(h.get(id).reason, FinishReason::Stop) << at << " " << len;
      EXPECT_EQ(h.get(id).tokens, std::vector<int32_t>(ref.begin(), ref.begin() + first)) << at << " " << len;
    }
  }
}

TEST(Scheduler, Eos) {
  // The eos id is the config's: take a token the greedy reference produces as eos.
  ModelConfig c = model("k3").config;
  const std::vector<int32_t> prompt = {2, 7, 1, 8};
  const std::vector<int32_t> ref = alone(c, prompt, 20, {}).tokens;
  c.eos_token_id = ref[5];
  const GenerateResult g = alone(c, prompt, 20, {});
  ASSERT_TRUE(g.hit_eos);
  for (int draft : {0, 3}) {
    SchedulerOptions so;
    so.draft_tokens = draft;
    Harness h(c, opts(2), so);
    const int64_t id = h.submit(greedy(prompt, 20));
    Request ignore = greedy(prompt, 20);
    ignore.sampling.stop_at_eos = false;
    const int64_t id2 = h.submit(ignore);
    h.drain();
    EXPECT_EQ(h.get(id).reason, FinishReason::Eos);
    EXPECT_EQ(h.get(id).tokens, g.tokens);  // up to and including eos, as generate()
    EXPECT_EQ(h.get(id2).reason, FinishReason::Length);
    EXPECT_EQ(h.get(id2).tokens, ref);
  }
}

TEST(Scheduler, SeededSamplingIsDeterministic) {
  const ModelConfig& c = model("k3").config;
  SamplingParams sp;
  sp.greedy = false;
  sp.temperature = 1.5f;
  sp.top_p = 0.95f;
  sp.seed = 42;
  const std::vector<int32_t> prompt = {5, 6, 7, 5, 6, 7};
  const std::vector<int32_t> ref = alone(c, prompt, 24, sp).tokens;  // generate: request 0 samples from Rng(seed)
  ASSERT_NE(ref, alone(c, prompt, 24, {}).tokens) << "sampling gave the greedy tokens: the test would be vacuous";
  for (int draft : {0, 4}) {
    std::vector<int32_t> first;
    for (int run = 0; run < 2; ++run) {
      SchedulerOptions so;
      so.draft_tokens = draft;
      Harness h(c, opts(4), so);
      std::vector<int64_t> others;
      for (int i = 0; i < run * 3; ++i) others.push_back(h.submit(greedy({static_cast<int32_t>(i + 1), 3}, 10)));
      Request r = greedy(prompt, 24);
      r.sampling = sp;
      const int64_t id = h.submit(r);
      h.drain();
      if (draft == 0) EXPECT_EQ(h.get(id).tokens, ref);  // the same draws as generate()
      if (run == 0) first = h.get(id).tokens;
      EXPECT_EQ(h.get(id).tokens, first) << "draft " << draft << ": other requests changed a seeded request";
      EXPECT_EQ(h.get(id).tokens.size(), 24u);
    }
  }
}

// Logprobs against the log-softmax of generate()'s logits of the same positions.
TEST(Scheduler, Logprobs) {
  const ModelConfig& c = model("k3").config;
  const std::vector<int32_t> prompt = {8, 6, 7, 5, 3, 0, 9};
  const int n = 10;
  const GenerateResult g = alone(c, prompt, n, {}, /*keep_logits=*/true);
  Harness h(c, opts(2), {});
  Request r = greedy(prompt, n);
  r.logprobs = true;
  const int64_t id = h.submit(r);
  h.drain();
  const Outcome& o = h.get(id);
  ASSERT_EQ(o.tokens, g.tokens);
  ASSERT_EQ(o.logprobs.size(), o.tokens.size());
  const int64_t V = c.vocab_size;
  for (int j = 0; j < n; ++j) {
    const float* row = g.logits.data() + (static_cast<int64_t>(prompt.size()) - 1 + j) * V;
    double m = -INFINITY, z = 0;
    for (int64_t i = 0; i < V; ++i) m = std::max<double>(m, row[i]);
    for (int64_t i = 0; i < V; ++i) z += std::exp(row[i] - m);
    EXPECT_NEAR(o.logprobs[j], row[g.tokens[j]] - m - std::log(z), 1e-4) << j;
    EXPECT_LE(o.logprobs[j], 0.0f);
  }
}

// Top log-probs against generate()'s logits of the same positions: the n ids with the largest logits (ties to
// the lower id), each with its log-softmax; greedy, so the sampled token leads each list with its logprob. A
// request beside it without them, and a drafting server (verify rows), give the same tokens; a stop sequence
// drops its tokens' lists with them.
TEST(Scheduler, TopLogprobs) {
  const ModelConfig& c = model("k3").config;
  const std::vector<int32_t> prompt = {8, 6, 7, 5, 3, 0, 9};
  const int n = 10, top = 4;
  const GenerateResult g = alone(c, prompt, n, {}, /*keep_logits=*/true);
  const int64_t V = c.vocab_size;
  for (int draft : {0, 3}) {
    SCOPED_TRACE(testing::Message() << "draft " << draft);
    SchedulerOptions so;
    so.draft_tokens = draft;
    Harness h(c, opts(4), so);
    Request r = greedy(prompt, n);
    r.logprobs = true;
    r.top_logprobs = top;
    const int64_t id = h.submit(r);
    const int64_t plain = h.submit(greedy(prompt, n));
    h.drain();
    const Outcome& o = h.get(id);
    ASSERT_EQ(o.tokens, g.tokens);
    EXPECT_EQ(h.get(plain).tokens, g.tokens);
    EXPECT_TRUE(h.get(plain).top_logprobs.empty());
    ASSERT_EQ(o.top_logprobs.size(), o.tokens.size());
    for (int j = 0; j < n; ++j) {
      const float* row = g.logits.data() + (static_cast<int64_t>(prompt.size()) - 1 + j) * V;
      double m = -INFINITY, z = 0;
      for (int64_t i = 0; i < V; ++i) m = std::max<double>(m, row[i]);
      for (int64_t i = 0; i < V; ++i) z += std::exp(row[i] - m);
      std::vector<int32_t> ids(static_cast<size_t>(V));
      std::iota(ids.begin(), ids.end(), 0);
      std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return row[a] > row[b]; });
      ASSERT_EQ(o.top_logprobs[j].size(), static_cast<size_t>(top)) << j;
      for (int k = 0; k < top; ++k) {
        EXPECT_EQ(o.top_logprobs[j][k].token, ids[k]) << j << " " << k;
        EXPECT_NEAR(o.top_logprobs[j][k].logprob, row[ids[k]] - m - std::log(z), 1e-4) << j << " " << k;
      }
      EXPECT_EQ(o.top_logprobs[j][0].token, o.tokens[j]);
      EXPECT_EQ(o.top_logprobs[j][0].logprob, o.logprobs[j]);
    }
  }
  {  // a stop sequence: the tokens it takes back take their lists with them
    Harness h(c, opts(2), {});
    Request r = greedy(prompt, n);
    r.logprobs = true;
    r.top_logprobs = 2;
    r.stop = {{g.tokens[3], g.tokens[4]}};
    const int64_t id = h.submit(r);
    h.drain();
    EXPECT_EQ(h.get(id).tokens, std::vector<int32_t>(g.tokens.begin(), g.tokens.begin() + 3));
    EXPECT_EQ(h.get(id).top_logprobs.size(), 3u);
  }
  Harness h(c, opts(2), {});
  Request bad = greedy(prompt, n);
  bad.top_logprobs = 2;  // without logprobs
  EXPECT_THROW(h.submit(bad), SubmitError);
  bad.logprobs = true;
  bad.top_logprobs = kMaxTopLogprobs + 1;
  EXPECT_THROW(h.submit(bad), SubmitError);
}

}  // namespace

namespace {

// run() on its own thread, submissions from several threads, stop() drains what was admitted.
TEST(Scheduler, ThreadedRunAndDrain) {
  const ModelConfig& c = model("k3").config;
  Engine e(model("k3").src, c, opts(4));
  EngineDecoder dec(e);
  SchedulerOptions so;
  so.draft_tokens = 3;
  Scheduler sched(dec, so);
  std::thread runner([&] { sched.run(); });
  const auto ps = prompts();
  std::mutex mu;
  std::condition_variable cv;
  std::map<size_t, std::vector<int32_t>> got;
  std::vector<std::thread> clients;
  for (size_t i = 0; i < ps.size(); ++i)
    clients.emplace_back([&, i] {
      Request r = greedy(ps[i], 12);
      auto acc = std::make_shared<std::vector<int32_t>>();
      sched.submit(r, [&, i, acc](const RequestEvent& ev) {
        acc->insert(acc->end(), ev.tokens.begin(), ev.tokens.end());
        if (ev.done) {
          std::lock_guard<std::mutex> lock(mu);
          got[i] = *acc;
          cv.notify_all();
        }
      });
    });
  for (auto& t : clients) t.join();
  sched.stop();  // drains: every request submitted before finishes
  runner.join();
  EXPECT_THROW(sched.submit(greedy({1}, 1), {}), SubmitError);
  ASSERT_EQ(got.size(), ps.size());
  for (size_t i = 0; i < ps.size(); ++i) EXPECT_EQ(got[i], alone(c, ps[i], 12, {}).tokens) << i;
}

}  // namespace
