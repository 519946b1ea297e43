// LayoutDecoder (runtime/layout_decoder.h): a layout's ranks behind one Decoder; ThreadRanks, its rank threads.
#include "runtime/layout_decoder.h"

#include <pthread.h>

#include <algorithm>
#include <csignal>
#include <cstring>

#include "runtime/cluster.h"
#include "runtime/steps.h"

namespace k3 {

ThreadRanks::ThreadRanks(std::vector<std::unique_ptr<Decoder>> ranks, std::function<void(int)> on_thread)
    : ranks_(std::move(ranks)), on_thread_(std::move(on_thread)) {
  K3_CHECK(!ranks_.empty(), "layout decoder: no ranks");
  replies_.resize(ranks_.size());
  for (int w = 0; w < static_cast<int>(ranks_.size()); ++w) threads_.emplace_back([this, w] { loop(w); });
  // The threads' first round: on_thread (errors are the replies).
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return done_ == static_cast<int>(ranks_.size()); });
  for (const RankReply& r : replies_)
    if (r.status != RankReply::Status::Ok) {
      lock.unlock();
      shutdown();
      throw Error(r.message);
    }
}

ThreadRanks::~ThreadRanks() { shutdown(); }

void ThreadRanks::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    quit_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_)
    if (t.joinable()) t.join();
  threads_.clear();
}

void ThreadRanks::loop(int w) {
  // Asynchronous signals (SIGINT, SIGTERM, ...) are never delivered to a rank thread: a server's signal thread
  // (cli/serve.cpp blocks them after the decoder exists) must be the one that receives them.
  sigset_t sigs;
  sigfillset(&sigs);
  for (int s : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, SIGTRAP}) sigdelset(&sigs, s);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  RankReply first;
  if (on_thread_) {
    try {
      on_thread_(w);
    } catch (const std::exception& e) {
      first = RankReply::failure(RankReply::Status::Error, e.what());
    } catch (...) {
      first = RankReply::failure(RankReply::Status::Error, "layout decoder: an unknown exception on a rank thread");
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    replies_[w] = std::move(first);
    if (++done_ == static_cast<int>(ranks_.size())) done_cv_.notify_all();
  }
  uint64_t seen = 0;
  for (;;) {
    const RankCommand* cmd = nullptr;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return quit_ || gen_ != seen; });
      if (quit_) return;
      seen = gen_;
      cmd = cmd_;
    }
    RankReply r = execute(*cmd, ranks_[0]->layout(), w, *ranks_[w]);
    std::lock_guard<std::mutex> lock(mu_);
    replies_[w] = std::move(r);
    if (++done_ == static_cast<int>(ranks_.size())) done_cv_.notify_all();
  }
}

std::vector<RankReply> ThreadRanks::run(const RankCommand& cmd) {
  std::unique_lock<std::mutex> lock(mu_);
  K3_CHECK(!quit_, "layout decoder: shut down");
  cmd_ = &cmd;
  done_ = 0;
  replies_.assign(ranks_.size(), RankReply{});
  ++gen_;
  cv_.notify_all();
  done_cv_.wait(lock, [&] { return done_ == static_cast<int>(ranks_.size()); });
  cmd_ = nullptr;
  return std::move(replies_);
}

LayoutDecoder::LayoutDecoder(std::vector<std::unique_ptr<Decoder>> ranks, std::function<void(int)> on_thread)
    : LayoutDecoder(std::make_unique<ThreadRanks>(std::move(ranks), std::move(on_thread))) {}

LayoutDecoder::LayoutDecoder(std::unique_ptr<RankRunner> runner) : runner_(std::move(runner)) {
  layout_ = runner_->local().layout();
  layout_.validate();
  const int W = layout_.world();
  K3_CHECK(runner_->world_size() == W, "layout decoder: {} ranks for a world of {} (tp {} x dp {})",
           runner_->world_size(), W, layout_.tp, layout_.dp);
  const std::vector<RankReply> info = run(RankCommand{RankCommand::Op::Info});
  const RankInfo r0 = RankInfo::from(info[0].info);
  fit_limit_ = r0.fit_limit;
  for (int w = 0; w < W; ++w) {
    const RankInfo r = RankInfo::from(info[static_cast<size_t>(w)].info);
    K3_CHECK(r.tp == layout_.tp && r.dp == layout_.dp && r.dcp == layout_.dcp && r.world_rank == w,
             "layout decoder: rank decoder {} is world rank {} of tp {} dp {} dcp {} (expected rank {} of tp {} dp {} "
             "dcp {})", w, r.world_rank, r.tp, r.dp, r.dcp, w, layout_.tp, layout_.dp, layout_.dcp);
    K3_CHECK(r.max_slots == r0.max_slots && r.max_q == r0.max_q && r.max_context == r0.max_context,
             "layout decoder: rank {} has other cache sizes than rank 0", w);
    fit_limit_ = std::min(fit_limit_, r.fit_limit);
  }
  per_replica_ = static_cast<int>(r0.max_slots);
  max_q_ = static_cast<int>(r0.max_q);
  max_context_ = r0.max_context;
  used_.assign(static_cast<size_t>(layout_.dp), std::vector<char>(static_cast<size_t>(per_replica_), 0));
}

LayoutDecoder::~LayoutDecoder() = default;

std::vector<RankReply> LayoutDecoder::run(const RankCommand& cmd) const {
  std::vector<RankReply> replies = runner_->run(cmd);
  K3_CHECK(static_cast<int>(replies.size()) == layout_.world(), "layout decoder: {} replies from a world of {}",
           replies.size(), layout_.world());
  // The lowest rank's own error: before the ranks that only learnt that another rank rejected the input.
  const RankReply* peer = nullptr;
  for (const RankReply& r : replies) {
    if (r.status == RankReply::Status::Error) throw Error(r.message);
    if (r.status == RankReply::Status::PeerRejected && !peer) peer = &r;
  }
  if (peer) throw PeerRejectedInput();
  return replies;
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

std::vector<char> LayoutDecoder::replicas_can_admit(int64_t tokens) const {
  RankCommand c{RankCommand::Op::CanAdmit};
  c.reserve = tokens;
  const std::vector<RankReply> r = run(c);
  std::vector<char> ok(static_cast<size_t>(layout_.dp), 1);
  for (int w = 0; w < layout_.world(); ++w) ok[layout_.replica(w)] &= r[static_cast<size_t>(w)].value != 0;
  return ok;
}

bool LayoutDecoder::can_admit(int64_t tokens) const {
  std::lock_guard<std::mutex> call(call_mu_);
  bool slot = false;
  for (int p = 0; p < layout_.dp; ++p) slot = slot || free_slots(p) > 0;
  if (!slot) return false;
  const std::vector<char> ok = replicas_can_admit(tokens);
  for (int p = 0; p < layout_.dp; ++p)
    if (free_slots(p) > 0 && ok[p]) return true;
  return false;
}

int LayoutDecoder::admit(int64_t reserve_tokens) {
  std::lock_guard<std::mutex> call(call_mu_);
  bool slot = false;
  for (int p = 0; p < layout_.dp; ++p) slot = slot || free_slots(p) > 0;
  K3_CHECK(slot, "admit: all {} slots of the {} replicas are taken", max_slots(), layout_.dp);
  const std::vector<char> ok = replicas_can_admit(reserve_tokens);
  int best = -1;  // the replica with the most free slots that can set the pages aside
  for (int p = 0; p < layout_.dp; ++p)
    if (free_slots(p) > 0 && ok[p] && (best < 0 || free_slots(p) > free_slots(best))) best = p;
  if (best < 0)
    fail("admit: out of KV pages: no replica with a free slot can set aside the pages of {} tokens", reserve_tokens);
  RankCommand c{RankCommand::Op::Admit};
  c.replica = best;
  c.reserve = reserve_tokens;
  const std::vector<RankReply> got = run(c);
  const int64_t s = got[static_cast<size_t>(best * layout_.tp)].value;
  for (int w = best * layout_.tp; w < (best + 1) * layout_.tp; ++w)
    K3_CHECK(got[w].value == s, "admit: the ranks of replica {} disagree (slot {} on rank {}, {} on rank {})", best, s,
             best * layout_.tp, got[w].value, w);
  K3_CHECK(s >= 0 && s < per_replica_ && !used_[best][s], "admit: replica {} gave slot {} (in use or out of range)",
           best, s);
  used_[best][s] = 1;
  return best * per_replica_ + static_cast<int>(s);
}

void LayoutDecoder::release(int slot) {
  std::lock_guard<std::mutex> call(call_mu_);
  check_slot(slot, "release");
  RankCommand c{RankCommand::Op::Release};
  c.replica = slot / per_replica_;
  c.slot = slot % per_replica_;
  run(c);
  used_[c.replica][c.slot] = 0;
}

RankCommand LayoutDecoder::split(RankCommand::Op op, std::span<const int> slots, int q,
                                 std::vector<std::vector<int>>* index) const {
  RankCommand c{op};
  c.q = q;
  c.slots.resize(static_cast<size_t>(layout_.dp));
  if (index) index->assign(static_cast<size_t>(layout_.dp), {});
  for (size_t i = 0; i < slots.size(); ++i) {
    const int p = slots[i] / per_replica_;
    c.slots[p].push_back(slots[i] % per_replica_);
    if (index) (*index)[p].push_back(static_cast<int>(i));
  }
  return c;
}

namespace {

// Rows [i q, (i + 1) q) of `all` for each i of index, one vector per replica.
template <typename T>
std::vector<std::vector<T>> by_replica(std::span<const T> all, const std::vector<std::vector<int>>& index, int q) {
  std::vector<std::vector<T>> out(index.size());
  for (size_t p = 0; p < index.size(); ++p)
    for (int i : index[p]) out[p].insert(out[p].end(), all.begin() + int64_t{i} * q, all.begin() + int64_t{i + 1} * q);
  return out;
}

}  // namespace

std::vector<float> LayoutDecoder::step(std::span<const int> slots, int q, std::span<const int32_t> tokens) {
  std::lock_guard<std::mutex> call(call_mu_);
  const int B = static_cast<int>(slots.size());
  K3_CHECK(q >= 1 && q <= max_q(), "step: q = {} outside 1..{} (max_q)", q, max_q());
  K3_CHECK(static_cast<int64_t>(tokens.size()) == int64_t{B} * q, "step: {} tokens for {} requests x q = {}",
           tokens.size(), B, q);
  for (int s : slots) check_slot(s, "step");
  if (B == 0) return {};
  std::vector<std::vector<int>> index;
  RankCommand c = split(RankCommand::Op::Step, slots, q, &index);
  c.tokens = by_replica(tokens, index, q);
  const std::vector<RankReply> got = run(c);
  const int64_t V = config().vocab_size, rows = int64_t{q} * V;
  std::vector<float> out(static_cast<size_t>(int64_t{B} * rows));
  for (int p = 0; p < layout_.dp; ++p) {
    const std::vector<float>& l = got[static_cast<size_t>(p * layout_.tp)].logits;
    K3_CHECK(static_cast<int64_t>(l.size()) == static_cast<int64_t>(index[p].size()) * rows,
             "step: replica {} returned {} logits for {} requests x q {} x vocab {}", p, l.size(), index[p].size(), q,
             V);
    for (size_t j = 0; j < index[p].size(); ++j)
      std::memcpy(out.data() + index[p][j] * rows, l.data() + static_cast<int64_t>(j) * rows,
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
  std::vector<std::vector<int>> index;
  RankCommand c = split(RankCommand::Op::StepSample, slots, q, &index);
  c.tokens = by_replica(tokens, index, q);
  c.specs = by_replica(spec, index, q);
  const std::vector<RankReply> got = run(c);
  std::vector<ops::SampleResult> out(static_cast<size_t>(int64_t{B} * q));
  for (int p = 0; p < layout_.dp; ++p) {
    const std::vector<ops::SampleResult>& g = got[static_cast<size_t>(p * layout_.tp)].samples;
    K3_CHECK(static_cast<int64_t>(g.size()) == static_cast<int64_t>(index[p].size()) * q,
             "step_sample: replica {} returned {} records for {} requests x q {}", p, g.size(), index[p].size(), q);
    for (size_t j = 0; j < index[p].size(); ++j)
      std::copy_n(g.begin() + static_cast<int64_t>(j) * q, q, out.begin() + int64_t{index[p][j]} * q);
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
  std::vector<std::vector<int>> index;
  RankCommand c = split(RankCommand::Op::Commit, slots, 1, &index);
  c.counts = by_replica(counts, index, 1);
  run(c);
}

std::unique_ptr<LayoutDecoder> make_layout_decoder(LocalCluster& cluster) {
  std::vector<std::unique_ptr<Decoder>> ranks;
  for (int w = 0; w < cluster.layout().world(); ++w) ranks.push_back(std::make_unique<EngineDecoder>(cluster.engine(w)));
  return std::make_unique<LayoutDecoder>(std::move(ranks));
}

}  // namespace k3
