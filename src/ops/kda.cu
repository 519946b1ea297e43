// CUDA kernels of Kimi Delta Attention (see kda.h for the math).
//
//   kda_gate / kda_beta: elementwise, FP32 math on BF16 inputs.
//   l2norm_heads, kda_gated_norm: one warp per (row, head); the sum of squares in
//     double like the CPU reference, then the same FP32 ops and BF16 roundings.
//   kda_recurrence: rows of S [dv, dk] evolve independently, so a CTA of 4 warps owns
//     8 rows of one (request, head); each lane keeps float4 column chunks of its
//     warp's 2 rows in registers (coalesced 512 B row loads), loops the q_len tokens,
//     reduces S' k and S q over dk with warp shuffles, and writes the state after
//     every token to the slot's history row: the committed state is read once and the
//     history written once per token, nothing else touches the state bytes.
//   commit_state: a vectorized copy of the accepted history row per request.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda_bf16.cuh"
#include "ops/cuda_device.cuh"
#include "ops/kda.h"

namespace k3::ops::cuda {
namespace {

using bf16raw = __nv_bfloat16;

using detail::aligned16;
using detail::warp_sum;
using detail::round_bf16_dev;
using detail::sigmoid;

constexpr int kEltThreads = 256;
constexpr int kNormWarps = 8;  // (row, head) pairs per CTA of the per-head norms

unsigned blocks_for(int64_t n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

__global__ void kda_gate_kernel(const bf16raw* __restrict__ u, const float* __restrict__ A_log,
                                const float* __restrict__ dt_bias, float lower_bound, float* __restrict__ g, int64_t n,
                                int H, int dk) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kEltThreads + threadIdx.x;
  if (i >= n) return;
  const int64_t j = i % (static_cast<int64_t>(H) * dk);
  const float a = expf(A_log[j / dk]);
  g[i] = lower_bound * sigmoid(a * (__bfloat162float(u[i]) + dt_bias[j]));
}

__global__ void kda_beta_kernel(const bf16raw* __restrict__ b, int64_t b_ld, float* __restrict__ beta, int64_t n,
                                int H) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kEltThreads + threadIdx.x;
  if (i >= n) return;
  const int64_t r = i / H, h = i % H;
  beta[i] = sigmoid(__bfloat162float(b[r * b_ld + h]));
}

__global__ void l2norm_heads_kernel(const bf16raw* __restrict__ x, float* __restrict__ out, int64_t pairs, int d,
                                    float scale) {
  const int64_t p = static_cast<int64_t>(blockIdx.x) * kNormWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (p >= pairs) return;
  const bf16raw* xr = x + p * d;
  double ss = 0.0;
  for (int j = lane; j < d; j += 32) {
    const double v = __bfloat162float(xr[j]);
    ss += v * v;
  }
  ss = warp_sum(ss);
  const float f = scale / sqrtf(static_cast<float>(ss) + 1e-6f);
  float* yr = out + p * d;
  for (int j = lane; j < d; j += 32) yr[j] = __bfloat162float(xr[j]) * f;
}

__global__ void kda_gated_norm_kernel(const float* __restrict__ o, const bf16raw* __restrict__ gate, int64_t gate_ld,
                                      const float* __restrict__ w, float eps, bf16raw* __restrict__ out, int64_t pairs,
                                      int H, int dv) {
  const int64_t p = static_cast<int64_t>(blockIdx.x) * kNormWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (p >= pairs) return;
  const int64_t r = p / H, h = p % H;
  const float* orow = o + p * dv;
  const bf16raw* grow = gate + r * gate_ld + h * dv;
  double ss = 0.0;
  for (int j = lane; j < dv; j += 32) ss += static_cast<double>(orow[j]) * orow[j];
  ss = warp_sum(ss);
  const float inv = 1.0f / sqrtf(static_cast<float>(ss / dv) + eps);
  bf16raw* yr = out + p * dv;
  for (int j = lane; j < dv; j += 32) {
    const float n = round_bf16_dev(w[j] * round_bf16_dev(orow[j] * inv));
    yr[j] = __float2bfloat16_rn(n * sigmoid(__bfloat162float(grow[j])));
  }
}

// ---- recurrence ----
constexpr int kRecWarps = 4;
constexpr int kRowsPerWarp = 2;
constexpr int kRecThreads = kRecWarps * 32;
constexpr int kRowsPerCta = kRecWarps * kRowsPerWarp;

__device__ __forceinline__ float dot4(const float4& a, const float4& b) {
  return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
}

// CMAX: float4 chunks per lane per row (dk <= 128 CMAX). Lane l owns chunks l, l + 32, ...
template <int CMAX>
__global__ void __launch_bounds__(kRecThreads, 8)
    kda_recurrence_kernel(const float* __restrict__ q, const float* __restrict__ k, const bf16raw* __restrict__ v,
                          const float* __restrict__ g, const float* __restrict__ beta,
                          const float* __restrict__ state_pool, float* __restrict__ hist_pool,
                          const int32_t* __restrict__ slots, float* __restrict__ o, int q_len, int max_q, int H, int dk,
                          int dv) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int b = blockIdx.z, h = blockIdx.y;
  const int row0 = blockIdx.x * kRowsPerCta + warp * kRowsPerWarp;
  if (row0 >= dv) return;  // warp-uniform, and no CTA-wide barrier below
  const int64_t slot = slots[b];
  const int64_t state = static_cast<int64_t>(dv) * dk;
  const int nc4 = dk / 4;
  const float4 zero4 = make_float4(0.f, 0.f, 0.f, 0.f);

  float4 S[kRowsPerWarp][CMAX];
  {
    const float4* S0 = reinterpret_cast<const float4*>(state_pool + (slot * H + h) * state);
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
      for (int c = 0; c < CMAX; ++c) {
        const int i = row0 + r, j4 = lane + 32 * c;
        S[r][c] = (i < dv && j4 < nc4) ? S0[static_cast<int64_t>(i) * nc4 + j4] : zero4;
      }
  }

  for (int t = 0; t < q_len; ++t) {
    const int64_t row = static_cast<int64_t>(b) * q_len + t;
    const int64_t kb = (row * H + h) * dk;
    const float4* k4 = reinterpret_cast<const float4*>(k + kb);
    const float4* q4 = reinterpret_cast<const float4*>(q + kb);
    const float4* g4 = reinterpret_cast<const float4*>(g + kb);
    float4 kk[CMAX], qq[CMAX], al[CMAX];
#pragma unroll
    for (int c = 0; c < CMAX; ++c) {
      const int j4 = lane + 32 * c;
      if (j4 < nc4) {
        kk[c] = k4[j4];
        qq[c] = q4[j4];
        const float4 gg = g4[j4];
        al[c] = make_float4(expf(gg.x), expf(gg.y), expf(gg.z), expf(gg.w));
      } else {
        kk[c] = qq[c] = al[c] = zero4;
      }
    }
    const float bt = beta[row * H + h];
    const int64_t vb = (row * H + h) * dv;

    // S' = S diag(alpha); pred = S' k
    float pred[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      float p = 0.f;
#pragma unroll
      for (int c = 0; c < CMAX; ++c) {
        S[r][c].x *= al[c].x;
        S[r][c].y *= al[c].y;
        S[r][c].z *= al[c].z;
        S[r][c].w *= al[c].w;
        p += dot4(S[r][c], kk[c]);
      }
      pred[r] = p;
    }
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) pred[r] = warp_sum(pred[r]);

    // delta = beta (v - S' k); S = S' + delta k^T; o = S q
    float oi[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int i = row0 + r;
      const float vi = i < dv ? __bfloat162float(v[vb + i]) : 0.f;
      const float delta = bt * (vi - pred[r]);
      float acc = 0.f;
#pragma unroll
      for (int c = 0; c < CMAX; ++c) {
        S[r][c].x += delta * kk[c].x;
        S[r][c].y += delta * kk[c].y;
        S[r][c].z += delta * kk[c].z;
        S[r][c].w += delta * kk[c].w;
        acc += dot4(S[r][c], qq[c]);
      }
      oi[r] = acc;
    }
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) oi[r] = warp_sum(oi[r]);

    float4* Ht = reinterpret_cast<float4*>(hist_pool + ((slot * max_q + t) * H + h) * state);
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int i = row0 + r;
      if (i >= dv) continue;
      if (lane == 0) o[vb + i] = oi[r];
#pragma unroll
      for (int c = 0; c < CMAX; ++c) {
        const int j4 = lane + 32 * c;
        if (j4 < nc4) Ht[static_cast<int64_t>(i) * nc4 + j4] = S[r][c];
      }
    }
  }
}

// ---- commit ----
constexpr int kCommitThreads = 256;

template <bool VEC4>
__global__ void commit_state_kernel(const float* __restrict__ hist_pool, float* __restrict__ pool,
                                    const int32_t* __restrict__ slots, const int32_t* __restrict__ accepted, int max_q,
                                    int64_t floats_per_state) {
  const int b = blockIdx.y;
  const int n = accepted[b];
  if (n < 1 || n > max_q) return;
  const int64_t slot = slots[b];
  const float* src = hist_pool + (slot * max_q + (n - 1)) * floats_per_state;
  float* dst = pool + slot * floats_per_state;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kCommitThreads;
  const int64_t start = static_cast<int64_t>(blockIdx.x) * kCommitThreads + threadIdx.x;
  if (VEC4) {
    const int64_t n4 = floats_per_state / 4;
    const float4* s4 = reinterpret_cast<const float4*>(src);
    float4* d4 = reinterpret_cast<float4*>(dst);
    for (int64_t i = start; i < n4; i += stride) d4[i] = s4[i];
  } else {
    for (int64_t i = start; i < floats_per_state; i += stride) dst[i] = src[i];
  }
}

}  // namespace

int kda_gate(const bf16* u, const float* A_log, const float* dt_bias, float lower_bound, float* g, int64_t rows, int H,
             int dk, CUstream_st* stream) {
  if (rows < 0 || H <= 0 || dk <= 0) return cudaErrorInvalidValue;
  const int64_t n = rows * H * dk;
  if (n == 0) return cudaSuccess;
  kda_gate_kernel<<<blocks_for(n, kEltThreads), kEltThreads, 0, stream>>>(reinterpret_cast<const bf16raw*>(u), A_log,
                                                                          dt_bias, lower_bound, g, n, H, dk);
  return cudaGetLastError();
}

int kda_beta(const bf16* b, int64_t b_ld, float* beta, int64_t rows, int H, CUstream_st* stream) {
  if (rows < 0 || H <= 0 || b_ld < H) return cudaErrorInvalidValue;
  const int64_t n = rows * H;
  if (n == 0) return cudaSuccess;
  kda_beta_kernel<<<blocks_for(n, kEltThreads), kEltThreads, 0, stream>>>(reinterpret_cast<const bf16raw*>(b), b_ld,
                                                                          beta, n, H);
  return cudaGetLastError();
}

int l2norm_heads(const bf16* x, float* out, int64_t rows, int H, int d, float scale, CUstream_st* stream) {
  if (rows < 0 || H <= 0 || d <= 0) return cudaErrorInvalidValue;
  const int64_t pairs = rows * H;
  if (pairs == 0) return cudaSuccess;
  l2norm_heads_kernel<<<blocks_for(pairs, kNormWarps), kNormWarps * 32, 0, stream>>>(
      reinterpret_cast<const bf16raw*>(x), out, pairs, d, scale);
  return cudaGetLastError();
}

int kda_recurrence(const float* q, const float* k, const bf16* v, const float* g, const float* beta,
                   const float* state_pool, float* hist_pool, const int32_t* slots, float* o, int B, int q_len,
                   int max_q, int H, int dk, int dv, CUstream_st* stream) {
  if (B < 0 || q_len < 0 || q_len > max_q || H <= 0 || dv <= 0 || dk <= 0 || dk % 4 != 0 || dk > 256 || !aligned16(q) ||
      !aligned16(k) || !aligned16(g) || !aligned16(state_pool) || !aligned16(hist_pool))
    return cudaErrorInvalidValue;
  if (B == 0 || q_len == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((dv + kRowsPerCta - 1) / kRowsPerCta), static_cast<unsigned>(H),
                  static_cast<unsigned>(B));
  const auto* vr = reinterpret_cast<const bf16raw*>(v);
  if (dk <= 128)
    kda_recurrence_kernel<1>
        <<<grid, kRecThreads, 0, stream>>>(q, k, vr, g, beta, state_pool, hist_pool, slots, o, q_len, max_q, H, dk, dv);
  else
    kda_recurrence_kernel<2>
        <<<grid, kRecThreads, 0, stream>>>(q, k, vr, g, beta, state_pool, hist_pool, slots, o, q_len, max_q, H, dk, dv);
  return cudaGetLastError();
}

int kda_gated_norm(const float* o, const bf16* gate, int64_t gate_ld, const float* o_norm_w, float eps, bf16* out,
                   int64_t rows, int H, int dv, CUstream_st* stream) {
  if (rows < 0 || H <= 0 || dv <= 0 || gate_ld < static_cast<int64_t>(H) * dv) return cudaErrorInvalidValue;
  const int64_t pairs = rows * H;
  if (pairs == 0) return cudaSuccess;
  kda_gated_norm_kernel<<<blocks_for(pairs, kNormWarps), kNormWarps * 32, 0, stream>>>(
      o, reinterpret_cast<const bf16raw*>(gate), gate_ld, o_norm_w, eps, reinterpret_cast<bf16raw*>(out), pairs, H, dv);
  return cudaGetLastError();
}

int commit_state(const float* hist_pool, float* pool, const int32_t* slots, const int32_t* accepted, int B, int max_q,
                 int64_t floats_per_state, CUstream_st* stream) {
  if (B < 0 || max_q < 1 || floats_per_state < 0) return cudaErrorInvalidValue;
  if (B == 0 || floats_per_state == 0) return cudaSuccess;
  const bool vec4 = floats_per_state % 4 == 0 && aligned16(hist_pool) && aligned16(pool);
  const int64_t units = vec4 ? floats_per_state / 4 : floats_per_state;
  const int64_t want = (units + kCommitThreads * 4 - 1) / (kCommitThreads * 4);  // ~4 units per thread
  const dim3 grid(static_cast<unsigned>(want < 1 ? 1 : (want > 1024 ? 1024 : want)), static_cast<unsigned>(B));
  if (vec4)
    commit_state_kernel<true>
        <<<grid, kCommitThreads, 0, stream>>>(hist_pool, pool, slots, accepted, max_q, floats_per_state);
  else
    commit_state_kernel<false>
        <<<grid, kCommitThreads, 0, stream>>>(hist_pool, pool, slots, accepted, max_q, floats_per_state);
  return cudaGetLastError();
}

}  // namespace k3::ops::cuda
