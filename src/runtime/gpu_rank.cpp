#include "runtime/gpu_rank.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "config/schema.h"
#include "ops/attn_res.h"
#include "ops/dcp.h"
#include "ops/dsa.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/ep.h"
#include "ops/kda.h"
#include "ops/linear.h"
#include "ops/mla.h"
#include "ops/rmsnorm.h"
#include "ops/router.h"
#include "ops/short_conv.h"

namespace k3 {

namespace cu = ops::cuda;

#define K3_LAUNCH(expr) CUDA_CHECK(static_cast<cudaError_t>(expr))

namespace {

size_t align256(size_t b) { return (b + 255) / 256 * 256; }

}  // namespace

GpuFill upload_fill() {
  return [](void* dev, const void* host, size_t bytes, DType, const std::string& role) {
    K3_CHECK(host != nullptr, "gpu weights: no host data for {}", role);
    CUDA_CHECK(cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice));
  };
}

GpuWeights build_gpu_weights(const ModelConfig& c, const ShardSpec& shard, const ModelWeights* host,
                             const GpuFill& fill) {
  check_shardable(c, shard);
  GpuWeights g;
  auto put = [&](const void* h, int64_t n, DType dt, const std::string& role) -> void* {
    const size_t bytes = static_cast<size_t>(n) * dtype_size(dt);
    g.bufs.emplace_back(bytes);
    g.bytes += bytes;
    fill(g.bufs.back().get(), h, bytes, dt, role);
    return g.bufs.back().get();
  };
  auto bf = [&](const bf16* h, int64_t n, const std::string& role) {
    return static_cast<const bf16*>(put(h, n, DType::BF16, role));
  };
  auto f32 = [&](const float* h, int64_t n, const std::string& role) {
    return static_cast<const float*>(put(h, n, DType::F32, role));
  };
  const ModelWeights empty;
  const ModelWeights& H = host ? *host : empty;
  const int64_t D = c.hidden_size, V = c.vocab_size, G = shard.tp_size;
  ModelWeights& w = g.w;
  w.embed = bf(H.embed, V * D, "embed");
  w.out_res_norm = bf(H.out_res_norm, D, "norm");
  w.out_res_proj = bf(H.out_res_proj, D, "res_proj");
  w.norm = bf(H.norm, D, "norm");
  w.vocab_count = V / G;
  w.vocab_begin = shard.tp_rank * w.vocab_count;
  w.lm_head = bf(H.lm_head, w.vocab_count * D, "lm_head");
  const LayerPlan plan = LayerPlan::from(c);
  const int64_t per_rank = c.moe.num_experts / shard.world_size;
  g.tables.resize(static_cast<size_t>(c.num_layers));
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights* hl = host ? &host->layers[l] : nullptr;
    const LayerWeights hz;
    const LayerWeights& h = hl ? *hl : hz;
    LayerWeights L;
    L.attn = plan.layers[l].attn;
    L.ffn = plan.layers[l].ffn;
    L.attn_res_norm = bf(h.attn_res_norm, D, "norm");
    L.attn_res_proj = bf(h.attn_res_proj, D, "res_proj");
    L.mlp_res_norm = bf(h.mlp_res_norm, D, "norm");
    L.mlp_res_proj = bf(h.mlp_res_proj, D, "res_proj");
    L.input_norm = bf(h.input_norm, D, "norm");
    L.post_attn_norm = bf(h.post_attn_norm, D, "norm");
    if (L.attn == AttnKind::KDA) {
      const int64_t d = c.kda.head_dim, Hl = c.kda.num_heads / G, C = Hl * d, K = c.kda.conv_kernel;
      auto& k = L.kda;
      const auto& hk = h.kda;
      k.heads = static_cast<int>(Hl);
      k.in_rows = (4 * C + d + Hl + 15) / 16 * 16;
      k.in_proj = bf(hk.in_proj, k.in_rows * D, "proj");
      k.q_conv = f32(hk.q_conv, C * K, "conv");
      k.k_conv = f32(hk.k_conv, C * K, "conv");
      k.v_conv = f32(hk.v_conv, C * K, "conv");
      k.f_b = bf(hk.f_b, C * d, "proj");
      k.A_log = f32(hk.A_log, Hl, "A_log");
      k.dt_bias = f32(hk.dt_bias, C, "dt_bias");
      k.o_norm = f32(hk.o_norm, d, "norm");
      k.o_proj = bf(hk.o_proj, D * C, "out_proj");
    } else {
      const auto& m = c.mla;
      const int64_t Hl = m.num_heads / G, Q = m.q_lora_rank, R = m.kv_lora_rank, dn = m.qk_nope_head_dim,
                    dv = m.v_head_dim, E = m.cache_dim();
      auto& a = L.mla;
      const auto& ha = h.mla;
      a.heads = static_cast<int>(Hl);
      a.q_a = bf(ha.q_a, Q * D, "proj");
      a.q_a_norm = bf(ha.q_a_norm, Q, "norm");
      a.q_b = bf(ha.q_b, Hl * m.qk_head_dim() * Q, "proj");
      a.kv_a = bf(ha.kv_a, E * D, "proj");
      a.kv_a_norm = bf(ha.kv_a_norm, R, "norm");
      a.kv_b = bf(ha.kv_b, Hl * (dn + dv) * R, "proj");
      a.g_proj = bf(ha.g_proj, Hl * dv * D, "proj");
      a.o_proj = bf(ha.o_proj, D * Hl * dv, "out_proj");
      if (L.attn == AttnKind::DSA) {
        const int64_t Hi = c.dsa->index_n_heads, Di = c.dsa->index_head_dim;
        a.has_indexer = true;
        a.indexer.wq_b = bf(ha.indexer.wq_b, Hi * Di * Q, "proj");
        a.indexer.wk = bf(ha.indexer.wk, Di * D, "proj");
        a.indexer.weights_proj = bf(ha.indexer.weights_proj, Hi * D, "proj");
        a.indexer.k_norm_w = bf(ha.indexer.k_norm_w, Di, "norm");
        a.indexer.k_norm_b = bf(ha.indexer.k_norm_b, Di, "bias");
      }
    }
    if (L.ffn == FfnKind::Dense) {
      const int64_t I = c.dense_intermediate_size;
      L.dense.gate = bf(h.dense.gate, I * D, "proj");
      L.dense.up = bf(h.dense.up, I * D, "proj");
      L.dense.down = bf(h.dense.down, D * I, "out_proj");
    } else {
      const auto& e = c.moe;
      const int64_t E = e.num_experts, Lt = e.latent_size, I = e.intermediate_size, S = e.shared_intermediate();
      auto& m = L.moe;
      const auto& hm = h.moe;
      m.gate = bf(hm.gate, E * D, "router");
      m.gate_bias = f32(hm.gate_bias, E, "bias");
      m.down = bf(hm.down, Lt * D, "proj");
      m.norm = bf(hm.norm, Lt, "norm");
      m.up = bf(hm.up, D * Lt, "out_proj");
      m.shared_gate = bf(hm.shared_gate, S * D, "proj");
      m.shared_up = bf(hm.shared_up, S * D, "proj");
      m.shared_down = bf(hm.shared_down, D * S, "out_proj");
      m.expert_begin = static_cast<int>(shard.world_rank * per_rank);
      std::vector<const uint8_t*> ptrs[6];
      for (int64_t x = 0; x < per_rank; ++x) {
        const ExpertWeights* hx = host ? &hm.experts[x] : nullptr;
        auto mx = [&](const ops::Mxfp4Matrix* hmx, int64_t N, int64_t K) {
          ops::Mxfp4Matrix d;
          d.packed = static_cast<const uint8_t*>(put(hmx ? hmx->packed : nullptr, N * K / 2, DType::U8, "mxfp4"));
          d.scale = static_cast<const uint8_t*>(put(hmx ? hmx->scale : nullptr, N * K / 32, DType::U8, "e8m0"));
          return d;
        };
        ExpertWeights ex{mx(hx ? &hx->w1 : nullptr, I, Lt), mx(hx ? &hx->w3 : nullptr, I, Lt),
                         mx(hx ? &hx->w2 : nullptr, Lt, I)};
        m.experts.push_back(ex);
        ptrs[0].push_back(ex.w1.packed);
        ptrs[1].push_back(ex.w1.scale);
        ptrs[2].push_back(ex.w3.packed);
        ptrs[3].push_back(ex.w3.scale);
        ptrs[4].push_back(ex.w2.packed);
        ptrs[5].push_back(ex.w2.scale);
      }
      const uint8_t* const* dev[6];
      for (int j = 0; j < 6; ++j) {
        g.bufs.emplace_back(ptrs[j].size() * sizeof(void*));
        CUDA_CHECK(cudaMemcpy(g.bufs.back().get(), ptrs[j].data(), ptrs[j].size() * sizeof(void*),
                              cudaMemcpyHostToDevice));
        dev[j] = g.bufs.back().get<const uint8_t* const>();
      }
      g.tables[l] = cu::Mxfp4ExpertTable{dev[0], dev[1], dev[2], dev[3], dev[4], dev[5]};
    }
    w.layers.push_back(L);
  }
  return g;
}

GpuWorkspace gpu_workspace(const ModelConfig& c, const GpuRankOptions& o) {
  GpuWorkspace w;
  const int G = o.shard.tp_size, Hk = c.kda.num_heads / G, Hm = c.mla.num_heads / G;
  const int64_t D = c.hidden_size, V = c.vocab_size, R = int64_t{o.max_batch} * o.max_q;
  const int64_t d = c.kda.head_dim, C = int64_t{Hk} * d, E = c.mla.cache_dim();
  // Per-layer scratch: an upper bound of every path's intermediates at R rows.
  const auto& m = c.mla;
  const int64_t Qr = m.q_lora_rank, Rl = m.kv_lora_rank, dn = m.qk_nope_head_dim, dv = m.v_head_dim;
  const int64_t Hi = c.dsa ? c.dsa->index_n_heads : 0, Di = c.dsa ? c.dsa->index_head_dim : 0;
  const int64_t topk = c.dsa ? c.dsa->index_topk : 0;
  const int64_t Ex = c.moe.num_experts, Lt = c.moe.latent_size, I = c.moe.intermediate_size,
                Sh = c.moe.shared_intermediate(), k = c.moe.experts_per_token, Idn = c.dense_intermediate_size;
  const int64_t in_rows = (4 * C + d + Hk + 15) / 16 * 16;
  size_t kda = align256(R * in_rows * 2) + 3 * align256(R * C * 2) + 2 * align256(R * C * 4) + align256(R * d * 2) +
               align256(R * C * 2) + align256(R * C * 4) + align256(R * Hk * 4) + align256(R * C * 4) +
               align256(R * C * 2);
  size_t mla = align256(R * Qr * 2) + align256(R * Hm * (dn + m.qk_rope_head_dim) * 2) + align256(R * E * 2) +
               align256(R * Hm * E * 2) + align256(R * Hm * Rl * 4) + align256(R * Hm * 4) +
               align256(R * Hm * Rl * 2) + 2 * align256(R * Hm * dv * 2) + align256(R * Hi * Di * 2) +
               align256(R * Hi * 4) + align256(R * Di * 2) + align256(R * o.max_context * 4) +
               align256(R * topk * 4) + align256(R * 4);
  size_t moe = align256(R * Ex * 4) + align256(R * k * 4) * 2 + align256(R * Lt * 2) * 2 + align256(R * D * 2) * 2 +
               align256(2 * R * Sh * 2) + align256(cu::moe_experts_scratch_bytes(R, static_cast<int>(k), Lt, I)) +
               2 * align256(R * k * Lt * 2);
  const int Dc = o.groups && !o.loopback ? o.groups->dcp->size() : 1;
  if (Dc > 1) {
    // DCP: gathered queries, partial outputs and LSEs sent and received; DSA's candidates and selections.
    mla += align256(Dc * R * Hm * E * 2) + 2 * align256(Dc * R * Hm * Rl * 4) + 2 * align256(Dc * R * Hm * 4);
    if (c.dsa) mla += 4 * align256(R * topk * 4) + 2 * align256(Dc * R * topk * 4) + 2 * align256(R * 4);
  }
  size_t dense = align256(2 * R * Idn * 2);
  const int64_t cR = (R + G - 1) / G, Rp = G * cR;  // row shards of R rows, gathered
  if (o.groups && !o.loopback) {
    // The EP exchange (real collectives): [W, cap] slots, cap = cR k.
    const int64_t slots = int64_t{o.shard.world_size} * cR * k;
    moe += align256(R * k * 4) + 2 * align256(slots * 4) + 3 * align256(slots * Lt * 2) +
           align256(cu::moe_experts_scratch_bytes(slots, 1, Lt, I));
  }
  // Gathers (all rows, padded to G shards), the reduce-scatter input, the shard, the lm_head slices.
  size_t step = align256(Rp * D * 2) * 2 + align256(R * D * 2) + align256(R * V * 4);
  w.layer_bytes = std::max({kda, mla, moe, dense});
  w.work_bytes = w.layer_bytes + step;
  w.attention_bytes = std::max(cu::mla_attend_paged_scratch_bytes(o.max_batch, o.max_q, Hm, static_cast<int>(Rl),
                                                                     static_cast<int>(o.max_context)),
                                 c.dsa ? cu::mla_attend_indexed_scratch_bytes(R, Hm, static_cast<int>(Rl),
                                                                              static_cast<int>(topk))
                                       : size_t{0});
  return w;
}

GpuRank::GpuRank(const ModelConfig& c, GpuWeights weights, const GpuRankOptions& o, cu::Context& ctx)
    : c_(c), weights_(std::move(weights)), o_(o), ctx_(ctx), plan_(LayerPlan::from(c)) {
  G_ = o.shard.tp_size;
  using Mode = GpuCollectives::Mode;
  const Mode mode = G_ == 1 && o.shard.world_size == 1 ? Mode::Single : o.loopback ? Mode::Loopback : Mode::Real;
  K3_CHECK(mode != Mode::Real || o.groups,
           "gpu: a multi-rank shard needs its groups (GpuRankOptions::groups) or loopback collectives");
  coll_ = GpuCollectives(mode, o.groups, G_, o.shard.tp_rank, ctx.stream);
  if (coll_.real()) {
    K3_CHECK(o.groups->world->size() == o.shard.world_size && o.groups->world->rank() == o.shard.world_rank,
             "gpu: world group of rank {} of {} for the shard of world rank {} of {}", o.groups->world->rank(),
             o.groups->world->size(), o.shard.world_rank, o.shard.world_size);
  }
  Hk_ = c.kda.num_heads / G_;
  Hm_ = c.mla.num_heads / G_;
  const int64_t D = c.hidden_size, V = c.vocab_size, R = int64_t{o.max_batch} * o.max_q;
  const int64_t S = o.max_slots, Q = o.max_q, d = c.kda.head_dim, C = int64_t{Hk_} * d, Kc = c.kda.conv_kernel;
  max_pages_ = static_cast<int>((o.max_context + o.page_size - 1) / o.page_size);
  const int64_t pages = S * max_pages_, E = c.mla.cache_dim();
  for (int32_t p = static_cast<int32_t>(pages) - 1; p >= 0; --p) free_pages_.push_back(p);
  slots_.resize(static_cast<size_t>(S));
  auto zeroed = [&](size_t bytes) {
    DeviceBuffer b(bytes);
    CUDA_CHECK(cudaMemset(b.get(), 0, bytes));
    cache_bytes_ += bytes;
    return b;
  };
  for (AttnKind k : c.attn_kinds) {
    if (k == AttnKind::KDA) {
      kda_index_.push_back(static_cast<int>(state_.size()));
      full_index_.push_back(-1);
      for (int j = 0; j < 3; ++j) {
        conv_.push_back(zeroed(S * C * (Kc - 1) * 4));
        conv_hist_.push_back(zeroed(S * Q * C * (Kc - 1) * 4));
      }
      state_.push_back(zeroed(S * Hk_ * d * d * 4));
      state_hist_.push_back(zeroed(S * Q * Hk_ * d * d * 4));
    } else {
      kda_index_.push_back(-1);
      full_index_.push_back(static_cast<int>(kv_.size()));
      kv_.push_back(zeroed(pages * o.page_size * E * 2));
      index_.push_back(zeroed(c.dsa ? pages * o.page_size * c.dsa->index_head_dim * 2 : 0));
    }
  }
  // Step metadata and its pinned staging.
  d_tokens_ = DeviceBuffer(R * 4);
  d_slots_ = DeviceBuffer(o.max_batch * 4);
  d_pos0_ = DeviceBuffer(o.max_batch * 4);
  d_ctx_ = DeviceBuffer(R * 4);
  d_ctx_local_ = DeviceBuffer(R * 4);
  d_tables_ = DeviceBuffer(int64_t{o.max_batch} * max_pages_ * 4);
  d_accepted_ = DeviceBuffer(o.max_batch * 4);
  pinned_bytes_ = static_cast<size_t>(R * 4 * 3 + o.max_batch * 4 * 3 + int64_t{o.max_batch} * max_pages_ * 4);
  CUDA_CHECK(cudaMallocHost(&pinned_, pinned_bytes_));
  // Activations.
  const int nb = plan_.num_blocks;
  P_ = DeviceBuffer(R * D * 2);
  blocks_ = DeviceBuffer(R * nb * D * 2);
  x_ = DeviceBuffer(R * D * 2);
  a_ = DeviceBuffer(R * D * 2);
  const int64_t cR = (R + G_ - 1) / G_;
  f_ = DeviceBuffer(G_ * cR * D * 2);  // the hybrid MoE gathers G shards into it
  if (coll_.real()) {
    ep_cap_ = cR * c.moe.experts_per_token;
    const std::vector<float> ones(static_cast<size_t>(o.shard.world_size * ep_cap_), 1.0f);
    ep_ones_ = DeviceBuffer(ones.size() * 4);
    CUDA_CHECK(cudaMemcpy(ep_ones_.get(), ones.data(), ones.size() * 4, cudaMemcpyHostToDevice));
  }
  logits_ = DeviceBuffer(R * V * 4);
  const GpuWorkspace ws = gpu_workspace(c, o);
  work_bytes_ = ws.work_bytes;
  layer_bytes_ = ws.layer_bytes;
  work_ = DeviceBuffer(work_bytes_);
  attn_scratch_bytes_ = ws.attention_bytes;
  attn_scratch_ = DeviceBuffer(std::max<size_t>(attn_scratch_bytes_, 256));
}

GpuRank::~GpuRank() {
  for (auto& e : events_) cudaEventDestroy(e);
  for (auto& g : graphs_) cudaGraphExecDestroy(g.exec);
  if (pinned_) cudaFreeHost(pinned_);
}

int GpuRank::admit() {
  for (int s = 0; s < static_cast<int>(slots_.size()); ++s) {
    if (slots_[s].active) continue;
    slots_[s].active = true;
    slots_[s].length = 0;
    for (size_t i = 0; i < conv_.size(); ++i) {
      const size_t per = conv_[i].bytes() / slots_.size();
      CUDA_CHECK(cudaMemsetAsync(conv_[i].get<char>() + s * per, 0, per, ctx_.stream));
    }
    for (auto& st : state_) {
      const size_t per = st.bytes() / slots_.size();
      CUDA_CHECK(cudaMemsetAsync(st.get<char>() + s * per, 0, per, ctx_.stream));
    }
    return s;
  }
  fail("admit: too many requests: all {} slots are in use", slots_.size());
}

void GpuRank::release(int slot) {
  K3_CHECK(slot >= 0 && slot < static_cast<int>(slots_.size()) && slots_[slot].active, "release: slot {} holds no request",
           slot);
  for (int32_t p : slots_[slot].pages) free_pages_.push_back(p);
  slots_[slot] = Slot{};
}

void GpuRank::set_context(int slot, int64_t length) {
  K3_CHECK(slot >= 0 && slot < static_cast<int>(slots_.size()) && slots_[slot].active, "slot {} holds no request", slot);
  K3_CHECK(length >= 0 && length <= o_.max_context, "context {} outside 0..{}", length, o_.max_context);
  Slot& s = slots_[slot];
  while (static_cast<int64_t>(s.pages.size()) * o_.page_size < length) {
    K3_CHECK(!free_pages_.empty(), "out of KV pages");
    s.pages.push_back(free_pages_.back());
    free_pages_.pop_back();
  }
  s.length = length;
}

std::vector<GpuRank::Pool> GpuRank::cache_pools() {
  std::vector<Pool> out;
  for (auto* v : {&conv_, &state_, &kv_, &index_})
    for (auto& b : *v)
      if (b.bytes()) out.push_back({b.get(), b.bytes(), v == &conv_ || v == &state_});
  return out;
}

void GpuRank::prepare(std::span<const int> slots, int q, std::span<const int32_t> tokens) {
  const int B = static_cast<int>(slots.size());
  const int min_b = coll_.real() && o_.shard.world_size > 1 ? 0 : 1;  // an idle replica steps with B = 0
  K3_CHECK(B >= min_b && B <= o_.max_batch, "step: {} requests outside {}..{}", B, min_b, o_.max_batch);
  K3_CHECK(q >= 1 && q <= o_.max_q, "step: q = {} outside 1..{}", q, o_.max_q);
  K3_CHECK(static_cast<int64_t>(tokens.size()) == int64_t{B} * q, "step: {} tokens for {} x {}", tokens.size(), B, q);
  for (int32_t t : tokens) K3_CHECK(t >= 0 && t < c_.vocab_size, "step: token id {} outside vocab 0..{}", t, c_.vocab_size - 1);
  int64_t need = 0;
  for (int s : slots) {
    K3_CHECK(s >= 0 && s < static_cast<int>(slots_.size()) && slots_[s].active, "step: slot {} holds no request", s);
    K3_CHECK(slots_[s].length + q <= o_.max_context, "step: slot {} is full ({} + {} > {})", s, slots_[s].length, q,
             o_.max_context);
    need += (slots_[s].length + q + o_.page_size - 1) / o_.page_size - static_cast<int64_t>(slots_[s].pages.size());
  }
  K3_CHECK(need <= static_cast<int64_t>(free_pages_.size()), "step: out of KV pages");
  B_ = B;
  q_ = q;
  prepared_ = true;
  const int64_t rows = int64_t{B} * q;
  auto* p = static_cast<int32_t*>(pinned_);
  int32_t* tok = p;
  int32_t* ctx = tok + rows;
  int32_t* sl = ctx + rows;
  int32_t* pos0 = sl + B;
  int32_t* tables = pos0 + B;
  int32_t* ctx_local = tables + int64_t{B} * max_pages_;  // DCP: positions of this rank visible to each row
  max_ctx_ = 0;
  for (int b = 0; b < B; ++b) {
    Slot& s = slots_[slots[b]];
    while (static_cast<int64_t>(s.pages.size()) * o_.page_size < s.length + q) {
      s.pages.push_back(free_pages_.back());
      free_pages_.pop_back();
    }
    sl[b] = slots[b];
    pos0[b] = static_cast<int32_t>(s.length);
    for (int i = 0; i < q; ++i) ctx[b * q + i] = static_cast<int32_t>(s.length + i + 1);
    for (int j = 0; j < max_pages_; ++j)
      tables[b * max_pages_ + j] = j < static_cast<int>(s.pages.size()) ? s.pages[j] : 0;
    max_ctx_ = std::max<int64_t>(max_ctx_, s.length + q);
  }
  std::copy(tokens.begin(), tokens.end(), tok);
  CUDA_CHECK(cudaMemcpyAsync(d_tokens_.get(), tok, rows * 4, cudaMemcpyHostToDevice, ctx_.stream));
  CUDA_CHECK(cudaMemcpyAsync(d_ctx_.get(), ctx, rows * 4, cudaMemcpyHostToDevice, ctx_.stream));
  if (coll_.dcp_size() > 1) {
    // DCP rank r of D holds positions p = j D + r: row at position t sees local j <= (t - r) / D.
    const int64_t D = coll_.dcp_size(), r = coll_.dcp_rank();
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t t = ctx[i] - 1;
      ctx_local[i] = static_cast<int32_t>(t >= r ? (t - r) / D + 1 : 0);
    }
    CUDA_CHECK(cudaMemcpyAsync(d_ctx_local_.get(), ctx_local, rows * 4, cudaMemcpyHostToDevice, ctx_.stream));
  }
  CUDA_CHECK(cudaMemcpyAsync(d_slots_.get(), sl, B * 4, cudaMemcpyHostToDevice, ctx_.stream));
  CUDA_CHECK(cudaMemcpyAsync(d_pos0_.get(), pos0, B * 4, cudaMemcpyHostToDevice, ctx_.stream));
  CUDA_CHECK(cudaMemcpyAsync(d_tables_.get(), tables, int64_t{B} * max_pages_ * 4, cudaMemcpyHostToDevice,
                             ctx_.stream));
  // The staging is reused by the next prepare(): finish these copies first.
  CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
}

bf16* GpuRank::scratch_bf16(size_t& at, int64_t n) {
  bf16* p = reinterpret_cast<bf16*>(work_.get<char>() + at);
  at += align256(static_cast<size_t>(n) * 2);
  K3_CHECK(at <= layer_bytes_, "internal: gpu scratch overflow ({} > {} bytes)", at, layer_bytes_);
  return p;
}
float* GpuRank::scratch_f32(size_t& at, int64_t n) {
  float* p = reinterpret_cast<float*>(work_.get<char>() + at);
  at += align256(static_cast<size_t>(n) * 4);
  K3_CHECK(at <= layer_bytes_, "internal: gpu scratch overflow ({} > {} bytes)", at, layer_bytes_);
  return p;
}

// Attention of layer l on the step's rows: out = o_proj partial of the local heads.
void GpuRank::attention(int l, const bf16* x, bf16* out) {
  const LayerWeights& lw = weights_.w.layers[l];
  auto* s = ctx_.stream;
  const int64_t D = c_.hidden_size, rows = int64_t{B_} * q_;
  const float eps = c_.rms_norm_eps;
  size_t at = 0;
  if (lw.attn == AttnKind::KDA) {
    const auto& w = lw.kda;
    const int H = w.heads, d = c_.kda.head_dim, K = c_.kda.conv_kernel;
    const int64_t C = int64_t{H} * d, P = w.in_rows;
    const int i = kda_index_[l];
    bf16* proj = scratch_bf16(at, rows * P);
    bf16* y[3] = {scratch_bf16(at, rows * C), scratch_bf16(at, rows * C), scratch_bf16(at, rows * C)};
    float* qn = scratch_f32(at, rows * C);
    float* kn = scratch_f32(at, rows * C);
    bf16* fa = scratch_bf16(at, rows * d);
    bf16* u = scratch_bf16(at, rows * C);
    float* g = scratch_f32(at, rows * C);
    float* beta = scratch_f32(at, rows * H);
    float* o = scratch_f32(at, rows * C);
    bf16* normed = scratch_bf16(at, rows * C);
    mark("kda.in_proj");
    K3_LAUNCH(cu::linear(ctx_, x, w.in_proj, proj, false, rows, D, P));
    mark("kda.conv_gate");
    const float* cw[3] = {w.q_conv, w.k_conv, w.v_conv};
    for (int j = 0; j < 3; ++j)
      K3_LAUNCH(cu::short_conv_silu(proj + j * C, P, cw[j], conv_[3 * i + j].get<float>(),
                                    conv_hist_[3 * i + j].get<float>(), d_slots_.get<int32_t>(), y[j], B_, q_, o_.max_q,
                                    C, K, s));
    K3_LAUNCH(cu::l2norm_heads(y[0], qn, rows, H, d, 1.0f / std::sqrt(static_cast<float>(d)), s));
    K3_LAUNCH(cu::l2norm_heads(y[1], kn, rows, H, d, 1.0f, s));
    CUDA_CHECK(cudaMemcpy2DAsync(fa, d * 2, proj + 4 * C, P * 2, d * 2, rows, cudaMemcpyDeviceToDevice, s));
    K3_LAUNCH(cu::linear(ctx_, fa, w.f_b, u, false, rows, d, C));
    K3_LAUNCH(cu::kda_gate(u, w.A_log, w.dt_bias, c_.kda.gate_lower_bound, g, rows, H, d, s));
    K3_LAUNCH(cu::kda_beta(proj + 4 * C + d, P, beta, rows, H, s));
    mark("kda.recurrence");
    K3_LAUNCH(cu::kda_recurrence(qn, kn, y[2], g, beta, state_[i].get<float>(), state_hist_[i].get<float>(),
                                 d_slots_.get<int32_t>(), o, B_, q_, o_.max_q, H, d, d, s));
    mark("kda.norm_o_proj");
    K3_LAUNCH(cu::kda_gated_norm(o, proj + 3 * C, P, w.o_norm, eps, normed, rows, H, d, s));
    K3_LAUNCH(cu::linear(ctx_, normed, w.o_proj, out, false, rows, C, D));
    return;
  }
  const auto& w = lw.mla;
  const auto& m = c_.mla;
  const int H = w.heads, R = m.kv_lora_rank, P = m.qk_rope_head_dim, dn = m.qk_nope_head_dim, dv = m.v_head_dim;
  const int64_t Q = m.q_lora_rank, E = R + P;
  const int i = full_index_[l];
  // DCP (Dc > 1): this rank's cache holds positions p = j Dc + dr at local index j.
  const int Dc = coll_.dcp_size(), dr = coll_.dcp_rank();
  const int32_t* ctx_here = Dc > 1 ? d_ctx_local_.get<int32_t>() : d_ctx_.get<int32_t>();
  bf16* cq = scratch_bf16(at, rows * Q);
  bf16* qf = scratch_bf16(at, rows * H * (dn + P));
  bf16* kv = scratch_bf16(at, rows * E);
  bf16* qlat = scratch_bf16(at, rows * H * E);
  float* olat = scratch_f32(at, rows * H * R);
  float* lse = scratch_f32(at, rows * H);
  bf16* olat_bf = scratch_bf16(at, rows * H * R);
  bf16* o = scratch_bf16(at, rows * H * dv);
  bf16* gate = scratch_bf16(at, rows * H * dv);
  mark("mla.proj");
  K3_LAUNCH(cu::linear(ctx_, x, w.q_a, cq, false, rows, D, Q));
  K3_LAUNCH(cu::rmsnorm(cq, w.q_a_norm, cq, rows, Q, eps, s));
  K3_LAUNCH(cu::linear(ctx_, cq, w.q_b, qf, false, rows, Q, int64_t{H} * (dn + P)));
  K3_LAUNCH(cu::linear(ctx_, x, w.kv_a, kv, false, rows, D, E));
  K3_LAUNCH(cu::cache_write(kv, E, E, w.kv_a_norm, R, eps, d_pos0_.get<int32_t>(), B_, q_, d_tables_.get<int32_t>(),
                            max_pages_, o_.page_size, Dc, dr, kv_[i].get<bf16>(), s));
  K3_LAUNCH(cu::mla_absorb_q(ctx_, qf, w.kv_b, qlat, rows, H, dn, P, dv, R));
  const float scale = 1.0f / std::sqrt(static_cast<float>(dn + P));
  // The queries attended here: this rank's heads, or (DCP) every DCP member's [Dc, rows, H, E], each
  // member's partial (o, lse) [Dc, rows, H, R] / [Dc, rows, H] sent back to it and merged below.
  const bf16* qs = qlat;
  float* po = olat;
  float* pl = lse;
  float *got_o = nullptr, *got_lse = nullptr;
  if (Dc > 1) {
    bf16* qall = scratch_bf16(at, Dc * rows * H * E);
    po = scratch_f32(at, Dc * rows * H * R);
    got_o = scratch_f32(at, Dc * rows * H * R);
    pl = scratch_f32(at, Dc * rows * H);
    got_lse = scratch_f32(at, Dc * rows * H);
    mark("collectives");
    coll_.dcp_all_gather(qlat, qall, rows * H * E, DType::BF16);
    qs = qall;
  }
  mark(w.has_indexer ? "dsa.indexer_attend" : "mla.attend");
  if (!w.has_indexer) {
    for (int mb = 0; mb < Dc; ++mb)
      K3_LAUNCH(cu::mla_attend_paged(qs + mb * rows * H * E, kv_[i].get<bf16>(), d_tables_.get<int32_t>(), max_pages_,
                                     o_.page_size, ctx_here, B_, q_, static_cast<int>(max_ctx_), H, R, P, scale,
                                     po + mb * rows * H * R, pl + mb * rows * H, attn_scratch_.get(),
                                     attn_scratch_bytes_, s));
  } else {
    const int Hi = c_.dsa->index_n_heads, Di = c_.dsa->index_head_dim, topk = c_.dsa->index_topk;
    bf16* qi = scratch_bf16(at, rows * Hi * Di);
    float* wi = scratch_f32(at, rows * Hi);
    bf16* ki = scratch_bf16(at, rows * Di);
    float* scores = scratch_f32(at, rows * o_.max_context);
    auto* sel = reinterpret_cast<int32_t*>(scratch_f32(at, rows * topk));
    auto* cnt = reinterpret_cast<int32_t*>(scratch_f32(at, rows));
    K3_LAUNCH(cu::linear(ctx_, x, w.indexer.wk, ki, false, rows, D, Di));
    K3_LAUNCH(cu::layernorm(ki, w.indexer.k_norm_w, w.indexer.k_norm_b, ki, rows, Di, eps, s));
    K3_LAUNCH(cu::cache_write(ki, Di, Di, nullptr, 0, eps, d_pos0_.get<int32_t>(), B_, q_, d_tables_.get<int32_t>(),
                              max_pages_, o_.page_size, Dc, dr, index_[i].get<bf16>(), s));
    K3_LAUNCH(cu::linear(ctx_, cq, w.indexer.wq_b, qi, false, rows, Q, int64_t{Hi} * Di));
    K3_LAUNCH(cu::linear(ctx_, x, w.indexer.weights_proj, wi, true, rows, D, Hi));
    K3_LAUNCH(cu::scale(wi, 1.0f / std::sqrt(static_cast<float>(Di)) / std::sqrt(static_cast<float>(Hi)), rows * Hi, s));
    const int max_ctx = static_cast<int>(max_ctx_);
    K3_LAUNCH(cu::dsa_index_scores_paged(qi, wi, index_[i].get<bf16>(), d_tables_.get<int32_t>(), max_pages_,
                                         o_.page_size, ctx_here, B_, q_, max_ctx, Hi, Di, scores, s));
    K3_LAUNCH(cu::topk_indices(scores, max_ctx, ctx_here, rows, topk, sel, cnt, s));
    if (Dc > 1) {
      // The global top-k (ops/dcp.h): local candidates, all-gathered, the same selection on every
      // member, then the selected positions held here as local indices.
      float* cand_s = scratch_f32(at, rows * topk);
      auto* cand_p = reinterpret_cast<int32_t*>(scratch_f32(at, rows * topk));
      float* all_s = scratch_f32(at, Dc * rows * topk);
      auto* all_p = reinterpret_cast<int32_t*>(scratch_f32(at, Dc * rows * topk));
      auto* sel_g = reinterpret_cast<int32_t*>(scratch_f32(at, rows * topk));
      auto* cnt_g = reinterpret_cast<int32_t*>(scratch_f32(at, rows));
      K3_LAUNCH(cu::dcp_topk_candidates(scores, max_ctx, sel, cnt, rows, topk, Dc, dr, cand_s, cand_p, s));
      mark("collectives");
      coll_.dcp_all_gather(cand_s, all_s, rows * topk, DType::F32);
      coll_.dcp_all_gather(cand_p, all_p, rows * topk, DType::I32);
      mark("dsa.indexer_attend");
      K3_LAUNCH(cu::dcp_scatter_candidates(all_s, all_p, Dc, rows, topk, max_ctx, scores, s));
      K3_LAUNCH(cu::topk_indices(scores, max_ctx, d_ctx_.get<int32_t>(), rows, topk, sel_g, cnt_g, s));
      K3_LAUNCH(cu::dcp_local_selection(sel_g, cnt_g, rows, topk, Dc, dr, sel, cnt, s));
    }
    for (int mb = 0; mb < Dc; ++mb)
      K3_LAUNCH(cu::mla_attend_indexed(qs + mb * rows * H * E, kv_[i].get<bf16>(), d_tables_.get<int32_t>(),
                                       max_pages_, o_.page_size, sel, cnt, topk, B_, q_, H, R, P, scale,
                                       po + mb * rows * H * R, pl + mb * rows * H, attn_scratch_.get(),
                                       attn_scratch_bytes_, s));
  }
  if (Dc > 1) {
    mark("collectives");
    coll_.dcp_all_to_all(po, got_o, rows * H * R, DType::F32);
    coll_.dcp_all_to_all(pl, got_lse, rows * H, DType::F32);
    mark("mla.merge");
    K3_LAUNCH(cu::lse_merge(got_o, got_lse, Dc, rows, H, R, olat, lse, s));
  }
  mark("mla.out");
  K3_LAUNCH(cu::to_bf16(olat, olat_bf, rows * H * R, s));
  K3_LAUNCH(cu::mla_unabsorb(ctx_, olat_bf, w.kv_b, o, rows, H, dn, dv, R));
  K3_LAUNCH(cu::linear(ctx_, x, w.g_proj, gate, false, rows, D, int64_t{H} * dv));
  K3_LAUNCH(cu::gate_sigmoid(o, gate, o, rows * H * dv, s));
  K3_LAUNCH(cu::linear(ctx_, o, w.o_proj, out, false, rows, int64_t{H} * dv, D));
}

// The MoE of layer l on `rows` rows of x (this rank's shard) -> out. With real
// collectives every rank calls it for every MoE layer, rows = 0 included (the
// EP exchange spans the world).
void GpuRank::moe(int l, const bf16* x, int64_t rows, bf16* out) {
  if (rows == 0 && !coll_.real()) return;
  const MoeWeights& w = weights_.w.layers[l].moe;
  const auto& e = c_.moe;
  auto* s = ctx_.stream;
  const int64_t D = c_.hidden_size, E = e.num_experts, L = e.latent_size, I = e.intermediate_size,
                S = e.shared_intermediate();
  const int k = e.experts_per_token;
  const ops::SituParams situ{c_.situ_beta, c_.situ_linear_beta};
  size_t at = 0;
  float* logits = scratch_f32(at, rows * E);
  auto* idx = reinterpret_cast<int32_t*>(scratch_f32(at, rows * k));
  float* wts = scratch_f32(at, rows * k);
  bf16* z = scratch_bf16(at, rows * L);
  bf16* y = scratch_bf16(at, rows * L);
  bf16* up = scratch_bf16(at, rows * D);
  bf16* shared = scratch_bf16(at, rows * D);
  bf16* mlp_scratch = scratch_bf16(at, 2 * rows * S);
  mark("moe.router_down");
  if (rows > 0) {
    K3_LAUNCH(cu::linear(ctx_, x, w.gate, logits, true, rows, D, E));
    K3_LAUNCH(cu::route(logits, w.gate_bias, rows, static_cast<int>(E), k, e.renormalize, e.routed_scaling_factor,
                        idx, wts, s));
    K3_LAUNCH(cu::linear(ctx_, x, w.down, z, false, rows, D, L));
  }
  const int count = static_cast<int>(w.experts.size());
  mark("moe.experts");
  if (coll_.real()) {
    ep_experts(l, z, idx, wts, rows, y, at);
    if (rows == 0) return;
  } else if (!o_.loopback) {
    const size_t moe_bytes = cu::moe_experts_scratch_bytes(rows, k, L, I);
    void* moe_scratch = scratch_bf16(at, static_cast<int64_t>((moe_bytes + 1) / 2));
    K3_LAUNCH(cu::moe_experts(ctx_, z, idx, wts, weights_.tables[l], w.expert_begin, count, y, moe_scratch, rows, k,
                              L, I, situ));
  } else {
    // EP over W ranks: this rank sends its rows * k pairs out and receives, on
    // average, the pairs of the world's real rows that chose its experts:
    // recv = ceil(m DP k / W) = ceil(m k / G). The loopback computes exactly that
    // many pairs on its local experts (router choices folded into the local
    // range) and moves the latent rows of the dispatch and the combine.
    const size_t moe_bytes = cu::moe_experts_scratch_bytes(rows, k, L, I);
    void* moe_scratch = scratch_bf16(at, static_cast<int64_t>((moe_bytes + 1) / 2));
    bf16* exchange = scratch_bf16(at, 2 * rows * k * L);  // sent rows, then received outputs
    const int64_t m = int64_t{B_} * q_, recv = std::min<int64_t>(rows * k, (m * k + G_ - 1) / G_);
    CUDA_CHECK(cudaMemcpyAsync(exchange, z, rows * L * 2, cudaMemcpyDeviceToDevice, s));  // dispatch (send side)
    coll_.replicate_rows(exchange, rows, rows * k, L);
    K3_LAUNCH(cu::remap_experts(idx, recv, w.expert_begin, count, s));
    bf16* got = exchange + rows * k * L;  // the received pairs' outputs
    K3_LAUNCH(cu::moe_experts(ctx_, exchange, idx, wts, weights_.tables[l], w.expert_begin, count, got, moe_scratch,
                              recv, 1, L, I, situ));
    CUDA_CHECK(cudaMemcpyAsync(y, got, rows * L * 2, cudaMemcpyDeviceToDevice, s));  // combine (return side)
  }
  mark("moe.norm_up");
  K3_LAUNCH(cu::rmsnorm(y, w.norm, y, rows, L, c_.rms_norm_eps, s));
  K3_LAUNCH(cu::linear(ctx_, y, w.up, up, false, rows, L, D));
  mark("moe.shared");
  K3_LAUNCH(cu::mlp(ctx_, x, w.shared_gate, w.shared_up, w.shared_down, shared, rows, D, S, situ, mlp_scratch));
  K3_LAUNCH(cu::add(up, shared, out, rows * D, s));
}

// The EP exchange over the world (ops/ep.h): the shard's (row, choice) pairs packed
// per owner into [W, cap] slots, all-to-all, the owner's experts on what it received
// (k = 1, weight 1; padding slots carry id -1 and are skipped), all-to-all back, and
// the combine in each row's chosen order: y [rows, L].
void GpuRank::ep_experts(int l, const bf16* z, const int32_t* idx, const float* wts, int64_t rows, bf16* y,
                         size_t& at) {
  const MoeWeights& w = weights_.w.layers[l].moe;
  const auto& e = c_.moe;
  auto* s = ctx_.stream;
  const int64_t L = e.latent_size, I = e.intermediate_size, W = o_.shard.world_size, slots = W * ep_cap_;
  const int k = e.experts_per_token;
  auto* slot = reinterpret_cast<int32_t*>(scratch_f32(at, int64_t{o_.max_batch} * o_.max_q * k));
  auto* send_ids = reinterpret_cast<int32_t*>(scratch_f32(at, slots));
  auto* recv_ids = reinterpret_cast<int32_t*>(scratch_f32(at, slots));
  bf16* send = scratch_bf16(at, slots * L);  // the packed rows, then the outputs that come back
  bf16* recv = scratch_bf16(at, slots * L);
  bf16* out = scratch_bf16(at, slots * L);
  void* moe_scratch = scratch_bf16(at, static_cast<int64_t>((cu::moe_experts_scratch_bytes(slots, 1, L, I) + 1) / 2));
  K3_LAUNCH(cu::ep_pack(idx, z, rows, k, L, static_cast<int>(e.num_experts / W), static_cast<int>(W), ep_cap_, slot,
                        send_ids, send, s));
  mark("collectives");
  coll_.world_all_to_all(send_ids, recv_ids, ep_cap_, DType::I32);
  coll_.world_all_to_all(send, recv, ep_cap_ * L, DType::BF16);
  mark("moe.experts");
  K3_LAUNCH(cu::moe_experts(ctx_, recv, recv_ids, ep_ones_.get<float>(), weights_.tables[l], w.expert_begin,
                            static_cast<int>(w.experts.size()), out, moe_scratch, slots, 1, L, I,
                            ops::SituParams{c_.situ_beta, c_.situ_linear_beta}));
  mark("collectives");
  coll_.world_all_to_all(out, send, ep_cap_ * L, DType::BF16);
  mark("moe.combine");
  K3_LAUNCH(cu::ep_combine(send, slot, wts, rows, k, L, y, s));
}

void GpuRank::enqueue(StepKind kind) {
  K3_CHECK(prepared_, "step: prepare() first");
  auto* s = ctx_.stream;
  const int64_t D = c_.hidden_size, m = int64_t{B_} * q_, V = c_.vocab_size;
  if (m == 0) {
    // An idle replica: only the EP exchanges of the MoE layers (the other replicas' rows).
    for (int l = 0; l < c_.num_layers; ++l)
      if (weights_.w.layers[l].ffn == FfnKind::MoE) moe(l, nullptr, 0, nullptr);
    return;
  }
  const int nb = plan_.num_blocks;
  const float eps = c_.rms_norm_eps;
  const bool stock = kind == StepKind::Stock;
  // Row shard of this rank (rank t of G): stock keeps the residual on it.
  const int t = o_.shard.tp_rank;
  const int64_t cs = (m + G_ - 1) / G_, r0 = std::min(m, t * cs), real = std::min(m, r0 + cs) - r0;
  const int64_t res_rows = stock ? cs : m;
  bf16* P = P_.get<bf16>();
  bf16* blocks = blocks_.get<bf16>();
  bf16* x = x_.get<bf16>();
  bf16* a = a_.get<bf16>();
  bf16* f = f_.get<bf16>();
  // The step's buffers live after the per-layer scratch (sizes of gpu_workspace).
  const int64_t R = int64_t{o_.max_batch} * o_.max_q, Rp = G_ * ((R + G_ - 1) / G_);
  char* tail = work_.get<char>() + (work_bytes_ - (align256(Rp * D * 2) * 2 + align256(R * D * 2) + align256(R * V * 4)));
  bf16* gathered = reinterpret_cast<bf16*>(tail);                              // [G cs, D]
  bf16* partial = reinterpret_cast<bf16*>(tail + align256(Rp * D * 2));        // [G cs, D]
  bf16* sharded = reinterpret_cast<bf16*>(tail + 2 * align256(Rp * D * 2));    // [cs, D] (loopback: scratch [m, D])
  float* lm = reinterpret_cast<float*>(tail + 2 * align256(Rp * D * 2) + align256(R * D * 2));  // [G, m, V / G]
  if (stock) {
    CUDA_CHECK(cudaMemsetAsync(P, 0, cs * D * 2, s));
    K3_LAUNCH(cu::embedding(d_tokens_.get<int32_t>() + r0, real, weights_.w.embed, V, D, P, s));
    // The reduce-scatter sums G cs rows; attention writes the first m.
    if (G_ > 1) CUDA_CHECK(cudaMemsetAsync(partial + m * D, 0, (G_ * cs - m) * D * 2, s));
  } else {
    K3_LAUNCH(cu::embedding(d_tokens_.get<int32_t>(), m, weights_.w.embed, V, D, P, s));
  }
  for (int l = 0; l < c_.num_layers; ++l) {
    const LayerInfo& li = plan_.layers[l];
    const LayerWeights& lw = weights_.w.layers[l];
    cu::AttnResCudaArgs pre;
    pre.prefix = P;
    pre.delta = l == 0 ? nullptr : f;
    pre.blocks = blocks;
    pre.max_blocks = nb;
    pre.norm_w = lw.attn_res_norm;
    pre.proj_w = lw.attn_res_proj;
    pre.out_norm_w = lw.input_norm;
    pre.num_blocks = li.blocks_before_attn;
    pre.block_write_idx = li.block_write_idx;
    pre.eps = eps;
    pre.out_eps = eps;
    pre.out = x;
    pre.rows = res_rows;
    pre.dim = D;
    mark("attn_res");
    K3_LAUNCH(cu::attn_res(pre, s));
    const bf16* attn_in = x;
    if (stock && G_ > 1) {
      mark("collectives");
      coll_.tp_all_gather_rows(x, gathered, m, D);
      attn_in = gathered;
    }
    attention(l, attn_in, stock && G_ > 1 ? partial : a);
    mark("collectives");
    if (stock && G_ > 1)
      coll_.tp_reduce_scatter_rows(partial, a, m, D, sharded);  // [G cs, D] partials -> this rank's [cs, D]
    else if (!stock)
      coll_.tp_all_reduce(a, m * D, partial);
    mark("attn_res");
    if (li.block_start) CUDA_CHECK(cudaMemcpyAsync(P, a, res_rows * D * 2, cudaMemcpyDeviceToDevice, s));
    cu::AttnResCudaArgs post = pre;
    post.delta = li.block_start ? nullptr : a;
    post.norm_w = lw.mlp_res_norm;
    post.proj_w = lw.mlp_res_proj;
    post.out_norm_w = lw.post_attn_norm;
    post.num_blocks = li.blocks_after_attn;
    post.block_write_idx = -1;
    K3_LAUNCH(cu::attn_res(post, s));
    if (lw.ffn == FfnKind::Dense) {
      mark("dense_mlp");
      const int64_t rows = stock ? real : m;
      size_t at = 0;
      bf16* scratch = scratch_bf16(at, 2 * rows * c_.dense_intermediate_size);
      if (rows > 0)
        K3_LAUNCH(cu::mlp(ctx_, x, lw.dense.gate, lw.dense.up, lw.dense.down, f, rows, D, c_.dense_intermediate_size,
                          ops::SituParams{c_.situ_beta, c_.situ_linear_beta}, scratch));
    } else if (stock) {
      moe(l, x, real, f);
    } else {
      // run_stock_moe: this rank's shard, then all-gathered back to all rows.
      moe(l, x + r0 * D, real, G_ > 1 ? sharded : f);
      mark("collectives");
      if (G_ > 1) coll_.tp_all_gather_rows(sharded, f, m, D);
    }
  }
  cu::AttnResCudaArgs fin;
  fin.prefix = P;
  fin.delta = f;
  fin.blocks = blocks;
  fin.max_blocks = nb;
  fin.norm_w = weights_.w.out_res_norm;
  fin.proj_w = weights_.w.out_res_proj;
  fin.num_blocks = nb;
  fin.eps = eps;
  fin.out_eps = eps;
  fin.out = x;
  fin.rows = res_rows;
  fin.dim = D;
  mark("lm_head");
  K3_LAUNCH(cu::attn_res(fin, s));
  K3_LAUNCH(cu::rmsnorm(x, weights_.w.norm, x, res_rows, D, eps, s));
  const bf16* h = x;
  if (stock && G_ > 1) {
    coll_.tp_all_gather_rows(x, gathered, m, D);
    h = gathered;
  }
  const int64_t Vl = weights_.w.vocab_count;
  float* out = logits_.get<float>();
  if (G_ == 1) {
    K3_LAUNCH(cu::linear(ctx_, h, weights_.w.lm_head, out, true, m, D, Vl));
  } else {
    K3_LAUNCH(cu::linear(ctx_, h, weights_.w.lm_head, lm + t * m * Vl, true, m, D, Vl));
    coll_.vocab_all_gather(lm, m, Vl, out);
  }
}

void GpuRank::mark(const char* label) {
  if (!profiling_) return;
  if (n_marks_ == events_.size()) {
    cudaEvent_t e;
    CUDA_CHECK(cudaEventCreate(&e));
    events_.push_back(e);
    labels_.push_back(nullptr);
  }
  CUDA_CHECK(cudaEventRecord(events_[n_marks_], ctx_.stream));
  labels_[n_marks_++] = label;
}

std::vector<std::pair<std::string, double>> GpuRank::profile(StepKind kind) {
  profiling_ = true;
  n_marks_ = 0;
  try {
    enqueue(kind);
    mark("end");
  } catch (...) {
    profiling_ = false;
    throw;
  }
  profiling_ = false;
  CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
  std::vector<std::pair<std::string, double>> out;
  for (size_t i = 0; i + 1 < n_marks_; ++i) {
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, events_[i], events_[i + 1]));
    auto it = std::find_if(out.begin(), out.end(), [&](const auto& p) { return p.first == labels_[i]; });
    if (it == out.end())
      out.emplace_back(labels_[i], ms);
    else
      it->second += ms;
  }
  return out;
}

void GpuRank::run_graph(StepKind kind) {
  K3_CHECK(coll_.capturable(),
           "gpu: this rank's collectives ({}) cannot be captured in a CUDA graph; run the step with enqueue()",
           o_.groups ? o_.groups->tp->name() : std::string("?"));
  for (auto& g : graphs_)
    if (g.kind == kind && g.B == B_ && g.q == q_) {
      CUDA_CHECK(cudaGraphLaunch(g.exec, ctx_.stream));
      return;
    }
  cudaGraph_t graph;
  CUDA_CHECK(cudaStreamBeginCapture(ctx_.stream, cudaStreamCaptureModeThreadLocal));
  const int64_t keep = max_ctx_;
  max_ctx_ = o_.max_context;  // a graph serves any context up to the capacity
  try {
    enqueue(kind);
  } catch (...) {
    cudaStreamEndCapture(ctx_.stream, &graph);
    max_ctx_ = keep;
    throw;
  }
  max_ctx_ = keep;
  CUDA_CHECK(cudaStreamEndCapture(ctx_.stream, &graph));
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_CHECK(cudaGraphDestroy(graph));
  graphs_.push_back({kind, B_, q_, exec});
  CUDA_CHECK(cudaGraphLaunch(exec, ctx_.stream));
}

std::vector<float> GpuRank::logits() {
  const int64_t n = int64_t{B_} * q_ * c_.vocab_size;
  std::vector<float> out(static_cast<size_t>(n));
  CUDA_CHECK(cudaMemcpyAsync(out.data(), logits_.get(), n * 4, cudaMemcpyDeviceToHost, ctx_.stream));
  CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
  return out;
}

void GpuRank::commit(std::span<const int> slots, std::span<const int> accepted) {
  const int B = static_cast<int>(slots.size());
  K3_CHECK(B == B_ && static_cast<int>(accepted.size()) == B, "commit: {} slots for the last step's {}", B, B_);
  auto* p = static_cast<int32_t*>(pinned_);
  for (int b = 0; b < B; ++b) {
    K3_CHECK(accepted[b] >= 0 && accepted[b] <= q_, "commit: {} tokens accepted of {}", accepted[b], q_);
    p[b] = accepted[b];
    p[B + b] = slots[b];
  }
  CUDA_CHECK(cudaMemcpyAsync(d_accepted_.get(), p, B * 4, cudaMemcpyHostToDevice, ctx_.stream));
  CUDA_CHECK(cudaMemcpyAsync(d_slots_.get(), p + B, B * 4, cudaMemcpyHostToDevice, ctx_.stream));
  const int64_t d = c_.kda.head_dim, C = int64_t{Hk_} * d, K = c_.kda.conv_kernel;
  for (size_t i = 0; i < state_.size(); ++i) {
    for (int j = 0; j < 3; ++j)
      K3_LAUNCH(cu::commit_state(conv_hist_[3 * i + j].get<float>(), conv_[3 * i + j].get<float>(),
                                 d_slots_.get<int32_t>(), d_accepted_.get<int32_t>(), B, o_.max_q, C * (K - 1),
                                 ctx_.stream));
    K3_LAUNCH(cu::commit_state(state_hist_[i].get<float>(), state_[i].get<float>(), d_slots_.get<int32_t>(),
                               d_accepted_.get<int32_t>(), B, o_.max_q, C * d, ctx_.stream));
  }
  CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
  for (int b = 0; b < B; ++b) {
    Slot& s = slots_[slots[b]];
    s.length += accepted[b];
    const size_t keep = static_cast<size_t>((s.length + o_.page_size - 1) / o_.page_size);
    while (s.pages.size() > keep) {
      free_pages_.push_back(s.pages.back());
      s.pages.pop_back();
    }
  }
}

}  // namespace k3
