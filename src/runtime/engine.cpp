// Engine (runtime/engine.h): one rank's CPU decode runtime over the one step loop.
#include "runtime/engine.h"

#include <algorithm>

#include "comm/local.h"
#include "model/layers.h"
#include "runtime/cpu_backend.h"

namespace k3 {

namespace {
ShardSpec shard_of(const Layout& L, int w, const EngineOptions& o) {
  return {L.tp, L.tp_rank(w), L.world(), w, o.shared == SharedExperts::Tp};
}
// Everything about the layout and the groups, before any weight is read.
Layout checked(const ModelConfig& c, const EngineOptions& o, const Layout& L, int w, const RankGroups& g) {
  L.validate();
  validate(StepOptions{o.step, o.moe_capacity, o.shared});
  for (int a : o.aux_layers)
    K3_CHECK(a >= 0 && a <= c.num_layers, "aux layer {} outside 0..{}", a, c.num_layers);
  K3_CHECK(w >= 0 && w < L.world(), "layout: rank {} outside 0..{}", w, L.world() - 1);
  check_shardable(c, shard_of(L, w, o));
  K3_CHECK(g.tp && g.dcp && g.world, "layout: rank {} is missing a tp / dcp / world group", w);
  K3_CHECK(g.tp->size() == L.tp && g.dcp->size() == L.dcp && g.world->size() == L.world(),
           "layout: groups of sizes tp {} dcp {} world {} for --tp {} --dcp {} --dp {}", g.tp->size(), g.dcp->size(),
           g.world->size(), L.tp, L.dcp, L.dp);
  K3_CHECK(g.tp->rank() == L.tp_rank(w) && g.dcp->rank() == L.dcp_rank(w) && g.world->rank() == w,
           "layout: rank {} was given the groups of tp rank {} / dcp rank {} / world rank {}", w, g.tp->rank(),
           g.dcp->rank(), g.world->rank());
  return L;
}
}  // namespace

Engine::Engine(std::shared_ptr<const TensorSource> src, const ModelConfig& config, const EngineOptions& options)
    : Engine(std::move(src), config, options, Layout{}, 0, std::move(make_local_world(Layout{})[0])) {}

Engine::Engine(std::shared_ptr<const TensorSource> src, const ModelConfig& config, const EngineOptions& options,
               const Layout& layout, int world_rank, RankGroups groups)
    : src_(std::move(src)),
      config_(config),
      opts_(options),
      layout_(checked(config_, options, layout, world_rank, groups)),
      world_rank_(world_rank),
      plan_(LayerPlan::from(config_)),
      weights_(load_weights(config_, *src_, shard_of(layout_, world_rank, options))),
      caches_(config_, options.cache, config_.kda.num_heads / layout_.tp, layout_.dcp, layout_.dcp_rank(world_rank)),
      tp_(std::make_unique<CountingComm>(std::move(groups.tp))),
      dcp_(std::make_unique<CountingComm>(std::move(groups.dcp))),
      world_(std::make_unique<CountingComm>(std::move(groups.world))) {}

void Engine::reset_counts() {
  tp_->reset();
  dcp_->reset();
  world_->reset();
}

StepKind Engine::choose_step(int64_t rows, int q) const {
  return k3::choose_step(step_options(), rows, q, layout_.tp);
}

int Engine::admit(int64_t reserve_tokens) {
  const int s = caches_.table().admit(reserve_tokens);
  caches_.reset_slot(s);
  return s;
}

void Engine::release(int slot) { caches_.table().release(slot); }

std::vector<float> Engine::step(std::span<const int> slots, int q, std::span<const int32_t> tokens) {
  SlotTable& table = caches_.table();
  std::function<void(float*)> world_sum;
  if (layout_.world() > 1) world_sum = [&](float* v) { world_->all_reduce(v, 1, DType::F32); };
  agree_on_input([&] { table.validate_step(slots, q, tokens, config_.vocab_size, layout_.world() > 1); }, world_sum);
  StepShape shape;
  shape.B = static_cast<int>(slots.size());
  shape.q = q;
  shape.pos0 = table.begin_step(slots, q);
  caches_.bind(std::vector<int>(slots.begin(), slots.end()));
  CpuStepEnv env{&config_, &plan_, &weights_, &caches_, tp_.get(), world_.get(),
                 Dcp{dcp_.get(), layout_.dcp, layout_.dcp_rank(world_rank_)}};
  CpuBackend be(env, tokens.data(), shape);
  last_step_ = choose_step(shape.rows(), q);
  run_step(last_step_, be, config_, plan_, step_rows(shape.rows(), layout_.tp, layout_.tp_rank(world_rank_)),
           opts_.aux_layers);
  last_aux_ = std::move(be.aux);
  return std::move(be.logits);
}

void Engine::commit(int slot, int n) {
  SlotTable& table = caches_.table();
  table.check_slot(slot, "commit");
  K3_CHECK(table.pending(slot), "commit: slot {} has no pending step", slot);
  const int q = table.pending_q(slot);
  table.commit(slot, n);  // checks n
  caches_.commit_kda(slot, n, q);
}

std::vector<float> Engine::prefill(int slot, std::span<const int32_t> prompt) {
  caches_.table().check_slot(slot, "prefill");
  const auto& o = caches_.options();
  K3_CHECK(!prompt.empty(), "prefill: empty prompt");
  K3_CHECK(length(slot) + static_cast<int64_t>(prompt.size()) <= o.max_context,
           "prefill: prompt of {} tokens exceeds the cache of {} tokens", prompt.size(), o.max_context);
  for (size_t i = 0; i < prompt.size(); ++i)
    K3_CHECK(prompt[i] >= 0 && prompt[i] < config_.vocab_size, "prefill: token id {} (position {}) outside vocab 0..{}",
             prompt[i], i, config_.vocab_size - 1);
  std::vector<float> all;
  all.reserve(prompt.size() * static_cast<size_t>(config_.vocab_size));
  for (size_t at = 0; at < prompt.size(); at += static_cast<size_t>(o.max_q)) {
    const int q = static_cast<int>(std::min<size_t>(static_cast<size_t>(o.max_q), prompt.size() - at));
    const int slots[1] = {slot};
    auto logits = step(slots, q, prompt.subspan(at, static_cast<size_t>(q)));
    commit(slot, q);
    all.insert(all.end(), logits.begin(), logits.end());
  }
  return all;
}

}  // namespace k3
