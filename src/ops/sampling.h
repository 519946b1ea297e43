// Token sampling from FP32 logits.
//   greedy: argmax (ties to the lower token id).
//   top_p:  probs = softmax(logits / temperature); keep the smallest set of tokens
//           with the highest probabilities whose sum >= top_p (ties in probability
//           to the lower id), renormalize, draw with u = rng.uniform().
//           Seeded: the same (logits, params, rng state) always gives the same token.
#pragma once

#include <cstdint>

#include "core/rng.h"
#include "ops/cuda_context.h"

namespace k3::ops {

int32_t sample_greedy(const float* logits, int64_t vocab);
// The sampling parameters as a caller gives them: temperature finite and >= 0 (0 = greedy), top_p finite in
// (0, 1]. Raises a one-line k3::Error naming the parameter otherwise (NaN, inf, negative, out of range).
void check_sampling_params(float temperature, float top_p);
// temperature must be > 0 here (and finite), top_p as check_sampling_params.
int32_t sample_top_p(const float* logits, int64_t vocab, float temperature, float top_p, Rng& rng);

}  // namespace k3::ops

namespace k3::ops::cuda {

// logits [rows, vocab] FP32 -> out [rows] int32: the CPU sample_greedy per row (argmax, ties to the lower id;
// NaN never wins, and a NaN at id 0 gives 0 as on the CPU). One CTA per row, any vocab.
int sample_greedy(const float* logits, int64_t rows, int64_t vocab, int32_t* out, CUstream_st* stream);

}  // namespace k3::ops::cuda
