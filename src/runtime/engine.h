// Engine: one rank's decode runtime on the CPU reference path.
//
// Requests live in slots. admit() takes a free slot; step() runs B requests x
// q tokens (q = 1 decode, q > 1 a verify step or a prefill chunk) and returns
// FP32 logits [B q, V]; every request of a step is then pending until
// commit(slot, n) accepts its first n <= q tokens: the request's length grows
// by n and its KDA state becomes the state after exactly those n tokens.
// prefill() feeds a prompt in chunks of max_q, committing each.
//
// Bad input (unknown or busy slot, token id out of range, a step past the
// cache, too many requests) is an Error raised before anything is written, so
// no other request's state is touched.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "config/model_config.h"
#include "io/checkpoint.h"
#include "model/weights.h"
#include "runtime/cache.h"

namespace k3 {

class Engine {
 public:
  // `src` holds the tensors `weights` view; the engine keeps it alive.
  Engine(std::shared_ptr<const TensorSource> src, const ModelConfig& config, const CacheOptions& options);

  const ModelConfig& config() const { return config_; }
  const CacheOptions& options() const { return caches_.options(); }

  int admit();                        // a free slot; Error when all are taken
  void release(int slot);
  int64_t length(int slot) const;     // committed tokens
  bool pending(int slot) const;

  // tokens [B * q], request b's tokens at [b q, (b+1) q). Returns logits [B * q, V].
  std::vector<float> step(std::span<const int> slots, int q, std::span<const int32_t> tokens);
  void commit(int slot, int n);
  // Feeds `prompt` and commits it; returns the logits of every prompt position [len, V].
  std::vector<float> prefill(int slot, std::span<const int32_t> prompt);

 private:
  struct Slot {
    bool active = false;
    int64_t length = 0;
    int pending_q = 0;
  };
  void check_slot(int slot, const char* what) const;

  std::shared_ptr<const TensorSource> src_;
  ModelConfig config_;
  ModelWeights weights_;
  Caches caches_;
  std::vector<Slot> slots_;
};

}  // namespace k3
