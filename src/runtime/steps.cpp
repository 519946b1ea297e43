#include "runtime/steps.h"

#include <algorithm>

#include "ops/attn_res.h"
#include "ops/embedding.h"
#include "ops/linear.h"
#include "ops/rmsnorm.h"

namespace k3 {

namespace {
using Buf = std::vector<float>;
Buf buf(int64_t n) { return Buf(static_cast<size_t>(n), 0.0f); }

bool has_aux(const StepEnv& env, int index) {
  return std::find(env.aux_layers.begin(), env.aux_layers.end(), index) != env.aux_layers.end();
}

// Attention of layer l on all m rows: the o_proj partial of the local heads.
void attention(const StepEnv& env, int l, const float* x, const StepShape& s, float* out) {
  const LayerWeights& lw = env.weights->layers[l];
  if (lw.attn == AttnKind::KDA)
    kda_attention(*env.config, lw.kda, l, x, s, *env.cache, out);
  else
    mla_attention(*env.config, lw.mla, l, x, s, *env.cache, env.dcp, out);
}

// Final AttnRes + norm on `rows` rows of P (the caller gathers them if sharded).
void final_norm(const StepEnv& env, float* P, const float* m, float* blocks, int64_t rows, float* h) {
  const ModelConfig& c = *env.config;
  const int nb = env.plan->num_blocks;
  const float eps = c.rms_norm_eps;
  ops::AttnResArgs fin{P, m, blocks, nb, env.weights->out_res_norm, env.weights->out_res_proj, nullptr, nb, -1,
                       eps, eps, h, rows, c.hidden_size};
  ops::attn_res(fin);
  ops::rmsnorm(h, env.weights->norm, h, rows, c.hidden_size, eps);
}

// Vocab-parallel lm_head on all m rows -> logits [m, V] on every tp rank.
void lm_head(const StepEnv& env, const float* h, int64_t m, std::vector<float>& logits) {
  const ModelConfig& c = *env.config;
  const ModelWeights& w = *env.weights;
  const int G = env.tp->size();
  const int64_t Vl = w.vocab_count, V = c.vocab_size;
  Buf part = buf(m * Vl), all = buf(G * m * Vl);
  if (m > 0) ops::linear(h, w.lm_head, part.data(), m, c.hidden_size, Vl, /*round_out=*/false);
  env.tp->all_gather(part.data(), all.data(), m * Vl, DType::F32);
  logits.assign(static_cast<size_t>(m * V), 0.0f);
  for (int g = 0; g < G; ++g)
    for (int64_t r = 0; r < m; ++r) std::copy_n(&all[(g * m + r) * Vl], Vl, &logits[r * V + g * Vl]);
}

void capture(std::vector<float>& aux, const float* P, const float* m, int64_t n) {
  for (int64_t i = 0; i < n; ++i) aux.push_back(m ? round_bf16(P[i] + m[i]) : P[i]);
}

}  // namespace

const char* step_kind_name(StepKind k) {
  switch (k) {
    case StepKind::Auto: return "auto";
    case StepKind::Stock: return "stock";
    case StepKind::Hybrid: return "hybrid";
  }
  return "?";
}

int64_t sp_shard_rows(int64_t m, int G) { return (m + G - 1) / G; }

int64_t sp_shard(const float* x, int64_t m, int64_t D, int G, int t, float* shard) {
  const int64_t c = sp_shard_rows(m, G), r0 = std::min(m, t * c), real = std::min(m, r0 + c) - r0;
  std::copy_n(x + r0 * D, real * D, shard);
  std::fill(shard + real * D, shard + c * D, 0.0f);
  return real;
}

void sp_all_gather(Comm& tp, const float* shard, int64_t c, int64_t D, float* all) {
  all_gather_bf16(tp, shard, all, c * D);
}

void run_stock_moe(const StepEnv& env, int layer, const float* x, int64_t m, float* out) {
  const int64_t D = env.config->hidden_size;
  const int G = env.tp->size();
  const int64_t c = sp_shard_rows(m, G);
  Buf shard = buf(c * D), y = buf(c * D), all = buf(G * c * D);
  const int64_t real = sp_shard(x, m, D, G, env.tp->rank(), shard.data());
  moe_ffn(*env.config, env.weights->layers[layer].moe, shard.data(), c, real, *env.world, y.data());
  sp_all_gather(*env.tp, y.data(), c, D, all.data());
  std::copy_n(all.data(), m * D, out);
}

void run_dense(const StepEnv& env, int layer, const float* x, int64_t m, float* out) {
  dense_ffn(*env.config, env.weights->layers[layer].dense, x, m, out);
}

StepOutput HybridStep::run(const StepEnv& env, const int32_t* tokens, const StepShape& s) {
  const ModelConfig& c = *env.config;
  const int64_t D = c.hidden_size, m = s.rows();
  const int nb = env.plan->num_blocks;
  const float eps = c.rms_norm_eps;
  StepOutput out;
  Buf P = buf(m * D), blocks = buf(m * nb * D), x = buf(m * D), a = buf(m * D), f = buf(m * D);
  if (m > 0) ops::embedding(tokens, m, env.weights->embed, c.vocab_size, D, P.data());
  if (has_aux(env, 0)) capture(out.aux, P.data(), nullptr, m * D);
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerInfo& li = env.plan->layers[l];
    const LayerWeights& lw = env.weights->layers[l];
    ops::attn_res({P.data(), l == 0 ? nullptr : f.data(), blocks.data(), nb, lw.attn_res_norm, lw.attn_res_proj,
                   lw.input_norm, li.blocks_before_attn, li.block_write_idx, eps, eps, x.data(), m, D});
    attention(env, l, x.data(), s, a.data());
    all_reduce_bf16(*env.tp, a.data(), m * D);
    if (li.block_start) std::copy(a.begin(), a.end(), P.begin());
    ops::attn_res({P.data(), li.block_start ? nullptr : a.data(), blocks.data(), nb, lw.mlp_res_norm,
                   lw.mlp_res_proj, lw.post_attn_norm, li.blocks_after_attn, -1, eps, eps, x.data(), m, D});
    if (lw.ffn == FfnKind::Dense)
      run_dense(env, l, x.data(), m, f.data());
    else
      run_stock_moe(env, l, x.data(), m, f.data());
    if (has_aux(env, l + 1)) capture(out.aux, P.data(), f.data(), m * D);
  }
  final_norm(env, P.data(), f.data(), blocks.data(), m, x.data());
  lm_head(env, x.data(), m, out.logits);
  return out;
}

StepOutput StockStep::run(const StepEnv& env, const int32_t* tokens, const StepShape& s) {
  const ModelConfig& c = *env.config;
  const int64_t D = c.hidden_size, m = s.rows();
  const int G = env.tp->size(), t = env.tp->rank(), nb = env.plan->num_blocks;
  const int64_t cs = sp_shard_rows(m, G), r0 = std::min(m, t * cs), real = std::min(m, r0 + cs) - r0;
  const float eps = c.rms_norm_eps;
  StepOutput out;
  // The residual stream of this rank's shard only.
  Buf P = buf(cs * D), blocks = buf(cs * nb * D), xs = buf(cs * D), as = buf(cs * D), f = buf(cs * D);
  Buf all = buf(G * cs * D), a = buf(G * cs * D), gathered = buf(G * cs * D);
  if (real > 0) ops::embedding(tokens + r0, real, env.weights->embed, c.vocab_size, D, P.data());
  auto capture_all = [&](const float* mm) {
    Buf stream = buf(cs * D);
    for (int64_t i = 0; i < cs * D; ++i) stream[i] = mm ? round_bf16(P[i] + mm[i]) : P[i];
    sp_all_gather(*env.tp, stream.data(), cs, D, gathered.data());
    out.aux.insert(out.aux.end(), gathered.begin(), gathered.begin() + m * D);
  };
  if (has_aux(env, 0)) capture_all(nullptr);
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerInfo& li = env.plan->layers[l];
    const LayerWeights& lw = env.weights->layers[l];
    ops::attn_res({P.data(), l == 0 ? nullptr : f.data(), blocks.data(), nb, lw.attn_res_norm, lw.attn_res_proj,
                   lw.input_norm, li.blocks_before_attn, li.block_write_idx, eps, eps, xs.data(), cs, D});
    sp_all_gather(*env.tp, xs.data(), cs, D, all.data());
    std::fill(a.begin(), a.end(), 0.0f);
    attention(env, l, all.data(), s, a.data());  // rows [m, G c) stay zero padding
    reduce_scatter_bf16(*env.tp, a.data(), as.data(), cs * D);
    if (li.block_start) std::copy(as.begin(), as.end(), P.begin());
    ops::attn_res({P.data(), li.block_start ? nullptr : as.data(), blocks.data(), nb, lw.mlp_res_norm,
                   lw.mlp_res_proj, lw.post_attn_norm, li.blocks_after_attn, -1, eps, eps, xs.data(), cs, D});
    if (lw.ffn == FfnKind::Dense) {
      std::fill(f.begin(), f.end(), 0.0f);
      dense_ffn(c, lw.dense, xs.data(), real, f.data());
    } else {
      moe_ffn(c, lw.moe, xs.data(), cs, real, *env.world, f.data());
    }
    if (has_aux(env, l + 1)) capture_all(f.data());
  }
  final_norm(env, P.data(), f.data(), blocks.data(), cs, xs.data());
  sp_all_gather(*env.tp, xs.data(), cs, D, all.data());
  lm_head(env, all.data(), m, out.logits);
  return out;
}

}  // namespace k3
