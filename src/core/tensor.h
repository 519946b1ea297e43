// Tensors: a dtype, a shape and bytes. TensorView borrows (a memory-mapped
// checkpoint, a buffer of the engine); Tensor owns host memory. Shapes are
// row-major, outermost first, as in safetensors ([out, in] for weights).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/bf16.h"
#include "core/error.h"

namespace k3 {

enum class DType : uint8_t { F64, F32, F16, BF16, F8_E4M3, F8_E5M2, I64, I32, I16, I8, U64, U32, U16, U8, BOOL };

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);               // safetensors spelling: "BF16", "F32", "U8", ...
std::optional<DType> dtype_from_name(std::string_view name);

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);              // "[3, 4]"
int64_t shape_numel(const Shape& s);

template <typename T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<double>() { return DType::F64; }
template <> constexpr DType dtype_of<float>() { return DType::F32; }
template <> constexpr DType dtype_of<bf16>() { return DType::BF16; }
template <> constexpr DType dtype_of<int64_t>() { return DType::I64; }
template <> constexpr DType dtype_of<int32_t>() { return DType::I32; }
template <> constexpr DType dtype_of<uint8_t>() { return DType::U8; }

struct TensorView {
  const void* data = nullptr;
  DType dtype = DType::F32;
  Shape shape;

  int64_t numel() const { return shape_numel(shape); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  int64_t dim(int i) const { return shape.at(static_cast<size_t>(i < 0 ? i + static_cast<int>(shape.size()) : i)); }

  template <typename T>
  const T* as() const {
    K3_CHECK(dtype == dtype_of<T>(), "tensor of dtype {} read as {}", dtype_name(dtype), dtype_name(dtype_of<T>()));
    return static_cast<const T*>(data);
  }
};

// Owned host tensor (64-byte aligned storage).
class Tensor {
 public:
  Tensor() = default;
  Tensor(DType dtype, Shape shape);

  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return bytes_; }
  void* data() { return data_.get(); }
  const void* data() const { return data_.get(); }
  TensorView view() const { return TensorView{data_.get(), dtype_, shape_}; }

  template <typename T>
  T* as() {
    K3_CHECK(dtype_ == dtype_of<T>(), "tensor of dtype {} read as {}", dtype_name(dtype_), dtype_name(dtype_of<T>()));
    return static_cast<T*>(data());
  }
  template <typename T>
  const T* as() const {
    return view().as<T>();
  }

 private:
  struct Free {
    void operator()(void* p) const;
  };
  DType dtype_ = DType::F32;
  Shape shape_;
  size_t bytes_ = 0;
  std::unique_ptr<void, Free> data_;
};

}  // namespace k3
