// MXFP4 experts and the SiTU-GLU MLPs (kimi-k3.md section 2).
//
//   situ_glu(a, b) = bf16(beta tanh(a / beta) sigmoid(a) * lbeta tanh(b / lbeta))   (FP32;
//                    beta = activation_situ_beta 4, lbeta = activation_situ_linear_beta 25)
//   mxfp4_linear:   y[r, n] = bf16(sum_k x[r, k] * W[n, k]), W = e2m1 * 2^(scale - 127)
//                   dequantized exactly, FP32 accumulation (packed [N, K/2] low nibble
//                   first, scale [N, K/32] E8M0)
//   expert_mlp:     h = situ_glu(W1 z, W3 z) (both BF16-rounded);  out = W2 h
//   mlp (dense layer 0 and the merged shared experts, BF16 weights):
//                   h = situ_glu(W_gate x, W_up x);  out = W_down h
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/bf16.h"
#include "ops/cuda_context.h"
#include "ops/linear.h"
#include "ops/rmsnorm.h"

namespace k3::ops {

struct SituParams {
  float beta = 4.0f;
  float linear_beta = 25.0f;
};

// a, b, out [n] (out may alias a or b).
void situ_glu(const float* a, const float* b, float* out, int64_t n, SituParams p);

// x [rows, K]; packed [N, K/2] U8; scale [N, K/32] U8; y [rows, N].
void mxfp4_linear(const float* x, const uint8_t* packed, const uint8_t* scale, float* y, int64_t rows, int64_t K,
                  int64_t N);

struct Mxfp4Matrix {
  const uint8_t* packed = nullptr;  // [N, K/2]
  const uint8_t* scale = nullptr;   // [N, K/32]
};

// One routed expert: z [rows, D] -> out [rows, D]; w1, w3 [I, D]; w2 [D, I]. scratch >= 2 * rows * I floats.
void expert_mlp(const float* z, Mxfp4Matrix w1, Mxfp4Matrix w3, Mxfp4Matrix w2, float* out, int64_t rows, int64_t D,
                int64_t I, SituParams p, float* scratch);

// The MLPs' gate and up: h [rows, I] = situ_glu(bf16(x W_gate^T), bf16(x W_up^T)); x [rows, D]; w_gate, w_up
// [I, D]. scratch >= rows * I floats (h may not alias it).
void linear_glu(const float* x, const bf16* w_gate, const bf16* w_up, float* h, int64_t rows, int64_t D, int64_t I,
                SituParams p, float* scratch);

// BF16 MLP: x [rows, D]; w_gate, w_up [I, D]; w_down [D, I]; out [rows, D]. scratch >= 2 * rows * I floats.
void mlp(const float* x, const bf16* w_gate, const bf16* w_up, const bf16* w_down, float* out, int64_t rows, int64_t D,
         int64_t I, SituParams p, float* scratch);

}  // namespace k3::ops

namespace k3::ops::cuda {

// a, b, out [n] BF16 (out may alias a or b): out = situ_glu(a, b), FP32 math, BF16 out.
int situ_glu(const bf16* a, const bf16* b, bf16* out, int64_t n, SituParams p, CUstream_st* stream);

// x [rows, K] BF16 (16-byte aligned), packed [N, K/2] U8, scale [N, K/32] U8 -> y [rows, N] BF16; K % 32 == 0.
// W4A16: weights dequantized exactly in registers, FP32 accumulation (packed: any alignment, 8 bytes is fastest).
int mxfp4_linear(const bf16* x, const uint8_t* packed, const uint8_t* scale, bf16* y, int64_t rows, int64_t K,
                 int64_t N, CUstream_st* stream);

// One routed expert, as the CPU expert_mlp: z [rows, D] BF16 -> out [rows, D] BF16; w1, w3 [I, D], w2 [D, I]
// MXFP4 (device pointers); scratch BF16 [2 * rows * I] (16-byte aligned).
int expert_mlp(const bf16* z, Mxfp4Matrix w1, Mxfp4Matrix w3, Mxfp4Matrix w2, bf16* out, int64_t rows, int64_t D,
               int64_t I, SituParams p, bf16* scratch, CUstream_st* stream);

// As the CPU linear_glu, BF16: x [rows, D] -> h [rows, I] = situ_glu(bf16(x W_gate^T), bf16(x W_up^T)),
// bitwise linear_group of the two projections then situ_glu. One launch of a GLU member (linear.h,
// LinearOut::w_up; a kernel and a round trip of [2 rows I] fewer): at up to linear_group_glu_max_rows() rows
// with both weights equally aligned, the rows kernel's group (each CTA its tile over gate rows f, f + 1 and
// up rows f, f + 1, the SiTU in its epilogue); at the tensor-core group's (linear_glu_tc_takes) where it
// fits, that kernel's; otherwise (or fused = false) the group and situ_glu through scratch BF16 [2 rows I]
// (h may be its first half).
int linear_glu(const Context& ctx, const bf16* x, const bf16* w_gate, const bf16* w_up, bf16* h, int64_t rows,
               int64_t D, int64_t I, SituParams p, bf16* scratch, bool fused = true);

// The tensor-core group's GLU member for h [rows, I] = situ_glu(x W_gate^T, x W_up^T) (linear.h,
// LinearOut::w_up): what linear_glu launches, and what a caller puts beside other projections of the same x.
inline LinearOut glu_member(const bf16* w_gate, const bf16* w_up, bf16* h, int64_t I, SituParams p) {
  LinearOut o{w_gate, h, I};
  o.w_up = w_up;
  o.glu_beta = p.beta;
  o.glu_linear_beta = p.linear_beta;
  return o;
}

// BF16 MLP, as the CPU mlp: x [rows, D]; w_gate, w_up [I, D]; w_down [D, I]; out [rows, D] BF16;
// scratch BF16 [2 * rows * I]. linear_glu, then the down projection.
int mlp(const Context& ctx, const bf16* x, const bf16* w_gate, const bf16* w_up, const bf16* w_down, bf16* out,
        int64_t rows, int64_t D, int64_t I, SituParams p, bf16* scratch);

// The routed experts of this rank: device arrays (one entry per local expert e = global id - expert_begin)
// of device pointers to each expert's MXFP4 tensors.
struct Mxfp4ExpertTable {
  const uint8_t* const* w1_packed = nullptr;  // [expert_count] -> [I, L/2] (gate)
  const uint8_t* const* w1_scale = nullptr;   // [expert_count] -> [I, L/32]
  const uint8_t* const* w3_packed = nullptr;  // [expert_count] -> [I, L/2] (up)
  const uint8_t* const* w3_scale = nullptr;   // [expert_count] -> [I, L/32]
  const uint8_t* const* w2_packed = nullptr;  // [expert_count] -> [L, I/2] (down)
  const uint8_t* const* w2_scale = nullptr;   // [expert_count] -> [L, I/32]
};

// Scratch of moe_experts in bytes: a routing plan (int32 [2 + 5 rows k]), h BF16 [rows k, I] and the expert
// outputs BF16 [rows k, L], each 256-byte aligned.
inline size_t moe_experts_scratch_bytes(int64_t rows, int k, int64_t L, int64_t I) {
  const auto al = [](int64_t b) { return static_cast<size_t>((b + 255) / 256 * 256); };
  const int64_t pairs = rows * k;
  return al(4 * (2 + 5 * pairs)) + al(2 * pairs * I) + al(2 * pairs * L);
}

// Routed experts of one rank: z [rows, L] BF16 (16-byte aligned), idx [rows, k] global expert ids, w [rows, k]
// FP32 -> y [rows, L] BF16 (16-byte aligned), y[r] = bf16(sum over j in 0..k-1 with idx[r, j] in
// [expert_begin, expert_begin + expert_count) of w[r, j] * expert_{idx[r, j]}(z[r])), summed in j order in
// FP32 (the CPU moe_ffn's combine);
// every expert output is the CPU expert_mlp's (BF16). Rows with no local expert get 0. L, I multiples of 32;
// expert_count <= kMoeMaxLocalExperts; scratch: moe_experts_scratch_bytes(rows, k, L, I), 16-byte aligned.
// norm.w != nullptr: y = RMSNorm(that y; norm.w [L], norm.eps) in the combine (the latent norm), the bits of
// a separate rmsnorm on it.
constexpr int kMoeMaxLocalExperts = 6144;
// The up and down GEMMs run the warp-specialized wgmma kernel (moe_experts_wg.cu, a prototype) when L and I
// are multiples of 64 and either K3_MOE_WG=1 was in the environment at the first call or this set it
// (tests); false: today's kernels.
void moe_experts_force_wg(bool on);
// The split-K kernel's team size (a few pairs per expert): 0 = by the wave (teams of 8 warps when every item
// gets its own CTA in one wave, else of 4), 1 = always 4, 2 = always 8. Set by K3_MOE_TEAM at the first call
// (A/B runs) or by this (tests); any other value means 0. The size splits K differently, so the FP32 sum
// order (not the tolerance against the CPU) changes with it.
void moe_experts_force_team(int choice);
int moe_experts(const Context& ctx, const bf16* z, const int32_t* idx, const float* w, const Mxfp4ExpertTable& experts,
                int expert_begin, int expert_count, bf16* y, void* scratch, int64_t rows, int k, int64_t L, int64_t I,
                SituParams p, const RowNorm& norm = {});

}  // namespace k3::ops::cuda
