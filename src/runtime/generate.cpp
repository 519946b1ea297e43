#include "runtime/generate.h"

#include "core/rng.h"
#include "ops/sampling.h"

namespace k3 {

GenerateResult generate(Engine& engine, const std::vector<int32_t>& prompt, int max_new, const SamplingParams& sp,
                        bool keep_logits) {
  K3_CHECK(max_new >= 0, "generate: max_new {} must be >= 0", max_new);
  const int64_t V = engine.config().vocab_size;
  K3_CHECK(static_cast<int64_t>(prompt.size()) + max_new - 1 <= engine.options().max_context,
           "generate: prompt of {} tokens + {} new exceeds the cache of {} tokens", prompt.size(), max_new,
           engine.options().max_context);
  GenerateResult r;
  Rng rng(sp.seed);
  const int slot = engine.admit();
  try {
    std::vector<float> logits = engine.prefill(slot, prompt);
    r.positions = static_cast<int64_t>(prompt.size());
    if (keep_logits) r.logits = logits;
    const float* last = logits.data() + (r.positions - 1) * V;
    std::vector<float> step_logits;
    for (int i = 0; i < max_new; ++i) {
      const int32_t tok = sp.greedy ? ops::sample_greedy(last, V) : ops::sample_top_p(last, V, sp.temperature, sp.top_p, rng);
      r.tokens.push_back(tok);
      if (sp.stop_at_eos && tok == engine.config().eos_token_id) {
        r.hit_eos = true;
        break;
      }
      if (i + 1 == max_new) break;
      const int slots[1] = {slot};
      const int32_t ids[1] = {tok};
      step_logits = engine.step(slots, 1, ids);
      engine.commit(slot, 1);
      ++r.positions;
      if (keep_logits) r.logits.insert(r.logits.end(), step_logits.begin(), step_logits.end());
      last = step_logits.data();
    }
  } catch (...) {
    engine.release(slot);
    throw;
  }
  engine.release(slot);
  return r;
}

}  // namespace k3
