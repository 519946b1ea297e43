// CPU reference for SiTU-GLU, MXFP4 linears, the routed expert MLP and the BF16 MLP (see moe.h).
#include "ops/moe.h"

#include <cmath>
#include <vector>

#include "core/error.h"
#include "ops/dot.h"
#include "core/mxfp4.h"
#include "ops/linear.h"

namespace k3::ops {
void situ_glu(const float* a, const float* b, float* out, int64_t n, SituParams p) {
  const float beta = p.beta, lbeta = p.linear_beta;
  for (int64_t i = 0; i < n; ++i) {
    const float x = a[i], y = b[i];
    const float sig = 1.f / (1.f + std::exp(-x));  // exp overflow gives 1 / inf = 0: saturates correctly
    const float gate = beta * std::tanh(x / beta) * sig;
    const float lin = lbeta * std::tanh(y / lbeta);
    out[i] = round_bf16(gate * lin);
  }
}

void mxfp4_linear(const float* x, const uint8_t* packed, const uint8_t* scale, float* y, int64_t rows, int64_t K,
                  int64_t N) {
  K3_CHECK(K > 0 && K % kMxfp4Group == 0, "mxfp4_linear: K = {} must be a positive multiple of {}", K, kMxfp4Group);
  K3_CHECK(rows >= 0 && N >= 0, "mxfp4_linear: bad sizes rows={} N={}", rows, N);
  const int64_t groups = K / kMxfp4Group;
  std::vector<float> wrow(static_cast<size_t>(K));
  for (int64_t n = 0; n < N; ++n) {
    // Dequantize weight row n exactly (e2m1 * 2^(s - 127) is representable in FP32).
    const uint8_t* pr = packed + n * (K / 2);
    const uint8_t* sr = scale + n * groups;
    for (int64_t g = 0; g < groups; ++g) {
      const float sc = e8m0_to_float(sr[g]);
      float tbl[16];  // the 16 codes times this group's scale
      for (int c = 0; c < 16; ++c) tbl[c] = e2m1_to_float(static_cast<uint8_t>(c)) * sc;
      for (int64_t j = 0; j < kMxfp4Group / 2; ++j) {
        const uint8_t byte = pr[g * (kMxfp4Group / 2) + j];
        const int64_t k = g * kMxfp4Group + 2 * j;
        wrow[k] = tbl[byte & 0xf];  // low nibble first
        wrow[k + 1] = tbl[byte >> 4];
      }
    }
    for (int64_t r = 0; r < rows; ++r) y[r * N + n] = round_bf16(dot(x + r * K, wrow.data(), K));
  }
}

void expert_mlp(const float* z, Mxfp4Matrix w1, Mxfp4Matrix w3, Mxfp4Matrix w2, float* out, int64_t rows, int64_t D,
                int64_t I, SituParams p, float* scratch) {
  float* a = scratch;
  float* b = scratch + rows * I;
  mxfp4_linear(z, w1.packed, w1.scale, a, rows, D, I);  // BF16-rounded
  mxfp4_linear(z, w3.packed, w3.scale, b, rows, D, I);
  situ_glu(a, b, a, rows * I, p);
  mxfp4_linear(a, w2.packed, w2.scale, out, rows, I, D);
}

void linear_glu(const float* x, const bf16* w_gate, const bf16* w_up, float* h, int64_t rows, int64_t D, int64_t I,
                SituParams p, float* scratch) {
  linear(x, w_gate, h, rows, D, I);  // BF16-rounded
  linear(x, w_up, scratch, rows, D, I);
  situ_glu(h, scratch, h, rows * I, p);
}

void mlp(const float* x, const bf16* w_gate, const bf16* w_up, const bf16* w_down, float* out, int64_t rows, int64_t D,
         int64_t I, SituParams p, float* scratch) {
  float* h = scratch;
  linear_glu(x, w_gate, w_up, h, rows, D, I, p, scratch + rows * I);
  linear(h, w_down, out, rows, I, D);
}

}  // namespace k3::ops
