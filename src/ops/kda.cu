// CUDA kernels of Kimi Delta Attention (see kda.h for the math).
//
//   (the gate, beta and the q / k l2 norms run in kda_prep, ops/kda_prep.cu)
//   kda_gated_norm: one warp per (row, head); the sum of squares in double like the
//     CPU reference, then the same FP32 ops and BF16 roundings.
//   kda_recurrence: rows of S [dv, dk] evolve independently, so a CTA of 4 warps owns
//     16 rows of one (request, head), or 8 when the batch is too small to fill the SMs;
//     each lane keeps float4 column chunks of its warp's rows in registers (coalesced
//     512 B row loads), loops the q_len tokens, reduces S' k and S q over dk with warp
//     shuffles, and writes the state after the last token to the slot's other state
//     buffer: one state read and one written per request, whatever q_len. With
//     q_len > 1 it keeps the tokens' k, g, v, beta (small) for a partial commit.
//   kda_replay: the same kernel on the kept inputs of the first n accepted tokens.
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

constexpr int kNormWarps = 8;  // (row, head) pairs per CTA of the gated norm

unsigned blocks_for(int64_t n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

__global__ void kda_gated_norm_kernel(const float* __restrict__ o, const bf16raw* __restrict__ gate, int64_t gate_ld,
                                      const float* __restrict__ w, float eps, bf16raw* __restrict__ out, int64_t pairs,
                                      int H, int dv) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
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

// ---- recurrence (step) and replay (commit of n < q accepted tokens) ----
// A warp owns RPW rows of one (request, head); a CTA 4 warps. The step and the
// replay share the kernel, so a replay gives the bits of a step of those tokens. Every input (and the state read) is read-only for the kernel's lifetime
// (the state written is the other buffer), so loads go through the read-only path.
constexpr int kRecMaxThreads = 128;

struct RecArgs {
  // step inputs (null in the replay)
  const float* q;
  const float* k;
  const bf16raw* v;
  const float* g;
  const float* beta;
  float* o;
  // states and the kept inputs
  float* state_pool;
  const int32_t* read_idx;
  const int32_t* write_idx;
  KdaKept kept;
  const int32_t* slots;
  const int32_t* accepted;  // replay only
  int q_len, max_q, H, dk, dv;
};

__device__ __forceinline__ float dot4(const float4& a, const float4& b) {
  return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
}

// CMAX: float4 chunks per lane per row (dk <= 128 CMAX); RPW rows per warp; REPLAY: the commit's replay
// (inputs from the kept pool, n = accepted[b] tokens, no output) instead of the step.
template <int CMAX, int RPW, bool REPLAY>
__global__ void __launch_bounds__(kRecMaxThreads, 8) kda_rec_kernel(const RecArgs a) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int b = blockIdx.z, h = blockIdx.y, H = a.H, dk = a.dk, dv = a.dv;
  const int row0 = (blockIdx.x * warps + warp) * RPW;
  if (row0 >= dv) return;  // warp-uniform, and no CTA-wide barrier below
  int n = a.q_len;
  if (REPLAY) {
    n = a.accepted[b];
    if (n <= 0 || n >= a.q_len) return;
  }
  const int64_t slot = a.slots != nullptr ? a.slots[b] : b;
  const int64_t state = static_cast<int64_t>(dv) * dk;
  const int nc4 = dk / 4;
  const float4 zero4 = make_float4(0.f, 0.f, 0.f, 0.f);
  const bool keep = !REPLAY && a.q_len > 1 && a.kept.k != nullptr;
  const bool keep_k = keep && blockIdx.x == 0 && warp == 0;  // one warp per (request, head) keeps k, g, beta

  float4 S[RPW][CMAX];
  {
    const float4* S0 = reinterpret_cast<const float4*>(a.state_pool + (int64_t{a.read_idx[b]} * H + h) * state);
#pragma unroll
    for (int r = 0; r < RPW; ++r)
#pragma unroll
      for (int c = 0; c < CMAX; ++c) {
        const int i = row0 + r, j4 = lane + 32 * c;
        S[r][c] = (i < dv && j4 < nc4) ? __ldg(S0 + static_cast<int64_t>(i) * nc4 + j4) : zero4;
      }
  }

  for (int t = 0; t < n; ++t) {
    const int64_t row = static_cast<int64_t>(b) * a.q_len + t;  // the step's row
    const int64_t krow = (slot * a.max_q + t) * H + h;          // the slot's kept row
    const float4* k4 = reinterpret_cast<const float4*>(REPLAY ? a.kept.k + krow * dk : a.k + (row * H + h) * dk);
    const float4* g4 = reinterpret_cast<const float4*>(REPLAY ? a.kept.g + krow * dk : a.g + (row * H + h) * dk);
    const float4* q4 = reinterpret_cast<const float4*>(REPLAY ? nullptr : a.q + (row * H + h) * dk);
    float4 kk[CMAX], qq[CMAX], al[CMAX];
#pragma unroll
    for (int c = 0; c < CMAX; ++c) {
      const int j4 = lane + 32 * c;
      if (j4 < nc4) {
        kk[c] = __ldg(k4 + j4);
        qq[c] = REPLAY ? zero4 : __ldg(q4 + j4);
        const float4 gg = __ldg(g4 + j4);
        al[c] = make_float4(expf(gg.x), expf(gg.y), expf(gg.z), expf(gg.w));
        if (keep_k) {
          reinterpret_cast<float4*>(a.kept.k + krow * dk)[j4] = kk[c];
          reinterpret_cast<float4*>(a.kept.g + krow * dk)[j4] = gg;
        }
      } else {
        kk[c] = qq[c] = al[c] = zero4;
      }
    }
    const float bt = REPLAY ? __ldg(a.kept.beta + krow) : __ldg(a.beta + row * H + h);
    if (keep_k && lane == 0) a.kept.beta[krow] = bt;
    const int64_t vb = (row * H + h) * dv;

    // S' = S diag(alpha); pred = S' k
    float pred[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
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
    for (int r = 0; r < RPW; ++r) pred[r] = warp_sum(pred[r]);

    // delta = beta (v - S' k); S = S' + delta k^T; o = S q
    float oi[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      const int i = row0 + r;
      float vi = 0.f;
      if (i < dv) vi = REPLAY ? __ldg(a.kept.v + krow * dv + i) : __bfloat162float(a.v[vb + i]);
      if (keep && lane == 0 && i < dv) a.kept.v[krow * dv + i] = vi;
      const float delta = bt * (vi - pred[r]);
      float acc = 0.f;
#pragma unroll
      for (int c = 0; c < CMAX; ++c) {
        S[r][c].x += delta * kk[c].x;
        S[r][c].y += delta * kk[c].y;
        S[r][c].z += delta * kk[c].z;
        S[r][c].w += delta * kk[c].w;
        if (!REPLAY) acc += dot4(S[r][c], qq[c]);
      }
      oi[r] = acc;
    }
    if (!REPLAY) {
#pragma unroll
      for (int r = 0; r < RPW; ++r) oi[r] = warp_sum(oi[r]);
#pragma unroll
      for (int r = 0; r < RPW; ++r)
        if (lane == 0 && row0 + r < dv) a.o[vb + row0 + r] = oi[r];
    }
  }

  float4* Sw = reinterpret_cast<float4*>(a.state_pool + (int64_t{a.write_idx[b]} * H + h) * state);
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const int i = row0 + r;
    if (i >= dv) continue;
#pragma unroll
    for (int c = 0; c < CMAX; ++c) {
      const int j4 = lane + 32 * c;
      if (j4 < nc4) Sw[static_cast<int64_t>(i) * nc4 + j4] = S[r][c];
    }
  }
}

// Rows per warp: a row's arithmetic does not depend on it (its dk lanes, its shuffles), so the choice
// changes speed, not bits. Four rows share each token's k, g, q loads and interleave their warp sums;
// two give twice the CTAs, which small batches need to fill the SMs.
int rec_rows_per_warp(int B, int H, int dv) {
  const int64_t ctas4 = int64_t{B} * H * ((dv + 15) / 16);  // 4 warps x 4 rows per CTA
  return ctas4 >= 4 * int64_t{detail::device_sm_count()} ? 4 : 2;
}

template <int RPW, bool REPLAY>
cudaError_t launch_rec_rpw(const RecArgs& a, int B, CUstream_st* stream) {
  constexpr int warps = 4, rows_per_cta = warps * RPW;
  const dim3 grid(static_cast<unsigned>((a.dv + rows_per_cta - 1) / rows_per_cta), static_cast<unsigned>(a.H),
                  static_cast<unsigned>(B));
  const unsigned threads = static_cast<unsigned>(warps * 32);
  if (a.dk <= 128) return detail::launch(kda_rec_kernel<1, RPW, REPLAY>, grid, threads, 0, stream, a);
  return detail::launch(kda_rec_kernel<2, RPW, REPLAY>, grid, threads, 0, stream, a);
}

template <bool REPLAY>
int launch_rec(const RecArgs& a, int B, CUstream_st* stream) {
  if (rec_rows_per_warp(B, a.H, a.dv) == 4) return launch_rec_rpw<4, REPLAY>(a, B, stream);
  return launch_rec_rpw<2, REPLAY>(a, B, stream);
}

}  // namespace

int kda_recurrence(const float* q, const float* k, const bf16* v, const float* g, const float* beta, float* state_pool,
                   const int32_t* read_idx, const int32_t* write_idx, KdaKept kept, const int32_t* slots, float* o,
                   int B, int q_len, int max_q, int H, int dk, int dv, CUstream_st* stream) {
  if (B < 0 || q_len < 0 || q_len > max_q || H <= 0 || dv <= 0 || dk <= 0 || dk % 4 != 0 || dk > 256 || !aligned16(q) ||
      !aligned16(k) || !aligned16(g) || !aligned16(state_pool) || !aligned16(kept.k) || !aligned16(kept.g))
    return cudaErrorInvalidValue;
  if (kept.k != nullptr && (kept.g == nullptr || kept.v == nullptr || kept.beta == nullptr || slots == nullptr))
    return cudaErrorInvalidValue;
  if (B == 0 || q_len == 0) return cudaSuccess;
  const RecArgs a{.q = q, .k = k, .v = reinterpret_cast<const bf16raw*>(v), .g = g, .beta = beta, .o = o,
                  .state_pool = state_pool, .read_idx = read_idx, .write_idx = write_idx, .kept = kept,
                  .slots = slots, .accepted = nullptr, .q_len = q_len, .max_q = max_q, .H = H, .dk = dk, .dv = dv};
  return launch_rec<false>(a, B, stream);
}

int kda_replay(KdaKept kept, float* state_pool, const int32_t* read_idx, const int32_t* write_idx,
               const int32_t* slots, const int32_t* accepted, int B, int q_len, int max_q, int H, int dk, int dv,
               CUstream_st* stream) {
  if (B < 0 || q_len < 0 || q_len > max_q || H <= 0 || dv <= 0 || dk <= 0 || dk % 4 != 0 || dk > 256 ||
      !aligned16(state_pool) || !aligned16(kept.k) || !aligned16(kept.g))
    return cudaErrorInvalidValue;
  if (B == 0 || q_len <= 1) return cudaSuccess;  // n < q_len <= 1: nothing to replay
  if (kept.k == nullptr || kept.g == nullptr || kept.v == nullptr || kept.beta == nullptr || slots == nullptr ||
      accepted == nullptr)
    return cudaErrorInvalidValue;
  const RecArgs a{.q = nullptr, .k = nullptr, .v = nullptr, .g = nullptr, .beta = nullptr, .o = nullptr,
                  .state_pool = state_pool, .read_idx = read_idx, .write_idx = write_idx, .kept = kept,
                  .slots = slots, .accepted = accepted, .q_len = q_len, .max_q = max_q, .H = H, .dk = dk, .dv = dv};
  return launch_rec<true>(a, B, stream);
}

int kda_gated_norm(const float* o, const bf16* gate, int64_t gate_ld, const float* o_norm_w, float eps, bf16* out,
                   int64_t rows, int H, int dv, CUstream_st* stream) {
  if (rows < 0 || H <= 0 || dv <= 0 || gate_ld < static_cast<int64_t>(H) * dv) return cudaErrorInvalidValue;
  const int64_t pairs = rows * H;
  if (pairs == 0) return cudaSuccess;
  return detail::launch(kda_gated_norm_kernel, blocks_for(pairs, kNormWarps), kNormWarps * 32, 0, stream, o,
                        reinterpret_cast<const bf16raw*>(gate), gate_ld, o_norm_w, eps, reinterpret_cast<bf16raw*>(out),
                        pairs, H, dv);
}

}  // namespace k3::ops::cuda
