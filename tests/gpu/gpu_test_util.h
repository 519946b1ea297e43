// Helpers of the GPU tests: skip without a device, host <-> device copies,
// and the comparison against the CPU reference with a per-op tolerance.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <utility>
#include <vector>

#include "core/bf16.h"
#include "core/cuda.h"
#include "core/rng.h"
#include "ops/cuda_context.h"

namespace k3::gputest {

#define K3_REQUIRE_GPU()                                      \
  do {                                                        \
    if (!::k3::cuda_device_available()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

// A context per test binary (created on first use).
inline ops::cuda::Context& ctx() {
  static ops::cuda::Context c = ops::cuda::create_context();
  return c;
}
inline cudaStream_t stream() { return reinterpret_cast<cudaStream_t>(ctx().stream); }

template <typename T>
DeviceBuffer upload(const std::vector<T>& h) {
  DeviceBuffer d(h.size() * sizeof(T));
  // Landed on return: a pageable cudaMemcpy may return before its DMA ends, and the kernels under test run
  // on a non-blocking stream that does not wait for it.
  if (!h.empty()) CUDA_CHECK(cudaMemcpy(d.get(), h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaDeviceSynchronize());
  return d;
}
template <typename T>
std::vector<T> download(const DeviceBuffer& d, size_t n) {
  std::vector<T> h(n);
  CUDA_CHECK(cudaStreamSynchronize(stream()));
  if (n) CUDA_CHECK(cudaMemcpy(h.data(), d.get(), n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

inline std::vector<bf16> to_bf16_vec(const std::vector<float>& v) {
  std::vector<bf16> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = to_bf16(v[i]);
  return o;
}
inline std::vector<float> to_float_vec(const std::vector<bf16>& v) {
  std::vector<float> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = to_float(v[i]);
  return o;
}
// Random bf16-representable values in [-a, a] (never all zero).
inline std::vector<float> random_bf16_values(size_t n, uint64_t seed, double a = 1.0) {
  Rng r(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = round_bf16(static_cast<float>(r.uniform(-a, a)));
  return v;
}

// max |got - want| <= atol + rtol * max|want|, reporting the worst index.
inline void expect_close(const std::vector<float>& got, const std::vector<float>& want, double rtol, double atol,
                         const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 0;
  for (float w : want) scale = std::max(scale, static_cast<double>(std::fabs(w)));
  size_t worst = 0;
  double err = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    double e = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!(e <= err)) {
      err = e;
      worst = i;
    }
  }
  EXPECT_LE(err, atol + rtol * scale) << what << ": worst at " << worst << " got " << got[worst] << " want "
                                      << want[worst] << " (scale " << scale << ")";
}

// Shorthands of the op tests: BF16 / F32 / I32 transfers, a NaN-filled output, uniform random values,
// a seeded shuffle, the context's stream.
inline DeviceBuffer up_bf16(const std::vector<float>& v) { return upload(to_bf16_vec(v)); }
inline std::vector<float> down_bf16(const DeviceBuffer& d, size_t n) { return to_float_vec(download<bf16>(d, n)); }
inline std::vector<float> down_f32(const DeviceBuffer& d, size_t n) { return download<float>(d, n); }
inline std::vector<int32_t> down_i32(const DeviceBuffer& d, size_t n) { return download<int32_t>(d, n); }
// n BF16 NaNs (all-ones bits): an output value a kernel never writes stays NaN and fails the comparison.
inline void fill_nan_bf16(DeviceBuffer& b, size_t n) {
  ASSERT_EQ(cudaMemset(b.get(), 0xFF, n * sizeof(bf16)), cudaSuccess);
}
inline std::vector<float> uniform(size_t n, uint64_t seed, double lo, double hi) {
  Rng r(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(r.uniform(lo, hi));
  return v;
}
template <typename T>
void shuffle(std::vector<T>& v, Rng& r) {
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[r.below(i)]);
}
inline CUstream_st* st() { return ctx().stream; }

// A launcher's status (0 = cudaSuccess), asserted.
#define K3_CU(expr) ASSERT_EQ(static_cast<int>(expr), 0) << #expr

// Tolerances of the op tests, in bf16 ulps relative to the top of a value's binade.
constexpr double kBf16Ulp = 1.0 / 128;
constexpr double kOneRounding = kBf16Ulp;   // one BF16 rounding apart
constexpr double kChained = 2 * kBf16Ulp;   // two chained roundings

}  // namespace k3::gputest
