// moe_experts on the GPU (math in moe.h): the routed experts of one rank, grouped by expert.
//
// Three steps on the stream (no host synchronization):
//   plan:    one CTA groups the (row, j) pairs whose expert is local by expert (counts, scans, the
//            slots of the experts in use, their token tiles, the pair list) and zeroes the work counters;
//   experts: the warp-specialized grouped GEMMs of moe_experts_ws.cu, h[pair] = bf16(situ(bf16(W1 z),
//            bf16(W3 z))) then o[pair] = bf16(W2 h[pair]) for every planned pair (one persistent launch);
//   combine: y[r, i] = bf16(sum_j w[r, j] o[(r, j), i]) over the local j in order, unfused FP32 as the CPU.
#include <algorithm>

#include "ops/cuda_bf16.cuh"
#include "ops/cuda_device.cuh"
#include "ops/moe.h"
#include "ops/moe_experts.cuh"

namespace k3::ops::cuda {
namespace {

using detail::aligned16;
using detail::kWarp;
using detail::MoePlan;

static_assert(detail::kMoePlanHeader == 4 && detail::kMoePlanArrays == 6,
              "moe_experts_scratch_bytes (moe.h) sizes the plan as [4 + 6 pairs]");

// Exclusive block scan of kScanN values per thread (each its own scan); totals returned too. Every thread
// calls it; ends with a barrier.
constexpr int kScanN = 3;
__device__ void block_exclusive_scan(int (&v)[kScanN], int (&total)[kScanN], int (*wt)[kScanN]) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  int in[kScanN];
#pragma unroll
  for (int n = 0; n < kScanN; ++n) in[n] = v[n];
#pragma unroll
  for (int o = 1; o < kWarp; o *= 2) {
#pragma unroll
    for (int n = 0; n < kScanN; ++n) {
      const int t = __shfl_up_sync(0xffffffffu, in[n], o);
      if (lane >= o) in[n] += t;
    }
  }
  if (lane == kWarp - 1) {
#pragma unroll
    for (int n = 0; n < kScanN; ++n) wt[warp][n] = in[n];
  }
  __syncthreads();
  if (warp == 0) {
    int x[kScanN];
#pragma unroll
    for (int n = 0; n < kScanN; ++n) x[n] = lane < warps ? wt[lane][n] : 0;
#pragma unroll
    for (int o = 1; o < kWarp; o *= 2) {
#pragma unroll
      for (int n = 0; n < kScanN; ++n) {
        const int t = __shfl_up_sync(0xffffffffu, x[n], o);
        if (lane >= o) x[n] += t;
      }
    }
    if (lane < warps) {
#pragma unroll
      for (int n = 0; n < kScanN; ++n) wt[lane][n] = x[n];  // inclusive over warps
    }
  }
  __syncthreads();
#pragma unroll
  for (int n = 0; n < kScanN; ++n) {
    v[n] = (warp > 0 ? wt[warp - 1][n] : 0) + in[n] - v[n];
    total[n] = wt[warps - 1][n];
  }
  __syncthreads();
}

constexpr int kPlanThreads = 1024;

__global__ void __launch_bounds__(kPlanThreads)
    moe_plan_kernel(const int32_t* __restrict__ idx, int64_t pairs, int expert_begin, int expert_count, int cols,
                    MoePlan plan) {
  extern __shared__ int plan_smem[];  // cnt [expert_count], cursor [expert_count]
  __shared__ int wt[kPlanThreads / kWarp][kScanN];
  int* cnt = plan_smem;
  int* cursor = plan_smem + expert_count;
  for (int e = threadIdx.x; e < expert_count; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  for (int64_t p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int64_t e = static_cast<int64_t>(idx[p]) - expert_begin;
    if (e >= 0 && e < expert_count) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  // Each thread scans a contiguous range of experts: pair offsets and slots of the experts in use.
  const int per = (expert_count + blockDim.x - 1) / blockDim.x;
  const int lo = min(expert_count, static_cast<int>(threadIdx.x) * per), hi = min(expert_count, lo + per);
  // Scanned: pair offsets (a), slots (b) and passes (c) of the experts before this thread's range.
  int v[kScanN] = {0, 0, 0};
  for (int e = lo; e < hi; ++e) v[0] += cnt[e], v[1] += cnt[e] > 0, v[2] += (cnt[e] + cols - 1) / cols;
  int total[kScanN];
  block_exclusive_scan(v, total, wt);
  int a = v[0], b = v[1], c = v[2];
  for (int e = lo; e < hi; ++e) {
    if (cnt[e] == 0) continue;
    plan.slot_expert[b] = e;
    plan.slot_begin[b] = a;
    plan.slot_count[b] = cnt[e];
    plan.slot_pass_begin[b] = c;
    plan.slot_done[b] = 0;
    cursor[e] = a;
    a += cnt[e];
    c += (cnt[e] + cols - 1) / cols;
    ++b;
  }
  if (threadIdx.x == 0) {
    *plan.n_active = total[1];
    *plan.n_passes = total[2];
    *plan.next_a = 0;
    *plan.next_b = 0;
  }
  __syncthreads();
  // Pair order inside an expert's group follows the atomics; every pair is computed alone, so results do not.
  for (int64_t p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int64_t e = static_cast<int64_t>(idx[p]) - expert_begin;
    if (e >= 0 && e < expert_count) plan.pair_list[atomicAdd(&cursor[e], 1)] = static_cast<int>(p);
  }
}

// y[r, i] = bf16(sum over local j, in order, of w[r, j] * o[(r, j), i]); 0 for a row with none. A thread
// per 8 consecutive i (L % 32 == 0; o and y 16-byte aligned): one 16-byte load per (r, j) and store per r.
__global__ void moe_combine_kernel(const bf16* __restrict__ o, const int32_t* __restrict__ idx,
                                   const float* __restrict__ w, int expert_begin, int expert_count, bf16* __restrict__ y,
                                   int64_t rows, int k, int64_t L) {
  const int64_t L8 = L / 8, total = rows * L8;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = t / L8, i = (t % L8) * 8;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int j = 0; j < k; ++j) {
      const int64_t pair = r * k + j;
      const int64_t e = static_cast<int64_t>(idx[pair]) - expert_begin;
      if (e < 0 || e >= expert_count) continue;
      const float wj = w[pair];
      float v[8];
      detail::load_bf16<8>(o + pair * L + i, v);
#pragma unroll
      for (int u = 0; u < 8; ++u) acc[u] = __fadd_rn(acc[u], __fmul_rn(wj, v[u]));
    }
    detail::store_bf16<8>(y + r * L + i, acc);
  }
}

unsigned grid_for(int64_t threads_needed, int threads_per_block, int cap_blocks) {
  const int64_t b = (threads_needed + threads_per_block - 1) / threads_per_block;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(b, cap_blocks)));
}

}  // namespace

int moe_experts(const Context& ctx, const bf16* z, const int32_t* idx, const float* w, const Mxfp4ExpertTable& experts,
                int expert_begin, int expert_count, bf16* y, void* scratch, int64_t rows, int k, int64_t L, int64_t I,
                SituParams p) {
  if (rows < 0 || k <= 0 || L <= 0 || I <= 0 || L % 32 != 0 || I % 32 != 0) return cudaErrorInvalidValue;
  if (expert_count < 0 || expert_count > kMoeMaxLocalExperts) return cudaErrorInvalidValue;
  if (rows * k > 0x7fffffff || L > 0x7fffffff || I > 0x7fffffff) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (!aligned16(z) || !aligned16(y) || !aligned16(scratch)) return cudaErrorMisalignedAddress;
  const cudaStream_t s = ctx.stream;
  const int64_t pairs = rows * k;
  const size_t meta_bytes =
      (static_cast<size_t>(4 * (detail::kMoePlanHeader + detail::kMoePlanArrays * pairs)) + 255) / 256 * 256;
  const MoePlan plan = detail::moe_plan_at(scratch, pairs);
  bf16* h = reinterpret_cast<bf16*>(static_cast<char*>(scratch) + meta_bytes);
  bf16* o = h + (pairs * I + 127) / 128 * 128;  // the 256-byte aligned offset of moe_experts_scratch_bytes

  const int sms = ctx.sm_count > 0 ? ctx.sm_count : detail::device_sm_count();
  const int64_t max_slots = std::min<int64_t>(expert_count, pairs);
  const int T = detail::moe_token_tile(pairs, max_slots);
  const size_t plan_smem = 2 * static_cast<size_t>(expert_count) * sizeof(int);
  moe_plan_kernel<<<1, kPlanThreads, plan_smem, s>>>(idx, pairs, expert_begin, expert_count, T, plan);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (max_slots > 0) {
    if (const int e = detail::moe_expert_gemms(plan, experts, z, h, o, k, L, I, T, p, sms, s); e != 0) return e;
  }
  moe_combine_kernel<<<grid_for(rows * L / 8, 256, 8 * sms), 256, 0, s>>>(o, idx, w, expert_begin, expert_count, y,
                                                                         rows, k, L);
  return cudaGetLastError();
}

}  // namespace k3::ops::cuda
