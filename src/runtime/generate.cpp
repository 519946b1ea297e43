// generate() over a Decoder (runtime/generate.h): prefill in chunks, greedy or top-p sampling, eos.
#include "runtime/generate.h"

#include <algorithm>

#include "core/rng.h"
#include "ops/sampling.h"

namespace k3 {

std::vector<ops::SampleResult> Decoder::step_sample(std::span<const int> slots, int q, std::span<const int32_t> tokens,
                                                    std::span<const ops::SampleSpec> spec) {
  const int64_t V = config().vocab_size, rows = static_cast<int64_t>(slots.size()) * q;
  K3_CHECK(static_cast<int64_t>(spec.size()) == rows, "step_sample: {} specs for {} requests x q = {}", spec.size(),
           slots.size(), q);
  ops::check_specs(spec.data(), rows, V);
  const std::vector<float> logits = step(slots, q, tokens);
  std::vector<ops::SampleResult> out(static_cast<size_t>(rows));
  ops::sample_rows(logits.data(), rows, V, spec.data(), out.data());
  return out;
}

namespace {

struct Live {
  int index = 0;  // request id
  int slot = -1;
  size_t fed = 0;  // prompt tokens fed
  bool done = false;
  Rng rng{0};
  GenerateResult result;
};

}  // namespace

void EngineDecoder::commit(std::span<const int> slots, std::span<const int> counts) {
  K3_CHECK(slots.size() == counts.size(), "commit: {} slots but {} counts", slots.size(), counts.size());
  for (size_t i = 0; i < slots.size(); ++i) e_.commit(slots[i], counts[i]);
}

void EngineDecoder::world_sum(float* data, int64_t n) {
  if (e_.layout().world() > 1) e_.world().all_reduce(data, n, DType::F32);
}

std::vector<GenerateResult> generate(Engine& engine, const std::vector<std::vector<int32_t>>& prompts, int max_new,
                                     const SamplingParams& sp, bool keep_logits) {
  EngineDecoder d(engine);
  return generate(d, prompts, max_new, sp, keep_logits);
}

std::vector<GenerateResult> generate(Decoder& engine, const std::vector<std::vector<int32_t>>& prompts, int max_new,
                                     const SamplingParams& sp, bool keep_logits) {
  const ModelConfig& c = engine.config();
  const int64_t V = c.vocab_size;
  const Layout& L = engine.layout();
  const int replica = L.replica(engine.world_rank());
  K3_CHECK(max_new >= 1, "generate: max_new {} must be >= 1", max_new);
  K3_CHECK(!prompts.empty(), "generate: no prompts");
  // Validate every request up front, identically on every rank.
  int mine = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    K3_CHECK(!prompts[i].empty(), "generate: prompt {} is empty", i);
    K3_CHECK(static_cast<int64_t>(prompts[i].size()) + max_new - 1 <= engine.max_context(),
             "generate: prompt {} of {} tokens + {} new exceeds the cache of {} tokens", i, prompts[i].size(), max_new,
             engine.max_context());
    for (int32_t t : prompts[i])
      K3_CHECK(t >= 0 && t < V, "generate: token id {} in prompt {} outside vocab 0..{}", t, i, V - 1);
    mine += static_cast<int>(i) % L.dp == replica;
  }
  K3_CHECK(mine <= engine.max_slots(), "generate: {} requests on one replica exceed its {} slots", mine,
           engine.max_slots());

  std::vector<Live> live;
  for (size_t i = 0; i < prompts.size(); ++i)
    if (static_cast<int>(i) % L.dp == replica) {
      Live r;
      r.index = static_cast<int>(i);
      r.slot = engine.admit(0);
      r.rng = Rng(sp.seed + i);
      live.push_back(std::move(r));
    }
  // A generated token's spec: two uniforms from the request's Rng, always both.
  auto spec_of = [&](Live& r) {
    ops::SampleSpec s;
    s.temperature = sp.greedy ? 0.0f : sp.temperature;
    s.top_p = sp.greedy ? 1.0f : sp.top_p;
    s.u_accept = r.rng.uniform();
    s.u_draw = r.rng.uniform();
    return s;
  };
  auto take = [&](Live& r, int32_t tok) {
    r.result.tokens.push_back(tok);
    if ((sp.stop_at_eos && tok == c.eos_token_id) || static_cast<int>(r.result.tokens.size()) == max_new) {
      r.result.hit_eos = sp.stop_at_eos && tok == c.eos_token_id;
      r.done = true;
    }
  };
  auto keep = [&](Live& r, const std::vector<float>& logits, int64_t row0, int64_t n) {
    r.result.positions += n;
    if (keep_logits && r.index == 0)
      r.result.logits.insert(r.result.logits.end(), logits.begin() + row0 * V, logits.begin() + (row0 + n) * V);
  };
  const int max_q = engine.max_q();
  for (;;) {
    auto feeding = std::find_if(live.begin(), live.end(),
                           [&](const Live& r) { return r.fed < prompts[r.index].size(); });
    std::vector<int> slots;
    std::vector<int32_t> tokens;
    std::vector<ops::SampleSpec> specs;  // [rows]: greedy where no token is taken
    std::vector<Live*> takers;           // the live request of each row that gives a token, else null
    int q = 1;
    if (feeding != live.end()) {
      const auto& p = prompts[feeding->index];
      q = static_cast<int>(std::min<size_t>(static_cast<size_t>(max_q), p.size() - feeding->fed));
      slots.push_back(feeding->slot);
      tokens.assign(p.begin() + static_cast<int64_t>(feeding->fed), p.begin() + static_cast<int64_t>(feeding->fed) + q);
      specs.resize(static_cast<size_t>(q));
      takers.assign(static_cast<size_t>(q), nullptr);
      if (feeding->fed + static_cast<size_t>(q) == p.size()) {
        specs.back() = spec_of(*feeding);
        takers.back() = &*feeding;
      }
    } else {
      for (Live& r : live)
        if (!r.done) {
          slots.push_back(r.slot);
          tokens.push_back(r.result.tokens.back());
          specs.push_back(spec_of(r));
          takers.push_back(&r);
        }
    }
    float active = slots.empty() ? 0.0f : 1.0f;
    engine.world_sum(&active, 1);
    if (active == 0) break;
    if (slots.empty() && L.world() == 1) break;
    std::vector<ops::SampleResult> sampled(specs.size());
    std::vector<float> logits;
    if (keep_logits) {
      logits = engine.step(slots, q, tokens);
      ops::sample_rows(logits.data(), static_cast<int64_t>(specs.size()), V, specs.data(), sampled.data());
    } else {
      sampled = engine.step_sample(slots, q, tokens, specs);
    }
    engine.commit(slots, q);
    if (feeding != live.end()) {
      Live& r = *feeding;
      r.fed += static_cast<size_t>(q);
      keep(r, logits, 0, q);
    } else {
      for (size_t i = 0; i < takers.size(); ++i) keep(*takers[i], logits, static_cast<int64_t>(i), 1);
    }
    for (size_t i = 0; i < takers.size(); ++i)
      if (takers[i]) take(*takers[i], sampled[i].token);
  }
  for (Live& r : live) engine.release(r.slot);

  // Assemble every request's tokens on every rank: a world sum where the first
  // rank of each replica contributes its requests' ids + 1.
  const int64_t n = static_cast<int64_t>(prompts.size());
  std::vector<float> table(static_cast<size_t>(n * (max_new + 1)), 0.0f);  // per request: eos flag, tokens
  if (L.tp_rank(engine.world_rank()) == 0)
    for (const Live& r : live) {
      table[r.index * (max_new + 1)] = r.result.hit_eos ? 1.0f : 0.0f;
      for (size_t j = 0; j < r.result.tokens.size(); ++j)
        table[r.index * (max_new + 1) + 1 + j] = static_cast<float>(r.result.tokens[j] + 1);
    }
  engine.world_sum(table.data(), static_cast<int64_t>(table.size()));
  std::vector<GenerateResult> out(prompts.size());
  for (int64_t i = 0; i < n; ++i) {
    out[i].hit_eos = table[i * (max_new + 1)] > 0;
    for (int j = 0; j < max_new; ++j) {
      const float v = table[i * (max_new + 1) + 1 + j];
      if (v > 0) out[i].tokens.push_back(static_cast<int32_t>(v) - 1);
    }
  }
  for (Live& r : live)
    if (r.index == 0) {
      out[0].logits = std::move(r.result.logits);
      out[0].positions = r.result.positions;
    }
  return out;
}

}  // namespace k3
