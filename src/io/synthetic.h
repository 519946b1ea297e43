// Synthetic K3 / K3.1 checkpoints (make-model and the embedded tiny model):
// every tensor of the schema (config/schema.h) with the real names, dtypes
// and layouts, routed experts quantized to MXFP4, deterministic for a seed
// (each tensor's values come from its own stream keyed by (seed, name), and
// only integer arithmetic and exact scaling are used to draw them).
//
// Conditioning (a random tiny model is otherwise chaotic): norm weights near
// 0.5; input projections of unit gain (uniform, variance 1/in); output
// projections (o_proj, MLP down, latent up) scaled down so each layer is a
// small update of the residual stream; AttnRes pseudo-queries small so the
// source softmax is smooth; exp(A_log) in [0.5, 2] (a gentle KDA gate);
// router logits of std ~2 (weights that vary with the input) and a bias
// gap: the k experts of highest bias per layer are raised by 1, the whole
// range of a sigmoid score, so the k-th and (k+1)-th biased scores are at
// least 0.6 / (E - 1) apart for any input (measured >= 0.1, typically ~1)
// and no BF16 rounding or summation order flips the choice; every row of a
// layer goes to the same k experts. (Before, with a bias spread below 1,
// margins of 1e-4..1e-3 moved a few rows per test by 5-60% of the logit
// spread.) The DSA indexer's top-k is not conditioned: its rare near-ties
// move a K3.1 row by up to ~9% of the spread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "config/model_config.h"
#include "io/checkpoint.h"

namespace k3 {

// preset: "tiny" | "small"; variant: "k3" (MLA) | "k3.1" (DSA). Error on others.
ModelConfig preset_config(const std::string& preset, const std::string& variant);

// All tensors of checkpoint_schema(config), named with the `language_model.` prefix.
std::unique_ptr<MemoryCheckpoint> make_synthetic(const ModelConfig& config, uint64_t seed);

}  // namespace k3
