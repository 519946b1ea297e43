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
// router logits spread wide with a bias that separates experts, so the k-th
// and (k+1)-th scores have clear margins.
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
