// The MLA attend kernel of up to 48 query rows per CTA (see mla.h for the math; launched by
// mla_attend.cu, which also plans the context splits):
//   s_j = scale * (q_lat . entry_j);  o_lat = sum_j exp(s_j - lse) c_kv_j,  lse = log sum_j exp(s_j)
//
//   mla_attend_kernel (both launchers): flash decoding on tensor cores (mma.sync m16n8k16,
//     BF16 inputs, FP32 accumulation, fragments through ldmatrix). Dense rows are the (token,
//     head) pairs of one request, whose q_len tokens share every cache entry; sparse rows are the
//     heads of one token. A CTA owns up to 48 rows of one group (MT = 1..3 M tiles of 16, blockDim
//     128 MT; more rows take more CTAs: 64 rows would not fit 227 KB of shared memory) and one
//     context split, so each cache entry is read once per request and split. Tiles of 64
//     (R+P)-wide entries stream through shared memory (cp.async, double buffered, a warp copies 512
//     contiguous bytes); the pool row of each entry (block table, DSA selection) is looked up two
//     tiles ahead, between this tile's steps, so the copies never wait on it. Per tile, 4 barriers:
//       S = scale Q E^T: the 4 warps of an M tile take 16 entries each (4 accumulator chains, the
//         odd k steps split off), mask (entry j < the row's length), row max of their 16 entries
//         to shared memory (warps 0..3 computing every M tile left 2/3 of the warps idle);
//       online softmax in FP32 in the same warps: tile max from the 4 partial maxima, p =
//         exp(s - m) split into BF16 hi + lo (~16 mantissa bits: the FP32 weights of the CPU
//         within ~1e-5) stored as the A operand, partial row sums; thread r updates l of row r;
//       O = corr O + P E[:, :R]: warp (M tile, quarter of R) with two MMAs (hi, lo) per B
//         fragment, B from ldmatrix.trans of the row-major entry tile (O: 64 FP32 per thread).
//     Row strides of the Q, E and P tiles are odd multiples of 16 bytes: conflict-free ldmatrix.
//     Each split writes (o / l, m + log l), and lse_merge combines the splits exactly as it
//     merges DCP partials (the split count: plan_splits in mla_attend.cu).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "ops/cuda_cp_async.cuh"
#include "ops/cuda_device.cuh"
#include "ops/cuda_mma.cuh"
#include "ops/mla_attend.cuh"

namespace k3::ops::cuda::mla_detail {
namespace {

using detail::allow_optin_smem;

// Byte offsets of the dynamic shared memory of a CTA with MT M tiles (QR = 16 MT rows).
struct AttendSmem {
  int q;        // bf16 [QR][es] query rows
  int e;        // bf16 [2][kBN][es] entry tiles (double buffered)
  int phi;      // bf16 [QR][kPS] P, BF16 high part
  int plo;      // bf16 [QR][kPS] P - high, BF16
  int rows;     // int64 [2][kBN] pool row of each entry of the next tiles (-1: zeros)
  int red_max;  // f32 [kQKWarps][QR] row max of each QK warp's 16 entries
  int red_sum;  // f32 [kQKWarps][QR] row sum of exp of each QK warp's 16 entries
  int corr;     // f32 [QR] exp(m_old - m_new) of the current tile
  int m;        // f32 [QR] final running max
  int l;        // f32 [QR] running sum of exp (updated by thread r)
  int len;      // int32 [QR] entries visible to the row
  int total;
};

__host__ __device__ inline AttendSmem attend_smem(int E, int MT) {
  const int es = attend_es(E), qr = 16 * MT;
  AttendSmem s{};
  int o = 0;
  s.q = o;
  o += 2 * qr * es;
  s.e = o;
  o += 2 * 2 * kBN * es;
  s.phi = o;
  o += 2 * qr * kPS;
  s.plo = o;
  o += 2 * qr * kPS;
  s.rows = o;
  o += 8 * 2 * kBN;
  s.red_max = o;
  o += 4 * kQKWarps * qr;
  s.red_sum = o;
  o += 4 * kQKWarps * qr;
  s.corr = o;
  o += 4 * qr;
  s.m = o;
  o += 4 * qr;
  s.l = o;
  o += 4 * qr;
  s.len = o;
  o += 4 * qr;
  s.total = o;
  return s;
}

using detail::ldsm_x4;
using detail::ldsm_x4_trans;
using detail::smem_u32;
using detail::cp_async16;
using detail::cp_async_commit;
using detail::mma_bf16_16816;

using detail::cp_async_wait;
using detail::cp_async_wait_all;

// S (+)= Q E^T for one M tile and the 16 entries of a warp, K = ek16 (zero padded): per pair of k steps
// two x4 of E (two n8 tiles: b0, b1 of each) and two x4 of Q; the odd k steps go to slot 1 (4
// independent accumulator chains), added at the end (FP32, another summation order). q_addr, e_addr:
// this lane's ldmatrix row addresses at k = 0.
__device__ __forceinline__ void qk_tile(float (&sv)[2][2][4], uint32_t q_addr, uint32_t e_addr, int ek16) {
  int kk = 0;
#pragma unroll 1
  for (; kk + 16 < ek16; kk += 32) {
    uint32_t b0[4], b1[4], a0[4], a1[4];
    ldsm_x4(b0, e_addr + kk * 2);
    ldsm_x4(a0, q_addr + kk * 2);
    ldsm_x4(b1, e_addr + (kk + 16) * 2);
    ldsm_x4(a1, q_addr + (kk + 16) * 2);
    mma_bf16_16816(sv[0][0], a0[0], a0[1], a0[2], a0[3], b0[0], b0[1]);
    mma_bf16_16816(sv[0][1], a0[0], a0[1], a0[2], a0[3], b0[2], b0[3]);
    mma_bf16_16816(sv[1][0], a1[0], a1[1], a1[2], a1[3], b1[0], b1[1]);
    mma_bf16_16816(sv[1][1], a1[0], a1[1], a1[2], a1[3], b1[2], b1[3]);
  }
  if (kk < ek16) {
    uint32_t b0[4], a0[4];
    ldsm_x4(b0, e_addr + kk * 2);
    ldsm_x4(a0, q_addr + kk * 2);
    mma_bf16_16816(sv[0][0], a0[0], a0[1], a0[2], a0[3], b0[0], b0[1]);
    mma_bf16_16816(sv[0][1], a0[0], a0[1], a0[2], a0[3], b0[2], b0[3]);
  }
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) sv[0][n][i] += sv[1][n][i];
}

template <bool INDEXED>
__global__ void __launch_bounds__(kThreadsPerMT * kMaxMT, 1) mla_attend_kernel(const AttendParams p) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  extern __shared__ __align__(16) unsigned char smem[];
  const int H = p.H, R = p.R, E = p.R + p.P;
  const int ek16 = attend_ek16(E), es = attend_es(E);
  const int NTH = blockDim.x, MT = NTH / kThreadsPerMT, QR = 16 * MT;
  const AttendSmem lay = attend_smem(E, MT);
  bf16raw* Qs = reinterpret_cast<bf16raw*>(smem + lay.q);
  bf16raw* Es = reinterpret_cast<bf16raw*>(smem + lay.e);
  bf16raw* Phi = reinterpret_cast<bf16raw*>(smem + lay.phi);
  bf16raw* Plo = reinterpret_cast<bf16raw*>(smem + lay.plo);
  long long* rows_s = reinterpret_cast<long long*>(smem + lay.rows);
  float* red_max = reinterpret_cast<float*>(smem + lay.red_max);
  float* red_sum = reinterpret_cast<float*>(smem + lay.red_sum);
  float* corr_s = reinterpret_cast<float*>(smem + lay.corr);
  float* m_s = reinterpret_cast<float*>(smem + lay.m);
  float* l_s = reinterpret_cast<float*>(smem + lay.l);
  int* len_s = reinterpret_cast<int*>(smem + lay.len);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const int64_t grp = blockIdx.z;
  const int64_t b = INDEXED ? grp / p.q_len : grp;
  const int64_t t0 = INDEXED ? grp : grp * p.q_len;
  const int rows_total = INDEXED ? H : p.q_len * H;
  const int row0 = blockIdx.x * p.rows_per_cta;
  const int nrows = min(p.rows_per_cta, rows_total - row0);
  const int64_t th0 = t0 * H + row0;  // rows are token-major: row r is (token, head) th0 + r
  const int split = blockIdx.y, nsplit = gridDim.y;
  const int64_t TH = p.T * H;

  // The query rows first (they depend on nothing; committed with tile 0), zeros in their K padding.
  const int cpr = E / 8, kc16 = ek16 / 8;  // 16-byte chunks per entry; per tile row with the K padding
  for (int i = tid; i < QR * kc16; i += NTH) {
    const int r = i / kc16, c = i - r * kc16;
    bf16raw* dst = Qs + r * es + c * 8;
    if (c < cpr) {
      const bool valid = r < nrows;
      cp_async16(dst, valid ? p.q_lat + (th0 + r) * E + c * 8 : p.q_lat, valid);
    } else {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
  for (int r = tid; r < QR; r += NTH) {
    int len = 0;
    if (r < nrows) {
      const int64_t tok = t0 + (row0 + r) / H;
      len = INDEXED ? p.sel_count[tok] : p.ctx_len[tok];
      len = max(0, min(len, p.max_len));
    }
    len_s[r] = len;
    l_s[r] = 0.f;
  }
  __syncthreads();
  int L = 0;
  for (int r = 0; r < QR; ++r) L = max(L, len_s[r]);
  // This split's entries [c0, c1): the rows' longest length L in nsplit chunks of whole tiles.
  const int64_t chunk = (static_cast<int64_t>(L) + nsplit - 1) / nsplit;
  const int64_t c0l = split * ((chunk + kBN - 1) / kBN * kBN);
  const int c0 = static_cast<int>(min(c0l, static_cast<int64_t>(L)));
  const int c1 = static_cast<int>(min(c0l + (chunk + kBN - 1) / kBN * kBN, static_cast<int64_t>(L)));
  if (c0 >= c1) {  // no entries: lse -inf; o zeros only where it is the final output (lse_merge skips it)
    cp_async_wait_all();  // the query copies
    for (int r = tid; r < nrows; r += NTH) p.lse_out[split * TH + th0 + r] = -INFINITY;
    if (nsplit == 1)
      for (int i = tid; i < nrows * R; i += NTH) p.o_out[th0 * R + i] = 0.f;
    return;
  }

  // Pool row of entry j of the chunk (-1: a zero entry, as an invalid page or a negative selection).
  auto entry_pos = [&](int j) -> int { return j < c1 ? (INDEXED ? p.sel[t0 * p.max_sel + j] : j) : -1; };
  auto entry_page = [&](int pos) -> int {
    if (pos < 0) return -1;
    const int pg = pos / p.page_size;
    return pg < p.max_pages ? p.tables[b * p.max_pages + pg] : -1;
  };
  auto entry_row = [&](int pos, int page) -> long long {
    return pos >= 0 && page >= 0 ? static_cast<long long>(page) * p.page_size + pos % p.page_size : -1LL;
  };

  // Row indices of tiles 0 and 1, zeros in the K padding of the entry tiles.
  if (tid < 2 * kBN) {
    const int pos = entry_pos(c0 + tid);
    rows_s[tid] = entry_row(pos, entry_page(pos));
  }
  if (ek16 != E) {  // E % 8 == 0: one 16-byte chunk per row
    for (int i = tid; i < 2 * kBN; i += NTH)
      *reinterpret_cast<uint4*>(Es + i * es + E) = make_uint4(0u, 0u, 0u, 0u);
  }
  __syncthreads();  // rows_s

  // Loader: chunk i = n cpr + c of a tile is copied by thread i % NTH; a warp reads 512 contiguous bytes.
  const int ld_dn = NTH / cpr, ld_dc = NTH % cpr, ld_n0 = tid / cpr, ld_c0 = tid % cpr;
  auto load_tile = [&](int buf) {
    const long long* rs = rows_s + buf * kBN;
    bf16raw* eb = Es + buf * kBN * es;
    int n = ld_n0, c = ld_c0;
    while (n < kBN) {
      const long long row = rs[n];
      const bool valid = row >= 0;
      cp_async16(eb + n * es + c * 8, valid ? p.pool + row * E + c * 8 : p.pool, valid);
      n += ld_dn;
      c += ld_dc;
      if (c >= cpr) {
        c -= cpr;
        ++n;
      }
    }
  };
  load_tile(0);
  cp_async_commit();

  // Warp (M tile pm, cq): in S the scores of its M tile's rows and entries 16 cq .. 16 cq + 15 of the
  // tile, and their softmax (the 4 warps of an M tile keep the same running max of its rows); in P.V
  // the 16-column pairs [pp0, pp0 + npw) of R for its M tile's rows.
  const int pm = warp / kColWarps, cq = warp % kColWarps;
  float m_run[2] = {-INFINITY, -INFINITY};
  const int NP = (R + 15) / 16, npw = (NP + kColWarps - 1) / kColWarps, pp0 = cq * npw;
  float acc[kMaxPairs][2][4];
#pragma unroll
  for (int i = 0; i < kMaxPairs; ++i)
#pragma unroll
    for (int n = 0; n < 2; ++n) acc[i][n][0] = acc[i][n][1] = acc[i][n][2] = acc[i][n][3] = 0.f;

  // ldmatrix lane addresses (bytes). A fragments (Q, P): row lane % 16, column 8 (lane / 16).
  // QK B (E rows = entries, non-trans): entry (lane % 8) + 8 (lane / 16), column 8 ((lane / 8) % 2).
  // PV B (E rows = entries, trans): entry (lane % 8) + 8 ((lane / 8) % 2), column 8 (lane / 16).
  const uint32_t q_addr = smem_u32(Qs) + ((16 * pm + (lane & 15)) * es + (lane >> 4) * 8) * 2;
  const uint32_t qk_b_addr =
      smem_u32(Es) + ((16 * cq + (lane & 7) + ((lane >> 4) << 3)) * es + ((lane >> 3) & 1) * 8) * 2;
  const uint32_t pa_off = ((16 * pm + (lane & 15)) * kPS + (lane >> 4) * 8) * 2;
  const uint32_t phi_addr = smem_u32(Phi) + pa_off, plo_addr = smem_u32(Plo) + pa_off;
  const uint32_t pv_b_addr = smem_u32(Es) + (((lane & 7) + ((lane >> 3) & 1) * 8) * es + (lane >> 4) * 8) * 2;

  int it = 0;
  for (int j0 = c0; j0 < c1; j0 += kBN, ++it) {
    const int buf = it & 1;
    if (j0 + kBN < c1) load_tile(buf ^ 1);
    cp_async_commit();
    cp_async_wait<1>();  // this thread's copies of tile `it` have landed
    __syncthreads();    // B0: tile `it` complete; every warp is past the previous P.V
    const uint32_t tile_off = static_cast<uint32_t>(buf * kBN * es * 2);

    // Row lookup of tile it + 2 (into rows_s[buf], read when tile it + 1 is current), in three steps
    // spread over this tile's math so that its global loads are not waited for.
    const int look_pos = tid < kBN ? entry_pos(j0 + 2 * kBN + tid) : -1;

    // S of this warp's M tile (2 chains per n8 tile, summed into sv[0]), then the masked scaled scores, then p.
    float sv[2][2][4];
    {
#pragma unroll
      for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int n = 0; n < 2; ++n) sv[c][n][0] = sv[c][n][1] = sv[c][n][2] = sv[c][n][3] = 0.f;
      qk_tile(sv, q_addr, qk_b_addr + tile_off, ek16);
      // Scale, mask (entry j visible to row r iff j < min(len_r, c1)), the row max of these 16 entries.
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = 16 * pm + 8 * h + g;
        const int lim = min(len_s[r], c1);
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int j = j0 + 16 * cq + 8 * n + 2 * tq + c;
            const float v = j < lim ? p.scale * sv[0][n][2 * h + c] : -INFINITY;
            sv[0][n][2 * h + c] = v;
            mx = fmaxf(mx, v);
          }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        if (tq == 0) red_max[cq * QR + r] = mx;
      }
    }
    __syncthreads();  // B1: red_max

    // Online softmax, FP32: every thread forms the tile max of its rows from the 4 partial maxima (the
    // same values in the same order in each warp of the M tile, so their running maxima agree), writes
    // p = exp(s - m) as BF16 hi + lo and the partial row sums; warp cq = 0 of the M tile publishes the
    // correction.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = 16 * pm + 8 * h + g;
      const float tmax = fmaxf(fmaxf(red_max[r], red_max[QR + r]), fmaxf(red_max[2 * QR + r], red_max[3 * QR + r]));
      const float m_new = fmaxf(m_run[h], tmax);
      float corr = 1.f, pv[4] = {0.f, 0.f, 0.f, 0.f};
      if (m_new != -INFINITY) {
        corr = expf(m_run[h] - m_new);
        pv[0] = expf(sv[0][0][2 * h] - m_new);
        pv[1] = expf(sv[0][0][2 * h + 1] - m_new);
        pv[2] = expf(sv[0][1][2 * h] - m_new);
        pv[3] = expf(sv[0][1][2 * h + 1] - m_new);
      }
      m_run[h] = m_new;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const bf16raw h0 = __float2bfloat16_rn(pv[2 * n]), h1 = __float2bfloat16_rn(pv[2 * n + 1]);
        const bf16raw l0 = __float2bfloat16_rn(pv[2 * n] - __bfloat162float(h0));
        const bf16raw l1 = __float2bfloat16_rn(pv[2 * n + 1] - __bfloat162float(h1));
        const int col = 16 * cq + 8 * n + 2 * tq;
        *reinterpret_cast<uint32_t*>(Phi + r * kPS + col) = pack_bf16(h0, h1);
        *reinterpret_cast<uint32_t*>(Plo + r * kPS + col) = pack_bf16(l0, l1);
      }
      float psum = (pv[0] + pv[1]) + (pv[2] + pv[3]);
      psum += __shfl_xor_sync(0xffffffffu, psum, 1);
      psum += __shfl_xor_sync(0xffffffffu, psum, 2);
      if (tq == 0) {
        red_sum[cq * QR + r] = psum;
        if (cq == 0) corr_s[r] = corr;
      }
    }
    const int look_page = tid < kBN ? entry_page(look_pos) : -1;
    __syncthreads();  // B2: P, red_sum, corr_s

    if (tid < QR)
      l_s[tid] = l_s[tid] * corr_s[tid] +
                 ((red_sum[tid] + red_sum[QR + tid]) + (red_sum[2 * QR + tid] + red_sum[3 * QR + tid]));

    // O = corr O + P E[:, :R] with P = hi + lo (two MMAs per B fragment).
    {
      const float cg = corr_s[16 * pm + g], cg8 = corr_s[16 * pm + g + 8];
#pragma unroll
      for (int i = 0; i < kMaxPairs; ++i)
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          acc[i][n][0] *= cg;
          acc[i][n][1] *= cg;
          acc[i][n][2] *= cg8;
          acc[i][n][3] *= cg8;
        }
#pragma unroll  // the 4 k steps unrolled: P and E fragments load ahead of their MMAs (unroll 1 waits on each)
      for (int ks = 0; ks < kBN; ks += 16) {
        uint32_t ah[4], al[4];
        ldsm_x4(ah, phi_addr + ks * 2);
        ldsm_x4(al, plo_addr + ks * 2);
        // Two pairs at a time, the hi products before the lo ones: an accumulator's next MMA is 4 MMAs
        // after its previous one (hi, lo back to back waited on each other).
#pragma unroll
        for (int i0 = 0; i0 < kMaxPairs; i0 += 2) {
          uint32_t bv[2][4];
#pragma unroll
          for (int d = 0; d < 2; ++d)
            if (i0 + d < npw && pp0 + i0 + d < NP)
              ldsm_x4_trans(bv[d], pv_b_addr + tile_off + (ks * es + 16 * (pp0 + i0 + d)) * 2);
#pragma unroll
          for (int part = 0; part < 2; ++part) {
            const uint32_t* a = part == 0 ? ah : al;
#pragma unroll
            for (int d = 0; d < 2; ++d)
              if (i0 + d < npw && pp0 + i0 + d < NP) {
                mma_bf16_16816(acc[i0 + d][0], a[0], a[1], a[2], a[3], bv[d][0], bv[d][1]);
                mma_bf16_16816(acc[i0 + d][1], a[0], a[1], a[2], a[3], bv[d][2], bv[d][3]);
              }
          }
        }
      }
    }
    if (tid < kBN) rows_s[buf * kBN + tid] = entry_row(look_pos, look_page);
    __syncthreads();  // B3: the next iteration's copy overwrites this tile; rows_s of tile it + 2
  }

  if (cq == 0 && tq == 0) {
    m_s[16 * pm + g] = m_run[0];
    m_s[16 * pm + 8 + g] = m_run[1];
  }
  __syncthreads();

  const bool pairs = (R & 1) == 0 && (reinterpret_cast<uintptr_t>(p.o_out) & 7u) == 0;  // float2 stores
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = 16 * pm + 8 * h + g;
    if (r >= nrows) continue;
    const float l = l_s[r];
    const float inv = l > 0.f ? 1.f / l : 0.f;
    float* orow = p.o_out + (split * TH + th0 + r) * R;
#pragma unroll
    for (int i = 0; i < kMaxPairs; ++i) {
      if (i < npw && pp0 + i < NP) {
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          const int col = 16 * (pp0 + i) + 8 * n + 2 * tq;
          const float v0 = acc[i][n][2 * h] * inv, v1 = acc[i][n][2 * h + 1] * inv;
          if (pairs && col + 1 < R) {
            *reinterpret_cast<float2*>(orow + col) = make_float2(v0, v1);
          } else {
            if (col < R) orow[col] = v0;
            if (col + 1 < R) orow[col + 1] = v1;
          }
        }
      }
    }
  }
  if (tid < nrows) {
    const float l = l_s[tid];
    p.lse_out[split * TH + th0 + tid] = l > 0.f ? m_s[tid] + logf(l) : -INFINITY;
  }
}

}  // namespace

template <bool INDEXED>
cudaError_t launch_attend_mt(const AttendParams& p, const AttendShape& sh, int splits, int64_t groups,
                             cudaStream_t stream) {
  const int E = p.R + p.P;
  const size_t smem = static_cast<size_t>(attend_smem(E, sh.mt).total);
  cudaError_t err = allow_optin_smem<mla_attend_kernel<INDEXED>>();
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(sh.mctas), static_cast<unsigned>(splits), static_cast<unsigned>(groups));
  return detail::launch(mla_attend_kernel<INDEXED>, grid, kThreadsPerMT * sh.mt, smem, stream, p);
}

template cudaError_t launch_attend_mt<false>(const AttendParams&, const AttendShape&, int, int64_t, cudaStream_t);
template cudaError_t launch_attend_mt<true>(const AttendParams&, const AttendShape&, int, int64_t, cudaStream_t);

}  // namespace k3::ops::cuda::mla_detail
