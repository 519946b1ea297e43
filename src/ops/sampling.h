// Token sampling from FP32 logits, one spec per row (ops::sample_rows): greedy, nucleus (top-p) sampling
// and the rejection rule of a draft token, with the row's log-probability; a CPU reference and the CUDA
// kernel that runs on logits already on the device (only the small per-row records move).
//
// Row r of logits [rows, V] under spec[r]:
//   Values: NaN counts as -inf (never chosen), +inf as the largest finite float.
//   Greedy (temperature 0): token = argmax (ties to the lower id). accepted = (token == draft).
//   Sampled (temperature T > 0): p_i = exp((l_i - max) / T).
//     Kept set K: order the tokens by probability descending, ties in probability to the lower id (p is
//       monotone in the logit: by logit descending, then id); K is the smallest prefix of that order whose
//       mass reaches top_p * sum(p). top_p = 1 keeps every token. kept_mass = sum over K of p.
//     Draw with u in [0, 1) from a set S with mass M: walk the tokens of S IN ID ORDER accumulating p and
//       take the first whose cumulative mass exceeds u * M (not in probability order: the device then needs
//       no sort, only a prefix scan over ids).
//     No draft (draft = -1): token = the draw from K with u_draw.
//     Draft d: accepted iff u_accept < p_K(d) = p_d / kept_mass (0 when d is outside K): token = d;
//       else token = the draw from K \ {d} (the residual) with u_draw. Whatever the draft, the token's
//       distribution is p_K (the standard rule for a deterministic draft).
//   A row whose every logit is -inf (or NaN) is greedy: token 0.
//   logprob (when asked, else 0): log p(token) under softmax of the raw logits (temperature 1).
// The uniforms come from the caller (two per row, always both drawn): the result is a pure function of
// (logits, spec), the same on the CPU and the GPU up to rounding.
//
// The CPU op sums in double. The kernel (FP32 exp, integer fixed-point masses) gives the same ids and flags
// except when u lands within rounding (~1e-6 of the mass) of a cumulative boundary, or the top-p mass is
// within rounding of top_p at the kept set's edge; log-probs agree to ~1e-6 relative.
#pragma once

#include <cstdint>
#include <vector>

#include "ops/cuda_context.h"

namespace k3::ops {

struct SampleSpec {
  float temperature = 0.0f;  // 0: greedy
  float top_p = 1.0f;        // (0, 1]
  int32_t draft = -1;        // a draft token to accept or reject, -1: none
  int32_t logprob = 0;       // nonzero: compute the log-probability of the token
  double u_accept = 0.0;     // [0, 1): the draft's acceptance uniform
  double u_draw = 0.0;       // [0, 1): the draw's uniform
};

struct SampleResult {
  int32_t token = 0;
  int32_t accepted = 0;  // 1 when the draft was accepted (token == draft)
  float logprob = 0.0f;
};

// The sampling parameters as a caller gives them: temperature finite and >= 0 (0 = greedy), top_p finite in
// (0, 1]. Raises a one-line k3::Error naming the parameter otherwise (NaN, inf, negative, out of range).
void check_sampling_params(float temperature, float top_p);

// logits [rows, vocab] -> out [rows]. Checks every spec (parameters, uniforms in [0, 1), draft in -1..vocab-1)
// before computing anything.
void sample_rows(const float* logits, int64_t rows, int64_t vocab, const SampleSpec* spec, SampleResult* out);
// Those checks alone (the GPU callers run them on the host specs before uploading).
void check_specs(const SampleSpec* spec, int64_t rows, int64_t vocab);

// A token with its log-probability under softmax of the raw logits (temperature 1, as SampleResult::logprob).
struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.0f;
};
// The n most likely tokens of one row of logits [vocab] (NaN as -inf, +inf as the largest finite float, as
// sample_rows): by logit descending, ties to the lower id, each with its log p, bit for bit the
// SampleResult::logprob sample_rows gives that token (a row of -inf: every log p -inf). 0 <= n <= vocab.
// Host only: the Scheduler's top log-probs take a step's logits to the host (Decoder::step).
std::vector<TokenLogprob> top_logprobs(const float* logits, int64_t vocab, int n);

// What a batch of specs needs beyond the argmax, for the device launcher (ops::cuda::sample_rows), which skips
// the phases no row needs: sampled (a row with temperature > 0), top_p (a sampled row with top_p < 1), logprob
// (a row asking for its log-probability). The default, every phase, is right for any specs.
struct SampleNeeds {
  bool sampled = true;
  bool top_p = true;
  bool logprob = true;
};
// The needs of these (host) specs: exactly what they ask for.
SampleNeeds sample_needs(const SampleSpec* spec, int64_t rows);

}  // namespace k3::ops

namespace k3::ops::cuda {

// How the device op splits a row: `ctas` CTAs per row, CTA j over ids [j chunk, (j + 1) chunk) in 16
// segments of `segment` ids (a multiple of 4). ctas_per_row 0: chosen from rows and the device's SM count
// (floor(2 SMs / rows): one wave of two CTAs per SM in all, at least 2048 ids each; one CTA per row from
// SMs + 1 rows on); > 0: that many (at most one per 64 ids), for the tests. Host only.
struct SampleSplit {
  int64_t ctas = 1, chunk = 0, segment = 0;
};
SampleSplit sample_split(int64_t rows, int64_t vocab, int64_t ctas_per_row = 0);

// Scratch of sample_rows in bytes for up to max_rows rows of this vocab (and ctas_per_row, as given to
// sample_rows): per row a block of a counter, the row's state, a histogram and the per-CTA partials
// (36 KB a row at vocab 163840). ZEROED ONCE before its first use (cudaMemset); every call leaves it
// reusable (the counters back at 0), for any rows <= max_rows. One scratch per stream.
size_t sample_rows_scratch_bytes(int64_t max_rows, int64_t vocab, int64_t ctas_per_row = 0);

// The same on the device: logits [rows, vocab] FP32, spec [rows] and out [rows] device pointers; vocab <= 2^23.
// Each row split over sample_split(rows, vocab, ctas_per_row).ctas CTAs, up to six kernels (fewer when `needs`,
// from the host specs, says no row needs them), no allocation, no host synchronization: capturable in a CUDA
// graph (capture with the default `needs`, the replays' specs being unknown). Specs are trusted (the host
// checks them: check_specs). Ids, accepted flags and log-probs do not depend on the split (see sampling.cu).
int sample_rows(const float* logits, int64_t rows, int64_t vocab, const SampleSpec* spec, SampleResult* out,
                void* scratch, size_t scratch_bytes, CUstream_st* stream, SampleNeeds needs = {},
                int64_t ctas_per_row = 0);

}  // namespace k3::ops::cuda
