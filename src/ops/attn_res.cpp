// Source norms and the softmax are reduced in double, the mix in FP32.
// out must not alias prefix (prefix keeps p, out gets the mix).
#include "ops/attn_res.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "ops/rmsnorm.h"

namespace k3::ops {

void attn_res(const AttnResArgs& a) {
  K3_CHECK(a.rows >= 0 && a.dim > 0, "attn_res: bad shape rows {} dim {}", a.rows, a.dim);
  if (a.rows == 0) return;  // a replica with no requests this step
  K3_CHECK(a.prefix != nullptr && a.out != nullptr && a.norm_w != nullptr && a.proj_w != nullptr,
           "attn_res: prefix, out, norm_w and proj_w are required");
  K3_CHECK(a.out != a.prefix, "attn_res: out must not alias prefix");
  K3_CHECK(a.num_blocks >= 0 && a.num_blocks <= a.max_blocks, "attn_res: num_blocks {} outside [0, max_blocks {}]",
           a.num_blocks, a.max_blocks);
  K3_CHECK(a.block_write_idx >= -1 && a.block_write_idx < a.max_blocks,
           "attn_res: block_write_idx {} outside [-1, max_blocks {})", a.block_write_idx, a.max_blocks);
  K3_CHECK(a.blocks != nullptr || (a.num_blocks == 0 && a.block_write_idx < 0),
           "attn_res: blocks is null but num_blocks {} / block_write_idx {} use it", a.num_blocks, a.block_write_idx);

  const int64_t dim = a.dim;
  const int nsrc = a.num_blocks + 1;
  // norm_w * proj_w: a product of two bf16 values is exact in FP32.
  std::vector<float> np(static_cast<size_t>(dim));
  for (int64_t i = 0; i < dim; ++i) np[i] = to_float(a.norm_w[i]) * to_float(a.proj_w[i]);
  std::vector<const float*> src(static_cast<size_t>(nsrc));
  std::vector<double> score(static_cast<size_t>(nsrc));
  std::vector<float> alpha(static_cast<size_t>(nsrc));
  std::vector<float> mix(static_cast<size_t>(dim));

  for (int64_t r = 0; r < a.rows; ++r) {
    float* p = a.prefix + r * dim;
    if (a.delta != nullptr) {
      const float* d = a.delta + r * dim;
      for (int64_t i = 0; i < dim; ++i) p[i] = round_bf16(p[i] + d[i]);
    }
    float* blocks_r = a.blocks != nullptr ? a.blocks + r * a.max_blocks * dim : nullptr;
    if (a.block_write_idx >= 0) std::copy(p, p + dim, blocks_r + a.block_write_idx * dim);

    for (int s = 0; s < a.num_blocks; ++s) src[s] = blocks_r + s * dim;
    src[a.num_blocks] = p;
    double smax = -INFINITY;
    for (int s = 0; s < nsrc; ++s) {
      const float* V = src[s];
      double ss = 0.0, dot = 0.0;
      for (int64_t i = 0; i < dim; ++i) {
        ss += static_cast<double>(V[i]) * V[i];
        dot += static_cast<double>(np[i]) * V[i];
      }
      const float inv = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(dim)) + a.eps);
      score[s] = static_cast<float>(dot) * inv;
      smax = std::max(smax, score[s]);
    }
    double z = 0.0;
    for (int s = 0; s < nsrc; ++s) z += std::exp(score[s] - smax);
    for (int s = 0; s < nsrc; ++s) alpha[s] = static_cast<float>(std::exp(score[s] - smax) / z);

    std::fill(mix.begin(), mix.end(), 0.0f);
    for (int s = 0; s < nsrc; ++s) {
      const float* V = src[s];
      const float al = alpha[s];
      for (int64_t i = 0; i < dim; ++i) mix[i] += al * V[i];
    }
    round_bf16_inplace(mix.data(), dim);
    float* out = a.out + r * dim;
    if (a.out_norm_w != nullptr) {
      rmsnorm(mix.data(), a.out_norm_w, out, 1, dim, a.out_eps);
    } else {
      std::copy(mix.begin(), mix.end(), out);
    }
  }
}

}  // namespace k3::ops
