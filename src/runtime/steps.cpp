// The step loop of runtime/steps.h, once for every backend.
#include "runtime/steps.h"

#include <algorithm>

namespace k3 {

const char* step_kind_name(StepKind k) {
  switch (k) {
    case StepKind::Auto: return "auto";
    case StepKind::Stock: return "stock";
    case StepKind::Hybrid: return "hybrid";
  }
  return "?";
}

int64_t sp_shard_rows(int64_t m, int G) { return (m + G - 1) / G; }

StepRows step_rows(int64_t m, int G, int t) {
  StepRows r;
  r.m = m;
  r.G = G;
  r.t = t;
  r.cs = sp_shard_rows(m, G);
  r.r0 = std::min(m, t * r.cs);
  r.real = std::min(m, r.r0 + r.cs) - r.r0;
  return r;
}

int64_t sp_shard(const float* x, int64_t m, int64_t D, int G, int t, float* shard) {
  const StepRows r = step_rows(m, G, t);
  std::copy_n(x + r.r0 * D, r.real * D, shard);
  std::fill(shard + r.real * D, shard + r.cs * D, 0.0f);
  return r.real;
}

void sp_all_gather(Comm& tp, const float* shard, int64_t c, int64_t D, float* all) {
  all_gather_bf16(tp, shard, all, c * D);
}

const char* shared_experts_name(SharedExperts s) { return s == SharedExperts::Tp ? "tp" : "replicated"; }

SharedExperts default_shared_experts(StepKind step) {
  return step == StepKind::Hybrid ? SharedExperts::Tp : SharedExperts::Replicated;
}

SharedExperts parse_shared_experts(const std::string& flag, StepKind step) {
  K3_CHECK(flag.empty() || flag == "auto" || flag == "replicated" || flag == "tp",
           "--shared-experts {}: expected replicated | tp", flag);
  if (flag.empty() || flag == "auto") return default_shared_experts(step);
  return flag == "tp" ? SharedExperts::Tp : SharedExperts::Replicated;
}

void validate(const StepOptions& o) {
  K3_CHECK(!(o.step == StepKind::Stock && o.shared == SharedExperts::Tp),
           "--step stock needs --shared-experts replicated (TP-sharded shared experts run in the hybrid step only)");
  K3_CHECK(o.moe_capacity >= 1, "--moe-capacity {} must be >= 1", o.moe_capacity);
}

StepKind choose_step(const StepOptions& o, int64_t rows, int q, int G) {
  validate(o);
  if (o.shared == SharedExperts::Tp) return StepKind::Hybrid;
  if (o.step != StepKind::Auto) return o.step;
  if (G == 1) return StepKind::Hybrid;
  const int64_t c = sp_shard_rows(rows, G);
  return q > 1 && rows % q == 0 && c <= o.moe_capacity ? StepKind::Hybrid : StepKind::Stock;
}

void agree_on_input(const std::function<void()>& validate, const std::function<void(float*)>& world_sum) {
  std::string error;
  try {
    validate();
  } catch (const Error& e) {
    error = e.what();
  }
  if (world_sum) {
    float bad = error.empty() ? 0.0f : 1.0f;
    world_sum(&bad);
    if (bad > 0 && error.empty()) throw PeerRejectedInput();
  }
  if (!error.empty()) throw Error(error);
}

namespace {

bool listed(const std::vector<int>& aux, int index) { return std::find(aux.begin(), aux.end(), index) != aux.end(); }

// The layer loop of both steps. Stock keeps the residual stream on the rank's
// row shard and gathers rows around attention; hybrid keeps every row and
// shards only the MoE.
void run_layers(bool stock, StepBackend& be, const ModelConfig& c, const LayerPlan& plan, const StepRows& r,
                const std::vector<int>& aux) {
  const ModelWeights& w = be.weights();
  K3_CHECK(!(stock && w.ffn_tp),
           "step: the stock step needs replicated shared experts and dense MLP; these weights are TP-sharded");
  be.begin(stock ? StepKind::Stock : StepKind::Hybrid, r);
  if (r.m == 0) {
    // An idle replica: only the EP exchanges of the MoE layers (the other replicas' rows).
    const SharedPart shared = w.ffn_tp ? SharedPart::TpAllRows : SharedPart::Own;
    for (int l = 0; l < c.num_layers; ++l)
      if (plan.layers[l].ffn == FfnKind::MoE) be.moe(l, Act::X, 0, 0, 0, Act::F, shared);
    return;
  }
  const int64_t res_rows = stock ? r.cs : r.m;
  if (stock)
    be.embed(r.r0, r.real, r.cs);
  else
    be.embed(0, r.m, r.m);
  if (listed(aux, 0)) be.capture_aux(false, res_rows, stock);
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerInfo& li = plan.layers[l];
    const LayerWeights& lw = w.layers[l];
    ResMix pre{l, Act::F, l > 0, lw.attn_res_norm, lw.attn_res_proj, lw.input_norm, li.blocks_before_attn,
               li.block_write_idx, res_rows};
    be.attn_res(pre);
    if (stock) {
      be.all_gather_rows(Act::X, Act::Gathered, r.m);
      be.attention(l, Act::Gathered, Act::Partial);  // rows [m, G cs) stay zero padding
      be.reduce_scatter_rows(Act::Partial, Act::A, r.m);
    } else {
      be.attention(l, Act::X, Act::A);
      be.all_reduce(Act::A, r.m);
    }
    if (li.block_start) be.copy_rows(Act::P, Act::A, res_rows);
    ResMix post{l, Act::A, !li.block_start, lw.mlp_res_norm, lw.mlp_res_proj, lw.post_attn_norm,
                li.blocks_after_attn, -1, res_rows};
    be.attn_res(post);
    if (lw.ffn == FfnKind::Dense) {
      be.dense(l, Act::X, stock ? r.real : r.m, Act::F);
      if (w.ffn_tp) be.all_reduce(Act::F, r.m);  // the partial sums of the rank's intermediate slices
    } else if (stock) {
      be.moe(l, Act::X, 0, r.cs, r.real, Act::F, SharedPart::Own);
    } else if (w.ffn_tp) {
      // The shared partial of all rows, the routed rows of this rank's shard added into it: one all-reduce.
      be.moe(l, Act::X, r.r0, r.cs, r.real, Act::F, SharedPart::TpAllRows);
      be.all_reduce(Act::F, r.m);
    } else {
      be.moe(l, Act::X, r.r0, r.cs, r.real, Act::Sharded, SharedPart::Own);
      be.all_gather_rows(Act::Sharded, Act::F, r.m);
    }
    if (listed(aux, l + 1)) be.capture_aux(true, res_rows, stock);
  }
  const int nb = plan.num_blocks;
  be.attn_res(ResMix{-1, Act::F, true, w.out_res_norm, w.out_res_proj, nullptr, nb, -1, res_rows});
  be.rmsnorm(Act::X, w.norm, res_rows);
  if (stock) {
    be.all_gather_rows(Act::X, Act::Gathered, r.m);
    be.lm_head(Act::Gathered, r.m);
  } else {
    be.lm_head(Act::X, r.m);
  }
}

}  // namespace

void StockStep::run(StepBackend& be, const ModelConfig& c, const LayerPlan& plan, const StepRows& rows,
                    const std::vector<int>& aux_layers) {
  run_layers(true, be, c, plan, rows, aux_layers);
}

void HybridStep::run(StepBackend& be, const ModelConfig& c, const LayerPlan& plan, const StepRows& rows,
                     const std::vector<int>& aux_layers) {
  run_layers(false, be, c, plan, rows, aux_layers);
}

void run_step(StepKind kind, StepBackend& be, const ModelConfig& c, const LayerPlan& plan, const StepRows& rows,
              const std::vector<int>& aux_layers) {
  K3_CHECK(kind == StepKind::Stock || kind == StepKind::Hybrid, "step: kind {} is not a step (choose_step first)",
           step_kind_name(kind));
  if (kind == StepKind::Stock)
    StockStep::run(be, c, plan, rows, aux_layers);
  else
    HybridStep::run(be, c, plan, rows, aux_layers);
}

}  // namespace k3
