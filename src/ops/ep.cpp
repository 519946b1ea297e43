// CPU reference of the fixed-capacity EP exchange's pack, assemble, return and combine (ops/ep.h).
#include "ops/ep.h"

#include <algorithm>
#include <vector>

#include "core/error.h"

namespace k3::ops {

int64_t EpShard::own0() const { return std::min(rows, int64_t{t} * cs); }

int64_t EpShard::own() const { return std::min(rows, own0() + cs) - own0(); }

void check(const EpShard& s) {
  K3_CHECK(s.rows >= 0 && s.k >= 1 && s.Ls >= 1 && s.experts_per_rank >= 1 && s.W >= 1 && s.cs >= 0 && s.cap >= 0,
           "ep: bad shard (rows {}, k {}, Ls {}, experts per rank {}, W {}, cs {}, cap {})", s.rows, s.k, s.Ls,
           s.experts_per_rank, s.W, s.cs, s.cap);
  K3_CHECK(s.Gs >= 1 && s.W % s.Gs == 0 && s.t >= 0 && s.t < s.Gs,
           "ep: member {} of slice groups of {} over {} ranks", s.t, s.Gs, s.W);
  K3_CHECK(s.rows <= int64_t{s.Gs} * s.cs, "ep: {} rows exceed {} members of {} rows", s.rows, s.Gs, s.cs);
  K3_CHECK(s.cs * s.k <= s.cap, "ep: {} pairs per member exceed the capacity of {} per rank", s.cs * s.k, s.cap);
  K3_CHECK(int64_t{s.W} * s.meta() <= 0x7fffffff && s.rows * s.k <= 0x7fffffff,
           "ep: {} slots per rank exceed int32 indexing", s.meta());
}

void ep_pack(const int32_t* idx, const float* z, const EpShard& s, int32_t* slot, int32_t* send_slot, int32_t* meta,
             float* send) {
  check(s);
  const int64_t M = s.meta(), scap = int64_t{s.Gs} * s.cap, own0 = s.own0() * s.k, own1 = own0 + s.own() * s.k;
  std::fill(meta, meta + s.W * M, -1);
  std::vector<int64_t> used(static_cast<size_t>(s.W), 0), used_own(static_cast<size_t>(s.W), 0);
  int64_t owner = -1;
  for (int64_t i = 0; i < s.rows * s.k; ++i) {
    const int64_t o = (i / s.k) / s.cs;
    if (o != owner) std::fill(used_own.begin(), used_own.end(), 0);
    owner = o;
    const int64_t d = idx[i] >= 0 ? idx[i] / s.experts_per_rank : -1;
    const bool mine = i >= own0 && i < own1;
    if (d < 0 || d >= s.W) {
      send_slot[i] = -1;
      if (mine) slot[i - own0] = -1;
      continue;
    }
    const int64_t pos = used[d]++, pos_own = used_own[d]++;
    send_slot[i] = static_cast<int32_t>(d * scap + pos);
    if (mine) slot[i - own0] = static_cast<int32_t>(d * s.cap + pos_own);
    meta[d * M + pos] = idx[i];
    if (s.Gs > 1) meta[d * M + scap + pos] = static_cast<int32_t>(o * s.cap + pos_own);
    std::copy_n(z + (i / s.k) * s.Ls, s.Ls, send + (d * scap + pos) * s.Ls);
  }
}

void ep_assemble(const float* recv, const int32_t* recv_meta, const EpShard& s, float* z, int32_t* ids,
                 int32_t* codes) {
  check(s);
  const int64_t M = s.meta(), scap = int64_t{s.Gs} * s.cap, L = s.Gs * s.Ls;
  for (int g = 0; g < s.W / s.Gs; ++g)
    for (int64_t j = 0; j < scap; ++j) {
      const int64_t q = g * scap + j;
      ids[q] = recv_meta[int64_t{g} * s.Gs * M + j];
      codes[q] = s.Gs > 1 ? recv_meta[int64_t{g} * s.Gs * M + scap + j] : -1;
      if (ids[q] < 0) continue;
      for (int t = 0; t < s.Gs; ++t)
        std::copy_n(recv + ((int64_t{g} * s.Gs + t) * scap + j) * s.Ls, s.Ls, z + q * L + t * s.Ls);
    }
}

void ep_return(const float* out, const int32_t* ids, const int32_t* codes, const EpShard& s, float* back) {
  check(s);
  const int64_t scap = int64_t{s.Gs} * s.cap, L = s.Gs * s.Ls;
  for (int64_t q = 0; q < s.W * s.cap; ++q) {
    if (ids[q] < 0) continue;
    const int64_t g = q / scap, code = codes[q];
    K3_CHECK(code >= 0 && code < scap, "ep_return: slot {} has code {} outside [0, {})", q, code, scap);
    std::copy_n(out + q * L, L, back + ((g * s.Gs + code / s.cap) * s.cap + code % s.cap) * L);
  }
}

void ep_combine(const float* back, const int32_t* slot, const float* w, int64_t rows, int k, int64_t L, float* y) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < L; ++c) {
      float acc = 0;
      for (int j = 0; j < k; ++j) {
        const int32_t s = slot[r * k + j];
        if (s >= 0) acc += w[r * k + j] * back[int64_t{s} * L + c];
      }
      y[r * L + c] = round_bf16(acc);
    }
}

}  // namespace k3::ops
