// Synthetic models (io/synthetic.h): make-model checkpoints and the embedded tiny model.
#include "io/synthetic.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <nlohmann/json.hpp>

#include "config/schema.h"
#include "core/mxfp4.h"
#include "core/rng.h"

namespace k3 {

ModelConfig preset_config(const std::string& preset, const std::string& variant) {
  K3_CHECK(variant == "k3" || variant == "k3.1", "--variant: unknown variant \"{}\" (k3 | k3.1)", variant);
  ModelConfig c;
  std::vector<int> full;  // 1-based full-attention layers
  if (preset == "tiny") {
    c.hidden_size = 64;
    c.num_layers = 8;
    c.vocab_size = 256;
    c.attn_res_block_size = 3;  // blocks start at layers 0, 3, 6: 3 blocks
    c.dense_intermediate_size = 128;
    c.kda = {8, 16, 4, -5.0f, true};
    c.mla = {8, 32, 32, 16, 8, 16, true};
    c.moe.num_experts = 16;
    c.moe.experts_per_token = 4;
    c.moe.num_shared_experts = 2;
    c.moe.intermediate_size = 32;
    c.moe.latent_size = 32;
    full = {4, 7, 8};  // K K K M K K M M: the last two are full attention, as in K3
    if (variant == "k3.1") c.dsa = DsaConfig{4, 16, 4};
  } else if (preset == "small") {
    c.hidden_size = 256;
    c.num_layers = 12;
    c.vocab_size = 1024;
    c.attn_res_block_size = 4;
    c.dense_intermediate_size = 512;
    c.kda = {16, 32, 4, -5.0f, true};
    c.mla = {16, 64, 64, 32, 16, 32, true};
    c.moe.num_experts = 32;
    c.moe.experts_per_token = 4;
    c.moe.num_shared_experts = 2;
    c.moe.intermediate_size = 64;
    c.moe.latent_size = 128;
    full = {4, 8, 11, 12};
    if (variant == "k3.1") c.dsa = DsaConfig{8, 32, 16};
  } else if (preset == "full") {  // the published K3 / K3.1 shapes (kimi-k3.md section 1)
    c.hidden_size = 7168;
    c.num_layers = 93;
    c.vocab_size = 163840;
    c.attn_res_block_size = 12;
    c.dense_intermediate_size = 33792;
    c.kda = {96, 128, 4, -5.0f, true};
    c.mla = {96, 1536, 512, 128, 64, 128, true};
    c.moe.num_experts = 896;
    c.moe.experts_per_token = 16;
    c.moe.num_shared_experts = 2;
    c.moe.intermediate_size = 3072;
    c.moe.latent_size = 3584;
    for (int l = 4; l <= 92; l += 4) full.push_back(l);
    full.push_back(93);
    if (variant == "k3.1") c.dsa = DsaConfig{32, 128, 2048};
  } else {
    fail("--preset: unknown preset \"{}\" (tiny | small | full)", preset);
  }
  c.eos_token_id = preset == "full" ? 163586 : c.vocab_size - 2;
  c.rms_norm_eps = 1e-5f;
  c.situ_beta = 4.0f;
  c.situ_linear_beta = 25.0f;
  c.moe.latent_use_norm = true;
  c.moe.renormalize = true;
  c.moe.routed_scaling_factor = 1.0f;
  c.moe.first_k_dense_replace = 1;
  c.attn_kinds.assign(c.num_layers, AttnKind::KDA);
  for (int l : full) c.attn_kinds[l - 1] = c.dsa ? AttnKind::DSA : AttnKind::MLA;
  // Round-trip through JSON so a preset is exactly what a config.json would give.
  return ModelConfig::from_json(c.to_json());
}

namespace {

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : s) h = (h ^ ch) * 1099511628211ull;
  return h;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
bool has(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

// How one float tensor is drawn: uniform in [center - half, center + half].
struct Draw {
  double center = 0;
  double half = 0;
};

Draw draw_for(const ModelConfig& c, const TensorSpec& s) {
  const std::string& n = s.name;
  const double in = s.shape.size() >= 2 ? static_cast<double>(s.shape[1]) : 1.0;
  const double unit = std::sqrt(3.0 / in);  // uniform with variance 1/in: unit gain
  if (n == "model.embed_tokens.weight") return {0, std::sqrt(3.0)};
  if (n == "lm_head.weight") return {0, 4 * unit};
  if (ends_with(n, "_res_proj.weight")) return {0, 0.6 * std::sqrt(3.0 / c.hidden_size)};
  if (has(n, "k_norm.bias")) return {0, 0.1};
  if (has(n, "k_norm.weight")) return {1.0, 0.1};
  if (ends_with(n, "norm.weight") || has(n, "layernorm.weight")) return {0.5, 0.1};
  if (has(n, "conv1d")) return {0, 0.8};
  if (ends_with(n, "A_log")) return {0, std::log(2.0)};  // exp(A_log) in [0.5, 2]
  if (ends_with(n, "dt_bias")) return {-3.0, 1.0};  // exp(g) around 0.7: a KDA memory of several tokens
  if (ends_with(n, "e_score_correction_bias")) return {0, 0.3};
  if (ends_with(n, "gate.weight")) return {0, 4 * unit};  // router logits of std ~2: the weights vary, see make_synthetic
  if (has(n, "routed_expert_down_proj")) return {0, unit};
  if (has(n, "o_proj") || has(n, "down_proj") || has(n, "routed_expert_up_proj")) return {0, 0.25 * unit};
  return {0, unit};
}

Tensor float_tensor(const TensorSpec& s, Draw d, Rng& rng) {
  Tensor t(s.dtype, s.shape);
  const int64_t n = t.numel();
  if (s.dtype == DType::F32) {
    float* p = t.as<float>();
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(d.center + d.half * (2 * rng.uniform() - 1));
  } else {
    K3_CHECK(s.dtype == DType::BF16, "make-model: no generator for {} of dtype {}", s.name, dtype_name(s.dtype));
    bf16* p = t.as<bf16>();
    for (int64_t i = 0; i < n; ++i) p[i] = to_bf16(static_cast<float>(d.center + d.half * (2 * rng.uniform() - 1)));
  }
  return t;
}

// An MXFP4 matrix [N, K] with unit gain: uniform values quantized per group of 32
// with the E8M0 scale that maps the group's largest magnitude into E2M1's range.
std::pair<Tensor, Tensor> mxfp4_matrix(int64_t N, int64_t K, double half, Rng& rng) {
  Tensor packed(DType::U8, {N, K / 2}), scale(DType::U8, {N, K / kMxfp4Group});
  uint8_t* pk = packed.as<uint8_t>();
  uint8_t* sc = scale.as<uint8_t>();
  std::vector<double> g(kMxfp4Group);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k0 = 0; k0 < K; k0 += kMxfp4Group) {
      double amax = 0;
      for (int j = 0; j < kMxfp4Group; ++j) {
        g[j] = half * (2 * rng.uniform() - 1);
        amax = std::max(amax, std::fabs(g[j]));
      }
      int e = 0;
      std::frexp(amax / 6.0, &e);  // 2^e >= amax / 6
      const int biased = std::clamp(e + 127, 1, 254);
      sc[n * (K / kMxfp4Group) + k0 / kMxfp4Group] = static_cast<uint8_t>(biased);
      const float inv = std::ldexp(1.0f, 127 - biased);
      for (int j = 0; j < kMxfp4Group; ++j) {
        const int64_t k = k0 + j;
        uint8_t code = float_to_e2m1(static_cast<float>(g[j]) * inv);
        uint8_t& byte = pk[n * (K / 2) + k / 2];
        byte = (k & 1) ? static_cast<uint8_t>(byte | (code << 4)) : static_cast<uint8_t>(byte | code);
      }
    }
  }
  return {std::move(packed), std::move(scale)};
}

}  // namespace

std::unique_ptr<MemoryCheckpoint> make_synthetic(const ModelConfig& c, uint64_t seed) {
  auto out = std::make_unique<MemoryCheckpoint>();
  const auto specs = checkpoint_schema(c);
  for (size_t i = 0; i < specs.size(); ++i) {
    const TensorSpec& s = specs[i];
    Rng rng(seed ^ fnv1a(s.name));
    if (ends_with(s.name, ".weight_packed")) {
      const int64_t N = s.shape[0], K = s.shape[1] * 2;
      const double gain = ends_with(s.name, "w2.weight_packed") ? 0.5 : 1.0;
      auto [packed, scale] = mxfp4_matrix(N, K, gain * std::sqrt(3.0 / K), rng);
      out->add(kTextPrefix + s.name, std::move(packed));
      K3_CHECK(i + 1 < specs.size() && ends_with(specs[i + 1].name, ".weight_scale"),
               "make-model: schema lists {} without its scale", s.name);
      out->add(kTextPrefix + specs[i + 1].name, std::move(scale));
      ++i;
      continue;
    }
    TensorSpec stored = s;
    if (s.min_numel) stored.shape = {a_log_stored_len(c)};
    Tensor t = float_tensor(stored, draw_for(c, s), rng);
    if (ends_with(s.name, "e_score_correction_bias")) {
      // Evenly spaced in [-0.3, 0.3] (steps 0.6 / (E - 1)), permuted per layer, and the k highest raised by
      // 1, the whole range of a sigmoid score: the k-th and (k+1)-th biased scores s + b are then at least
      // one step apart for ANY input (typically ~1 apart), so no BF16 rounding (nor a summation order) can
      // flip the choice. The chosen set is the same for every token of a layer (another set per layer); the
      // unbiased scores still set the combine weights. (With a bias spread below 1, some pair of experts sits
      // at a tie for some inputs, and a few rows of every test went to the runner-up expert.)
      const int64_t E = s.shape[0];
      const int64_t k = c.moe.experts_per_token;
      uint64_t stride = 1 + rng.below(static_cast<uint64_t>(E));
      while (std::gcd(stride, static_cast<uint64_t>(E)) != 1) ++stride;  // e -> e * stride mod E permutes
      float* b = t.as<float>();
      for (int64_t e = 0; e < E; ++e) {
        const int64_t rank = static_cast<int64_t>((static_cast<uint64_t>(e) * stride) % E);
        b[e] = static_cast<float>(-0.3 + 0.6 * static_cast<double>(rank) / (E - 1) + (rank >= E - k ? 1.0 : 0.0));
      }
    }
    out->add(kTextPrefix + s.name, std::move(t));
  }
  return out;
}

}  // namespace k3
