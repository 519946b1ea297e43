#include "runtime/engine.h"

#include <algorithm>

#include "comm/local.h"
#include "model/layers.h"

namespace k3 {

namespace {
ShardSpec shard_of(const Layout& L, int w) { return {L.tp, L.tp_rank(w), L.world(), w}; }
// Everything about the layout and the groups, before any weight is read.
Layout checked(const ModelConfig& c, const EngineOptions& o, const Layout& L, int w, const RankGroups& g) {
  L.validate();
  for (int a : o.aux_layers)
    K3_CHECK(a >= 0 && a <= c.num_layers, "aux layer {} outside 0..{}", a, c.num_layers);
  K3_CHECK(w >= 0 && w < L.world(), "layout: rank {} outside 0..{}", w, L.world() - 1);
  check_shardable(c, shard_of(L, w));
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
      weights_(load_weights(config_, *src_, shard_of(layout_, world_rank))),
      caches_(config_, options.cache, config_.kda.num_heads / layout_.tp, layout_.dcp, layout_.dcp_rank(world_rank)),
      tp_(std::make_unique<CountingComm>(std::move(groups.tp))),
      dcp_(std::make_unique<CountingComm>(std::move(groups.dcp))),
      world_(std::make_unique<CountingComm>(std::move(groups.world))) {
  slots_.resize(static_cast<size_t>(caches_.options().max_slots));
}

void Engine::reset_counts() {
  tp_->reset();
  dcp_->reset();
  world_->reset();
}

StepKind Engine::choose_step(int64_t rows, int q) const {
  if (opts_.step != StepKind::Auto) return opts_.step;
  const int64_t c = (rows + layout_.tp - 1) / layout_.tp;
  return q > 1 && rows % q == 0 && c <= opts_.moe_capacity ? StepKind::Hybrid : StepKind::Stock;
}

void Engine::check_slot(int slot, const char* what) const {
  K3_CHECK(slot >= 0 && slot < static_cast<int>(slots_.size()), "{}: slot {} does not exist (0..{})", what, slot,
           slots_.size() - 1);
  K3_CHECK(slots_[slot].active, "{}: slot {} holds no request", what, slot);
}

int Engine::admit() {
  for (int s = 0; s < static_cast<int>(slots_.size()); ++s) {
    if (slots_[s].active) continue;
    caches_.reset_slot(s);
    slots_[s] = Slot{true, 0, 0};
    return s;
  }
  fail("admit: too many requests: all {} slots are in use", slots_.size());
}

void Engine::release(int slot) {
  check_slot(slot, "release");
  caches_.reset_slot(slot);
  slots_[slot] = Slot{};
}

int64_t Engine::length(int slot) const {
  check_slot(slot, "length");
  return slots_[slot].length;
}

bool Engine::pending(int slot) const {
  check_slot(slot, "pending");
  return slots_[slot].pending_q > 0;
}

void Engine::validate_step(std::span<const int> slots, int q, std::span<const int32_t> tokens) const {
  const auto& o = caches_.options();
  const int B = static_cast<int>(slots.size());
  K3_CHECK(B >= 1 || layout_.world() > 1, "step: no requests");
  K3_CHECK(q >= 1 && q <= o.max_q, "step: q = {} outside 1..{} (max_q)", q, o.max_q);
  K3_CHECK(static_cast<int64_t>(tokens.size()) == int64_t{B} * q, "step: {} tokens for {} requests x q = {}",
           tokens.size(), B, q);
  int64_t new_pages = 0;
  for (int b = 0; b < B; ++b) {
    check_slot(slots[b], "step");
    K3_CHECK(std::count(slots.begin(), slots.end(), slots[b]) == 1, "step: slot {} listed twice", slots[b]);
    const Slot& s = slots_[slots[b]];
    K3_CHECK(s.pending_q == 0, "step: slot {} has an uncommitted step (commit it first)", slots[b]);
    K3_CHECK(s.length + q <= o.max_context, "step: slot {} is full: {} + {} tokens exceed the cache of {} tokens",
             slots[b], s.length, q, o.max_context);
    new_pages += caches_.new_pages(s.length, s.length + q);
  }
  for (size_t i = 0; i < tokens.size(); ++i)
    K3_CHECK(tokens[i] >= 0 && tokens[i] < config_.vocab_size, "step: token id {} (row {}) outside vocab 0..{}",
             tokens[i], i, config_.vocab_size - 1);
  K3_CHECK(new_pages <= caches_.free_pages(), "step: out of KV pages ({} free, {} needed)", caches_.free_pages(),
           new_pages);

}

std::vector<float> Engine::step(std::span<const int> slots, int q, std::span<const int32_t> tokens) {
  // Every rank validates; on a multi-rank layout the ranks agree (one 4-byte world
  // all-reduce) so that a rejected input raises on all of them and none is left
  // waiting in a collective.
  std::string error;
  try {
    validate_step(slots, q, tokens);
  } catch (const Error& e) {
    error = e.what();
  }
  if (layout_.world() > 1) {
    float bad = error.empty() ? 0.0f : 1.0f;
    world_->all_reduce(&bad, 1, DType::F32);
    if (bad > 0 && error.empty()) error = "step: aborted because another rank rejected its input";
  }
  if (!error.empty()) throw Error(error);
  const int B = static_cast<int>(slots.size());
  StepShape shape;
  shape.B = B;
  shape.q = q;
  std::vector<int> bound(slots.begin(), slots.end());
  for (int b = 0; b < B; ++b) {
    Slot& s = slots_[slots[b]];
    caches_.reserve(slots[b], s.length + q);
    shape.pos0.push_back(s.length);
    s.pending_q = q;
  }
  caches_.bind(bound);
  StepEnv env;
  env.config = &config_;
  env.plan = &plan_;
  env.weights = &weights_;
  env.cache = &caches_;
  env.tp = tp_.get();
  env.world = world_.get();
  env.dcp = Dcp{dcp_.get(), layout_.dcp, layout_.dcp_rank(world_rank_)};
  env.aux_layers = opts_.aux_layers;
  last_step_ = choose_step(shape.rows(), q);
  StepOutput out = last_step_ == StepKind::Hybrid ? HybridStep::run(env, tokens.data(), shape)
                                                   : StockStep::run(env, tokens.data(), shape);
  last_aux_ = std::move(out.aux);
  return std::move(out.logits);
}

void Engine::commit(int slot, int n) {
  check_slot(slot, "commit");
  Slot& s = slots_[slot];
  K3_CHECK(s.pending_q > 0, "commit: slot {} has no pending step", slot);
  K3_CHECK(n >= 0 && n <= s.pending_q, "commit: {} tokens accepted of a step of {}", n, s.pending_q);
  if (n > 0) caches_.commit_kda(slot, n);
  s.length += n;
  s.pending_q = 0;
  caches_.shrink(slot, s.length);
}

std::vector<float> Engine::prefill(int slot, std::span<const int32_t> prompt) {
  check_slot(slot, "prefill");
  const auto& o = caches_.options();
  K3_CHECK(!prompt.empty(), "prefill: empty prompt");
  K3_CHECK(slots_[slot].length + static_cast<int64_t>(prompt.size()) <= o.max_context,
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
