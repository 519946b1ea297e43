// CpuBackend (runtime/cpu_backend.h).
#include "runtime/cpu_backend.h"

#include <algorithm>

#include "ops/attn_res.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/linear.h"
#include "ops/rmsnorm.h"
#include "runtime/steps.h"

namespace k3 {

CpuBackend::CpuBackend(const CpuStepEnv& env, const int32_t* tokens, const StepShape& shape)
    : env_(env), tokens_(tokens), shape_(shape), D_(env.config->hidden_size) {}

void CpuBackend::begin(StepKind, const StepRows& r) {
  r_ = r;
  const int64_t rows = r.G * r.cs, nb = env_.plan->num_blocks;
  for (Act a : {Act::P, Act::X, Act::A, Act::F, Act::Gathered, Act::Partial})
    bufs_[static_cast<size_t>(a)].assign(static_cast<size_t>(rows * D_), 0.0f);
  bufs_[static_cast<size_t>(Act::Blocks)].assign(static_cast<size_t>(rows * nb * D_), 0.0f);
  bufs_[static_cast<size_t>(Act::Sharded)].assign(static_cast<size_t>(r.cs * D_), 0.0f);
  logits.clear();
  aux.clear();
}

void CpuBackend::embed(int64_t row0, int64_t rows, int64_t) {
  if (rows > 0) ops::embedding(tokens_ + row0, rows, env_.weights->embed, env_.config->vocab_size, D_, at(Act::P));
}

void CpuBackend::attn_res(const ResMix& r) {
  const float eps = env_.config->rms_norm_eps;
  ops::attn_res({at(Act::P), r.has_delta ? at(r.delta) : nullptr, at(Act::Blocks), env_.plan->num_blocks, r.norm_w,
                 r.proj_w, r.out_norm_w, r.num_blocks, r.block_write_idx, eps, eps, at(Act::X), r.rows, D_});
}

void CpuBackend::rmsnorm(Act x, const bf16* w, int64_t rows) {
  ops::rmsnorm(at(x), w, at(x), rows, D_, env_.config->rms_norm_eps);
}

void CpuBackend::copy_rows(Act dst, Act src, int64_t rows) { std::copy_n(at(src), rows * D_, at(dst)); }

void CpuBackend::attention(int l, Act x, Act out) {
  const LayerWeights& lw = env_.weights->layers[l];
  if (lw.attn == AttnKind::KDA)
    kda_attention(*env_.config, lw.kda, l, at(x), shape_, *env_.cache, at(out));
  else
    mla_attention(*env_.config, lw.mla, l, at(x), shape_, *env_.cache, env_.dcp, at(out));
}

void CpuBackend::moe(int l, Act x, int64_t row0, int64_t cs, int64_t real, Act out, SharedPart shared) {
  const MoeWeights& w = env_.weights->layers[l].moe;
  const bool own = shared == SharedPart::Own;
  // TP-sharded shared experts: their partial sum of all m rows first, the routed rows added into it.
  if (!own && r_.m > 0) k3::shared_mlp(*env_.config, w, at(x), r_.m, at(out));
  if (w.down_rows < env_.config->moe.latent_size) {
    // Sliced (TP-sharded latent down): all m rows routed here, this member's own rows [row0, row0 + real)
    // added into out.
    K3_CHECK(!own, "internal: a sliced latent down goes with TP-sharded shared experts");
    moe_ffn(*env_.config, w, at(x), r_.m, r_.m, *env_.world, at(out), false, MoeSlice{r_.G, r_.t, r_.cs});
    return;
  }
  // x has G cs rows: the shard's padding rows past m are zero and never routed. Without the shared experts
  // the routed rows are added into out's rows [row0, row0 + real).
  moe_ffn(*env_.config, w, at(x) + row0 * D_, cs, real, *env_.world, at(out) + (own ? 0 : row0 * D_), own);
}

void CpuBackend::dense(int l, Act x, int64_t rows, Act out) {
  std::fill(bufs_[static_cast<size_t>(out)].begin(), bufs_[static_cast<size_t>(out)].end(), 0.0f);
  dense_ffn(*env_.config, env_.weights->layers[l].dense, at(x), rows, at(out));
}

void CpuBackend::lm_head(Act h, int64_t m) {
  const ModelWeights& w = *env_.weights;
  const int G = env_.tp->size();
  const int64_t Vl = w.vocab_count, V = env_.config->vocab_size;
  std::vector<float> part(static_cast<size_t>(m * Vl)), all(static_cast<size_t>(G * m * Vl));
  if (m > 0) ops::linear(at(h), w.lm_head, part.data(), m, D_, Vl, /*round_out=*/false);
  env_.tp->all_gather(part.data(), all.data(), m * Vl, DType::F32);
  logits.assign(static_cast<size_t>(m * V), 0.0f);
  for (int g = 0; g < G; ++g)
    for (int64_t r = 0; r < m; ++r) std::copy_n(&all[(g * m + r) * Vl], Vl, &logits[r * V + g * Vl]);
}

void CpuBackend::all_gather_rows(Act shard, Act all, int64_t) { sp_all_gather(*env_.tp, at(shard), r_.cs, D_, at(all)); }

void CpuBackend::reduce_scatter_rows(Act partial, Act shard, int64_t) {
  reduce_scatter_bf16(*env_.tp, at(partial), at(shard), r_.cs * D_);
}

void CpuBackend::all_reduce(Act a, int64_t m) { all_reduce_bf16(*env_.tp, at(a), m * D_); }

void CpuBackend::capture_aux(bool with_delta, int64_t rows, bool gather) {
  std::vector<float> stream(static_cast<size_t>(rows * D_));
  const float* P = at(Act::P);
  const float* f = at(Act::F);
  for (int64_t i = 0; i < rows * D_; ++i) stream[i] = with_delta ? round_bf16(P[i] + f[i]) : P[i];
  if (!gather) {
    aux.insert(aux.end(), stream.begin(), stream.end());
    return;
  }
  std::vector<float> all(static_cast<size_t>(r_.G * r_.cs * D_));
  sp_all_gather(*env_.tp, stream.data(), r_.cs, D_, all.data());
  aux.insert(aux.end(), all.begin(), all.begin() + r_.m * D_);
}

}  // namespace k3
