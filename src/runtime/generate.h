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
// samples from Rng(seed + i), so results do not depend on the layout.
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
  std::vector<float> logits;    // request 0 with keep_logits: [positions, V]
  int64_t positions = 0;
};

std::vector<GenerateResult> generate(Engine& engine, const std::vector<std::vector<int32_t>>& prompts, int max_new,
                                     const SamplingParams& sp, bool keep_logits);

}  // namespace k3
