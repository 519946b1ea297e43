// Tensor / TensorView (core/tensor.h).
#include "core/tensor.h"

#include <cstdlib>
#include <cstring>

namespace k3 {

namespace {
struct DTypeInfo {
  DType t;
  const char* name;
  size_t size;
};
constexpr DTypeInfo kDTypes[] = {
    {DType::F64, "F64", 8},     {DType::F32, "F32", 4},         {DType::F16, "F16", 2},
    {DType::BF16, "BF16", 2},   {DType::F8_E4M3, "F8_E4M3", 1}, {DType::F8_E5M2, "F8_E5M2", 1},
    {DType::I64, "I64", 8},     {DType::I32, "I32", 4},         {DType::I16, "I16", 2},
    {DType::I8, "I8", 1},       {DType::U64, "U64", 8},         {DType::U32, "U32", 4},
    {DType::U16, "U16", 2},     {DType::U8, "U8", 1},           {DType::BOOL, "BOOL", 1},
};
}  // namespace

size_t dtype_size(DType t) { return kDTypes[static_cast<int>(t)].size; }
std::string_view dtype_name(DType t) { return kDTypes[static_cast<int>(t)].name; }
std::optional<DType> dtype_from_name(std::string_view name) {
  for (const auto& d : kDTypes)
    if (name == d.name) return d.t;
  return std::nullopt;
}

std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

void Tensor::Free::operator()(void* p) const { std::free(p); }

Tensor::Tensor(DType dtype, Shape shape) : dtype_(dtype), shape_(std::move(shape)) {
  for (int64_t d : shape_) K3_CHECK(d >= 0, "negative dimension in shape {}", shape_str(shape_));
  bytes_ = static_cast<size_t>(numel()) * dtype_size(dtype_);
  size_t alloc = (bytes_ + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, alloc == 0 ? 64 : alloc);
  K3_CHECK(p != nullptr, "out of host memory allocating {} bytes", bytes_);
  std::memset(p, 0, alloc == 0 ? 64 : alloc);
  data_.reset(p);
}

}  // namespace k3
