// GpuWeights: one rank's weights on the device, a ModelWeights whose pointers
// are device pointers (the same shard as model/weights.h), plus the MXFP4
// expert pointer tables of the MoE layers. One factory, load_gpu_weights,
// serves every caller (the CLI, the clusters, the decoder, the bench);
// build_gpu_weights with another fill gives the bench its random weights.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "config/model_config.h"
#include "core/cuda.h"
#include "io/checkpoint.h"
#include "model/weights.h"
#include "ops/moe.h"

namespace k3 {

struct GpuWeights {
  ModelWeights w;                                   // device pointers
  std::vector<ops::cuda::Mxfp4ExpertTable> tables;  // [layers] (MoE layers only)
  std::vector<DeviceBuffer> bufs;
  size_t bytes = 0;  // allocated (with layer copies, less than a step reads)
};

// Fills a device buffer: from `host` (nullptr when building without host weights).
using GpuFill = std::function<void(void* dev, const void* host, size_t bytes, DType dt, const std::string& role)>;
// layer_copies > 0 (the bench's rank slice and its test): the layers of one kind share that many sets of
// weights (LayerPlan::weight_sources: a later layer holds the device pointers of its source layer, whose
// host weights are the ones read), so that a rank larger than the GPU still fits; 0: every layer its own,
// as deployed.
GpuWeights build_gpu_weights(const ModelConfig& c, const ShardSpec& shard, const ModelWeights* host,
                             const GpuFill& fill, int layer_copies = 0);
// The upload fill (cudaMemcpy from host).
GpuFill upload_fill();
// The shard of `src` read on the host, uploaded, and the host copy dropped.
GpuWeights load_gpu_weights(const TensorSource& src, const ModelConfig& c, const ShardSpec& shard);

}  // namespace k3
