// CpuBackend: the StepBackend of the CPU reference engine. Activations are
// host float arrays of BF16 values sized for the step; the work runs the CPU
// ops (src/ops/*.cpp) and the CPU modules of model/layers.h; collectives go
// through the rank's Comm groups (BF16 on the wire, FP32 sums in rank order).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "comm/comm.h"
#include "config/model_config.h"
#include "model/layers.h"
#include "runtime/step_backend.h"

namespace k3 {

struct CpuStepEnv {
  const ModelConfig* config = nullptr;
  const LayerPlan* plan = nullptr;
  const ModelWeights* weights = nullptr;
  AttentionCache* cache = nullptr;
  Comm* tp = nullptr;
  Comm* world = nullptr;
  Dcp dcp;
};

class CpuBackend final : public StepBackend {
 public:
  // tokens [B q] of the step `shape` (cache bound to the step's slots).
  CpuBackend(const CpuStepEnv& env, const int32_t* tokens, const StepShape& shape);

  std::vector<float> logits;  // [m, V] FP32, after the step
  std::vector<float> aux;     // [aux layers, m, D], after the step

  const ModelWeights& weights() const override { return *env_.weights; }
  void begin(StepKind kind, const StepRows& r) override;
  void embed(int64_t row0, int64_t rows, int64_t res_rows) override;
  void attn_res(const ResMix& r) override;
  void rmsnorm(Act x, const bf16* w, int64_t rows) override;
  void copy_rows(Act dst, Act src, int64_t rows) override;
  void attention(int layer, Act x, Act out) override;
  void moe(int layer, Act x, int64_t row0, int64_t cs, int64_t real, Act out, SharedPart shared) override;
  void dense(int layer, Act x, int64_t rows, Act out) override;
  void lm_head(Act h, int64_t m) override;
  void all_gather_rows(Act shard, Act all, int64_t m) override;
  void reduce_scatter_rows(Act partial, Act shard, int64_t m) override;
  void all_reduce(Act a, int64_t m) override;
  void capture_aux(bool with_delta, int64_t rows, bool gather) override;

 private:
  float* at(Act a) { return bufs_[static_cast<size_t>(a)].data(); }

  CpuStepEnv env_;
  const int32_t* tokens_;
  StepShape shape_;
  StepRows r_;
  int64_t D_ = 0;
  std::array<std::vector<float>, 8> bufs_;  // by Act
};

}  // namespace k3
