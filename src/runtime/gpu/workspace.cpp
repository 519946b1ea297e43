// The GpuRank's scratch carving (runtime/gpu/workspace.h).
#include "runtime/gpu/workspace.h"

#include <algorithm>

#include "core/error.h"
#include "ops/mla.h"
#include "ops/moe.h"

namespace k3 {

namespace cu = ops::cuda;

void Carve::check() const {
  K3_CHECK(at_ <= limit_, "internal: gpu scratch overflow ({} > {} bytes)", at_, limit_);
}

GpuDims::GpuDims(const ModelConfig& c, const GpuRankOptions& o) {
  const auto mode = collective_mode(o);
  G = o.shard.tp_size;
  W = o.shard.world_size;
  real = mode == GpuCollectives::Mode::Real;
  loopback = mode == GpuCollectives::Mode::Loopback;
  Dc = real ? o.groups->dcp->size() : 1;
  Hk = c.kda.num_heads / G;
  Hm = c.mla.num_heads / G;
  max_rows = int64_t{o.max_batch} * o.max_q;
  ep_cap = real ? (max_rows + G - 1) / G * c.moe.experts_per_token : 0;
  ep_slices = o.shard.ffn_tp ? G : 1;
  max_context = o.max_context;
  const int parts = o.shard.ffn_tp ? G : 1;
  shared_rows = c.moe.shared_intermediate() / parts;
  dense_rows = c.dense_intermediate_size / parts;
}

KdaScratch carve_kda(Carve& s, const ModelConfig& c, const GpuDims& d, int64_t rows) {
  const int64_t dh = c.kda.head_dim, C = int64_t{d.Hk} * dh, P = (4 * C + dh + d.Hk + 15) / 16 * 16;
  KdaScratch k;
  k.proj = s.take<bf16>(rows * P);
  k.qn = s.take<float>(rows * C);
  k.kn = s.take<float>(rows * C);
  k.v = s.take<bf16>(rows * C);
  k.u = s.take<bf16>(rows * C);
  k.g = s.take<float>(rows * C);
  k.beta = s.take<float>(rows * d.Hk);
  k.o = s.take<float>(rows * C);
  k.normed = s.take<bf16>(rows * C);
  return k;
}

MlaScratch carve_mla(Carve& s, const ModelConfig& c, const GpuDims& d, int64_t rows) {
  const auto& m = c.mla;
  const int64_t H = d.Hm, R = m.kv_lora_rank, E = m.cache_dim(), Dc = d.Dc;
  MlaScratch a{};
  a.cq = s.take<bf16>(rows * m.q_lora_rank);
  a.qf = s.take<bf16>(rows * H * m.qk_head_dim());
  a.kv = s.take<bf16>(rows * E);
  a.qlat = s.take<bf16>(rows * H * E);
  a.olat = s.take<float>(rows * H * R);
  a.lse = s.take<float>(rows * H);
  a.olat_bf = s.take<bf16>(rows * H * R);
  a.o = s.take<bf16>(rows * H * m.v_head_dim);
  a.gate = s.take<bf16>(rows * H * m.v_head_dim);
  if (Dc > 1) {
    a.qall = s.take<bf16>(Dc * rows * H * E);
    a.po = s.take<float>(Dc * rows * H * R);
    a.got_o = s.take<float>(Dc * rows * H * R);
    a.pl = s.take<float>(Dc * rows * H);
    a.got_lse = s.take<float>(Dc * rows * H);
  }
  if (c.dsa) {
    const int64_t Hi = c.dsa->index_n_heads, Di = c.dsa->index_head_dim, topk = c.dsa->index_topk;
    a.qi = s.take<bf16>(rows * Hi * Di);
    a.wi = s.take<float>(rows * Hi);
    a.ki = s.take<bf16>(rows * Di);
    a.scores = s.take<float>(rows * d.max_context);
    a.sel = s.take<int32_t>(rows * topk);
    a.cnt = s.take<int32_t>(rows);
    if (Dc > 1) {
      a.cand_s = s.take<float>(rows * topk);
      a.cand_p = s.take<int32_t>(rows * topk);
      a.all_s = s.take<float>(Dc * rows * topk);
      a.all_p = s.take<int32_t>(Dc * rows * topk);
      a.sel_g = s.take<int32_t>(rows * topk);
      a.cnt_g = s.take<int32_t>(rows);
    }
  }
  return a;
}

MoeScratch carve_moe(Carve& s, const ModelConfig& c, const GpuDims& d, int64_t rows) {
  const auto& e = c.moe;
  const int64_t D = c.hidden_size, L = e.latent_size, I = e.intermediate_size, k = e.experts_per_token;
  MoeScratch m{};
  m.logits = s.take<float>(rows * e.num_experts);
  m.idx = s.take<int32_t>(rows * k);
  m.wts = s.take<float>(rows * k);
  m.z = s.take<bf16>(rows * L);
  m.y = s.take<bf16>(rows * L);
  m.mlp = s.take<bf16>(2 * rows * d.shared_rows);
  if (d.real) {
    const int64_t slots = int64_t{d.W} * d.ep_cap, meta = d.W * (d.ep_slices == 1 ? d.ep_cap : 2 * d.ep_slices * d.ep_cap);
    m.slot = s.take<int32_t>(d.max_rows * k);
    m.send_slot = s.take<int32_t>(d.max_rows * k);
    m.send_meta = s.take<int32_t>(meta);
    m.recv_meta = s.take<int32_t>(meta);
    if (d.ep_slices > 1) {
      m.ids = s.take<int32_t>(slots);
      m.codes = s.take<int32_t>(slots);
    }
    m.send = s.take<bf16>(slots * L);
    m.recv = s.take<bf16>(slots * L);
    m.out = s.take<bf16>(slots * L);
    m.ep_experts = s.take<char>(static_cast<int64_t>(cu::moe_experts_scratch_bytes(slots, 1, L, I)));
  } else {
    m.experts = s.take<char>(static_cast<int64_t>(cu::moe_experts_scratch_bytes(rows, static_cast<int>(k), L, I)));
    if (d.loopback) m.exchange = s.take<bf16>(2 * rows * k * L);
  }
  return m;
}

bf16* carve_dense(Carve& s, const GpuDims& d, int64_t rows) { return s.take<bf16>(2 * rows * d.dense_rows); }

bf16* carve_shared(Carve& s, const GpuDims& d, int64_t rows) { return s.take<bf16>(2 * rows * d.shared_rows); }

StepScratch carve_step(Carve& s, const ModelConfig& c, const GpuDims& d) {
  const int64_t D = c.hidden_size, R = d.max_rows, Rp = d.G * ((R + d.G - 1) / d.G);
  StepScratch t;
  t.gathered = s.take<bf16>(Rp * D);
  t.partial = s.take<bf16>(Rp * D);
  t.sharded = s.take<bf16>(R * D);
  t.lm = s.take<float>(R * c.vocab_size);
  return t;
}

GpuWorkspace gpu_workspace(const ModelConfig& c, const GpuRankOptions& o) {
  const GpuDims d(c, o);
  const int64_t R = d.max_rows;
  size_t layer = 0;
  {
    Carve s;
    carve_kda(s, c, d, R);
    layer = std::max(layer, s.bytes());
  }
  {
    Carve s;
    carve_mla(s, c, d, R);
    layer = std::max(layer, s.bytes());
  }
  {
    Carve s;
    carve_moe(s, c, d, R);
    layer = std::max(layer, s.bytes());
  }
  {
    Carve s;
    carve_dense(s, d, R);
    layer = std::max(layer, s.bytes());
  }
  {
    Carve s;
    carve_shared(s, d, R);
    layer = std::max(layer, s.bytes());
  }
  Carve step;
  carve_step(step, c, d);
  GpuWorkspace w;
  w.layer_bytes = layer;
  w.work_bytes = layer + step.bytes();
  const int Rl = c.mla.kv_lora_rank;
  w.attention_bytes = std::max(
      cu::mla_attend_paged_scratch_bytes(o.max_batch, o.max_q, d.Hm, Rl, static_cast<int>(o.max_context)),
      c.dsa ? cu::mla_attend_indexed_scratch_bytes(R, d.Hm, Rl, c.dsa->index_topk) : size_t{0});
  return w;
}

}  // namespace k3
