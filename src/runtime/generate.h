// generate: requests decoded to completion, greedy or seeded top-p.
//
// Every rank calls generate() with the same arguments (SPMD). Request i is
// served by DP replica i mod dp. Each round every replica makes exactly one
// step: a prefill chunk (up to max_q tokens) of one of its requests whose
// prompt is not yet fed, else a decode step (q = 1) of all its requests still
// generating, else an empty step (the MoE exchange spans every rank); a world
// all-reduce per round tells when every replica is done. Results are
// assembled on every rank.
//
// The logits of request 0 are kept on request: its prompt positions first,
// then each generated token that was fed back (the last generated token is not
// fed back). A request stops at eos unless stop_at_eos is false. Request i
// samples from Rng(seed + i), two uniforms per generated token (ops::sample_rows' u_accept, u_draw), so
// results do not depend on the layout. Without keep_logits each step is Decoder::step_sample (on a GPU
// the logits stay there); with it, step() and the same op on the host.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "ops/sampling.h"
#include "runtime/engine.h"

namespace k3 {

struct SamplingParams {
  bool greedy = true;
  float temperature = 1.0f;
  float top_p = 1.0f;
  uint64_t seed = 0;
  bool stop_at_eos = true;
};

struct GenerateResult {
  std::vector<int32_t> tokens;  // generated ids
  bool hit_eos = false;
  std::vector<float> logits;    // request 0 with keep_logits: [positions, V]
  int64_t positions = 0;
};

// What generate() drives: one rank of a layout (the CPU Engine, or a GpuRank through runtime/gpu/decoder.h);
// what the Scheduler drives: a Decoder that is the whole world (one rank, or runtime/layout_decoder.h).
class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual const ModelConfig& config() const = 0;
  virtual const Layout& layout() const = 0;
  virtual int world_rank() const = 0;
  virtual int max_slots() const = 0;
  virtual int max_q() const = 0;
  virtual int64_t max_context() const = 0;
  // A free slot with the KV pages of its first `reserve_tokens` positions set aside (SlotTable::admit: a server
  // reserves a request's worst case so it never runs out of pages later; 0 reserves none). Error when none.
  virtual int admit(int64_t reserve_tokens) = 0;
  // Whether admit(tokens) would succeed now; whether a request of `tokens` positions could ever be admitted.
  virtual bool can_admit(int64_t tokens) const = 0;
  virtual bool fits(int64_t tokens) const = 0;
  virtual void release(int slot) = 0;
  // B requests x q tokens -> logits [B q, V] (every rank of the replica calls it alike).
  virtual std::vector<float> step(std::span<const int> slots, int q, std::span<const int32_t> tokens) = 0;
  // The same step, returning each row's sample [B q] under spec [B q] (ops/sampling.h: greedy or top-p, a
  // draft's rejection rule, the log-prob) instead of the logits: on a GPU the logits stay on the device and
  // only the B q small records come back. The specs are checked before the step runs. Default: step() +
  // ops::sample_rows on the host.
  virtual std::vector<ops::SampleResult> step_sample(std::span<const int> slots, int q, std::span<const int32_t> tokens,
                                                     std::span<const ops::SampleSpec> spec);
  // Commits all q tokens of the last step for each slot.
  virtual void commit(std::span<const int> slots, int q) = 0;
  // Commits the first counts[i] (1..q) tokens of the last step for slots[i]: a verify step's accepted prefix
  // (the KDA state after exactly those tokens; the cache past them is overwritten later).
  virtual void commit(std::span<const int> slots, std::span<const int> counts) = 0;
  // Sum over the world's ranks of host floats (identity on one rank).
  virtual void world_sum(float* data, int64_t n) = 0;
  // True when one caller drives every rank of the layout through this object (one rank, or a LayoutDecoder,
  // runtime/layout_decoder.h): the Scheduler needs it.
  virtual bool whole_world() const { return layout().world() == 1; }
};

// The CPU Engine as a Decoder (generate, the Scheduler).
class EngineDecoder : public Decoder {
 public:
  explicit EngineDecoder(Engine& e) : e_(e) {}
  const ModelConfig& config() const override { return e_.config(); }
  const Layout& layout() const override { return e_.layout(); }
  int world_rank() const override { return e_.world_rank(); }
  int max_slots() const override { return e_.options().max_slots; }
  int max_q() const override { return e_.options().max_q; }
  int64_t max_context() const override { return e_.options().max_context; }
  int admit(int64_t reserve_tokens) override { return e_.admit(reserve_tokens); }
  bool can_admit(int64_t tokens) const override { return e_.can_admit(tokens); }
  bool fits(int64_t tokens) const override { return e_.fits(tokens); }
  void release(int slot) override { e_.release(slot); }
  std::vector<float> step(std::span<const int> slots, int q, std::span<const int32_t> tokens) override {
    return e_.step(slots, q, tokens);
  }
  void commit(std::span<const int> slots, int q) override {
    for (int s : slots) e_.commit(s, q);
  }
  void commit(std::span<const int> slots, std::span<const int> counts) override;
  void world_sum(float* data, int64_t n) override;

 private:
  Engine& e_;
};

std::vector<GenerateResult> generate(Decoder& decoder, const std::vector<std::vector<int32_t>>& prompts, int max_new,
                                     const SamplingParams& sp, bool keep_logits);
// The CPU engine as the Decoder.
std::vector<GenerateResult> generate(Engine& engine, const std::vector<std::vector<int32_t>>& prompts, int max_new,
                                     const SamplingParams& sp, bool keep_logits);

}  // namespace k3
