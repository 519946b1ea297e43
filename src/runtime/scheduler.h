// Scheduler: continuous batching over a Decoder (the CPU Engine or a GpuDecoder).
//
// Requests are submitted at any time (any thread); one thread calls iterate()
// (or run()) and drives the Decoder. Each iteration:
//   1. cancelled requests leave (a running one releases its slot at once);
//   2. waiting requests are admitted into free slots, first come first served;
//   3. one step call: either a prefill step or a decode step. When both kinds
//      of work exist the steps alternate, so neither prompts nor running
//      requests starve.
//        - prefill: every request with prompt tokens left, each fed the same
//          q = min(max_q, the fewest tokens any of them has left) (the Decoder
//          steps B requests x one q); a request whose prompt is then complete
//          samples its first token from its last row;
//        - decode: every generating request, q = 1, or with n-gram drafting
//          q = 1 + the most drafts any request proposed (at most
//          draft_tokens); requests with fewer drafts are padded with their last
//          token and only their real rows are read. Each request accepts the
//          longest agreeing prefix of its drafts plus one token and commits
//          exactly the tokens it fed that are now part of its sequence
//          (Decoder::commit with per-slot counts); the Decoder restores the KDA
//          state and overwrites the cache of the rest.
//   4. new tokens are streamed to each request's callback; a request that
//      finishes (length, stop sequence, eos, cancel) frees its slot at once.
//
// Drafting (prompt lookup): the last n tokens of the request's context
// (prompt + generated; n from ngram_max down to ngram_min) are matched against
// their latest earlier occurrence and the tokens that followed are proposed.
// Greedy: a draft is accepted when it equals the argmax. Sampling: the draft
// x is accepted with probability p(x) (p: the temperature / top-p distribution
// that sampling draws from), else a token is drawn from p with x removed and
// renormalised: the output distribution is p's (the standard rule for a
// deterministic draft).
//
// Every step is one Decoder::step_sample: each row's spec (ops/sampling.h) goes
// down, and the row's token, whether its draft was accepted and its log-prob
// come back (on a GPU the logits never leave the device). Rows that give no
// token (prompt rows before the last, padding) are greedy specs.
//
// Per-request sampling draws from Rng(seed) of the request only, two uniforms
// per generated token (as generate() does), so a request's tokens never depend
// on the other requests of its steps (greedy: each row's logits do not depend
// on the others'; tested). Log-probabilities are those of the model's raw
// distribution (log-softmax of the logits, temperature 1).
//
// Admission: a request is refused (SubmitError) when it can never run (empty
// prompt, token id outside the vocabulary, prompt + max_tokens - 1 over the
// context or over the KV pages of an empty cache, bad sampling parameters) or
// when the wait queue is full; otherwise it waits until a slot is free and
// the KV pages of its worst case (prompt + max_tokens - 1, plus draft_tokens
// of verify padding) can be set aside for it (Decoder::admit), so an admitted
// request never runs out of pages. The Decoder is the whole world: one rank, or a layout's ranks as threads behind a
// LayoutDecoder (runtime/layout_decoder.h: DP replicas' slots are its slots).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/rng.h"
#include "ops/sampling.h"
#include "runtime/generate.h"

namespace k3 {

enum class FinishReason { None, Length, Stop, Eos, Cancelled, Error };
const char* finish_reason_name(FinishReason r);

struct Request {
  std::vector<int32_t> prompt;
  int max_tokens = 16;
  SamplingParams sampling;                    // greedy, temperature, top_p, seed, stop_at_eos
  std::vector<std::vector<int32_t>> stop;     // stop sequences (token ids): not part of the output
  bool logprobs = false;
  // With logprobs: the n most likely tokens at each generated position too (0..kMaxTopLogprobs). A step that
  // has such a request takes its logits to the host (Decoder::step) and samples there (ops::sample_rows,
  // the reference of the device sampler: the same tokens up to rounding at a draw's boundary).
  int top_logprobs = 0;
};
constexpr int kMaxTopLogprobs = 20;

// What a request's callback receives, on the scheduler thread (keep it short).
struct RequestEvent {
  std::vector<int32_t> tokens;  // new tokens, in order
  std::vector<float> logprobs;  // with Request::logprobs: one per token
  std::vector<std::vector<ops::TokenLogprob>> top_logprobs;  // with Request::top_logprobs: one list per token
  bool done = false;
  FinishReason reason = FinishReason::None;
  std::string error;            // reason Error
};
using RequestCallback = std::function<void(const RequestEvent&)>;

class SubmitError : public Error {
 public:
  enum class Kind { Invalid, QueueFull, ShuttingDown };
  SubmitError(Kind k, const std::string& what) : Error(what), kind(k) {}
  Kind kind;
};

struct SchedulerOptions {
  int max_queue = 64;      // waiting requests beyond the running ones
  int draft_tokens = 0;    // n-gram drafts per request per step (0: off); capped at max_q - 1
  int ngram_max = 3;       // the longest suffix matched
  int ngram_min = 1;
};

struct SchedulerMetrics {
  int64_t requests_submitted = 0, requests_rejected = 0, requests_finished = 0;
  int64_t finished_length = 0, finished_stop = 0, finished_eos = 0, finished_cancelled = 0, finished_error = 0;
  int64_t queue_depth = 0, running = 0, free_slots = 0;
  int64_t steps = 0, prefill_steps = 0, decode_steps = 0;
  int64_t prompt_tokens = 0, generated_tokens = 0;
  int64_t batch_rows = 0;        // sum over steps of B q
  int64_t batch_requests = 0;    // sum over steps of B
  int64_t last_batch = 0;        // B of the last step
  double step_seconds = 0;       // sum of the Decoder's step + commit time
  int64_t decode_request_steps = 0;  // sum over decode steps of B (tokens per step = decode_tokens / this)
  int64_t decode_tokens = 0;         // tokens produced by decode steps
  int64_t draft_proposed = 0, draft_accepted = 0;
};

class Scheduler {
 public:
  Scheduler(Decoder& decoder, const SchedulerOptions& options = {});
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Any thread. Returns the request id; throws SubmitError. The callback may be called before submit returns.
  int64_t submit(Request request, RequestCallback callback);
  // Any thread. A waiting or running request finishes with reason Cancelled (its slot freed by the
  // scheduler thread's next iteration). False when the id is unknown or already finished.
  bool cancel(int64_t id);

  // The scheduler thread: one iteration (cancels, admissions, at most one step). False when idle.
  bool iterate();
  // Runs iterations until stop(); sleeps while idle. stop(): submit refuses from now on; run() returns once
  // every admitted and waiting request has finished (drain).
  void run();
  void stop();
  void stop_accepting();  // submit refuses (ShuttingDown); run() goes on

  SchedulerMetrics metrics() const;
  const SchedulerOptions& options() const { return opts_; }
  Decoder& decoder() { return dec_; }

 private:
  struct Live;
  void finish(Live& r, FinishReason reason, const std::string& error = {});
  void emit(Live& r);  // the new tokens no stop sequence may still claim
  void reap();         // releases the slots of finished requests
  void append_token(Live& r, int32_t tok, float logprob, std::vector<ops::TokenLogprob> top);
  // Decoder::step_sample, or (a row asking for top log-probs, top[row] > 0) Decoder::step, ops::sample_rows
  // and ops::top_logprobs on the host; tops[row] holds that row's list.
  std::vector<ops::SampleResult> sample_step(std::span<const int> slots, int q, std::span<const int32_t> tokens,
                                             std::span<const ops::SampleSpec> specs, std::span<const int> top,
                                             std::vector<std::vector<ops::TokenLogprob>>& tops);
  // A row's spec (ops/sampling.h) for a request: its sampling parameters, the draft (-1: none), two
  // uniforms drawn from `rng` (a copy of the request's stream: step_decode advances the real one by two per
  // token it keeps).
  static ops::SampleSpec spec_of(const Live& r, int32_t draft, Rng& rng);
  bool step_prefill(std::vector<Live*>& group);
  bool step_decode(std::vector<Live*>& group);
  std::vector<int32_t> propose(const Live& r, int k) const;
  int64_t reserve_tokens(const Request& req) const;

  Decoder& dec_;
  SchedulerOptions opts_;
  int64_t vocab_ = 0;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Live>> waiting_;     // guarded by mu_
  std::vector<int64_t> cancels_;                  // guarded by mu_
  std::map<int64_t, Live*> index_;                // every waiting / running request, guarded by mu_
  std::vector<std::unique_ptr<Live>> running_;    // scheduler thread only
  int64_t next_id_ = 1;
  bool accepting_ = true, stopping_ = false;
  bool prefill_turn_ = true;
  SchedulerMetrics m_;                            // guarded by mu_
};

}  // namespace k3
