// The FFN modules on the GPU (GpuRank::moe, GpuRank::dense), the op sequence
// of model/layers.h's moe_ffn / dense_ffn:
//   router logits (FP32) and z = W_down x (one projection group) -> biased top-k, renormalised weights
//   -> the routed experts (local, loopback, or the EP exchange over the world)
//   -> y = RMSNorm(sum) -> shared(x), then W_up y added into it (linear_add); dense: the SiTU-GLU MLP.
#include "ops/elementwise.h"
#include "ops/ep.h"
#include "ops/linear.h"
#include "ops/moe.h"
#include "ops/rmsnorm.h"
#include "ops/router.h"
#include "runtime/gpu/rank.h"

namespace k3 {

namespace cu = ops::cuda;

#define K3_LAUNCH(expr) CUDA_CHECK(static_cast<cudaError_t>(expr))

// The MoE of layer l on rows [row0, row0 + real) of x -> out [real, D] (with_shared = false: added into out's
// rows [row0, row0 + real), which hold the shared experts' TP partial sum). With real
// collectives every rank calls it for every MoE layer, real = 0 included (the EP
// exchange spans the world).
void GpuRank::moe(int l, Act xa, int64_t row0, int64_t, int64_t rows, Act outa, bool with_shared) {
  if (rows == 0 && !coll_.real()) return;
  const MoeWeights& w = weights_.w.layers[l].moe;
  const auto& e = c_.moe;
  auto* s = ctx_.stream;
  const int64_t D = c_.hidden_size, E = e.num_experts, L = e.latent_size, I = e.intermediate_size,
                S = w.shared_rows;
  const int k = e.experts_per_token;
  const ops::SituParams situ{c_.situ_beta, c_.situ_linear_beta};
  const bf16* x = act(xa) + row0 * D;
  bf16* out = act(outa) + (with_shared ? 0 : row0 * D);
  Carve scratch = layer_scratch();
  const MoeScratch m = carve_moe(scratch, c_, dims_, rows);
  mark("moe.router_down");
  if (rows > 0) {
    // The router logits (FP32) and the latent down projection read the same rows: one group.
    const cu::LinearOut px[2] = {{w.gate, m.logits, E, /*y_f32=*/true}, {w.down, m.z, L}};
    K3_LAUNCH(cu::linear_group(ctx_, x, rows, D, px, 2));
    K3_LAUNCH(cu::route(m.logits, w.gate_bias, rows, static_cast<int>(E), k, e.renormalize, e.routed_scaling_factor,
                        m.idx, m.wts, s));
  }
  const int count = static_cast<int>(w.experts.size());
  mark("moe.experts");
  if (coll_.real()) {
    ep_experts(l, m, rows);
    if (rows == 0) return;
  } else if (!o_.loopback) {
    K3_LAUNCH(cu::moe_experts(ctx_, m.z, m.idx, m.wts, weights_.tables[l], w.expert_begin, count, m.y, m.experts,
                              rows, k, L, I, situ));
  } else {
    // EP over W ranks: this rank sends its rows * k pairs out and receives, on
    // average, the pairs of the world's real rows that chose its experts:
    // recv = ceil(m DP k / W) = ceil(m k / G). The loopback computes exactly that
    // many pairs on its local experts (router choices folded into the local
    // range) and moves the latent rows of the dispatch and the combine.
    const int64_t all = int64_t{B_} * q_, recv = std::min<int64_t>(rows * k, (all * k + G_ - 1) / G_);
    coll_.ep_loopback_dispatch(m.z, m.exchange, rows, rows * k, L);
    K3_LAUNCH(cu::remap_experts(m.idx, recv, w.expert_begin, count, s));
    bf16* got = m.exchange + rows * k * L;  // the received pairs' outputs
    K3_LAUNCH(cu::moe_experts(ctx_, m.exchange, m.idx, m.wts, weights_.tables[l], w.expert_begin, count, got,
                              m.experts, recv, 1, L, I, situ));
    coll_.ep_loopback_combine(got, m.y, rows, L);
  }
  mark("moe.norm_up");
  K3_LAUNCH(cu::rmsnorm(m.y, w.norm, m.y, rows, L, c_.rms_norm_eps, s));
  // The shared experts' output first (with_shared = false: their TP partial sum is already in out, shared_mlp),
  // then W_up y added into it in the projection's epilogue.
  if (with_shared) {
    mark("moe.shared");
    K3_LAUNCH(cu::mlp(ctx_, x, w.shared_gate, w.shared_up, w.shared_down, out, rows, D, S, situ, m.mlp));
    mark("moe.norm_up");
  }
  K3_LAUNCH(cu::linear_add(ctx_, m.y, w.up, out, rows, L, D));
}

// The EP exchange over the world (ops/ep.h): the shard's (row, choice) pairs packed
// per owner into [W, cap] slots, all-to-all, the owner's experts on what it received
// (k = 1, weight 1; padding slots carry id -1 and are skipped), all-to-all back, and
// the combine in each row's chosen order: y [rows, L].
void GpuRank::ep_experts(int l, const MoeScratch& m, int64_t rows) {
  const MoeWeights& w = weights_.w.layers[l].moe;
  const auto& e = c_.moe;
  auto* s = ctx_.stream;
  const int64_t L = e.latent_size, I = e.intermediate_size, W = o_.shard.world_size, cap = dims_.ep_cap,
                slots = W * cap;
  const int k = e.experts_per_token;
  K3_LAUNCH(cu::ep_pack(m.idx, m.z, rows, k, L, static_cast<int>(e.num_experts / W), static_cast<int>(W), cap, m.slot,
                        m.send_ids, m.send, s));
  mark("collectives");
  coll_.world_all_to_all(m.send_ids, m.recv_ids, cap, DType::I32);
  coll_.world_all_to_all(m.send, m.recv, cap * L, DType::BF16);
  mark("moe.experts");
  K3_LAUNCH(cu::moe_experts(ctx_, m.recv, m.recv_ids, ep_ones_.get<float>(), weights_.tables[l], w.expert_begin,
                            static_cast<int>(w.experts.size()), m.out, m.ep_experts, slots, 1, L, I,
                            ops::SituParams{c_.situ_beta, c_.situ_linear_beta}));
  mark("collectives");
  coll_.world_all_to_all(m.out, m.send, cap * L, DType::BF16);
  mark("moe.combine");
  K3_LAUNCH(cu::ep_combine(m.send, m.slot, m.wts, rows, k, L, m.y, s));
}

void GpuRank::shared_mlp(int l, Act x, int64_t rows, Act out) {
  mark("moe.shared");
  const MoeWeights& w = weights_.w.layers[l].moe;
  Carve scratch = layer_scratch();
  bf16* mlp = carve_shared(scratch, dims_, rows);
  if (rows > 0)
    K3_LAUNCH(cu::mlp(ctx_, act(x), w.shared_gate, w.shared_up, w.shared_down, act(out), rows, c_.hidden_size,
                      w.shared_rows, ops::SituParams{c_.situ_beta, c_.situ_linear_beta}, mlp));
}

void GpuRank::dense(int l, Act x, int64_t rows, Act out) {
  mark("dense_mlp");
  const DenseWeights& w = weights_.w.layers[l].dense;
  Carve scratch = layer_scratch();
  bf16* mlp = carve_dense(scratch, dims_, rows);
  if (rows > 0)
    K3_LAUNCH(cu::mlp(ctx_, act(x), w.gate, w.up, w.down, act(out), rows, c_.hidden_size, w.rows,
                      ops::SituParams{c_.situ_beta, c_.situ_linear_beta}, mlp));
}

}  // namespace k3
