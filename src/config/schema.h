// The checkpoint schema: every tensor a K3 / K3.1 model directory holds for a
// ModelConfig, with its dtype and shape (kimi-k3.md section 3), names without
// the `language_model.` prefix. One source of truth for make-model (what to
// write), the loader (what to expect) and `inspect` (parameter count).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config/model_config.h"
#include "core/tensor.h"

namespace k3 {

struct TensorSpec {
  std::string name;
  DType dtype;
  Shape shape;
  bool min_numel = false;  // A_log: any shape holding at least numel values (stored padded)
};

inline constexpr const char* kTextPrefix = "language_model.";

std::string layer_prefix(int layer);  // "model.layers.{l}."
std::string expert_prefix(int layer, int expert);  // "model.layers.{l}.block_sparse_moe.experts.{e}."

// Padded A_log length make-model writes (K3 stores 128 values for 96 heads).
int a_log_stored_len(const ModelConfig& c);

std::vector<TensorSpec> checkpoint_schema(const ModelConfig& c);

// Parameters of the model: MXFP4 bytes count two parameters each, scales none.
int64_t parameter_count(const ModelConfig& c);
// Parameters touched by one token (top-k routed experts of each MoE layer, lm_head whole, one embedding row).
int64_t active_parameter_count(const ModelConfig& c);

}  // namespace k3
