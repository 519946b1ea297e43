// CPU reference for the absorbed Gated MLA decode (see mla.h for the math).
#include "ops/mla.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "ops/dot.h"

namespace k3::ops {
namespace {


inline float dot(const float* a, const bf16* b, int64_t n) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * to_float(b[i + j]);
  }
  for (; i < n; ++i) acc[i & 7] += a[i] * to_float(b[i]);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

}  // namespace

void mla_absorb_q(const float* q, const bf16* w_kvb, float* q_lat, int64_t T, int H, int dn, int P, int dv, int R) {
  K3_CHECK(T >= 0 && H > 0 && dn > 0 && P >= 0 && dv > 0 && R > 0,
           "mla_absorb_q: bad sizes T={} H={} dn={} P={} dv={} R={}", T, H, dn, P, dv, R);
  const int64_t q_stride = dn + P;
  const int64_t lat_stride = int64_t{R} + P;
  std::vector<float> acc(static_cast<size_t>(R));
  for (int64_t t = 0; t < T; ++t) {
    for (int h = 0; h < H; ++h) {
      const float* qh = q + (t * H + h) * q_stride;
      float* out = q_lat + (t * H + h) * lat_stride;
      // W_uk_h^T q_nope: accumulate the dn key rows of head h, each [R], scaled by q_nope[i].
      const bf16* w_uk = w_kvb + static_cast<int64_t>(h) * (dn + dv) * R;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int i = 0; i < dn; ++i) {
        const float qi = qh[i];
        const bf16* row = w_uk + static_cast<int64_t>(i) * R;
        for (int r = 0; r < R; ++r) acc[r] += qi * to_float(row[r]);
      }
      for (int r = 0; r < R; ++r) out[r] = round_bf16(acc[r]);
      for (int p = 0; p < P; ++p) out[R + p] = round_bf16(qh[dn + p]);
    }
  }
}

void mla_attend(const float* q_lat, const float* const* entries, int64_t n, int H, int R, int P, float scale,
                float* o_lat, float* lse) {
  K3_CHECK(n >= 0 && H > 0 && R > 0 && P >= 0, "mla_attend: bad sizes n={} H={} R={} P={}", n, H, R, P);
  const int64_t L = int64_t{R} + P;
  std::fill(o_lat, o_lat + static_cast<int64_t>(H) * R, 0.f);
  if (n == 0) {
    std::fill(lse, lse + H, -INFINITY);
    return;
  }
  // Scores [H, n]: each entry is read once for all heads.
  std::vector<float> s(static_cast<size_t>(H) * static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) {
    const float* e = entries[j];
    for (int h = 0; h < H; ++h) s[h * n + j] = scale * dot(q_lat + h * L, e, L);
  }
  // Numerically stable softmax per head: p_j = exp(s_j - m) / sum_k exp(s_k - m).
  std::vector<float> inv_sum(static_cast<size_t>(H));
  for (int h = 0; h < H; ++h) {
    float* sh = s.data() + h * n;
    float m = -INFINITY;
    for (int64_t j = 0; j < n; ++j) m = std::max(m, sh[j]);
    if (m == -INFINITY) {  // every score is -inf: nothing to attend to
      for (int64_t j = 0; j < n; ++j) sh[j] = 0.f;
      inv_sum[h] = 0.f;
      lse[h] = -INFINITY;
      continue;
    }
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      sh[j] = std::exp(sh[j] - m);
      sum += sh[j];
    }
    inv_sum[h] = 1.f / sum;
    lse[h] = m + std::log(sum);
  }
  // o_lat[h] = sum_j p_j c_kv_j: again each entry once for all heads.
  for (int64_t j = 0; j < n; ++j) {
    const float* c = entries[j];
    for (int h = 0; h < H; ++h) {
      const float pj = s[h * n + j] * inv_sum[h];
      float* o = o_lat + static_cast<int64_t>(h) * R;
      for (int r = 0; r < R; ++r) o[r] += pj * c[r];
    }
  }
}

void lse_merge(const float* o_parts, const float* lse_parts, int D, int H, int R, float* o, float* lse) {
  K3_CHECK(D >= 0 && H > 0 && R > 0, "lse_merge: bad sizes D={} H={} R={}", D, H, R);
  for (int h = 0; h < H; ++h) {
    float* oh = o + static_cast<int64_t>(h) * R;
    std::fill(oh, oh + R, 0.f);
    // Parts with lse = -inf (empty shards) are skipped entirely; a NaN lse is not skipped and propagates.
    float m = -INFINITY;
    bool any = false;
    for (int d = 0; d < D; ++d) {
      const float l = lse_parts[d * H + h];
      if (l == -INFINITY) continue;
      any = true;
      if (l > m) m = l;  // a NaN lse never becomes m but poisons the sum below
    }
    if (!any) {
      lse[h] = -INFINITY;
      continue;
    }
    float sum = 0.f;
    for (int d = 0; d < D; ++d) {
      const float l = lse_parts[d * H + h];
      if (l == -INFINITY) continue;
      sum += std::exp(l - m);
    }
    // exp(l - m) / sum rather than exp(l - L): L = m + log(sum) is rounded at the magnitude of lse, and that
    // absolute error would become a relative error of the weights.
    const float inv_sum = 1.f / sum;
    for (int d = 0; d < D; ++d) {
      const float l = lse_parts[d * H + h];
      if (l == -INFINITY) continue;
      const float wgt = std::exp(l - m) * inv_sum;
      const float* od = o_parts + (static_cast<int64_t>(d) * H + h) * R;
      for (int r = 0; r < R; ++r) oh[r] += wgt * od[r];
    }
    lse[h] = m + std::log(sum);
  }
}

void mla_unabsorb(const float* o_lat, const bf16* w_kvb, float* o, int64_t T, int H, int dn, int dv, int R) {
  K3_CHECK(T >= 0 && H > 0 && dn > 0 && dv > 0 && R > 0, "mla_unabsorb: bad sizes T={} H={} dn={} dv={} R={}", T, H,
           dn, dv, R);
  for (int64_t t = 0; t < T; ++t) {
    for (int h = 0; h < H; ++h) {
      const float* ol = o_lat + (t * H + h) * R;
      const bf16* w_uv = w_kvb + (static_cast<int64_t>(h) * (dn + dv) + dn) * R;  // the dv value rows of head h
      float* out = o + (t * H + h) * dv;
      for (int v = 0; v < dv; ++v) out[v] = round_bf16(dot(ol, w_uv + static_cast<int64_t>(v) * R, R));
    }
  }
}

}  // namespace k3::ops
