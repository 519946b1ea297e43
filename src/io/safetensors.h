// safetensors: reader (memory-mapped, zero-copy views) and writer.
//
// File layout: u64 little-endian header size N, N bytes of JSON
// {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}},
// then the data; offsets are relative to the end of the header.
// The reader validates the whole header before any tensor is touched: size sane
// (8 <= N, 8 + N <= file size, N <= 100 MB), JSON well formed, every dtype known,
// shape non-negative, end - begin == numel * dtype size, ranges inside the file
// and not overlapping. Any violation is an Error naming the file and tensor.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace k3 {

class SafetensorsFile {
 public:
  static std::unique_ptr<SafetensorsFile> open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  bool has(const std::string& name) const { return tensors_.count(name) != 0; }
  TensorView get(const std::string& name) const;  // Error if absent
  std::vector<std::string> names() const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Writes tensors (in the given order) to path; metadata goes to "__metadata__".
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, TensorView>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace k3
