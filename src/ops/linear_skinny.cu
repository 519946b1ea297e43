// The skinny-GEMM path of linear (2..64 rows): y[r, o] = sum_i x[r, i] * W[o, i] on tensor cores
// (mma.sync m16n8k16, BF16 in, FP32 accumulate), streaming W [out, in] once from HBM.
//
// The weights are the A operand (16 output features x 16 k), the tokens the B operand (n8 tiles of 8
// rows; NT tiles, NT = 1, 4 or 8 by the row count, those past the rows skipped). A CTA of 4 warps owns
// a tile of 128 output features and a range of 64-value k chunks; warp w owns features 32 w .. 32 w + 31
// (two m16 tiles sharing the B fragments) over the CTA's whole K range. Each chunk of W ([128][64] BF16,
// 16 KiB) and of x ([NT * 8][64] BF16; x is small and L2-resident) goes through a kSkStages-deep cp.async
// shared-memory ring; the rows of a staged chunk are 128 bytes, 16-byte piece p of row r stored at piece
// p ^ (r & 7), so the 8 row addresses of each ldmatrix phase hit 8 different bank groups. Rows past
// `out`, tokens past `rows` and k past `in` are zero-filled (nothing read), so they add nothing.
//
// Split K: CTAs (tile, split) with blockIdx.y = split, splits = one wave of CTAs / tiles (at least 1,
// at most the chunks, and as many as the partials fit in ctx.workspace), so even 896 x 7168 spreads over
// every SM. With one split the CTA writes y from its accumulators; with more, each writes its FP32
// partial tile to ctx.workspace [splits][rows][out] (stream-ordered, as cuBLASLt uses it) and
// linear_split_sum_kernel adds the splits in split order: one fixed summation order per output, so the
// result is the same bits on every run. y is rounded to BF16 once, from the FP32 sum.
//
// Resources (ptxas, sm_90a), NT = 1 / 4 / 8: 96 / 133 / 159 registers, 68 / 80 / 96 KiB of dynamic
// shared memory, so 3 / 2 / 2 CTAs per SM (the wave the split counts use, from the occupancy API).
#include <algorithm>
#include <atomic>

#include "ops/cuda_bf16.cuh"
#include "ops/cuda_cp_async.cuh"
#include "ops/cuda_device.cuh"
#include "ops/cuda_mma.cuh"
#include "ops/linear.h"

namespace k3::ops::cuda {
namespace {

using detail::aligned16;
using detail::cp_async_commit;
using detail::cp_async_wait;
using detail::kWarp;
using detail::ldsm_x4;
using detail::smem_u32;
using detail::mma_bf16_16816;

constexpr int kSkWarps = 4;
constexpr int kSkThreads = kSkWarps * kWarp;
constexpr int kSkWarpRows = 32;                        // output features per warp (two m16 tiles)
constexpr int kSkTileRows = kSkWarps * kSkWarpRows;    // output features per CTA
constexpr int kSkChunk = 64;                           // k values per stage: 128-byte staged rows
constexpr int kSkPieces = kSkChunk / 8;                // 16-byte pieces per staged row
constexpr int kSkRowBytes = kSkChunk * 2;
constexpr int kSkStages = 4;                           // chunks in the ring (3 in flight while one is used)
constexpr int kTokTile = 8;                            // tokens per n8 tile
constexpr int kSkMaxTiles = kLinearSkinnyMaxRows / kTokTile;

// Bytes of one ring slot's W chunk, one slot's x chunk (NT token tiles), and of the whole ring.
constexpr int kSkWSlotBytes = kSkTileRows * kSkRowBytes;
constexpr int sk_x_slot_bytes(int nt) { return nt * kTokTile * kSkRowBytes; }
constexpr size_t sk_smem_bytes(int nt) { return size_t{kSkStages} * (kSkWSlotBytes + sk_x_slot_bytes(nt)); }

// Byte offset of 16-byte piece p of staged row r (the swizzle above).
__device__ __forceinline__ uint32_t sk_swz(int r, int p) {
  return static_cast<uint32_t>(r * kSkRowBytes + 16 * (p ^ (r & 7)));
}


// 16 bytes global -> shared (shared-window address), asynchronous; zero-filled (nothing read) when
// !valid. L2_256 asks L2 to fetch the surrounding 256 bytes too: a weight row is staged 128 bytes per
// chunk, so the row's next chunk is on its way with this one.
template <bool L2_256>
__device__ __forceinline__ void cp_async16_at(uint32_t smem, const void* gmem, bool valid) {
  const int n = valid ? 16 : 0;
  if constexpr (L2_256) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(n)
                 : "memory");
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(n) : "memory");
  }
}


// x [rows, in], w [out, in] -> y [rows, out] (part == nullptr), else part [gridDim.y][rows][out] FP32.
// CTA (blockIdx.x, blockIdx.y): features 128 blockIdx.x .. + 127, chunks blockIdx.y * chunks_per_split
// .. (at least one). rows <= 8 NT; in % 8 == 0, x and w 16-byte aligned.
//
// Fragments (lane = 4 g + t; see mma_bf16_16816). A of m16 tile m of a warp at k16 step s: one
// ldmatrix.x4 of (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15) = a0..a3.
// B of token tile j for the two k16 steps of a k32 block: one ldmatrix.x4 of tokens 8 j .. 8 j + 7 at
// k 0-7, 8-15, 16-23, 24-31 = (b0, b1) of the first step, then (b0, b1) of the second.
template <int NT>
__global__ void __launch_bounds__(kSkThreads)
    linear_skinny_kernel(const bf16* __restrict__ x, const bf16* __restrict__ w, void* __restrict__ y,
                         float* __restrict__ part, bool y_f32, int rows, int64_t in, int64_t out,
                         int64_t chunks_per_split) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  extern __shared__ __align__(128) unsigned char sk_smem[];
  constexpr int kXSlot = sk_x_slot_bytes(NT);
  const uint32_t w_ring = smem_u32(sk_smem);                  // [kSkStages][128 features][128 bytes]
  const uint32_t x_ring = w_ring + kSkStages * kSkWSlotBytes;  // [kSkStages][8 NT tokens][128 bytes]
  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  const int64_t f0 = static_cast<int64_t>(blockIdx.x) * kSkTileRows;
  const int64_t chunks = (in + kSkChunk - 1) / kSkChunk;
  const int64_t c_begin = static_cast<int64_t>(blockIdx.y) * chunks_per_split;
  const int n = static_cast<int>(min(chunks, c_begin + chunks_per_split) - c_begin);  // chunks of this CTA
  const int nt = (rows + kTokTile - 1) / kTokTile;  // token tiles in use (CTA-uniform)

  // Staging: thread tid copies piece tid % 8 of the staged rows tid / 8 + 16 c (W: c < 8; x: the rows
  // of the nt tiles in use, tokens past `rows` zero-filled).
  constexpr int kRowStep = kSkThreads / kSkPieces;
  constexpr int kWCopies = kSkTileRows / kRowStep;
  constexpr int kXCopies = (NT * kTokTile + kRowStep - 1) / kRowStep;
  const int piece = tid % kSkPieces, row0 = tid / kSkPieces;
  const bf16* wsrc = w + (f0 + row0) * in + 8 * piece;
  const bf16* xsrc = x + row0 * in + 8 * piece;
  auto stage = [&](int i) {  // chunk c_begin + i into ring slot i % kSkStages
    const int64_t k = (c_begin + i) * kSkChunk;
    const bool k_ok = k + 8 * piece < in;
    const uint32_t wd = w_ring + (i % kSkStages) * kSkWSlotBytes, xd = x_ring + (i % kSkStages) * kXSlot;
#pragma unroll
    for (int c = 0; c < kWCopies; ++c) {
      const int r = row0 + kRowStep * c;
      const bool ok = k_ok && f0 + r < out;
      cp_async16_at<true>(wd + sk_swz(r, piece), ok ? wsrc + kRowStep * c * in + k : w, ok);
    }
#pragma unroll
    for (int c = 0; c < kXCopies; ++c) {
      const int r = row0 + kRowStep * c;
      if (r < nt * kTokTile) {
        const bool ok = k_ok && r < rows;
        cp_async16_at<false>(xd + sk_swz(r, piece), ok ? xsrc + kRowStep * c * in + k : x, ok);
      }
    }
  };

  // ldmatrix row addresses of this lane at k16 step 0 (A) and k32 block 0 (B), within a slot; a later
  // step or block changes only the piece, i.e. XORs the piece bits (the swizzle is an XOR too).
  const int mat = lane / 8, mrow = lane % 8;
  uint32_t a_off[2];
#pragma unroll
  for (int m = 0; m < 2; ++m) a_off[m] = sk_swz(kSkWarpRows * warp + 16 * m + 8 * (mat & 1) + mrow, mat >> 1);
  const uint32_t b_off = sk_swz(mrow, mat);  // token tile j adds 8 j rows (a multiple of 8: same swizzle)

  float acc[2][NT][4] = {};

#pragma unroll
  for (int i = 0; i < kSkStages - 1; ++i) {
    if (i < n) stage(i);
    cp_async_commit();
  }
  for (int i = 0; i < n; ++i) {
    cp_async_wait<kSkStages - 2>();
    __syncthreads();  // chunk i is visible to every warp, and every warp is done with chunk i - 1's slot
    if (i + kSkStages - 1 < n) stage(i + kSkStages - 1);
    cp_async_commit();
    const uint32_t ws = w_ring + (i % kSkStages) * kSkWSlotBytes, xs = x_ring + (i % kSkStages) * kXSlot;
#pragma unroll
    for (int kb = 0; kb < kSkChunk / 32; ++kb) {  // k32 blocks: pieces 4 kb .. 4 kb + 3
      uint32_t b[NT][4];
#pragma unroll
      for (int j = 0; j < NT; ++j)
        if (j < nt) ldsm_x4(b[j], xs + 8 * j * kSkRowBytes + (b_off ^ (64u * kb)));
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // k16 step 2 kb + h: pieces 4 kb + 2 h, + 1
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          uint32_t a[4];
          ldsm_x4(a, ws + (a_off[m] ^ (16u * (4 * kb + 2 * h))));
#pragma unroll
          for (int j = 0; j < NT; ++j)
            if (j < nt) mma_bf16_16816(acc[m][j], a[0], a[1], a[2], a[3], b[j][2 * h], b[j][2 * h + 1]);
        }
      }
    }
  }
  cp_async_wait<0>();

  // Lane (g, t) holds features g, g + 8 of each m16 tile and tokens 2 t, 2 t + 1 of each token tile.
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int m = 0; m < 2; ++m) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      if (j >= nt) continue;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = kTokTile * j + 2 * t + (e & 1);
        const int64_t o = f0 + kSkWarpRows * warp + 16 * m + g + 8 * (e >> 1);
        if (r >= rows || o >= out) continue;
        const float v = acc[m][j][e];
        if (part != nullptr) {
          part[(static_cast<int64_t>(blockIdx.y) * rows + r) * out + o] = v;
        } else if (y_f32) {
          static_cast<float*>(y)[r * out + o] = v;
        } else {
          static_cast<bf16*>(y)[r * out + o] = detail::float_to_bf16(v);
        }
      }
    }
  }
}

// y[e] = sum over s in order of part[s][e], e < n = rows * out (BF16: rounded once).
constexpr int kSumThreads = 256;
__global__ void __launch_bounds__(kSumThreads)
    linear_split_sum_kernel(const float* __restrict__ part, void* __restrict__ y, bool y_f32, int64_t n,
                            int splits) {
  detail::pdl_wait();
  detail::pdl_launch_dependents();
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * kSumThreads + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * kSumThreads) {
    float s = part[e];
    for (int p = 1; p < splits; ++p) s += part[p * n + e];
    if (y_f32) {
      static_cast<float*>(y)[e] = s;
    } else {
      static_cast<bf16*>(y)[e] = detail::float_to_bf16(s);
    }
  }
}

// CTAs of linear_skinny_kernel<NT> resident per SM (0: cannot run). The first call per device raises
// the kernel's dynamic shared-memory limit (the ring passes the 48 KiB a CTA gets without asking).
template <int NT>
int skinny_ctas_per_sm() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) {
    cudaGetLastError();
    return 0;
  }
  int n = cached[dev].load(std::memory_order_acquire);
  if (n > 0) return n;
  const int smem = static_cast<int>(sk_smem_bytes(NT));
  if (cudaFuncSetAttribute(linear_skinny_kernel<NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
          cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, linear_skinny_kernel<NT>, kSkThreads, smem) != cudaSuccess ||
      n <= 0) {
    cudaGetLastError();  // clear it: the caller falls back to another path
    return 0;
  }
  cached[dev].store(n, std::memory_order_release);
  return n;
}

template <int NT>
int launch_skinny(const Context& ctx, const bf16* x, const bf16* w, void* y, bool y_f32, int64_t rows, int64_t in,
                  int64_t out) {
  const int per_sm = skinny_ctas_per_sm<NT>();
  if (per_sm <= 0) return cudaErrorNotSupported;
  const int64_t tiles = (out + kSkTileRows - 1) / kSkTileRows;
  const int64_t chunks = (in + kSkChunk - 1) / kSkChunk;
  if (tiles > 0x7fffffff) return cudaErrorInvalidConfiguration;
  // Splits: enough CTAs for one full wave, each split at least one chunk, the partials in the workspace.
  const int64_t wave = int64_t{ctx.sm_count > 0 ? ctx.sm_count : detail::device_sm_count()} * per_sm;
  int64_t splits = std::clamp<int64_t>(wave / tiles, 1, std::min<int64_t>(chunks, 65535));
  const int64_t split_bytes = rows * out * static_cast<int64_t>(sizeof(float));
  const bool ws_ok = ctx.workspace != nullptr && (reinterpret_cast<uintptr_t>(ctx.workspace) % 16) == 0;
  splits = std::min<int64_t>(splits, ws_ok ? static_cast<int64_t>(ctx.workspace_bytes) / split_bytes : 1);
  splits = std::max<int64_t>(splits, 1);
  const int64_t chunks_per_split = (chunks + splits - 1) / splits;
  splits = (chunks + chunks_per_split - 1) / chunks_per_split;  // no empty split
  float* part = splits > 1 ? static_cast<float*>(ctx.workspace) : nullptr;

  const cudaStream_t s = reinterpret_cast<cudaStream_t>(ctx.stream);
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(splits));
  if (const cudaError_t e = detail::launch(linear_skinny_kernel<NT>, grid, kSkThreads, sk_smem_bytes(NT), s, x, w, y,
                                           part, y_f32, static_cast<int>(rows), in, out, chunks_per_split);
      e != cudaSuccess || part == nullptr)
    return e;
  const int64_t n = rows * out;
  const int64_t blocks = std::min<int64_t>((n + kSumThreads - 1) / kSumThreads, wave * 4);
  return detail::launch(linear_split_sum_kernel, static_cast<unsigned>(blocks), kSumThreads, 0, s, part, y, y_f32, n,
                        static_cast<int>(splits));
}

}  // namespace

bool linear_skinny_fits(int64_t rows, int64_t in, const bf16* x, const bf16* w) {
  return rows >= kLinearSkinnyMinRows && rows <= kLinearSkinnyMaxRows && in > 0 && in % 8 == 0 && aligned16(x) &&
         aligned16(w);
}

int linear_skinny(const Context& ctx, const bf16* x, const bf16* w, void* y, bool y_f32, int64_t rows, int64_t in,
                  int64_t out) {
  if (out <= 0 || x == nullptr || w == nullptr || y == nullptr) return cudaErrorInvalidValue;
  if (!linear_skinny_fits(rows, in, x, w)) return cudaErrorNotSupported;
  // The one place the row count becomes compile-time: token tiles of 8 rows, 1, 4 or 8 (fewer in use
  // are skipped at run time).
  static_assert(kSkMaxTiles == 8, "the largest instantiation covers kLinearSkinnyMaxRows");
  if (rows <= kTokTile) return launch_skinny<1>(ctx, x, w, y, y_f32, rows, in, out);
  if (rows <= 4 * kTokTile) return launch_skinny<4>(ctx, x, w, y, y_f32, rows, in, out);
  return launch_skinny<8>(ctx, x, w, y, y_f32, rows, in, out);
}

}  // namespace k3::ops::cuda
