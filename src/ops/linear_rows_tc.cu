// The tensor-core row-tile path of linear (a few rows, one or several projections of the same x):
// y_j[r, o] = sum_i x[r, i] W_j[o, i] for j < n; x [rows, in] BF16, W_j [out_j, in] BF16, y_j [rows, out_j]
// BF16 (rounded once from the FP32 sum) or FP32; FP32 accumulation (mma.sync m16n8k16).
//
// A CTA of WARPS warps (4 or 8) owns 16 output features of one projection (the mma's A operand, W rows o0 ..
// o0 + 15) and a tile of 8 NT rows of x (NT = 1, 2 or 4 by the row count: NT n8 B operands sharing each A
// fragment; rows past `rows` are zeros, nothing read). Its warps split the input dimension in chunks of 32
// values, chunk c on warp c % WARPS. In a chunk, lane (g = lane / 4, t = lane % 4) loads 16 bytes of W row
// o0 + g, of W row o0 + g + 8 and of x rows r0 + 8 n + g, all at k = 32 c + 8 t .. + 7, straight into
// fragment registers: the mma sums over k in any order as long as A and B use the same one, so the lane's
// 8 contiguous values serve as its k slots {2t, 2t+1, 2t+8, 2t+9} of two k16 steps (values 0-3 in the
// first, 4-7 in the second) for both operands. A warp holds kTcUnroll chunks of W in registers; on a grid of
// at most kLinearRowsTcPipeCtasPerSm CTAs per SM (PIPE) it also has the next kTcUnroll in flight while it
// multiplies, which takes more registers, so fewer CTAs fit an SM: on larger grids the CTAs an SM holds keep
// enough loads in flight without it. No shared-memory staging and no conversions: per 16
// bytes of W a lane issues one load and one mma, where the CUDA-core rows kernel (linear.cu) converts and
// multiplies every value once per row, which at 8 rows bounds it by instruction issue; and x is read once
// per 16 features (the rows kernel: once per 4). More than 8 NT rows: row tiles, each reading W again
// (from L2 when its neighbours in the grid just did).
//
// A GLU member (w_up given) takes 8 features per CTA: A rows 0-7 are W rows o0 .. o0 + 7 and rows 8-15 W_up's
// same rows, so a lane's accumulators i and i + 2 are the gate and up sums of one (feature, row), and the
// epilogue writes situ_glu of the two, each rounded to BF16 first: per M row the mma's sum is the same
// whichever rows share the tile, so these are the bits of the two projections in a group then situ_glu.
//
// W streams through L1 without allocating (ld.global.nc.L1::no_allocate), so x (small, read by every CTA)
// stays in L1. The warps' FP32 partials meet in shared memory and are summed in warp order, one fixed
// order per output: the same bits on every run for a shape. The row tile is the fastest grid index (the
// CTAs that read the same W rows run together); projection j's CTAs follow projection j - 1's in one grid.
#include <atomic>
#include <type_traits>

#include "core/env.h"
#include "ops/cuda_bf16.cuh"
#include "ops/cuda_device.cuh"
#include "ops/cuda_mma.cuh"
#include "ops/linear.h"
#include "ops/linear_rows.cuh"
#include "ops/moe_device.cuh"

namespace k3::ops::cuda {
namespace {

using detail::aligned16;
using detail::kWarp;
using detail::mma_bf16_16816;
using rows_detail::GroupArgs;

constexpr int kTcWarps = 8;   // warps per CTA (the default of K3_LINEAR_TC_WARPS)
constexpr int kTcFeat = 16;   // output features per CTA (the mma's m16)
constexpr int kTcN = 8;       // rows of x per mma (its n8); a CTA has NT of them
constexpr int kTcChunk = 32;  // k values per warp step: 8 per lane, two k16 mma steps
constexpr int kTcUnroll = 4;  // chunks a warp has in flight

// 16 bytes of a stream read once (the weights): read-only, not kept in L1.
__device__ __forceinline__ uint4 ld_stream16(const bf16* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

template <int NT, int WARPS, bool PIPE>
__global__ void __launch_bounds__(WARPS * kWarp)
    linear_rows_tc_kernel(const bf16* __restrict__ x, int64_t x_ld, const __grid_constant__ GroupArgs g, int64_t rows,
                          int64_t in, int64_t row_tiles, bool add) {
  const int64_t b = blockIdx.x;
  const int j = rows_detail::group_member(g, b);
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  __shared__ float red[WARPS][NT][4][kWarp];

  const int64_t blk = b - g.begin[j], out = g.out[j];
  const bf16* w_up = g.w_up[j];
  const bool glu = w_up != nullptr;
  const int64_t r0 = (blk % row_tiles) * kTcN * NT, o0 = (blk / row_tiles) * (glu ? kTcFeat / 2 : kTcFeat);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, gq = lane / 4, t = lane % 4;
  // Features past `out` read the last valid row (their sums are not written).
  const bf16* wa = g.w[j] + min(o0 + gq, out - 1) * in + 8 * t;
  const bf16* wb = glu ? w_up + min(o0 + gq, out - 1) * in + 8 * t : g.w[j] + min(o0 + gq + 8, out - 1) * in + 8 * t;
  bool has_row[NT];
  const bf16* xr[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    has_row[n] = r0 + kTcN * n + gq < rows;
    xr[n] = x + (has_row[n] ? r0 + kTcN * n + gq : 0) * x_ld + 8 * t;
  }

  float c[NT][4] = {};
  const int64_t kmax = in - 8 * t;  // the lane's piece of chunk ch is valid when 32 ch < kmax (in % 8 == 0)
  // The weights of kTcUnroll chunks from chunk c0 on (zeros past `in`): with PIPE issued one stage ahead of
  // their mma, else at the start of their own stage.
  auto load_w = [&](int64_t c0, uint4(&pa)[kTcUnroll], uint4(&pb)[kTcUnroll]) {
#pragma unroll
    for (int u = 0; u < kTcUnroll; ++u) {
      const int64_t k = (c0 + u * WARPS) * kTcChunk;
      const bool valid = k < kmax;
      pa[u] = valid ? ld_stream16(wa + k) : make_uint4(0, 0, 0, 0);
      pb[u] = valid ? ld_stream16(wb + k) : make_uint4(0, 0, 0, 0);
    }
  };
  uint4 a[kTcUnroll], a8[kTcUnroll];
  if constexpr (PIPE) load_w(warp, a, a8);
  for (int64_t c0 = warp; c0 * kTcChunk < in; c0 += WARPS * kTcUnroll) {
    uint4 na[kTcUnroll], na8[kTcUnroll], bx[kTcUnroll][NT];
    if constexpr (PIPE)
      load_w(c0 + WARPS * kTcUnroll, na, na8);
    else
      load_w(c0, a, a8);
#pragma unroll
    for (int u = 0; u < kTcUnroll; ++u) {
      const int64_t k = (c0 + u * WARPS) * kTcChunk;
#pragma unroll
      for (int n = 0; n < NT; ++n)
        bx[u][n] = k < kmax && has_row[n] ? __ldg(reinterpret_cast<const uint4*>(xr[n] + k)) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kTcUnroll; ++u) {
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        mma_bf16_16816(c[n], a[u].x, a8[u].x, a[u].y, a8[u].y, bx[u][n].x, bx[u][n].y);
        mma_bf16_16816(c[n], a[u].z, a8[u].z, a[u].w, a8[u].w, bx[u][n].z, bx[u][n].w);
      }
      if constexpr (PIPE) {
        a[u] = na[u];
        a8[u] = na8[u];
      }
    }
  }

#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) red[warp][n][i][lane] = c[n][i];
  }
  __syncthreads();
  for (int e = threadIdx.x; e < NT * 4 * kWarp; e += WARPS * kWarp) {
    // Accumulator i of lane l in n-tile n: feature l / 4 (+ 8 for i >= 2), row 8 n + 2 (l % 4) + (i & 1).
    const int n = e / (4 * kWarp), i = e / kWarp % 4, l = e % kWarp;
    if (glu && i >= 2) continue;  // a GLU pair's up sum is taken with its gate sum (i - 2)
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) s += red[w][n][i][l];
    const int64_t o = o0 + l / 4 + (!glu && i >= 2 ? 8 : 0), r = r0 + kTcN * n + 2 * (l % 4) + (i & 1);
    if (o < out && r < rows) {
      if (glu) {
        float u = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) u += red[w][n][i + 2][l];
        const float a = detail::bf16_to_float(detail::float_to_bf16(s)),
                    bu = detail::bf16_to_float(detail::float_to_bf16(u));
        static_cast<bf16*>(g.y[j])[r * out + o] =
            detail::float_to_bf16(detail::situ_dev(a, bu, SituParams{g.glu_beta[j], g.glu_linear_beta[j]}));
      } else if (g.y_f32[j]) {
        static_cast<float*>(g.y[j])[r * out + o] = s;
      } else {
        bf16* y = static_cast<bf16*>(g.y[j]) + r * out + o;
        if (add) s += detail::bf16_to_float(*y);  // linear_add: the sum and y, rounded once
        *y = detail::float_to_bf16(s);
      }
    }
  }
}

}  // namespace

int64_t linear_rows_tc_max_rows() {
  static const int64_t max_rows = env_int("K3_LINEAR_TC_ROWS_MAX", 0, kLinearSkinnyMaxRows, kLinearRowsTcMaxRows);
  return max_rows;
}

bool linear_rows_tc_pipelined(int64_t ctas, int sms) { return ctas <= kLinearRowsTcPipeCtasPerSm * int64_t{sms}; }

namespace {
// The tensor-core group's row counts: past the rows kernel's, kLinearRowsTcMinRows .. linear_rows_tc_max_rows().
bool tc_rows(int64_t rows) {
  return rows >= kLinearRowsTcMinRows && rows > linear_rows_kernel_max_rows() && rows <= linear_rows_tc_max_rows();
}

std::atomic<int> g_glu_tc{-1};  // linear_glu_tc_force's value, -1: the environment's
}  // namespace

bool linear_rows_tc_takes(int64_t rows, const bf16* x, int64_t x_ld, int64_t in, const LinearOut* outs, int n) {
  return n >= 2 && tc_rows(rows) && linear_rows_tc_fits(x, x_ld, in, outs, n);
}

void linear_glu_tc_force(int on) { g_glu_tc.store(on < 0 ? -1 : on > 0 ? 1 : 0, std::memory_order_relaxed); }

bool linear_glu_tc_takes(int64_t rows) {
  return env_knob(g_glu_tc, "K3_LINEAR_GLU_TC", 0, 1, 1) == 1 && tc_rows(rows);
}

bool linear_rows_tc_fits(const bf16* x, int64_t x_ld, int64_t in, const LinearOut* outs, int n) {
  if (n < 1 || n > kLinearGroupMax || x == nullptr || in <= 0 || in % 8 != 0 || x_ld < in || x_ld % 8 != 0 ||
      !aligned16(x) || outs == nullptr)
    return false;
  for (int j = 0; j < n; ++j) {
    if (outs[j].w == nullptr || outs[j].y == nullptr || outs[j].out <= 0 || !aligned16(outs[j].w)) return false;
    if (outs[j].w_up != nullptr && (outs[j].y_f32 || !aligned16(outs[j].w_up))) return false;  // GLU: BF16 y
  }
  return true;
}

int linear_rows_tc(const Context& ctx, const bf16* x, int64_t x_ld, int64_t rows, int64_t in, const LinearOut* outs,
                   int n, bool add) {
  if (rows < 0 || in <= 0 || n < 0 || n > kLinearGroupMax || (n > 0 && outs == nullptr)) return cudaErrorInvalidValue;
  for (int j = 0; j < n; ++j)
    if (add && (outs[j].y_f32 || outs[j].w_up != nullptr)) return cudaErrorInvalidValue;  // the add: BF16 y, no GLU
  if (rows == 0 || n == 0) return cudaSuccess;
  if (!linear_rows_tc_fits(x, x_ld, in, outs, n)) return cudaErrorNotSupported;
  // NT n8 tiles per CTA: the fewest that cover the rows, at most 4.
  const int nt = rows <= kTcN ? 1 : rows <= 2 * kTcN ? 2 : 4;
  GroupArgs g = rows_detail::group_args(outs, n);
  const int64_t row_tiles = (rows + kTcN * nt - 1) / (kTcN * nt);
  if (!rows_detail::set_begin(g, [&](int j) {
        const int64_t feat = g.w_up[j] != nullptr ? kTcFeat / 2 : kTcFeat;  // GLU: 8 (gate, up) pairs per CTA
        return row_tiles * ((g.out[j] + feat - 1) / feat);
      }))
    return cudaErrorInvalidConfiguration;
  const auto blocks = static_cast<unsigned>(g.begin[n]);
  auto s = reinterpret_cast<cudaStream_t>(ctx.stream);
  // Warps per CTA: kTcWarps, or K3_LINEAR_TC_WARPS=4|8 in the environment (read once).
  static const int warps = static_cast<int>(env_int("K3_LINEAR_TC_WARPS", 4, 8, kTcWarps, 4));
  // The loads one stage ahead (more registers) on grids too small to fill the GPU without them.
  const bool pipe = linear_rows_tc_pipelined(blocks, ctx.sm_count > 0 ? ctx.sm_count : detail::device_sm_count());
  auto go = [&](auto w, auto p) {
    constexpr int W = decltype(w)::value;
    constexpr bool P = decltype(p)::value;
    auto launch = [&](auto kernel) {
      return detail::launch(kernel, blocks, W * kWarp, 0, s, x, x_ld, g, rows, in, row_tiles, add);
    };
    return nt == 1 ? launch(linear_rows_tc_kernel<1, W, P>) : nt == 2 ? launch(linear_rows_tc_kernel<2, W, P>)
                                                                       : launch(linear_rows_tc_kernel<4, W, P>);
  };
  auto by_warps = [&](auto p) {
    return warps == 4 ? go(std::integral_constant<int, 4>{}, p) : go(std::integral_constant<int, 8>{}, p);
  };
  return pipe ? by_warps(std::true_type{}) : by_warps(std::false_type{});
}

}  // namespace k3::ops::cuda
