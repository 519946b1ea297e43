// CUDA kda_prep (see kda_prep.h for the math): the three short convs + SiLU, the q / k l2 norms per
// head, the gate and beta of a step in one launch.
//
// A CTA of 4 warps per (head h, request b): warps 0, 1, 2 run the conv of q, k, v over the head's d
// channels, warp 3 the gate of those channels; warp 0 also computes the request's beta of head h. A
// lane owns channels lane, lane + 32, ... of the head (NPL of them): it reads their committed conv
// states (K-1 floats each) once, keeps the K-wide windows in registers, loops the request's q_len
// tokens in order, and keeps each token's F32 input in the slot's rows of the kept pool. Per token the
// q and k warps round each SiLU output to BF16, sum the squares of the head's d outputs in double
// (lane-strided, then a butterfly over the warp) and scale by scale / sqrt(ss + 1e-6); the v warp
// stores its BF16 outputs.
//
// Bit-identity with the separate kernels this replaces (short_conv_silu, l2norm_heads, kda_gate,
// kda_beta): every output element is the same FP32 expression evaluated in the same order: the conv
// sum over j = 0..K-1, SiLU as z / (1 + e^-z) rounded to BF16; the norm's lane-strided double sum of
// the BF16 values and the same warp_sum, then the same divide and multiply; the gate and beta as
// before on the same BF16 inputs.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda_device.cuh"
#include "ops/kda_prep.h"

namespace k3::ops::cuda {
namespace {

using bf16raw = __nv_bfloat16;
using detail::sigmoid;
using detail::warp_sum;

constexpr int kMaxK = 8;     // conv taps
constexpr int kMaxD = 256;   // head dim: 8 channels per lane
constexpr int kThreads = 128;  // warps: conv q, conv k, conv v, gate

// NPL: channels per lane (d <= 32 NPL).
template <int NPL>
__global__ void __launch_bounds__(kThreads)
    kda_prep_kernel(const __grid_constant__ KdaPrep p, int q_len, int max_q, int H, int d, int K) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  const int part = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int h = blockIdx.x, b = blockIdx.y;
  const int64_t C = int64_t{H} * d, row0 = int64_t{b} * q_len, c0 = int64_t{h} * d;

  if (part == 3) {  // the gate: g = lower * sigmoid(e^A_log[h] (u + dt_bias))
    const bf16raw* __restrict__ u = reinterpret_cast<const bf16raw*>(p.u);
    const float a = expf(p.A_log[h]);
    for (int t = 0; t < q_len; ++t) {
      const int64_t row = row0 + t;
#pragma unroll
      for (int i = 0; i < NPL; ++i) {
        const int cl = lane + 32 * i;
        if (cl < d) {
          const int64_t c = c0 + cl;
          p.g[row * C + c] = p.lower_bound * sigmoid(a * (__bfloat162float(u[row * C + c]) + p.dt_bias[c]));
        }
      }
    }
    return;
  }

  const bf16raw* __restrict__ proj = reinterpret_cast<const bf16raw*>(p.proj);
  if (part == 0)  // beta of head h for the request's tokens
    for (int t = lane; t < q_len; t += 32) {
      const int64_t row = row0 + t;
      p.beta[row * H + h] = sigmoid(__bfloat162float(proj[row * p.proj_ld + p.b_col + h]));
    }

  const int S = K - 1;
  const int64_t slot = p.slots[b];
  const float* __restrict__ w = p.conv_w[part];
  const float* __restrict__ pool = p.conv_pool[part];
  float* __restrict__ kept = p.conv_kept[part];
  const bf16raw* __restrict__ x = proj + part * C;
  float wc[NPL][kMaxK];
  float win[NPL][kMaxK];
#pragma unroll
  for (int i = 0; i < NPL; ++i) {
    const int cl = lane + 32 * i;
    const int64_t c = c0 + cl;
#pragma unroll
    for (int j = 0; j < kMaxK; ++j) {
      wc[i][j] = cl < d && j < K ? w[c * K + j] : 0.f;
      win[i][j] = cl < d && j < S ? pool[(slot * C + c) * S + j] : 0.f;
    }
  }
  const float scale = part == 0 ? p.q_scale : 1.0f;
  float* __restrict__ normed = part == 0 ? p.q : p.k;
  bf16raw* __restrict__ v = reinterpret_cast<bf16raw*>(p.v);

  for (int t = 0; t < q_len; ++t) {
    const int64_t row = row0 + t;
    float y[NPL];
#pragma unroll
    for (int i = 0; i < NPL; ++i) {
      const int cl = lane + 32 * i;
      y[i] = 0.f;
      if (cl < d) {
        const int64_t c = c0 + cl;
        const float xv = __bfloat162float(x[row * p.proj_ld + c]);
#pragma unroll
        for (int j = 0; j < kMaxK; ++j)
          if (j == S) win[i][j] = xv;
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < kMaxK; ++j)
          if (j < K) acc += wc[i][j] * win[i][j];
        const bf16raw yb = __float2bfloat16_rn(acc / (1.0f + expf(-acc)));
        if (part == 2) v[row * C + c] = yb;
        y[i] = __bfloat162float(yb);
#pragma unroll
        for (int j = 0; j + 1 < kMaxK; ++j)
          if (j < S) win[i][j] = win[i][j + 1];
        if (kept != nullptr) kept[(slot * max_q + t) * C + c] = xv;
      }
    }
    if (part < 2) {  // warp-uniform: l2 norm of the head's d outputs of this token
      double ss = 0.0;
#pragma unroll
      for (int i = 0; i < NPL; ++i)
        if (lane + 32 * i < d) {
          const double yv = y[i];
          ss += yv * yv;
        }
      ss = warp_sum(ss);
      const float f = scale / sqrtf(static_cast<float>(ss) + 1e-6f);
#pragma unroll
      for (int i = 0; i < NPL; ++i) {
        const int cl = lane + 32 * i;
        if (cl < d) normed[row * C + c0 + cl] = y[i] * f;
      }
    }
  }
}

template <int NPL>
int launch(const KdaPrep& p, int B, int q_len, int max_q, int H, int d, int K, cudaStream_t s) {
  const dim3 grid(static_cast<unsigned>(H), static_cast<unsigned>(B));
  return detail::launch(kda_prep_kernel<NPL>, grid, kThreads, 0, s, p, q_len, max_q, H, d, K);
}

}  // namespace

int kda_prep(const KdaPrep& p, int B, int q_len, int max_q, int H, int d, int K, CUstream_st* stream) {
  if (K < 1 || K > kMaxK || d < 1 || d > kMaxD || H <= 0 || B < 0 || B > 65535 || q_len < 0 || q_len > max_q)
    return cudaErrorInvalidValue;
  const int64_t C = int64_t{H} * d;
  if (p.proj_ld < 3 * C || p.b_col < 0 || p.b_col + H > p.proj_ld) return cudaErrorInvalidValue;
  if (B == 0 || q_len == 0) return cudaSuccess;
  if (p.proj == nullptr || p.u == nullptr || p.slots == nullptr || p.A_log == nullptr || p.dt_bias == nullptr ||
      p.q == nullptr || p.k == nullptr || p.v == nullptr || p.g == nullptr || p.beta == nullptr)
    return cudaErrorInvalidValue;
  for (int j = 0; j < 3; ++j)
    if (p.conv_w[j] == nullptr || (K > 1 && p.conv_pool[j] == nullptr)) return cudaErrorInvalidValue;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  if (d <= 32) return launch<1>(p, B, q_len, max_q, H, d, K, s);
  if (d <= 64) return launch<2>(p, B, q_len, max_q, H, d, K, s);
  if (d <= 128) return launch<4>(p, B, q_len, max_q, H, d, K, s);
  return launch<8>(p, B, q_len, max_q, H, d, K, s);
}

}  // namespace k3::ops::cuda
