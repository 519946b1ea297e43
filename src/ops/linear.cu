// CUDA linear: y[r, o] = sum_i x[r, i] * W[o, i]; x [rows, in] BF16, W [out, in] BF16, y [rows, out]
// BF16 (rounded once from the FP32 sum) or FP32; FP32 accumulation. linear_via picks the path:
//
// Up to linear_rows_kernel_max_rows() rows (linear.h), and on LinearPath::Rows: linear_rows_kernel. A CTA of 128
// threads owns 4 output features and a tile of RT rows (RT = 1, 2, 4 or 8 by the row count). Its threads split the
// input dimension in 16-byte chunks (8 bf16; element-wise when in % 8 != 0 or a pointer is unaligned), load each of
// the 4 weight rows' chunk once and apply it to the RT activation rows (read through the read-only cache: x is small
// and shared by every CTA), accumulate in FP32, then reduce with warp shuffles and one shared-memory step. The row
// tile is the fastest grid index, so the CTAs that read the same weight rows run together and W comes from HBM about
// once. It also takes any row count on LinearPath::Kernel when the skinny kernel does not fit (in % 8 != 0, unaligned
// x or w).
//
// linear_group: linear_rows_group_kernel runs the tiles of several projections that share x in one grid
// (projection j's CTAs after projection j - 1's), each tile the code of linear_rows_kernel, so every
// output is bitwise the separate kernel's; used where linear_group_takes (linear.h: up to 2 rows, or 4 on
// groups up to MLA's size), separate linear calls otherwise.
//
// 2..64 rows (kLinearSkinnyMinRows..kLinearSkinnyMaxRows, in % 8 == 0, x and w 16-byte aligned) on
// LinearPath::Kernel, and on Auto when kLinearAutoSkinny: linear_skinny (linear_skinny.cu), tensor cores
// with W as the A operand, 128 features x a K range per CTA, split K with a fixed-order sum of FP32
// partials in ctx.workspace.
//
// More rows (and 2..64 rows that the skinny kernel does not take): cuBLASLt in column-major terms,
// y^T [out, rows] = (W^T [in, out])^T x^T [in, rows], BF16 A/B, FP32 compute and scale, BF16 or FP32
// C = D, split-K reductions (if any) in FP32; the hand-written kernels if it has no algorithm.
//
// linear_add: y = bf16(x W^T + y) on the same paths (not the skinny kernel): the rows kernel reads y in its
// epilogue, cuBLASLt runs with beta = 1 and C = D = y.
//
// linear_ld: the same with x's rows x_ld elements apart (a slice of a wider matrix read in place): the
// rows kernel steps x_ld per row (16-byte chunks when x_ld % 8 == 0 too), cuBLASLt takes ldx = x_ld,
// the skinny kernel is not taken.
#include <cublasLt.h>

#include <algorithm>
#include <atomic>
#include <utility>

#include "core/env.h"
#include "ops/cuda_bf16.cuh"
#include "ops/cuda_device.cuh"
#include "ops/linear.h"
#include "ops/linear_rows.cuh"
#include "ops/moe_device.cuh"

namespace k3::ops::cuda {
namespace {

using detail::aligned16;
using detail::kWarp;

using rows_detail::GroupArgs;
using rows_detail::kLinOut;
using rows_detail::kLinThreads;
using rows_detail::rows_vec;

// One CTA's tile of linear_rows_kernel: block b of the projection's grid (row tile b % row_tiles, features
// 4 (b / row_tiles) ..). The grouped kernel runs the same code per projection, so its outputs are bitwise
// the separate kernel's.
template <int RT, int VEC>
__device__ __forceinline__ void rows_tile(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                          void* __restrict__ y, bool y_f32, bool add, int64_t rows, int64_t in,
                                          int64_t x_ld, int64_t out, int64_t row_tiles, int64_t block,
                                          float (&red)[kLinThreads / kWarp][kLinOut * RT], bool preload) {
  const int64_t rt = block % row_tiles, ot = block / row_tiles;
  const int64_t r0 = rt * RT, o0 = ot * kLinOut;
  const int nr = static_cast<int>(min(static_cast<int64_t>(RT), rows - r0));
  const int no = static_cast<int>(min(static_cast<int64_t>(kLinOut), out - o0));

  // Features past `out` read the last valid row (their results are not written).
  const bf16* wrow[kLinOut];
#pragma unroll
  for (int o = 0; o < kLinOut; ++o) wrow[o] = w + (o0 + min(o, no - 1)) * in;
  rows_detail::tile_sums<RT, VEC>(x, wrow, r0, nr, in, x_ld, red, preload);

  const int t = threadIdx.x;
  if (t < kLinOut * RT) {
    const int o = t / RT, r = t % RT;
    if (o < no && r < nr) {
      float s = rows_detail::red_sum<RT>(red, t);
      const int64_t at = (r0 + r) * out + o0 + o;
      if (y_f32) {
        static_cast<float*>(y)[at] = s;
      } else {
        bf16* yb = static_cast<bf16*>(y);
        if (add) s += detail::bf16_to_float(yb[at]);  // linear_add: the sum and y, rounded once
        yb[at] = detail::float_to_bf16(s);
      }
    }
  }
}

// One CTA's tile of a GLU member (LinearOut::w_up) in linear_rows_group_kernel: block b of the member's grid
// (row tile b % row_tiles, features f = 2 (b / row_tiles), f + 1), its four weight rows gate f, gate f + 1,
// up f, up f + 1 (the last valid one past out) accumulated as rows_tile accumulates any four, so each sum
// has the bits of the gate or up projection as a plain member; then h = situ_glu(bf16(gate), bf16(up)).
template <int RT, int VEC>
__device__ __forceinline__ void glu_tile(const bf16* __restrict__ x, const bf16* __restrict__ wg,
                                         const bf16* __restrict__ wu, bf16* __restrict__ h, int64_t rows, int64_t in,
                                         int64_t out, int64_t row_tiles, int64_t block, SituParams p,
                                         float (&red)[kLinThreads / kWarp][kLinOut * RT], bool preload) {
  const int64_t r0 = (block % row_tiles) * RT, f = (block / row_tiles) * 2;
  const int nr = static_cast<int>(min(static_cast<int64_t>(RT), rows - r0));
  const int nf = static_cast<int>(min(int64_t{2}, out - f));
  const bf16* const wrow[kLinOut] = {wg + f * in, wg + (f + nf - 1) * in, wu + f * in, wu + (f + nf - 1) * in};
  rows_detail::tile_sums<RT, VEC>(x, wrow, r0, nr, in, in, red, preload);
  const int t = threadIdx.x;
  if (t < 2 * RT) {
    const int o = t / RT, r = t % RT;
    if (o < nf && r < nr) {
      const float a = detail::bf16_to_float(detail::float_to_bf16(rows_detail::red_sum<RT>(red, o * RT + r)));
      const float b = detail::bf16_to_float(detail::float_to_bf16(rows_detail::red_sum<RT>(red, (o + 2) * RT + r)));
      h[(r0 + r) * out + f + o] = detail::float_to_bf16(detail::situ_dev(a, b, p));
    }
  }
}

template <int RT, int VEC>
__global__ void __launch_bounds__(kLinThreads)
    linear_rows_kernel(const bf16* __restrict__ x, const bf16* __restrict__ w, void* __restrict__ y, bool y_f32,
                       bool add, int64_t rows, int64_t in, int64_t x_ld, int64_t out, int64_t row_tiles,
                       bool preload) {
  if (!preload) {  // else tile_sums waits once its first weight loads are issued
    detail::pdl_wait();
    detail::pdl_launch_dependents();
  }
  __shared__ float red[kLinThreads / kWarp][kLinOut * RT];
  rows_tile<RT, VEC>(x, w, y, y_f32, add, rows, in, x_ld, out, row_tiles, blockIdx.x, red, preload);
}

template <int RT, int VEC>
__global__ void __launch_bounds__(kLinThreads)
    linear_rows_group_kernel(const bf16* __restrict__ x, const __grid_constant__ GroupArgs g, int64_t rows,
                             int64_t in, int64_t row_tiles, bool preload) {
  const int64_t b = blockIdx.x;
  const int j = rows_detail::group_member(g, b);
  if (!preload) {  // else tile_sums waits once its first weight loads are issued
    detail::pdl_wait();
    detail::pdl_launch_dependents();
  }
  __shared__ float red[kLinThreads / kWarp][kLinOut * RT];
  if (g.w_up[j] != nullptr)
    glu_tile<RT, VEC>(x, g.w[j], g.w_up[j], static_cast<bf16*>(g.y[j]), rows, in, g.out[j], row_tiles, b - g.begin[j],
                      SituParams{g.glu_beta[j], g.glu_linear_beta[j]}, red, preload);
  else
    rows_tile<RT, VEC>(x, g.w[j], g.y[j], g.y_f32[j], false, rows, in, in, g.out[j], row_tiles, b - g.begin[j], red,
                       preload);
}

// K3_LINEAR_PRELOAD / linear_rows_preload_force: whether the rows kernels issue their first weight loads
// before the PDL wait (rows_detail::tile_sums; 16-byte chunks only).
std::atomic<int> g_preload{-1};
bool rows_preload(int vec) { return vec == 8 && env_knob(g_preload, "K3_LINEAR_PRELOAD", 0, 1, 1) == 1; }

template <int RT, int VEC>
int launch_rows(const bf16* x, int64_t x_ld, const bf16* w, void* y, bool y_f32, bool add, int64_t rows, int64_t in,
                int64_t out, cudaStream_t s) {
  const int64_t row_tiles = (rows + RT - 1) / RT;
  const int64_t blocks = row_tiles * ((out + kLinOut - 1) / kLinOut);
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  return detail::launch(linear_rows_kernel<RT, VEC>, static_cast<unsigned>(blocks), kLinThreads, 0, s, x, w, y, y_f32,
                        add, rows, in, x_ld, out, row_tiles, rows_preload(VEC));
}

// The one place the row count and the vector width become compile-time.
template <int VEC>
int dispatch_rows(const bf16* x, int64_t x_ld, const bf16* w, void* y, bool y_f32, bool add, int64_t rows,
                  int64_t in, int64_t out, cudaStream_t s) {
  if (rows <= 1) return launch_rows<1, VEC>(x, x_ld, w, y, y_f32, add, rows, in, out, s);
  if (rows <= 2) return launch_rows<2, VEC>(x, x_ld, w, y, y_f32, add, rows, in, out, s);
  if (rows <= 4) return launch_rows<4, VEC>(x, x_ld, w, y, y_f32, add, rows, in, out, s);
  return launch_rows<8, VEC>(x, x_ld, w, y, y_f32, add, rows, in, out, s);
}

// Whether linear_rows_kernel takes 16-byte chunks for (x, w).

// x's rows x_ld elements apart: 16-byte chunks need every row aligned too.
int linear_kernel(const bf16* x, int64_t x_ld, const bf16* w, void* y, bool y_f32, bool add, int64_t rows,
                  int64_t in, int64_t out, cudaStream_t s) {
  return rows_vec(x, w, in) && x_ld % 8 == 0 ? dispatch_rows<8>(x, x_ld, w, y, y_f32, add, rows, in, out, s)
                                             : dispatch_rows<1>(x, x_ld, w, y, y_f32, add, rows, in, out, s);
}

template <int RT, int VEC>
int launch_rows_group(const bf16* x, GroupArgs g, int64_t rows, int64_t in, cudaStream_t s) {
  const int64_t row_tiles = (rows + RT - 1) / RT;
  // A GLU member's CTA takes 2 features (4 weight rows, as a plain member's CTA).
  const auto blocks_of = [&](int j) {
    return row_tiles * (g.w_up[j] != nullptr ? (g.out[j] + 1) / 2 : (g.out[j] + kLinOut - 1) / kLinOut);
  };
  if (!rows_detail::set_begin(g, blocks_of))
    return cudaErrorInvalidConfiguration;
  const int64_t blocks = g.begin[g.n];
  return detail::launch(linear_rows_group_kernel<RT, VEC>, static_cast<unsigned>(blocks), kLinThreads, 0, s, x, g, rows,
                        in, row_tiles, rows_preload(VEC));
}

template <int VEC>
int dispatch_rows_group(const bf16* x, const GroupArgs& g, int64_t rows, int64_t in, cudaStream_t s) {
  if (rows <= 1) return launch_rows_group<1, VEC>(x, g, rows, in, s);
  if (rows <= 2) return launch_rows_group<2, VEC>(x, g, rows, in, s);
  if (rows <= 4) return launch_rows_group<4, VEC>(x, g, rows, in, s);
  return launch_rows_group<8, VEC>(x, g, rows, in, s);
}

// Largest power of two (<= 256) dividing the address: cuBLASLt's alignment preference.
uint32_t alignment_of_bytes(uint64_t a) {
  uint32_t al = 256;
  while (al > 1 && (a % al) != 0) al /= 2;
  return al;
}
uint32_t alignment_of(const void* p) { return alignment_of_bytes(reinterpret_cast<uintptr_t>(p)); }

struct LtDescs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~LtDescs() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// One cuBLASLt product, strided-batched when batch > 1, in column-major terms: C_b = y_b^T [out, rows] (ld
// ldy) = op(A_b) B_b with B_b = x_b^T [in, rows] (ld ldx) and A_b the weights: W_b [out, in] row-major
// (w_out_in) is column-major [in, out] with ld ldw, taken transposed; W_b [in, out] row-major is
// column-major [out, in], taken as is. Matrix b of each starts stride_* elements after matrix b - 1.
// True when cuBLASLt enqueued it; false when it has no algorithm (or failed before enqueueing).
bool cublaslt_product(const Context& ctx, const bf16* x, int64_t ldx, int64_t stride_x, const bf16* w, int64_t ldw,
                      int64_t stride_w, bool w_out_in, void* y, bool y_f32, int64_t ldy, int64_t stride_y,
                      int64_t rows, int64_t in, int64_t out, int batch, float beta = 0.f) {
  if (ctx.lt == nullptr) return false;
  auto lt = reinterpret_cast<cublasLtHandle_t>(ctx.lt);
  const auto ok = [](cublasStatus_t st) { return st == CUBLAS_STATUS_SUCCESS; };
  LtDescs d;
  if (!ok(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F))) return false;
  const cublasOperation_t ta = w_out_in ? CUBLAS_OP_T : CUBLAS_OP_N, tb = CUBLAS_OP_N;
  if (!ok(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)))) return false;
  if (!ok(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)))) return false;
  if (!ok(cublasLtMatrixLayoutCreate(&d.a, CUDA_R_16BF, w_out_in ? in : out, w_out_in ? out : in, ldw))) return false;
  if (!ok(cublasLtMatrixLayoutCreate(&d.b, CUDA_R_16BF, in, rows, ldx))) return false;
  if (!ok(cublasLtMatrixLayoutCreate(&d.c, y_f32 ? CUDA_R_32F : CUDA_R_16BF, out, rows, ldy))) return false;
  if (batch > 1) {
    const int32_t n = batch;
    const std::pair<cublasLtMatrixLayout_t, int64_t> lay[3] = {{d.a, stride_w}, {d.b, stride_x}, {d.c, stride_y}};
    for (const auto& [l, stride] : lay)
      if (!ok(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &n, sizeof(n))) ||
          !ok(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                               sizeof(stride))))
        return false;
  }
  if (!ok(cublasLtMatmulPreferenceCreate(&d.pref))) return false;
  const uint64_t ws = ctx.workspace ? ctx.workspace_bytes : 0;
  if (!ok(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws))))
    return false;
  // Split-K partial sums only in FP32 (never in place in a BF16 output).
  const uint32_t reduction = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  if (!ok(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reduction,
                                               sizeof(reduction))))
    return false;
  // A plain product's x read in place from a wider matrix (ldx > in): its later columns are only as aligned
  // as ldx's bytes, so the preference says no more than that.
  const uint32_t al_x = batch == 1 && ldx != in
                            ? std::min(alignment_of(x), alignment_of_bytes(static_cast<uint64_t>(ldx) * 2))
                            : alignment_of(x);
  const uint32_t al_a = alignment_of(w), al_b = al_x, al_c = alignment_of(y);
  if (!ok(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a,
                                               sizeof(al_a))) ||
      !ok(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b,
                                               sizeof(al_b))) ||
      !ok(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c,
                                               sizeof(al_c))) ||
      !ok(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c,
                                               sizeof(al_c))))
    return false;
  cublasLtMatmulHeuristicResult_t heur{};
  int found = 0;
  if (!ok(cublasLtMatmulAlgoGetHeuristic(lt, d.op, d.a, d.b, d.c, d.c, d.pref, 1, &heur, &found)) || found < 1)
    return false;
  const float alpha = 1.f;
  return ok(cublasLtMatmul(lt, d.op, &alpha, w, d.a, x, d.b, &beta, y, d.c, y, d.c, &heur.algo, ctx.workspace, ws,
                           reinterpret_cast<cudaStream_t>(ctx.stream)));
}

// add: y = x W^T + y (beta 1, C = D in place: the FP32 sum and y rounded once).
bool linear_cublaslt(const Context& ctx, const bf16* x, int64_t x_ld, const bf16* w, void* y, bool y_f32, bool add,
                     int64_t rows, int64_t in, int64_t out) {
  return cublaslt_product(ctx, x, x_ld, 0, w, in, 0, true, y, y_f32, out, 0, rows, in, out, 1, add ? 1.f : 0.f);
}

}  // namespace

void linear_rows_preload_force(int on) { g_preload.store(on == 0 || on == 1 ? on : -1, std::memory_order_relaxed); }

int64_t linear_rows_kernel_max_rows() {
  static const int64_t max_rows = env_int("K3_LINEAR_ROWS_MAX", 1, 8, kLinearRowsKernelMaxRows);
  return max_rows;
}

namespace {

// linear_ld_via, and with add (BF16 y only) linear_add_via: the skinny kernel does not add, so there the
// rows kernel takes its place.
int linear_path(const Context& ctx, LinearPath path, const bf16* x, int64_t x_ld, const bf16* w, void* y, bool y_f32,
                bool add, int64_t rows, int64_t in, int64_t out) {
  if (rows < 0 || in <= 0 || out <= 0 || x_ld < in || (add && y_f32)) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (x == nullptr || w == nullptr || y == nullptr) return cudaErrorInvalidValue;
  const bool rows_kernel =
      path == LinearPath::Rows || (path == LinearPath::Auto && rows <= linear_rows_kernel_max_rows());
  const bool skinny = !add && !rows_kernel &&
                      (path == LinearPath::Kernel || (path == LinearPath::Auto && kLinearAutoSkinny)) && x_ld == in &&
                      linear_skinny_fits(rows, in, x, w);
  if (path == LinearPath::RowsTc) {
    const LinearOut one{w, y, out, y_f32};
    const int e = linear_rows_tc(ctx, x, x_ld, rows, in, &one, 1, add);
    if (e != cudaErrorNotSupported) return e;  // not supported: in or x_ld % 8 != 0 or unaligned, nothing enqueued
  }
  const bool lt = path == LinearPath::CublasLt || (path == LinearPath::Auto && !rows_kernel && !skinny);
  if (lt && linear_cublaslt(ctx, x, x_ld, w, y, y_f32, add, rows, in, out)) return cudaGetLastError();
  if (skinny) {
    const int e = linear_skinny(ctx, x, w, y, y_f32, rows, in, out);
    if (e != cudaErrorNotSupported) return e;  // not supported: the device cannot run it, nothing enqueued
  }
  return linear_kernel(x, x_ld, w, y, y_f32, add, rows, in, out, reinterpret_cast<cudaStream_t>(ctx.stream));
}

}  // namespace

int linear_ld_via(const Context& ctx, LinearPath path, const bf16* x, int64_t x_ld, const bf16* w, void* y,
                  bool y_f32, int64_t rows, int64_t in, int64_t out) {
  return linear_path(ctx, path, x, x_ld, w, y, y_f32, false, rows, in, out);
}

int linear_add_via(const Context& ctx, LinearPath path, const bf16* x, const bf16* w, bf16* y, int64_t rows,
                   int64_t in, int64_t out) {
  return linear_path(ctx, path, x, in, w, y, false, true, rows, in, out);
}

int linear_add(const Context& ctx, const bf16* x, const bf16* w, bf16* y, int64_t rows, int64_t in, int64_t out) {
  return linear_add_via(ctx, LinearPath::Auto, x, w, y, rows, in, out);
}

int linear_via(const Context& ctx, LinearPath path, const bf16* x, const bf16* w, void* y, bool y_f32, int64_t rows,
               int64_t in, int64_t out) {
  return linear_ld_via(ctx, path, x, in, w, y, y_f32, rows, in, out);
}

int linear(const Context& ctx, const bf16* x, const bf16* w, void* y, bool y_f32, int64_t rows, int64_t in,
           int64_t out) {
  return linear_via(ctx, LinearPath::Auto, x, w, y, y_f32, rows, in, out);
}

int linear_ld(const Context& ctx, const bf16* x, int64_t x_ld, const bf16* w, void* y, bool y_f32, int64_t rows,
              int64_t in, int64_t out) {
  return linear_ld_via(ctx, LinearPath::Auto, x, x_ld, w, y, y_f32, rows, in, out);
}

namespace {

int64_t linear_group_rows_max() {
  static const int64_t max_rows = env_int("K3_LINEAR_GROUP_ROWS_MAX", 1, 8, kLinearGroupMaxRows);
  return max_rows;
}

}  // namespace

bool linear_group_takes(int64_t rows, const bf16* x, int64_t in, const LinearOut* outs, int n) {
  // K3_LINEAR_GROUP=0 in the environment: never (A/B runs of the step).
  static const bool env_off = env_int("K3_LINEAR_GROUP", 0, 1, 1) == 0;
  if (env_off || rows < 1 || n < 2 || !linear_group_fits(x, in, outs, n)) return false;
  if (rows <= linear_rows_kernel_max_rows()) return true;
  if (rows > linear_group_rows_max()) return false;
  if (rows <= kLinearGroupAnyRows) return true;
  int64_t weights = 0;
  for (int j = 0; j < n; ++j) weights += outs[j].out * in * (outs[j].w_up != nullptr ? 2 : 1);
  return weights <= kLinearGroupMaxWeights;
}

int64_t linear_group_glu_max_rows() { return std::max(linear_rows_kernel_max_rows(), kLinearGroupAnyRows); }

bool linear_group_fits(const bf16* x, int64_t in, const LinearOut* outs, int n) {
  if (n < 1 || n > kLinearGroupMax || x == nullptr || in <= 0 || outs == nullptr) return false;
  const bool vec = rows_vec(x, outs[0].w, in);
  for (int j = 0; j < n; ++j)
    if (outs[j].w == nullptr || outs[j].y == nullptr || outs[j].out <= 0 || rows_vec(x, outs[j].w, in) != vec ||
        (outs[j].w_up != nullptr && (outs[j].y_f32 || rows_vec(x, outs[j].w_up, in) != vec)))
      return false;
  return true;
}

int linear_group_via(const Context& ctx, LinearGroupPath path, const bf16* x, int64_t rows, int64_t in,
                     const LinearOut* outs, int n) {
  if (rows < 0 || in <= 0 || n < 0 || n > kLinearGroupMax || (n > 0 && outs == nullptr)) return cudaErrorInvalidValue;
  bool glu = false;
  for (int j = 0; j < n; ++j) {
    if (outs[j].out <= 0) return cudaErrorInvalidValue;
    glu = glu || outs[j].w_up != nullptr;
  }
  if (rows == 0 || n == 0) return cudaSuccess;
  if (path == LinearGroupPath::GroupedTc || (path == LinearGroupPath::Auto && (!glu || linear_glu_tc_takes(rows)) &&
                                             linear_rows_tc_takes(rows, x, in, in, outs, n))) {
    const int e = linear_rows_tc(ctx, x, in, rows, in, outs, n);
    if (e != cudaErrorNotSupported) return e;
  }
  const bool grouped = path == LinearGroupPath::Grouped ||
                       (path == LinearGroupPath::Auto && linear_group_takes(rows, x, in, outs, n) &&
                        (!glu || rows <= linear_group_glu_max_rows()));
  if (!grouped || !linear_group_fits(x, in, outs, n)) {
    if (glu) return cudaErrorNotSupported;  // a GLU member runs in a grouped kernel only; nothing enqueued
    const LinearPath each = path == LinearGroupPath::Grouped ? LinearPath::Rows : LinearPath::Auto;
    for (int j = 0; j < n; ++j)
      if (const int e = linear_via(ctx, each, x, outs[j].w, outs[j].y, outs[j].y_f32, rows, in, outs[j].out); e != 0)
        return e;
    return cudaSuccess;
  }
  const GroupArgs g = rows_detail::group_args(outs, n);
  auto s = reinterpret_cast<cudaStream_t>(ctx.stream);
  return rows_vec(x, outs[0].w, in) ? dispatch_rows_group<8>(x, g, rows, in, s)
                                    : dispatch_rows_group<1>(x, g, rows, in, s);
}

int linear_group(const Context& ctx, const bf16* x, int64_t rows, int64_t in, const LinearOut* outs, int n) {
  return linear_group_via(ctx, LinearGroupPath::Auto, x, rows, in, outs, n);
}

bool linear_batched_cublaslt(const Context& ctx, const bf16* x, int64_t ldx, int64_t stride_x, const bf16* w,
                             int64_t ldw, int64_t stride_w, bool w_out_in, bf16* y, int64_t ldy, int64_t stride_y,
                             int64_t rows, int64_t in, int64_t out, int batch) {
  if (rows <= 0 || in <= 0 || out <= 0 || batch <= 0 || x == nullptr || w == nullptr || y == nullptr) return false;
  return cublaslt_product(ctx, x, ldx, stride_x, w, ldw, stride_w, w_out_in, y, false, ldy, stride_y, rows, in, out,
                          batch);
}

}  // namespace k3::ops::cuda
