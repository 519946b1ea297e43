// Checkpoints: a named set of tensors, from a model directory (config.json +
// model.safetensors, or model.safetensors.index.json with its shard files) or
// from memory (the embedded tiny model, make-model before writing).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "config/model_config.h"
#include "core/tensor.h"

namespace k3 {

class SafetensorsFile;

class TensorSource {
 public:
  virtual ~TensorSource() = default;
  virtual bool has(const std::string& name) const = 0;
  virtual TensorView get(const std::string& name) const = 0;  // Error naming the tensor if absent
  virtual std::vector<std::string> names() const = 0;
};

// A model directory. Tensors stay memory-mapped: a view reads only the pages it touches.
class Checkpoint : public TensorSource {
 public:
  static std::unique_ptr<Checkpoint> open(const std::string& dir);
  ~Checkpoint() override;

  const ModelConfig& config() const { return config_; }
  bool has(const std::string& name) const override;
  TensorView get(const std::string& name) const override;
  std::vector<std::string> names() const override;

 private:
  Checkpoint() = default;
  std::string dir_;
  ModelConfig config_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsFile*> where_;
};

// Tensors held in memory.
class MemoryCheckpoint : public TensorSource {
 public:
  void add(const std::string& name, Tensor t);
  bool has(const std::string& name) const override { return tensors_.count(name) != 0; }
  TensorView get(const std::string& name) const override;
  std::vector<std::string> names() const override;  // in insertion order
  Tensor& mutable_tensor(const std::string& name);

 private:
  std::map<std::string, Tensor> tensors_;
  std::vector<std::string> order_;
};

// Writes config.json and the tensors of `src` (in names() order) to dir: one
// model.safetensors, or shards of at most max_shard_bytes with
// model.safetensors.index.json when the tensors exceed it.
void write_checkpoint(const std::string& dir, const ModelConfig& config, const TensorSource& src,
                      size_t max_shard_bytes);

}  // namespace k3
