// Sums of squares and means accumulate in double (cheap, and it keeps the
// reference's own error far below one bf16 ulp); everything else is FP32.
#include "ops/rmsnorm.h"

#include <cmath>

#include "core/error.h"

namespace k3::ops {
namespace {

inline float weight_at(const bf16* w, int64_t i) { return to_float(w[i]); }
inline float weight_at(const float* w, int64_t i) { return w[i]; }

template <typename W>
void rmsnorm_impl(const float* x, const W* w, float* out, int64_t rows, int64_t dim, float eps) {
  K3_CHECK(rows >= 0 && dim > 0, "rmsnorm: bad shape [{}, {}]", rows, dim);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = out + r * dim;
    double ss = 0.0;
    for (int64_t i = 0; i < dim; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const float inv = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(dim)) + eps);
    for (int64_t i = 0; i < dim; ++i) yr[i] = round_bf16(weight_at(w, i) * round_bf16(xr[i] * inv));
  }
}

}  // namespace

void rmsnorm(const float* x, const bf16* w, float* out, int64_t rows, int64_t dim, float eps) {
  rmsnorm_impl(x, w, out, rows, dim, eps);
}

void rmsnorm(const float* x, const float* w, float* out, int64_t rows, int64_t dim, float eps) {
  rmsnorm_impl(x, w, out, rows, dim, eps);
}

void layernorm(const float* x, const bf16* w, const bf16* b, float* out, int64_t rows, int64_t dim, float eps) {
  K3_CHECK(rows >= 0 && dim > 0, "layernorm: bad shape [{}, {}]", rows, dim);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = out + r * dim;
    double sum = 0.0;
    for (int64_t i = 0; i < dim; ++i) sum += xr[i];
    const float mu = static_cast<float>(sum / static_cast<double>(dim));
    double sq = 0.0;
    for (int64_t i = 0; i < dim; ++i) {
      const double c = static_cast<double>(xr[i]) - mu;
      sq += c * c;
    }
    const float inv = 1.0f / std::sqrt(static_cast<float>(sq / static_cast<double>(dim)) + eps);
    for (int64_t i = 0; i < dim; ++i) yr[i] = round_bf16(to_float(w[i]) * ((xr[i] - mu) * inv) + to_float(b[i]));
  }
}

}  // namespace k3::ops
