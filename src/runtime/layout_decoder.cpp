// LayoutDecoder (runtime/layout_decoder.h): a layout's rank threads behind one Decoder.
#include "runtime/layout_decoder.h"

#include <pthread.h>

#include <algorithm>
#include <csignal>
#include <cstring>

#include "runtime/cluster.h"
#include "runtime/steps.h"

namespace k3 {

LayoutDecoder::LayoutDecoder(std::vector<std::unique_ptr<Decoder>> ranks, std::function<void(int)> on_thread)
    : ranks_(std::move(ranks)) {
  K3_CHECK(!ranks_.empty(), "layout decoder: no ranks");
  layout_ = ranks_[0]->layout();
  layout_.validate();
  const int W = layout_.world();
  K3_CHECK(static_cast<int>(ranks_.size()) == W, "layout decoder: {} rank decoders for a world of {} (tp {} x dp {})",
           ranks_.size(), W, layout_.tp, layout_.dp);
  for (int w = 0; w < W; ++w) {
    const Decoder& d = *ranks_[w];
    const Layout& L = d.layout();
    K3_CHECK(L.tp == layout_.tp && L.dp == layout_.dp && L.dcp == layout_.dcp && d.world_rank() == w,
             "layout decoder: rank decoder {} is world rank {} of tp {} dp {} dcp {} (expected rank {} of tp {} dp {} "
             "dcp {})", w, d.world_rank(), L.tp, L.dp, L.dcp, w, layout_.tp, layout_.dp, layout_.dcp);
    K3_CHECK(d.max_slots() == ranks_[0]->max_slots() && d.max_q() == ranks_[0]->max_q() &&
                 d.max_context() == ranks_[0]->max_context(),
             "layout decoder: rank {} has other cache sizes than rank 0", w);
  }
  per_replica_ = ranks_[0]->max_slots();
  used_.assign(static_cast<size_t>(layout_.dp), std::vector<char>(static_cast<size_t>(per_replica_), 0));
  errors_.resize(static_cast<size_t>(W));
  for (int w = 0; w < W; ++w) threads_.emplace_back([this, w] { loop(w); });
  if (on_thread) {
    try {
      run([&](int w, Decoder&) { on_thread(w); });
    } catch (...) {
      shutdown();
      throw;
    }
  }
}

LayoutDecoder::~LayoutDecoder() { shutdown(); }

void LayoutDecoder::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    quit_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_)
    if (t.joinable()) t.join();
  threads_.clear();
}

void LayoutDecoder::loop(int w) {
  // Asynchronous signals (SIGINT, SIGTERM, ...) are never delivered to a rank thread: a server's signal thread
  // (cli/serve.cpp blocks them after the decoder exists) must be the one that receives them.
  sigset_t sigs;
  sigfillset(&sigs);
  for (int s : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, SIGTRAP}) sigdelset(&sigs, s);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int, Decoder&)>* cmd = nullptr;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return quit_ || gen_ != seen; });
      if (quit_) return;
      seen = gen_;
      cmd = cmd_;
    }
    std::exception_ptr err;
    try {
      (*cmd)(w, *ranks_[w]);
    } catch (...) {
      err = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(mu_);
    errors_[w] = err;
    if (++done_ == static_cast<int>(ranks_.size())) done_cv_.notify_all();
  }
}

void LayoutDecoder::run(const std::function<void(int, Decoder&)>& fn) {
  std::unique_lock<std::mutex> lock(mu_);
  K3_CHECK(!quit_, "layout decoder: shut down");
  cmd_ = &fn;
  done_ = 0;
  std::fill(errors_.begin(), errors_.end(), nullptr);
  ++gen_;
  cv_.notify_all();
  done_cv_.wait(lock, [&] { return done_ == static_cast<int>(ranks_.size()); });
  cmd_ = nullptr;
  // The lowest rank's own error: before the ranks that only learnt that another rank rejected the input.
  std::exception_ptr first, peer;
  for (const auto& e : errors_) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const PeerRejectedInput&) {
      if (!peer) peer = e;
    } catch (...) {
      if (!first) first = e;
    }
  }
  if (first) std::rethrow_exception(first);
  if (peer) std::rethrow_exception(peer);
}

int LayoutDecoder::free_slots(int replica) const {
  const auto& u = used_.at(static_cast<size_t>(replica));
  return static_cast<int>(std::count(u.begin(), u.end(), 0));
}

void LayoutDecoder::check_slot(int slot, const char* what) const {
  K3_CHECK(slot >= 0 && slot < max_slots(), "{}: slot {} outside 0..{} ({} replicas x {} slots)", what, slot,
           max_slots() - 1, layout_.dp, per_replica_);
  K3_CHECK(used_[slot / per_replica_][slot % per_replica_], "{}: slot {} is not admitted", what, slot);
}

// Whether every rank of replica p could admit a request of `tokens` positions now (the tables are read between
// commands, while the rank threads wait).
bool LayoutDecoder::replica_can_admit(int p, int64_t tokens) const {
  for (int w = p * layout_.tp; w < (p + 1) * layout_.tp; ++w)
    if (!ranks_[static_cast<size_t>(w)]->can_admit(tokens)) return false;
  return true;
}

bool LayoutDecoder::can_admit(int64_t tokens) const {
  std::lock_guard<std::mutex> call(call_mu_);
  for (int p = 0; p < layout_.dp; ++p)
    if (free_slots(p) > 0 && replica_can_admit(p, tokens)) return true;
  return false;
}

bool LayoutDecoder::fits(int64_t tokens) const {
  for (const auto& r : ranks_)
    if (!r->fits(tokens)) return false;
  return true;
}

int LayoutDecoder::admit(int64_t reserve_tokens) {
  std::lock_guard<std::mutex> call(call_mu_);
  int best = -1;  // the replica with the most free slots that can set the pages aside
  for (int p = 0; p < layout_.dp; ++p)
    if (free_slots(p) > 0 && (best < 0 || free_slots(p) > free_slots(best)) && replica_can_admit(p, reserve_tokens))
      best = p;
  if (best < 0) {
    bool slot = false;
    for (int p = 0; p < layout_.dp; ++p) slot = slot || free_slots(p) > 0;
    K3_CHECK(slot, "admit: all {} slots of the {} replicas are taken", max_slots(), layout_.dp);
    fail("admit: out of KV pages: no replica with a free slot can set aside the pages of {} tokens",
         reserve_tokens);
  }
  std::vector<int> got(ranks_.size(), -1);
  run([&](int w, Decoder& d) {
    if (layout_.replica(w) == best) got[w] = d.admit(reserve_tokens);
  });
  const int s = got[static_cast<size_t>(best * layout_.tp)];
  for (int w = best * layout_.tp; w < (best + 1) * layout_.tp; ++w)
    K3_CHECK(got[w] == s, "admit: the ranks of replica {} disagree (slot {} on rank {}, {} on rank {})", best, s,
             best * layout_.tp, got[w], w);
  K3_CHECK(s >= 0 && s < per_replica_ && !used_[best][s], "admit: replica {} gave slot {} (in use or out of range)",
           best, s);
  used_[best][s] = 1;
  return best * per_replica_ + s;
}

void LayoutDecoder::release(int slot) {
  std::lock_guard<std::mutex> call(call_mu_);
  check_slot(slot, "release");
  const int p = slot / per_replica_, s = slot % per_replica_;
  run([&](int w, Decoder& d) {
    if (layout_.replica(w) == p) d.release(s);
  });
  used_[p][s] = 0;
}

namespace {

// The step's slots of each replica, in the given order, and where each came from.
struct Split {
  std::vector<std::vector<int>> slots, index, counts;
  std::vector<std::vector<int32_t>> tokens;
  explicit Split(int dp) : slots(dp), index(dp), counts(dp), tokens(dp) {}
};

}  // namespace

std::vector<float> LayoutDecoder::step(std::span<const int> slots, int q, std::span<const int32_t> tokens) {
  std::lock_guard<std::mutex> call(call_mu_);
  const int B = static_cast<int>(slots.size());
  K3_CHECK(q >= 1 && q <= max_q(), "step: q = {} outside 1..{} (max_q)", q, max_q());
  K3_CHECK(static_cast<int64_t>(tokens.size()) == int64_t{B} * q, "step: {} tokens for {} requests x q = {}",
           tokens.size(), B, q);
  for (int s : slots) check_slot(s, "step");
  if (B == 0) return {};
  Split sp(layout_.dp);
  for (int i = 0; i < B; ++i) {
    const int p = slots[i] / per_replica_;
    sp.slots[p].push_back(slots[i] % per_replica_);
    sp.index[p].push_back(i);
    sp.tokens[p].insert(sp.tokens[p].end(), tokens.begin() + int64_t{i} * q, tokens.begin() + int64_t{i + 1} * q);
  }
  std::vector<std::vector<float>> logits(static_cast<size_t>(layout_.dp));
  run([&](int w, Decoder& d) {
    const int p = layout_.replica(w);
    // An idle replica steps with B = 0 and q = 1 (generate()'s rule): the MoE exchange spans every rank.
    std::vector<float> out = sp.slots[p].empty() ? d.step({}, 1, {}) : d.step(sp.slots[p], q, sp.tokens[p]);
    if (layout_.tp_rank(w) == 0) logits[p] = std::move(out);
  });
  const int64_t V = config().vocab_size, rows = int64_t{q} * V;
  std::vector<float> out(static_cast<size_t>(int64_t{B} * rows));
  for (int p = 0; p < layout_.dp; ++p) {
    K3_CHECK(static_cast<int64_t>(logits[p].size()) == static_cast<int64_t>(sp.slots[p].size()) * rows,
             "step: replica {} returned {} logits for {} requests x q {} x vocab {}", p, logits[p].size(),
             sp.slots[p].size(), q, V);
    for (size_t j = 0; j < sp.index[p].size(); ++j)
      std::memcpy(out.data() + sp.index[p][j] * rows, logits[p].data() + static_cast<int64_t>(j) * rows,
                  static_cast<size_t>(rows) * sizeof(float));
  }
  return out;
}

std::vector<ops::SampleResult> LayoutDecoder::step_sample(std::span<const int> slots, int q,
                                                          std::span<const int32_t> tokens,
                                                          std::span<const ops::SampleSpec> spec) {
  std::lock_guard<std::mutex> call(call_mu_);
  const int B = static_cast<int>(slots.size());
  K3_CHECK(q >= 1 && q <= max_q(), "step: q = {} outside 1..{} (max_q)", q, max_q());
  K3_CHECK(static_cast<int64_t>(tokens.size()) == int64_t{B} * q, "step: {} tokens for {} requests x q = {}",
           tokens.size(), B, q);
  K3_CHECK(static_cast<int64_t>(spec.size()) == int64_t{B} * q, "step_sample: {} specs for {} requests x q = {}",
           spec.size(), B, q);
  for (int s : slots) check_slot(s, "step");
  ops::check_specs(spec.data(), int64_t{B} * q, config().vocab_size);
  if (B == 0) return {};
  Split sp(layout_.dp);
  std::vector<std::vector<ops::SampleSpec>> specs(static_cast<size_t>(layout_.dp));
  for (int i = 0; i < B; ++i) {
    const int p = slots[i] / per_replica_;
    sp.slots[p].push_back(slots[i] % per_replica_);
    sp.index[p].push_back(i);
    sp.tokens[p].insert(sp.tokens[p].end(), tokens.begin() + int64_t{i} * q, tokens.begin() + int64_t{i + 1} * q);
    specs[p].insert(specs[p].end(), spec.begin() + int64_t{i} * q, spec.begin() + int64_t{i + 1} * q);
  }
  std::vector<std::vector<ops::SampleResult>> got(static_cast<size_t>(layout_.dp));
  run([&](int w, Decoder& d) {
    const int p = layout_.replica(w);
    std::vector<ops::SampleResult> out =
        sp.slots[p].empty() ? d.step_sample({}, 1, {}, {}) : d.step_sample(sp.slots[p], q, sp.tokens[p], specs[p]);
    if (layout_.tp_rank(w) == 0) got[p] = std::move(out);
  });
  std::vector<ops::SampleResult> out(static_cast<size_t>(int64_t{B} * q));
  for (int p = 0; p < layout_.dp; ++p) {
    K3_CHECK(static_cast<int64_t>(got[p].size()) == static_cast<int64_t>(sp.slots[p].size()) * q,
             "step_sample: replica {} returned {} records for {} requests x q {}", p, got[p].size(),
             sp.slots[p].size(), q);
    for (size_t j = 0; j < sp.index[p].size(); ++j)
      std::copy_n(got[p].begin() + static_cast<int64_t>(j) * q, q, out.begin() + int64_t{sp.index[p][j]} * q);
  }
  return out;
}

void LayoutDecoder::commit(std::span<const int> slots, int q) {
  const std::vector<int> counts(slots.size(), q);
  commit(slots, std::span<const int>(counts));
}

void LayoutDecoder::commit(std::span<const int> slots, std::span<const int> counts) {
  std::lock_guard<std::mutex> call(call_mu_);
  K3_CHECK(slots.size() == counts.size(), "commit: {} slots but {} counts", slots.size(), counts.size());
  for (int s : slots) check_slot(s, "commit");
  if (slots.empty()) return;
  Split sp(layout_.dp);
  for (size_t i = 0; i < slots.size(); ++i) {
    const int p = slots[i] / per_replica_;
    sp.slots[p].push_back(slots[i] % per_replica_);
    sp.counts[p].push_back(counts[i]);
  }
  run([&](int w, Decoder& d) {
    const int p = layout_.replica(w);
    if (!sp.slots[p].empty()) d.commit(sp.slots[p], sp.counts[p]);
  });
}

std::unique_ptr<LayoutDecoder> make_layout_decoder(LocalCluster& cluster) {
  std::vector<std::unique_ptr<Decoder>> ranks;
  for (int w = 0; w < cluster.layout().world(); ++w) ranks.push_back(std::make_unique<EngineDecoder>(cluster.engine(w)));
  return std::make_unique<LayoutDecoder>(std::move(ranks));
}

}  // namespace k3
