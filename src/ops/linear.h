// BF16 linear with FP32 accumulation: y[r, o] = sum_i x[r, i] * W[o, i].
// W is [out, in] BF16 (checkpoint layout). y is rounded to BF16 unless
// round_out is false (router logits and lm_head logits stay FP32).
#pragma once

#include <cstdint>

#include "core/bf16.h"
#include "ops/cuda_context.h"

namespace k3::ops {

// x [rows, in], w [out, in], y [rows, out] (y must not alias x).
void linear(const float* x, const bf16* w, float* y, int64_t rows, int64_t in, int64_t out, bool round_out = true);
// The projection added into y (a residual or a partial sum already there): y[r, o] = bf16(sum_i x[r, i] W[o, i]
// + y[r, o]), the FP32 sum and y's BF16 value rounded once. x [rows, in], w [out, in], y [rows, out] (BF16 values).
void linear_add(const float* x, const bf16* w, float* y, int64_t rows, int64_t in, int64_t out);

}  // namespace k3::ops

namespace k3::ops::cuda {

// x [rows, in] BF16, w [out, in] BF16 -> y [rows, out], BF16 (rounded once from the FP32 sum) or FP32
// when y_f32; FP32 accumulation. y must not alias x. Paths (src/ops/linear.cu, linear_skinny.cu):
//   rows == 1:                  linear_rows_kernel, CUDA cores, W streamed once (one row is a pure
//                               stream of W; no slower than cuBLASLt: bench --ops linear);
//   2 <= rows <= 64 (skinny):   linear_skinny, tensor cores, W streamed once through a cp.async ring,
//                               split K over the CTAs with a fixed-order FP32 sum (cuBLASLt falls short
//                               of the HBM bandwidth at these shapes); needs in % 8 == 0 and 16-byte aligned
//                               x and w, else cuBLASLt; in Auto only when kLinearAutoSkinny (below),
//                               else cuBLASLt;
//   more rows:                  cuBLASLt on ctx.workspace (the hand-written kernels if it has no algorithm).
// The hand-written paths give the same bits on every run for a given shape and Context (the skinny
// split depends on the SM count and ctx.workspace_bytes).
constexpr int64_t kLinearRowsKernelMaxRows = 1;
// The row count up to which Auto (and linear_group) takes linear_rows_kernel: kLinearRowsKernelMaxRows,
// or K3_LINEAR_ROWS_MAX=1..8 in the environment (read once; A/B runs of the step with one binary).
int64_t linear_rows_kernel_max_rows();
// Whether the rows kernels (linear_rows_kernel, the grouped one; 16-byte chunks) issue each thread's first
// weight loads before the PDL wait, so that under programmatic dependent launch the weights start to stream
// while the previous kernel finishes: K3_LINEAR_PRELOAD (1, the default, or 0; read once) or this (tests:
// 0 or 1; any other value returns to the environment's). The same bits either way.
void linear_rows_preload_force(int on);
constexpr int64_t kLinearSkinnyMinRows = 2;
constexpr int64_t kLinearSkinnyMaxRows = 64;
// Whether Auto (the engine) takes the skinny kernel. Off: it passes its GPU tests (CudaLinearSkinny), but
// against cuBLASLt (bench --ops linear, docs/PERF.md) it wins on only three K3 shapes at 2-16 rows and
// loses elsewhere, most at 64 rows; it stays reachable through
// LinearPath::Kernel (tests, bench --ops) until it is faster.
constexpr bool kLinearAutoSkinny = false;
int linear(const Context& ctx, const bf16* x, const bf16* w, void* y, bool y_f32, int64_t rows, int64_t in,
           int64_t out);
// The same with the rows of x x_ld elements apart (x_ld >= in; a column slice of a wider matrix, read in
// place): the same paths, except that the skinny kernel takes only x_ld == in (cuBLASLt instead). At 1 row
// (linear_rows_kernel) the bits are linear()'s on the compacted rows; cuBLASLt may pick another algorithm
// for the strided layout.
int linear_ld(const Context& ctx, const bf16* x, int64_t x_ld, const bf16* w, void* y, bool y_f32, int64_t rows,
              int64_t in, int64_t out);
// The same with the path forced (benchmarks compare them): Kernel = the hand-written kernels (skinny for
// the rows and shapes it takes, else linear_rows_kernel at any row count); Rows = linear_rows_kernel at
// any row count; CublasLt = cuBLASLt (the hand-written kernels if cuBLASLt has no algorithm); RowsTc = the
// tensor-core row-tile kernel (linear_rows_tc below; linear_rows_kernel where it does not fit); Auto =
// linear().
enum class LinearPath { Auto, Kernel, Rows, CublasLt, RowsTc };
int linear_via(const Context& ctx, LinearPath path, const bf16* x, const bf16* w, void* y, bool y_f32, int64_t rows,
               int64_t in, int64_t out);
int linear_ld_via(const Context& ctx, LinearPath path, const bf16* x, int64_t x_ld, const bf16* w, void* y,
                  bool y_f32, int64_t rows, int64_t in, int64_t out);

// As the CPU linear_add: y [rows, out] BF16 = bf16(x W^T + y), the FP32 sum and y rounded once (one launch in
// place of a linear and an add). Auto as linear() but never the skinny kernel (it does not add): the rows
// kernel with the add in its epilogue, or cuBLASLt with beta = 1 (C = D = y); the _via form forces the path
// as linear_via (Kernel = the rows kernel). y must not alias x.
int linear_add(const Context& ctx, const bf16* x, const bf16* w, bf16* y, int64_t rows, int64_t in, int64_t out);
int linear_add_via(const Context& ctx, LinearPath path, const bf16* x, const bf16* w, bf16* y, int64_t rows,
                   int64_t in, int64_t out);
// Several projections of the same input rows: y_j [rows, out_j] = x W_j^T for j < n (n <= kLinearGroupMax).
// Where linear_rows_tc_takes() (below) one launch of the tensor-core row-tile kernel does them all, each y_j
// bitwise linear_via(RowsTc). Else where linear_group_takes() one launch does them all
// (linear_rows_group_kernel: the CTAs of every projection dealt over one grid, so the small ones run in the
// large one's wave instead of paying their own launch ramp and tail), each y_j bitwise linear_via(Rows);
// otherwise one linear() call each, bitwise.
// No y may alias x or another y. K3_LINEAR_GROUP=0 in the environment makes Auto separate calls (A/B runs).
struct LinearOut {
  const bf16* w = nullptr;  // [out, in]
  void* y = nullptr;        // [rows, out], BF16 or FP32 (y_f32)
  int64_t out = 0;
  bool y_f32 = false;
  // A GLU member: w_up [out, in] given, y [rows, out] BF16 = situ_glu(bf16(x W^T), bf16(x W_up^T)) with these
  // betas (ops/moe.h), the bits of the two projections as members of the same group then situ_glu. Taken by
  // linear_rows_tc and by linear_group's two grouped kernels (below); never by separate calls.
  const bf16* w_up = nullptr;
  float glu_beta = 0.f, glu_linear_beta = 0.f;
};
// GLU members (LinearOut::w_up): Auto takes the tensor-core kernel for them where linear_glu_tc_takes too, the
// rows kernel's group at up to linear_group_glu_max_rows() rows (the rows kernel's or kLinearGroupAnyRows,
// whichever is more), each GLU CTA 2 features x the row tile; where neither takes the group,
// cudaErrorNotSupported with nothing enqueued (the caller runs the plain group and situ_glu).
constexpr int kLinearGroupMax = 6;
int linear_group(const Context& ctx, const bf16* x, int64_t rows, int64_t in, const LinearOut* outs, int n);
// Auto's choice: one grouped launch for n >= 2 projections that fit it (linear_group_fits) at up to
// kLinearGroupAnyRows rows, or up to linear_group_rows_max() rows (kLinearGroupMaxRows, or
// K3_LINEAR_GROUP_ROWS_MAX=1..8 in the environment, read once) when the group's weights hold at most
// kLinearGroupMaxWeights elements; any row count linear() itself gives to the rows kernel. Where one
// projection alone would go to cuBLASLt (two kernels each with its split-K), the grouped launch is faster
// at 2 rows on every per-rank group and at 4 rows on groups up to MLA's (3648 x 7168); from 4 rows on
// larger groups, and at 8 rows on all, cuBLASLt is (docs/PERF.md, "Projection groups").
constexpr int64_t kLinearGroupAnyRows = 2;
constexpr int64_t kLinearGroupMaxRows = 4;
constexpr int64_t kLinearGroupMaxWeights = int64_t{28} << 20;
bool linear_group_takes(int64_t rows, const bf16* x, int64_t in, const LinearOut* outs, int n);
int64_t linear_group_glu_max_rows();
// Auto = linear_group; Grouped = linear_rows_kernel per projection at any row count (tests): the grouped
// kernel (bitwise linear_via(Rows) per projection), or one linear_via(Rows) each where linear_group_fits is
// false; Separate = one linear() per projection; GroupedTc = linear_rows_tc at any row count (separate
// linear() calls where it does not fit). Where a group with a GLU member would take separate calls:
// cudaErrorNotSupported, nothing enqueued.
enum class LinearGroupPath { Auto, Grouped, Separate, GroupedTc };
int linear_group_via(const Context& ctx, LinearGroupPath path, const bf16* x, int64_t rows, int64_t in,
                     const LinearOut* outs, int n);
// Whether one grouped launch can take the projections (1 <= n <= kLinearGroupMax, pointers given, the same
// vector width for every w and w_up, a GLU member's y BF16).
bool linear_group_fits(const bf16* x, int64_t in, const LinearOut* outs, int n);

// Per-head products (the MLA absorptions): for b < batch, y_b [rows, out] = x_b [rows, in] W_b^T when
// w_out_in (W_b [out, in]), else x_b W_b (W_b [in, out]); BF16 in and out (rounded once), FP32
// accumulation, split-K partials (if any) in FP32. A matrix's rows are ld* elements apart, matrix b
// starts stride_* elements after matrix b - 1. cuBLASLt only: false when it has no algorithm (nothing
// enqueued), so the caller takes its own kernel.
bool linear_batched_cublaslt(const Context& ctx, const bf16* x, int64_t ldx, int64_t stride_x, const bf16* w,
                             int64_t ldw, int64_t stride_w, bool w_out_in, bf16* y, int64_t ldy, int64_t stride_y,
                             int64_t rows, int64_t in, int64_t out, int batch);

// The skinny path alone. It takes rows in [kLinearSkinnyMinRows, kLinearSkinnyMaxRows], in % 8 == 0 and
// 16-byte aligned x and w (linear_skinny_fits); otherwise linear_skinny enqueues nothing and returns
// cudaErrorNotSupported. Its split-K partials ([splits, rows, out] FP32) use ctx.workspace, stream-ordered
// like cuBLASLt's use of it; no workspace (or too small a one for two splits): no split.
bool linear_skinny_fits(int64_t rows, int64_t in, const bf16* x, const bf16* w);
int linear_skinny(const Context& ctx, const bf16* x, const bf16* w, void* y, bool y_f32, int64_t rows, int64_t in,
                  int64_t out);

// The tensor-core row-tile kernel (src/ops/linear_rows_tc.cu): y_j = x W_j^T (+ y_j when add, BF16 y only;
// a GLU member, LinearOut::w_up: the SiTU of two) for j < n in one launch, 16 features (a GLU member: 8
// pairs) x 8-32 rows per CTA on mma.sync, W streamed once per 32 rows; x's rows x_ld elements apart. It
// takes in % 8 == 0, x_ld % 8 == 0 and 16-byte aligned x, w_j and w_up (linear_rows_tc_fits; a GLU member's
// y BF16); otherwise it enqueues nothing and returns cudaErrorNotSupported. Same bits on every
// run for a shape, and per projection the same bits alone or in a group; not the rows kernel's or cuBLASLt's.
bool linear_rows_tc_fits(const bf16* x, int64_t x_ld, int64_t in, const LinearOut* outs, int n);
int linear_rows_tc(const Context& ctx, const bf16* x, int64_t x_ld, int64_t rows, int64_t in, const LinearOut* outs,
                   int n, bool add = false);
// linear_group's Auto takes it where linear_rows_tc_takes: a group (n >= 2) of kLinearRowsTcMinRows rows or
// more (and more than the rows kernel takes), at most linear_rows_tc_max_rows() (kLinearRowsTcMaxRows, or
// K3_LINEAR_TC_ROWS_MAX=0..64 in the environment, read once; 0: never), where it fits. One projection alone
// stays on linear()'s paths, which are as fast or faster at every per-rank shape (docs/PERF.md).
constexpr int64_t kLinearRowsTcMinRows = 3;
constexpr int64_t kLinearRowsTcMaxRows = 8;
int64_t linear_rows_tc_max_rows();
// Whether linear_glu (ops/moe.h) and the MoE's shared-expert group (runtime/gpu/moe.cpp) take the tensor-core
// kernel's GLU member at `rows` rows: the tc group's row counts (kLinearRowsTcMinRows ..
// linear_rows_tc_max_rows(), past the rows kernel's) unless K3_LINEAR_GLU_TC=0 (default 1, docs/PERF.md) or
// linear_glu_tc_force(0); linear_glu_tc_force(1) turns it on, -1 back to the environment's.
bool linear_glu_tc_takes(int64_t rows);
void linear_glu_tc_force(int on);
bool linear_rows_tc_takes(int64_t rows, const bf16* x, int64_t x_ld, int64_t in, const LinearOut* outs, int n);
// Its kernel issues each stage's weight loads one stage ahead of the mma on grids of at most
// kLinearRowsTcPipeCtasPerSm CTAs per SM (linear_rows_tc_pipelined): there the few CTAs need the loads in
// flight, and on larger grids the extra registers cost more CTAs per SM than they gain. Same bits either way.
constexpr int64_t kLinearRowsTcPipeCtasPerSm = 2;
bool linear_rows_tc_pipelined(int64_t ctas, int sms);

}  // namespace k3::ops::cuda
