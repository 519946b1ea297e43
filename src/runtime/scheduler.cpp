// Scheduler (runtime/scheduler.h): admission, prefill / decode steps, n-gram drafting, streaming.
#include "runtime/scheduler.h"

#include <algorithm>

#include "ops/sampling.h"

namespace k3 {

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::None: return "none";
    case FinishReason::Length: return "length";
    case FinishReason::Stop: return "stop";
    case FinishReason::Eos: return "eos";
    case FinishReason::Cancelled: return "cancelled";
    case FinishReason::Error: return "error";
  }
  return "?";
}

struct Scheduler::Live {
  int64_t id = 0;
  Request req;
  RequestCallback cb;
  int slot = -1;
  size_t fed = 0;                // prompt tokens fed
  std::vector<int32_t> context;  // prompt + generated
  std::vector<int32_t> out;      // generated
  std::vector<float> lps;
  std::vector<std::vector<ops::TokenLogprob>> tops;  // with req.top_logprobs: one list per generated token
  size_t emitted = 0;
  Rng rng{0};
  bool done = false;
};

Scheduler::Scheduler(Decoder& decoder, const SchedulerOptions& options) : dec_(decoder), opts_(options) {
  K3_CHECK(dec_.whole_world(), "scheduler: the decoder is one rank of a layout of {} ranks; drive the whole "
           "layout through one LayoutDecoder (runtime/layout_decoder.h)", dec_.layout().world());
  K3_CHECK(opts_.max_queue >= 0, "scheduler: max_queue {} must be >= 0", opts_.max_queue);
  K3_CHECK(opts_.draft_tokens >= 0, "scheduler: draft_tokens {} must be >= 0", opts_.draft_tokens);
  K3_CHECK(opts_.ngram_min >= 1 && opts_.ngram_max >= opts_.ngram_min, "scheduler: n-gram sizes {}..{} invalid",
           opts_.ngram_min, opts_.ngram_max);
  opts_.draft_tokens = std::min(opts_.draft_tokens, dec_.max_q() - 1);
  vocab_ = dec_.config().vocab_size;
  m_.free_slots = dec_.max_slots();
}

// The positions a request may ever write: prompt + max_tokens - 1, and with drafting the padding rows a verify
// step may give it beyond that (up to draft_tokens), within the context.
int64_t Scheduler::reserve_tokens(const Request& req) const {
  const int64_t need = static_cast<int64_t>(req.prompt.size()) + req.max_tokens - 1;
  return std::min<int64_t>(need + opts_.draft_tokens, dec_.max_context());
}

Scheduler::~Scheduler() {
  for (auto& r : running_)
    if (r->slot >= 0) dec_.release(r->slot);
}

int64_t Scheduler::submit(Request req, RequestCallback callback) {
  auto refuse = [&](SubmitError::Kind k, const std::string& msg) {
    std::lock_guard<std::mutex> lock(mu_);
    ++m_.requests_rejected;
    throw SubmitError(k, msg);
  };
  const int64_t V = vocab_;
  if (req.prompt.empty()) refuse(SubmitError::Kind::Invalid, "the prompt is empty");
  for (int32_t t : req.prompt)
    if (t < 0 || t >= V)
      refuse(SubmitError::Kind::Invalid, fmt::format("token id {} in the prompt is outside the vocabulary 0..{}", t,
                                                     V - 1));
  if (req.max_tokens < 1) refuse(SubmitError::Kind::Invalid, fmt::format("max_tokens {} must be >= 1", req.max_tokens));
  const int64_t need = static_cast<int64_t>(req.prompt.size()) + req.max_tokens - 1;
  if (need > dec_.max_context())
    refuse(SubmitError::Kind::Invalid,
           fmt::format("the prompt of {} tokens + max_tokens {} exceeds the context of {} tokens", req.prompt.size(),
                       req.max_tokens, dec_.max_context()));
  if (!dec_.fits(reserve_tokens(req)))
    refuse(SubmitError::Kind::Invalid,
           fmt::format("the prompt of {} tokens + max_tokens {} needs more KV pages than the cache holds",
                       req.prompt.size(), req.max_tokens));
  if (!req.sampling.greedy) {
    try {
      ops::check_sampling_params(req.sampling.temperature, req.sampling.top_p);
    } catch (const Error& e) {
      refuse(SubmitError::Kind::Invalid, e.what());
    }
    if (req.sampling.temperature <= 0) req.sampling.greedy = true;
  }
  if (req.top_logprobs < 0 || req.top_logprobs > kMaxTopLogprobs)
    refuse(SubmitError::Kind::Invalid,
           fmt::format("top_logprobs {} must be in 0..{}", req.top_logprobs, kMaxTopLogprobs));
  if (req.top_logprobs > 0 && !req.logprobs)
    refuse(SubmitError::Kind::Invalid, "top_logprobs needs logprobs");
  for (const auto& s : req.stop) {
    if (s.empty()) refuse(SubmitError::Kind::Invalid, "a stop sequence is empty");
    for (int32_t t : s)
      if (t < 0 || t >= V)
        refuse(SubmitError::Kind::Invalid, fmt::format("token id {} in a stop sequence is outside the vocabulary", t));
  }
  auto r = std::make_unique<Live>();
  r->req = std::move(req);
  r->cb = std::move(callback);
  r->rng = Rng(r->req.sampling.seed);
  r->context = r->req.prompt;
  std::lock_guard<std::mutex> lock(mu_);
  if (!accepting_) {
    ++m_.requests_rejected;
    throw SubmitError(SubmitError::Kind::ShuttingDown, "the server is shutting down");
  }
  if (static_cast<int64_t>(waiting_.size()) >= opts_.max_queue) {
    ++m_.requests_rejected;
    throw SubmitError(SubmitError::Kind::QueueFull,
                      fmt::format("the wait queue is full ({} requests waiting)", waiting_.size()));
  }
  r->id = next_id_++;
  const int64_t id = r->id;
  index_[id] = r.get();
  waiting_.push_back(std::move(r));
  ++m_.requests_submitted;
  m_.queue_depth = static_cast<int64_t>(waiting_.size());
  cv_.notify_all();
  return id;
}

bool Scheduler::cancel(int64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!index_.count(id)) return false;
  cancels_.push_back(id);
  cv_.notify_all();
  return true;
}

void Scheduler::emit(Live& r) {
  size_t hold = 0;
  for (const auto& s : r.req.stop)  // the longest suffix of out that a stop sequence may still complete
      for (size_t n = std::min(s.size() - 1, r.out.size()); n > hold; --n)
        if (std::equal(r.out.end() - static_cast<int64_t>(n), r.out.end(), s.begin())) {
          hold = n;
          break;
        }
  const size_t upto = r.out.size() - hold;
  if (upto <= r.emitted) return;
  RequestEvent ev;
  ev.tokens.assign(r.out.begin() + static_cast<int64_t>(r.emitted), r.out.begin() + static_cast<int64_t>(upto));
  if (r.req.logprobs)
    ev.logprobs.assign(r.lps.begin() + static_cast<int64_t>(r.emitted), r.lps.begin() + static_cast<int64_t>(upto));
  if (r.req.top_logprobs > 0)
    ev.top_logprobs.assign(r.tops.begin() + static_cast<int64_t>(r.emitted), r.tops.begin() + static_cast<int64_t>(upto));
  r.emitted = upto;
  if (r.cb) r.cb(ev);
}

void Scheduler::finish(Live& r, FinishReason reason, const std::string& error) {
  if (r.done) return;
  r.done = true;
  RequestEvent ev;
  if (reason != FinishReason::Cancelled && reason != FinishReason::Error && r.out.size() > r.emitted) {
    ev.tokens.assign(r.out.begin() + static_cast<int64_t>(r.emitted), r.out.end());
    if (r.req.logprobs) ev.logprobs.assign(r.lps.begin() + static_cast<int64_t>(r.emitted), r.lps.end());
    if (r.req.top_logprobs > 0) ev.top_logprobs.assign(r.tops.begin() + static_cast<int64_t>(r.emitted), r.tops.end());
    r.emitted = r.out.size();
  }
  ev.done = true;
  ev.reason = reason;
  ev.error = error;
  {  // the slot is released by reap(), after the step's commit
    std::lock_guard<std::mutex> lock(mu_);
    index_.erase(r.id);
    ++m_.requests_finished;
    switch (reason) {
      case FinishReason::Length: ++m_.finished_length; break;
      case FinishReason::Stop: ++m_.finished_stop; break;
      case FinishReason::Eos: ++m_.finished_eos; break;
      case FinishReason::Cancelled: ++m_.finished_cancelled; break;
      default: ++m_.finished_error; break;
    }
  }
  if (r.cb) r.cb(ev);
}

// Appends one generated token; finishes the request on eos, a completed stop sequence or max_tokens.
void Scheduler::append_token(Live& r, int32_t tok, float logprob, std::vector<ops::TokenLogprob> top) {
  r.out.push_back(tok);
  r.lps.push_back(logprob);
  if (r.req.top_logprobs > 0) r.tops.push_back(std::move(top));
  r.context.push_back(tok);
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++m_.generated_tokens;
  }
  if (r.req.sampling.stop_at_eos && tok == dec_.config().eos_token_id) return finish(r, FinishReason::Eos);
  for (const auto& s : r.req.stop)
    if (r.out.size() >= s.size() && std::equal(s.begin(), s.end(), r.out.end() - static_cast<int64_t>(s.size()))) {
      r.out.resize(r.out.size() - s.size());  // a stop sequence is not part of the output
      r.lps.resize(r.out.size());
      if (r.req.top_logprobs > 0) r.tops.resize(r.out.size());
      return finish(r, FinishReason::Stop);
    }
  if (static_cast<int>(r.out.size()) >= r.req.max_tokens) return finish(r, FinishReason::Length);
}

std::vector<int32_t> Scheduler::propose(const Live& r, int k) const {
  const auto& c = r.context;
  const int64_t n_ctx = static_cast<int64_t>(c.size());
  if (k <= 0) return {};
  for (int n = opts_.ngram_max; n >= opts_.ngram_min; --n) {
    if (n_ctx < n + 1) continue;
    const auto suffix = c.end() - n;
    for (int64_t i = n_ctx - n - 1; i >= 0; --i)  // the latest earlier occurrence
      if (std::equal(suffix, c.end(), c.begin() + i)) {
        const int64_t from = i + n, to = std::min(n_ctx, from + k);
        return std::vector<int32_t>(c.begin() + from, c.begin() + to);
      }
  }
  return {};
}

ops::SampleSpec Scheduler::spec_of(const Live& r, int32_t draft, Rng& rng) {
  ops::SampleSpec s;
  const SamplingParams& sp = r.req.sampling;
  s.temperature = sp.greedy ? 0.0f : sp.temperature;
  s.top_p = sp.greedy ? 1.0f : sp.top_p;
  s.draft = draft;
  s.logprob = r.req.logprobs ? 1 : 0;
  s.u_accept = rng.uniform();
  s.u_draw = rng.uniform();
  return s;
}

std::vector<ops::SampleResult> Scheduler::sample_step(std::span<const int> slots, int q,
                                                     std::span<const int32_t> tokens,
                                                     std::span<const ops::SampleSpec> specs, std::span<const int> top,
                                                     std::vector<std::vector<ops::TokenLogprob>>& tops) {
  tops.assign(specs.size(), {});
  if (std::all_of(top.begin(), top.end(), [](int n) { return n == 0; }))
    return dec_.step_sample(slots, q, tokens, specs);
  const int64_t V = dec_.config().vocab_size, rows = static_cast<int64_t>(specs.size());
  ops::check_specs(specs.data(), rows, V);  // as step_sample: before the step runs
  const std::vector<float> logits = dec_.step(slots, q, tokens);
  std::vector<ops::SampleResult> out(specs.size());
  ops::sample_rows(logits.data(), rows, V, specs.data(), out.data());
  for (size_t i = 0; i < specs.size(); ++i)
    if (top[i] > 0) tops[i] = ops::top_logprobs(logits.data() + static_cast<int64_t>(i) * V, V, top[i]);
  return out;
}

bool Scheduler::step_prefill(std::vector<Live*>& group) {
  int q = dec_.max_q();
  for (Live* r : group) q = std::min<int>(q, static_cast<int>(r->req.prompt.size() - r->fed));
  std::vector<int> slots;
  std::vector<int32_t> tokens;
  std::vector<ops::SampleSpec> specs;  // greedy, except the last row of a request whose prompt completes
  std::vector<int> top;                // that row's top log-probs asked for
  for (Live* r : group) {
    slots.push_back(r->slot);
    tokens.insert(tokens.end(), r->req.prompt.begin() + static_cast<int64_t>(r->fed),
                  r->req.prompt.begin() + static_cast<int64_t>(r->fed) + q);
    specs.resize(specs.size() + static_cast<size_t>(q));
    top.resize(specs.size());
    if (r->fed + static_cast<size_t>(q) == r->req.prompt.size()) {
      specs.back() = spec_of(*r, -1, r->rng);
      top.back() = r->req.top_logprobs;
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::vector<ops::TokenLogprob>> tops;
  const std::vector<ops::SampleResult> out = sample_step(slots, q, tokens, specs, top, tops);
  dec_.commit(slots, q);
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++m_.steps;
    ++m_.prefill_steps;
    m_.step_seconds += dt;
    m_.batch_rows += static_cast<int64_t>(slots.size()) * q;
    m_.batch_requests += static_cast<int64_t>(slots.size());
    m_.last_batch = static_cast<int64_t>(slots.size());
    m_.prompt_tokens += static_cast<int64_t>(slots.size()) * q;
  }
  for (size_t b = 0; b < group.size(); ++b) {
    Live& r = *group[b];
    r.fed += static_cast<size_t>(q);
    if (r.fed < r.req.prompt.size()) continue;
    const size_t row = b * static_cast<size_t>(q) + static_cast<size_t>(q) - 1;
    append_token(r, out[row].token, out[row].logprob, std::move(tops[row]));
    if (!r.done) emit(r);
  }
  return true;
}

bool Scheduler::step_decode(std::vector<Live*>& group) {
  const int64_t ctx = dec_.max_context();
  std::vector<std::vector<int32_t>> drafts(group.size());
  int q = 1;
  int64_t room = dec_.max_q();
  for (size_t b = 0; b < group.size(); ++b) {
    Live& r = *group[b];
    const int64_t committed = static_cast<int64_t>(r.req.prompt.size() + r.out.size()) - 1;
    room = std::min(room, ctx - committed);
    const int64_t k = std::min<int64_t>({opts_.draft_tokens, r.req.max_tokens - static_cast<int64_t>(r.out.size()) - 1,
                                         ctx - committed - 1});
    drafts[b] = propose(r, static_cast<int>(k));
    q = std::max(q, 1 + static_cast<int>(drafts[b].size()));
  }
  q = static_cast<int>(std::min<int64_t>(q, room));  // every request's q tokens must fit its cache
  std::vector<int> slots;
  std::vector<int32_t> tokens;
  // Row j <= drafts of a request: its draft j (none at the last); the uniforms come from a copy of its
  // stream, which advances by two per token kept. Padding rows: greedy.
  std::vector<ops::SampleSpec> specs;
  std::vector<int> top;  // each row's top log-probs asked for (padding rows: none)
  for (size_t b = 0; b < group.size(); ++b) {
    Live& r = *group[b];
    if (static_cast<int>(drafts[b].size()) > q - 1) drafts[b].resize(static_cast<size_t>(q - 1));
    slots.push_back(r.slot);
    tokens.push_back(r.out.back());
    tokens.insert(tokens.end(), drafts[b].begin(), drafts[b].end());
    for (int j = 1 + static_cast<int>(drafts[b].size()); j < q; ++j) tokens.push_back(r.out.back());  // padding
    Rng peek = r.rng;
    for (size_t j = 0; j <= drafts[b].size(); ++j)
      specs.push_back(spec_of(r, j < drafts[b].size() ? drafts[b][j] : -1, peek));
    top.resize(specs.size(), r.req.top_logprobs);
    specs.resize(specs.size() + static_cast<size_t>(q) - 1 - drafts[b].size());
    top.resize(specs.size(), 0);
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::vector<ops::TokenLogprob>> tops;
  const std::vector<ops::SampleResult> out = sample_step(slots, q, tokens, specs, top, tops);
  std::vector<int> counts(group.size(), 1);
  int64_t produced = 0, proposed = 0, accepted = 0;
  double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (size_t b = 0; b < group.size(); ++b) {
    Live& r = *group[b];
    const auto& d = drafts[b];
    proposed += static_cast<int64_t>(d.size());
    int n = 0;
    for (size_t j = 0; j <= d.size() && !r.done; ++j) {
      const size_t row = b * static_cast<size_t>(q) + j;
      const ops::SampleResult& s = out[row];
      const bool take_draft = j < d.size() && s.accepted;
      ++n;
      r.rng.uniform();  // the row's two uniforms
      r.rng.uniform();
      accepted += take_draft;
      append_token(r, s.token, s.logprob, std::move(tops[row]));
      if (!take_draft) break;
    }
    counts[b] = n;
    produced += n;
  }
  const auto t1 = std::chrono::steady_clock::now();
  dec_.commit(slots, counts);
  dt += std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  for (Live* r : group)
    if (!r->done) emit(*r);
  std::lock_guard<std::mutex> lock(mu_);
  ++m_.steps;
  ++m_.decode_steps;
  m_.step_seconds += dt;
  m_.batch_rows += static_cast<int64_t>(slots.size()) * q;
  m_.batch_requests += static_cast<int64_t>(slots.size());
  m_.last_batch = static_cast<int64_t>(slots.size());
  m_.decode_request_steps += static_cast<int64_t>(slots.size());
  m_.decode_tokens += produced;
  m_.draft_proposed += proposed;
  m_.draft_accepted += accepted;
  return true;
}

void Scheduler::reap() {
  for (auto& r : running_)
    if (r->done && r->slot >= 0) {
      dec_.release(r->slot);
      r->slot = -1;
    }
  std::erase_if(running_, [](const std::unique_ptr<Live>& r) { return r->done; });
}

bool Scheduler::iterate() {
  std::vector<int64_t> cancels;
  std::vector<std::unique_ptr<Live>> dropped;  // cancelled while waiting
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancels.swap(cancels_);
    for (int64_t id : cancels)
      for (auto it = waiting_.begin(); it != waiting_.end(); ++it)
        if ((*it)->id == id) {
          dropped.push_back(std::move(*it));
          waiting_.erase(it);
          break;
        }
  }
  for (auto& r : dropped) finish(*r, FinishReason::Cancelled);
  for (int64_t id : cancels)
    for (auto& r : running_)
      if (r->id == id) finish(*r, FinishReason::Cancelled);
  // Admit waiting requests, first come first served, while a slot and the pages of the next one's worst case
  // are free (a request that waits for pages holds back the ones behind it: none starves).
  while (static_cast<int>(running_.size()) < dec_.max_slots()) {
    std::unique_ptr<Live> r;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (waiting_.empty() || !dec_.can_admit(reserve_tokens(waiting_.front()->req))) break;
      r = std::move(waiting_.front());
      waiting_.pop_front();
    }
    r->slot = dec_.admit(reserve_tokens(r->req));
    running_.push_back(std::move(r));
  }
  reap();
  std::vector<Live*> prefill, decode;
  for (auto& r : running_) (r->fed < r->req.prompt.size() ? prefill : decode).push_back(r.get());
  const bool work = !prefill.empty() || !decode.empty();
  if (work) {
    const bool do_prefill = !prefill.empty() && (decode.empty() || prefill_turn_);
    prefill_turn_ = !do_prefill;
    std::vector<Live*>& group = do_prefill ? prefill : decode;
    try {
      do_prefill ? step_prefill(group) : step_decode(group);
    } catch (const std::exception& e) {  // input errors are raised before the Decoder writes anything
      for (Live* r : group) finish(*r, FinishReason::Error, e.what());
    }
    reap();
  }
  std::lock_guard<std::mutex> lock(mu_);
  m_.queue_depth = static_cast<int64_t>(waiting_.size());
  m_.running = static_cast<int64_t>(running_.size());
  m_.free_slots = dec_.max_slots() - m_.running;
  return work || !waiting_.empty() || !cancels_.empty();
}

void Scheduler::run() {
  for (;;) {
    if (iterate()) continue;
    std::unique_lock<std::mutex> lock(mu_);
    if (stopping_ && waiting_.empty() && running_.empty()) return;
    cv_.wait_for(lock, std::chrono::milliseconds(50),
                 [&] { return !waiting_.empty() || !cancels_.empty() || stopping_; });
    if (stopping_ && waiting_.empty() && running_.empty()) return;
  }
}

void Scheduler::stop_accepting() {
  std::lock_guard<std::mutex> lock(mu_);
  accepting_ = false;
}

void Scheduler::stop() {
  std::lock_guard<std::mutex> lock(mu_);
  accepting_ = false;
  stopping_ = true;
  cv_.notify_all();
}

SchedulerMetrics Scheduler::metrics() const {
  std::lock_guard<std::mutex> lock(mu_);
  return m_;
}

}  // namespace k3
