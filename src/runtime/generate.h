// generate: one request, prompt then max_new tokens, greedy or seeded top-p.
// The logits of every position fed to the model are kept on request: the
// prompt positions first, then each generated token that was fed back (the
// last generated token is not fed back). Generation stops early at eos.
#pragma once

#include <cstdint>
#include <vector>

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
  std::vector<float> logits;    // [positions, V] when keep_logits
  int64_t positions = 0;
};

GenerateResult generate(Engine& engine, const std::vector<int32_t>& prompt, int max_new, const SamplingParams& sp,
                        bool keep_logits);

}  // namespace k3
