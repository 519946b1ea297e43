// CUDA SiTU-GLU, MXFP4 linears, the routed expert MLP and the BF16 MLP (math in moe.h); the grouped
// routed experts are in moe_experts.cu.
//
// MXFP4 dot products (mxfp4_warp_dots): a warp owns NW weight rows and up to RT activation rows. The
// K dimension goes to the lanes in chunks of 16 values (8 packed bytes, half a scale group): each
// lane dequantizes a chunk exactly in registers (E2M1 bits placed into an FP32 and scaled by 2^126,
// which is exact), forms the chunk's FP32 dot with each activation row and adds it times the group's
// power-of-two scale (exact, so this equals summing the dequantized products in another order).
// Warp shuffles reduce the lanes.
#include <algorithm>

#include "ops/cuda_bf16.cuh"
#include "ops/cuda_device.cuh"
#include "ops/linear.h"
#include "ops/moe.h"
#include "ops/moe_device.cuh"

namespace k3::ops::cuda {
namespace {

using detail::aligned16;
using detail::kWarp;

constexpr int kMoeThreads = 256;
constexpr int kMoeWarps = kMoeThreads / kWarp;
constexpr int kNW = 2;       // weight rows per warp
constexpr int kChunk = 16;   // values per lane chunk (8 packed bytes)

// E8M0 scale byte -> 2^(s - 127) (s = 0: the subnormal 2^-127; s = 255: +inf, as ldexp on the CPU).
__device__ __forceinline__ float e8m0_dev(uint32_t s) {
  return __uint_as_float(s == 0 ? 0x00400000u : (s << 23));
}

// Nibble J of q as E2M1, exact: magnitude bits (e e m) go to FP32 bits 24..22, the sign to bit 31; as an
// FP32 that is the E2M1 value times 2^-126 (code 1, the E2M1 subnormal 0.5, becomes the FP32 subnormal
// 2^-127), so one exact multiply by 2^126 finishes it.
template <int J>
__device__ __forceinline__ float e2m1_nibble(uint32_t q) {
  constexpr int sm = 22 - 4 * J, ss = 28 - 4 * J;
  const uint32_t m = sm >= 0 ? (q << (sm >= 0 ? sm : 0)) : (q >> (sm < 0 ? -sm : 0));
  const uint32_t s = ss >= 0 ? (q << (ss >= 0 ? ss : 0)) : (q >> (ss < 0 ? -ss : 0));
  return __uint_as_float((m & 0x01c00000u) | (s & 0x80000000u)) * 0x1p126f;
}

__device__ __forceinline__ void dequant8(uint32_t q, float* f) {
  f[0] = e2m1_nibble<0>(q);
  f[1] = e2m1_nibble<1>(q);
  f[2] = e2m1_nibble<2>(q);
  f[3] = e2m1_nibble<3>(q);
  f[4] = e2m1_nibble<4>(q);
  f[5] = e2m1_nibble<5>(q);
  f[6] = e2m1_nibble<6>(q);
  f[7] = e2m1_nibble<7>(q);
}

// 8 packed bytes at p (low byte first); aligned: p is 8-byte aligned (one load), else bytewise.
__device__ __forceinline__ uint2 load_packed8(const uint8_t* p, bool aligned) {
  if (aligned) return __ldg(reinterpret_cast<const uint2*>(p));
  uint32_t lo = 0, hi = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    lo |= static_cast<uint32_t>(__ldg(p + i)) << (8 * i);
    hi |= static_cast<uint32_t>(__ldg(p + 4 + i)) << (8 * i);
  }
  return make_uint2(lo, hi);
}

// Per-lane partial dot products of NW MXFP4 weight rows (wp packed, ws scales) with the first nr (<= RT)
// of RT activation rows x[r] (16-byte aligned, K values each). acc is added to.
template <int NW, int RT>
__device__ __forceinline__ void mxfp4_warp_dots(const uint8_t* const (&wp)[NW], const uint8_t* const (&ws)[NW],
                                                const bf16* const (&x)[RT], int nr, int64_t K, int lane,
                                                float (&acc)[NW][RT]) {
  bool aligned = true;
#pragma unroll
  for (int n = 0; n < NW; ++n) aligned = aligned && (reinterpret_cast<uintptr_t>(wp[n]) & 7u) == 0;
  const int64_t chunks = K / kChunk;
#pragma unroll 2
  for (int64_t c = lane; c < chunks; c += kWarp) {
    float wv[NW][kChunk];
    float sc[NW];
#pragma unroll
    for (int n = 0; n < NW; ++n) {
      const uint2 q = load_packed8(wp[n] + c * (kChunk / 2), aligned);
      dequant8(q.x, wv[n]);
      dequant8(q.y, wv[n] + 8);
      sc[n] = e8m0_dev(__ldg(ws[n] + c / 2));  // 2 chunks per 32-value group
    }
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      if (r < nr) {
        const uint4* xp = reinterpret_cast<const uint4*>(x[r] + c * kChunk);
        float x0[8], x1[8];
        detail::unpack_bf16x8(__ldg(xp), x0);
        detail::unpack_bf16x8(__ldg(xp + 1), x1);
#pragma unroll
        for (int n = 0; n < NW; ++n) {
          float g = 0.f;
#pragma unroll
          for (int i = 0; i < 8; ++i) g = fmaf(x0[i], wv[n][i], g);
#pragma unroll
          for (int i = 0; i < 8; ++i) g = fmaf(x1[i], wv[n][8 + i], g);
          acc[n][r] = fmaf(g, sc[n], acc[n][r]);  // g * 2^e is exact
        }
      }
    }
  }
}

template <int NW, int RT>
__device__ __forceinline__ void warp_reduce_all(float (&acc)[NW][RT]) {
#pragma unroll
  for (int n = 0; n < NW; ++n) {
#pragma unroll
    for (int r = 0; r < RT; ++r) acc[n][r] = detail::warp_sum(acc[n][r]);
  }
}

// ---------------------------------------------------------------------------------------------
// situ_glu, mxfp4_linear

__global__ void situ_kernel(const bf16* a, const bf16* b, bf16* out, int64_t n, SituParams p) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = detail::float_to_bf16(detail::situ_dev(detail::bf16_to_float(a[i]), detail::bf16_to_float(b[i]), p));
  }
}

// Warp item = (pair of output features, tile of RT rows), the row tile fastest.
template <int RT>
__global__ void __launch_bounds__(kMoeThreads)
    mxfp4_linear_kernel(const bf16* __restrict__ x, const uint8_t* __restrict__ packed,
                        const uint8_t* __restrict__ scale, bf16* __restrict__ y, int64_t rows, int64_t K, int64_t N,
                        int64_t row_tiles, int64_t items) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  const int lane = threadIdx.x % kWarp;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kMoeWarps + threadIdx.x / kWarp;
  if (item >= items) return;
  const int64_t r0 = (item % row_tiles) * RT, n0 = (item / row_tiles) * kNW;
  const int nr = static_cast<int>(min(static_cast<int64_t>(RT), rows - r0));
  const int nn = static_cast<int>(min(static_cast<int64_t>(kNW), N - n0));
  const uint8_t* wp[kNW];
  const uint8_t* ws[kNW];
#pragma unroll
  for (int n = 0; n < kNW; ++n) {
    const int64_t row = n0 + min(n, nn - 1);
    wp[n] = packed + row * (K / 2);
    ws[n] = scale + row * (K / 32);
  }
  const bf16* xr[RT];
#pragma unroll
  for (int r = 0; r < RT; ++r) xr[r] = x + (r0 + min(r, nr - 1)) * K;
  float acc[kNW][RT] = {};
  mxfp4_warp_dots<kNW, RT>(wp, ws, xr, nr, K, lane, acc);
  warp_reduce_all(acc);
  if (lane == 0) {
#pragma unroll
    for (int n = 0; n < kNW; ++n) {
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        if (n < nn && r < nr) y[(r0 + r) * N + n0 + n] = detail::float_to_bf16(acc[n][r]);
      }
    }
  }
}

template <int RT>
int launch_mxfp4_linear(const bf16* x, const uint8_t* packed, const uint8_t* scale, bf16* y, int64_t rows, int64_t K,
                        int64_t N, cudaStream_t s) {
  const int64_t row_tiles = (rows + RT - 1) / RT;
  const int64_t items = row_tiles * ((N + kNW - 1) / kNW);
  const int64_t blocks = (items + kMoeWarps - 1) / kMoeWarps;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  return detail::launch(mxfp4_linear_kernel<RT>, static_cast<unsigned>(blocks), kMoeThreads, 0, s, x, packed, scale, y,
                        rows, K, N, row_tiles, items);
}

unsigned grid_for(int64_t threads_needed, int threads_per_block, int cap_blocks) {
  const int64_t b = (threads_needed + threads_per_block - 1) / threads_per_block;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(b, cap_blocks)));
}

}  // namespace

int situ_glu(const bf16* a, const bf16* b, bf16* out, int64_t n, SituParams p, CUstream_st* stream) {
  if (n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  return detail::launch(situ_kernel, grid_for(n, 256, 65535), 256, 0, stream, a, b, out, n, p);
}

int mxfp4_linear(const bf16* x, const uint8_t* packed, const uint8_t* scale, bf16* y, int64_t rows, int64_t K,
                 int64_t N, CUstream_st* stream) {
  if (rows < 0 || K <= 0 || K % 32 != 0 || N <= 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (!aligned16(x)) return cudaErrorMisalignedAddress;
  if (rows <= 1) return launch_mxfp4_linear<1>(x, packed, scale, y, rows, K, N, stream);
  if (rows <= 2) return launch_mxfp4_linear<2>(x, packed, scale, y, rows, K, N, stream);
  return launch_mxfp4_linear<4>(x, packed, scale, y, rows, K, N, stream);
}

int expert_mlp(const bf16* z, Mxfp4Matrix w1, Mxfp4Matrix w3, Mxfp4Matrix w2, bf16* out, int64_t rows, int64_t D,
               int64_t I, SituParams p, bf16* scratch, CUstream_st* stream) {
  if (rows < 0 || D <= 0 || I <= 0 || D % 32 != 0 || I % 32 != 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (!aligned16(scratch)) return cudaErrorMisalignedAddress;
  bf16* a = scratch;
  bf16* b = scratch + rows * I;  // 16-byte aligned: I % 32 == 0
  int err = mxfp4_linear(z, w1.packed, w1.scale, a, rows, D, I, stream);
  if (err == 0) err = mxfp4_linear(z, w3.packed, w3.scale, b, rows, D, I, stream);
  if (err == 0) err = situ_glu(a, b, a, rows * I, p, stream);
  if (err == 0) err = mxfp4_linear(a, w2.packed, w2.scale, out, rows, I, D, stream);
  return err;
}

int linear_glu(const Context& ctx, const bf16* x, const bf16* w_gate, const bf16* w_up, bf16* h, int64_t rows,
               int64_t D, int64_t I, SituParams p, bf16* scratch, bool fused) {
  if (rows < 0 || D <= 0 || I <= 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (x == nullptr || w_gate == nullptr || w_up == nullptr || h == nullptr) return cudaErrorInvalidValue;
  const LinearOut glu = glu_member(w_gate, w_up, h, I, p);
  if (fused && rows <= linear_group_glu_max_rows()) {
    // The rows kernel's group with the GLU member alone: the group's bits, the SiTU in its epilogue.
    const int e = linear_group_via(ctx, LinearGroupPath::Grouped, x, rows, D, &glu, 1);
    if (e != cudaErrorNotSupported) return e;
  }
  if (fused && linear_glu_tc_takes(rows)) {
    // The tensor-core kernel's GLU member: the group's bits and the SiTU in its epilogue, one launch.
    const int e = linear_rows_tc(ctx, x, D, rows, D, &glu, 1);
    if (e != cudaErrorNotSupported) return e;
  }
  if (scratch == nullptr) return cudaErrorInvalidValue;
  bf16* a = scratch;
  bf16* b = scratch + rows * I;
  const LinearOut gate_up[2] = {{w_gate, a, I}, {w_up, b, I}};
  int err = linear_group(ctx, x, rows, D, gate_up, 2);
  if (err == 0) err = situ_glu(a, b, h, rows * I, p, ctx.stream);
  return err;
}

int mlp(const Context& ctx, const bf16* x, const bf16* w_gate, const bf16* w_up, const bf16* w_down, bf16* out,
        int64_t rows, int64_t D, int64_t I, SituParams p, bf16* scratch) {
  if (rows < 0 || D <= 0 || I <= 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  int err = linear_glu(ctx, x, w_gate, w_up, scratch, rows, D, I, p, scratch);
  if (err == 0) err = linear(ctx, scratch, w_down, out, false, rows, I, D);
  return err;
}

}  // namespace k3::ops::cuda
