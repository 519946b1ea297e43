// The FFN modules on the GPU (GpuRank::moe, GpuRank::dense), the op sequence
// of model/layers.h's moe_ffn / dense_ffn:
//   router logits (FP32) and z = W_down x (one projection group) -> biased top-k, renormalised weights
//   -> the routed experts (local, loopback, or the EP exchange over the world; with the latent down
//      TP-sharded, every member routes all m rows and sends its columns of z, ops/ep.h)
//   -> y = RMSNorm(sum) (in the combine's kernel) -> shared(x), then W_up y added into it (linear_add);
//   TP-sharded shared experts (hybrid step): their partial sum on all m rows, their gate / up in the router's
//   group where the latent down is sliced too (the SiTU in the group kernel's epilogue where it takes them);
//   dense: the SiTU-GLU MLP.
#include <algorithm>

#include "core/env.h"
#include "ops/elementwise.h"
#include "ops/ep.h"
#include "ops/linear.h"
#include "ops/moe.h"
#include "ops/rmsnorm.h"
#include "ops/router.h"
#include "runtime/gpu/rank.h"

namespace k3 {

namespace cu = ops::cuda;

bool moe_shared_group_default() {
  static const bool on = env_int("K3_MOE_SHARED_GROUP", 0, 1, 1) == 1;
  return on;
}

#define K3_LAUNCH(expr) CUDA_CHECK(static_cast<cudaError_t>(expr))

// The MoE of layer l on rows [row0, row0 + real) of x -> out [real, D] (step_backend.h; TpAllRows: out's m
// rows hold this rank's TP partial of the shared experts on all m rows, the routed rows added into them). With
// the latent down TP-sharded (w.down_rows < L) all m rows of the group are routed here, the same top-k on every
// member, and z holds this member's Ll columns of them (ops/ep.h's sliced exchange); the router, the latent
// down and the shared gate / up then read the same m rows and, with moe_shared_group (options.h), run as one
// projection group where linear_group takes a GLU member (up to 2 rows, or the rows kernel's) or the
// tensor-core group takes the rows. With real collectives every rank calls it for every MoE layer, real = 0
// included (the EP exchange spans the world).
void GpuRank::moe(int l, Act xa, int64_t row0, int64_t, int64_t real, Act outa, SharedPart shared) {
  const MoeWeights& w = weights_.w.layers[l].moe;
  const auto& e = c_.moe;
  const int64_t D = c_.hidden_size, E = e.num_experts, L = e.latent_size, I = e.intermediate_size,
                S = w.shared_rows, Ll = w.down_rows;
  const bool sliced = Ll < L, own = shared == SharedPart::Own;
  const int64_t routed = sliced ? rows_.m : real, own0 = sliced ? row0 : 0;
  const ops::SituParams situ{c_.situ_beta, c_.situ_linear_beta};
  // The shared experts in the router's group: all m rows routed here, up to the tensor-core group's rows or
  // the rows kernel group's GLU rows (past them the group of four is the same launches as mlp's).
  const bool grouped_shared = o_.moe_shared_group && !own && sliced &&
                              routed <= std::max(cu::linear_group_glu_max_rows(), cu::linear_rows_tc_max_rows());
  if (!own && !grouped_shared && rows_.m > 0) {
    mark("moe.shared");
    Carve scratch = layer_scratch();
    bf16* mlp = carve_shared(scratch, dims_, rows_.m);  // in stream order before the MoE's use of the scratch
    K3_LAUNCH(cu::mlp(ctx_, act(xa), w.shared_gate, w.shared_up, w.shared_down, act(outa), rows_.m, D, S, situ,
                      mlp));
  }
  if (routed == 0 && !coll_.real()) return;
  auto* s = ctx_.stream;
  const int k = e.experts_per_token;
  const bf16* x = act(xa) + row0 * D;
  bf16* out = act(outa) + (own ? 0 : row0 * D);
  Carve scratch = layer_scratch();
  const MoeScratch m = carve_moe(scratch, c_, dims_, routed);
  const cu::RowNorm norm{w.norm, c_.rms_norm_eps};  // the latent norm, applied by each combine
  mark("moe.router_down");
  if (routed > 0) {
    // The router logits (FP32) and the latent down projection read the same rows: one group (with the shared
    // experts' gate and up where grouped_shared, into m.mlp [2 m S]).
    const bf16* xg = sliced ? act(xa) : x;
    const cu::LinearOut px[4] = {{w.gate, m.logits, E, /*y_f32=*/true},
                                 {w.down, m.z, Ll},
                                 {w.shared_gate, m.mlp, S},
                                 {w.shared_up, m.mlp + routed * S, S}};
    if (grouped_shared) {
      // h = situ_glu(gate, up) into m.mlp: a GLU member where linear_group takes it (the SiTU in the
      // kernel's epilogue), else the group of four and situ_glu; then the shared down into out.
      const cu::LinearOut glu[3] = {px[0], px[1], cu::glu_member(w.shared_gate, w.shared_up, m.mlp, S, situ)};
      const int rc = cu::linear_group(ctx_, xg, routed, D, glu, 3);
      if (rc == cudaErrorNotSupported) {
        K3_LAUNCH(cu::linear_group(ctx_, xg, routed, D, px, 4));
        mark("moe.shared");
        K3_LAUNCH(cu::situ_glu(m.mlp, m.mlp + routed * S, m.mlp, routed * S, situ, s));
      } else {
        K3_LAUNCH(rc);
        mark("moe.shared");
      }
      K3_LAUNCH(cu::linear(ctx_, m.mlp, w.shared_down, act(outa), false, routed, S, D));
      mark("moe.router_down");
    } else {
      K3_LAUNCH(cu::linear_group(ctx_, xg, routed, D, px, 2));
    }
    K3_LAUNCH(cu::route(m.logits, w.gate_bias, routed, static_cast<int>(E), k, e.renormalize, e.routed_scaling_factor,
                        m.idx, m.wts, s));
  }
  const int count = static_cast<int>(w.experts.size());
  mark("moe.experts");
  if (coll_.real()) {
    ep_experts(l, m, routed, own0, real, norm);
    if (real == 0) return;
  } else if (!o_.loopback) {
    K3_CHECK(!sliced, "internal: a sliced latent down needs the EP exchange");
    K3_LAUNCH(cu::moe_experts(ctx_, m.z, m.idx, m.wts, weights_.tables[l], w.expert_begin, count, m.y, m.experts,
                              real, k, L, I, situ, norm));
  } else {
    // EP over W ranks: this rank sends its real * k pairs (sliced: the Ll columns of the group's m k pairs,
    // about as many bytes) and receives, on average, the pairs of the world's real rows that chose its
    // experts: recv = ceil(m DP k / W) = ceil(m k / G). The loopback computes exactly that many pairs on its
    // local experts (router choices folded into the local range) and moves the latent rows of the dispatch
    // and the combine (not the sliced exchange's joining and return copies, 2 recv L elements); the combine's
    // stand-in is the latent norm from the received rows into y.
    const int64_t all = int64_t{B_} * q_, recv = std::min<int64_t>(real * k, (all * k + G_ - 1) / G_);
    coll_.ep_loopback_dispatch(m.z, m.exchange, routed * Ll, real * k * L);
    K3_LAUNCH(cu::remap_experts(m.idx, recv, w.expert_begin, count, s));
    bf16* got = m.exchange + routed * k * L;  // the received pairs' outputs
    K3_LAUNCH(cu::moe_experts(ctx_, m.exchange, m.idx, m.wts, weights_.tables[l], w.expert_begin, count, got,
                              m.experts, recv, 1, L, I, situ));
    K3_LAUNCH(cu::rmsnorm(got, norm.w, m.y, real, L, norm.eps, s));
  }
  mark("moe.norm_up");
  // The shared experts' output first (TpAllRows: their TP partial sum is already in out), then W_up y added
  // into it in the projection's epilogue.
  if (own) {
    mark("moe.shared");
    K3_LAUNCH(cu::mlp(ctx_, x, w.shared_gate, w.shared_up, w.shared_down, out, real, D, S, situ, m.mlp));
    mark("moe.norm_up");
  }
  K3_LAUNCH(cu::linear_add(ctx_, m.y, w.up, out, real, L, D));
}

// The EP exchange over the world (ops/ep.h): the routed rows' (row, choice) pairs packed per expert owner
// into [W, Gs cap] slots (whole latent rows, or this member's Ll columns of them), all-to-all, the owner
// joins a pair's slices (Gs > 1) and runs its experts on what it received (k = 1, weight 1; padding slots
// carry id -1 and are skipped), all-to-all back to the members owning the rows, and the combine of the own
// rows [own0, own0 + real) in each row's chosen order: y [real, L].
void GpuRank::ep_experts(int l, const MoeScratch& m, int64_t routed, int64_t own0, int64_t real,
                         const ops::cuda::RowNorm& norm) {
  const MoeWeights& w = weights_.w.layers[l].moe;
  const auto& e = c_.moe;
  auto* s = ctx_.stream;
  const int64_t L = e.latent_size, I = e.intermediate_size, W = o_.shard.world_size, cap = dims_.ep_cap,
                slots = W * cap;
  const int k = e.experts_per_token, Gs = static_cast<int>(L / w.down_rows);
  ops::EpShard sh;
  sh.rows = routed;
  sh.k = k;
  sh.cs = Gs > 1 ? rows_.cs : routed;
  sh.t = Gs > 1 ? o_.shard.tp_rank : 0;
  sh.Gs = Gs;
  sh.Ls = w.down_rows;
  sh.experts_per_rank = static_cast<int>(e.num_experts / W);
  sh.W = static_cast<int>(W);
  sh.cap = cap;
  K3_CHECK(Gs == dims_.ep_slices && sh.own0() == own0 && sh.own() == real,
           "internal: the EP shard (Gs {}, own rows {} + {}) is not the step's ({}, {} + {})", Gs, sh.own0(), sh.own(),
           dims_.ep_slices, own0, real);
  K3_LAUNCH(cu::ep_pack(m.idx, m.z, sh, m.slot, m.send_slot, m.send_meta, m.send, s));
  mark("collectives");
  coll_.world_all_to_all(m.send_meta, m.recv_meta, sh.meta(), DType::I32);
  coll_.world_all_to_all(m.send, m.recv, cap * L, DType::BF16);  // Gs cap Ls = cap L per peer
  mark("moe.experts");
  const ops::SituParams situ{c_.situ_beta, c_.situ_linear_beta};
  const int count = static_cast<int>(w.experts.size());
  if (Gs > 1) {
    K3_LAUNCH(cu::ep_assemble(m.recv, m.recv_meta, sh, m.send, m.ids, m.codes, s));
    K3_LAUNCH(cu::moe_experts(ctx_, m.send, m.ids, ep_ones_.get<float>(), weights_.tables[l], w.expert_begin, count,
                              m.out, m.ep_experts, slots, 1, L, I, situ));
    K3_LAUNCH(cu::ep_return(m.out, m.ids, m.codes, sh, m.recv, s));
    mark("collectives");
    coll_.world_all_to_all(m.recv, m.send, cap * L, DType::BF16);
  } else {
    K3_LAUNCH(cu::moe_experts(ctx_, m.recv, m.recv_meta, ep_ones_.get<float>(), weights_.tables[l], w.expert_begin,
                              count, m.out, m.ep_experts, slots, 1, L, I, situ));
    mark("collectives");
    coll_.world_all_to_all(m.out, m.send, cap * L, DType::BF16);
  }
  mark("moe.combine");
  K3_LAUNCH(cu::ep_combine(m.send, m.slot, m.wts + own0 * k, real, k, L, m.y, s, norm));
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
