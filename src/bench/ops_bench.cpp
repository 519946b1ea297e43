// k3decode bench --ops: the decode kernels one by one at the per-rank shapes of
// K3 (TP8 x DP4, EP32), each timed as a CUDA graph of 20 back-to-back launches
// (median over 15 replays, per launch; 2 launches and 5 replays for a kernel
// slower than 2 ms) beside its floor (its bytes over the HBM
// bandwidth of the same run). Inputs are random. The projections' weights
// rotate over copies of at least kColdBytes in all, launch i reading copy
// i % copies, so that they come from HBM as in the step (which streams every
// layer's weights once); elsewhere L2 is not flushed between the 20 launches,
// so operands smaller than L2 (50 MB) can beat the HBM floor.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench.h"
#include "bench/kernels.h"
#include "core/cuda.h"
#include "core/rng.h"
#include "ops/dsa.h"
#include "ops/kda.h"
#include "ops/kda_prep.h"
#include "ops/linear.h"
#include "ops/mla.h"
#include "ops/moe.h"
#include "ops/sampling.h"

namespace k3 {

namespace cu = ops::cuda;

namespace {

// A host-to-device copy that has landed when it returns: a pageable cudaMemcpy may return before its DMA
// ends, and the kernels run on non-blocking streams that do not wait for it.
void h2d(void* dst, const void* src, size_t bytes) {
  CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaDeviceSynchronize());
}

// Microseconds per launch of `fn` (which enqueues one launch on s; fn(i): launch i of the graph).
double time_us(cudaStream_t s, const std::function<void(int)>& fn) {
  cudaEvent_t a, b;
  CUDA_CHECK(cudaEventCreate(&a));
  CUDA_CHECK(cudaEventCreate(&b));
  CUDA_CHECK(cudaEventRecord(a, s));
  fn(0);  // warm-up and error check outside the graph
  CUDA_CHECK(cudaEventRecord(b, s));
  CUDA_CHECK(cudaEventSynchronize(b));
  float first_ms = 0;
  CUDA_CHECK(cudaEventElapsedTime(&first_ms, a, b));
  const int per_graph = first_ms > 2.0f ? 2 : 20, replays = first_ms > 2.0f ? 6 : 16;  // slow kernels: fewer
  cudaGraph_t g;
  CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < per_graph; ++i) fn(i);
  CUDA_CHECK(cudaStreamEndCapture(s, &g));
  cudaGraphExec_t e;
  CUDA_CHECK(cudaGraphInstantiate(&e, g, 0));
  std::vector<double> t;
  for (int r = 0; r < replays; ++r) {
    CUDA_CHECK(cudaEventRecord(a, s));
    CUDA_CHECK(cudaGraphLaunch(e, s));
    CUDA_CHECK(cudaEventRecord(b, s));
    CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    if (r > 0) t.push_back(ms * 1e3 / per_graph);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaGraphExecDestroy(e);
  cudaGraphDestroy(g);
  return median(t);
}

double time_us(cudaStream_t s, const std::function<void()>& fn) {
  return time_us(s, std::function<void(int)>([&](int) { fn(); }));
}

// Weights read by one launch of `bytes` rotate over copies(bytes) buffers: at least kColdBytes in all (3x the
// 50 MB L2 of an H100 / H200), at most one per launch of a graph.
constexpr double kColdBytes = 150e6;
int copies(double bytes) { return static_cast<int>(std::clamp(std::ceil(kColdBytes / bytes), 1.0, 20.0)); }

DeviceBuffer random_buffer(size_t bytes, int kind, cudaStream_t s, uint64_t seed) {
  DeviceBuffer b(bytes);
  const int64_t n = static_cast<int64_t>(bytes / (kind == 1 ? 4 : kind == 0 ? 2 : 1));
  CUDA_CHECK(static_cast<cudaError_t>(bench::fill(b.get(), n, kind, 0.0f, 0.05f, seed, s)));
  return b;
}

#define K3_OK(expr) CUDA_CHECK(static_cast<cudaError_t>(expr))

}  // namespace

int run_ops_bench(const BenchArgs& args, double bw, double flops, ops::cuda::Context& ctx) {
  cudaStream_t s = reinterpret_cast<cudaStream_t>(ctx.stream);
  nlohmann::json records = nlohmann::json::array();
  auto record = [&](const std::string& op, const std::string& shape, double us, double bytes, nlohmann::json extra) {
    const double floor_us = bytes / bw * 1e6;
    nlohmann::json r = {{"op", op},       {"shape", shape},        {"us", us},
                        {"bytes", bytes}, {"floor_us", floor_us},  {"ratio", us / floor_us},
                        {"pct_of_bw", 100 * floor_us / us},        {"hbm_gbps", bw / 1e9}, {"matrix_tflops", flops / 1e12},
                        {"commit", args.commit}};
    r.update(extra);
    records.push_back(r);
  };

  auto want = [&](const char* section) { return args.ops_only.empty() || args.ops_only == section; };

  // 1. Projections: hand-written kernel vs cuBLASLt vs the chosen path.
  if (want("linear")) {
    fmt::print("\nprojections (per-rank K3 shapes, out x in), us per call and % of HBM bandwidth (weights from HBM)\n");
    fmt::print("{:>12} {:>4} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7}\n", "out x in", "M", "kernel", "rows",
               "rows_tc", "cublasLt", "auto", "floor", "auto%");
    const std::pair<int64_t, int64_t> shapes[] = {{6288, 7168}, {7168, 1536}, {2304, 1536}, {1536, 7168},
                                                  {3584, 7168}, {7168, 3584}, {896, 7168},  {6144, 7168},
                                                  {7168, 6144}, {33792, 7168}, {7168, 33792}};
    const int Ms[] = {1, 2, 4, 8, 16, 32, 64};
    for (auto [out, in] : shapes) {
      std::vector<DeviceBuffer> w;
      for (int c = copies(double(out) * in * 2); c > 0; --c) w.push_back(random_buffer(out * in * 2, 0, s, 1 + c));
      DeviceBuffer x = random_buffer(64 * in * 2, 0, s, 2), y(64 * out * 4);
      for (int M : Ms) {
        // kernel = the hand-written path (skinny where it fits), rows = linear_rows_kernel alone, rows_tc = the
        // tensor-core row-tile kernel.
        double t[5];
        const cu::LinearPath paths[5] = {cu::LinearPath::Kernel, cu::LinearPath::Rows, cu::LinearPath::RowsTc,
                                         cu::LinearPath::CublasLt, cu::LinearPath::Auto};
        for (int p = 0; p < 5; ++p)
          t[p] = time_us(s, [&](int i) {
            K3_OK(cu::linear_via(ctx, paths[p], x.get<bf16>(), w[i % w.size()].get<bf16>(), y.get(), false, M, in,
                                 out));
          });
        const double bytes = double(out) * in * 2 + double(M) * (in + out) * 2;
        fmt::print("{:>6}x{:<5} {:>4} {:>9.1f} {:>9.1f} {:>9.1f} {:>9.1f} {:>9.1f} {:>9.1f} {:>6.0f}%\n", out, in, M,
                   t[0], t[1], t[2], t[3], t[4], bytes / bw * 1e6, 100 * bytes / bw * 1e6 / t[4]);
        record("linear", fmt::format("{}x{} M{}", out, in, M), t[4], bytes,
               {{"kernel_us", t[0]}, {"rows_us", t[1]}, {"rows_tc_us", t[2]}, {"cublaslt_us", t[3]}, {"M", M}});
      }
    }

    // Projection groups (cu::linear_group) at 1-8 rows: the projections of one input in one launch of the
    // rows kernel (Grouped) against one launch each (Separate: the rows kernel at 1 row, else cuBLASLt), as
    // the rank runs them; the step's choice is linear_group_takes().
    fmt::print("\nprojection groups at 1-16 rows (per-rank shapes), us per group and % of HBM bandwidth "
               "(weights from HBM)\n");
    fmt::print("{:>34} {:>4} {:>9} {:>9} {:>9} {:>9} {:>7} {:>7} {:>7}\n", "group (out..) x in", "rows", "separate",
               "grouped", "tc", "floor", "sep%", "grp%", "tc%");
    struct Group {
      const char* name;
      int64_t in;
      std::vector<std::pair<int64_t, bool>> outs;  // (out, FP32 output)
    };
    const Group groups[] = {
        {"mla q_a kv_a g_proj", 7168, {{1536, false}, {576, false}, {1536, false}}},
        {"dsa q_a kv_a g_proj wk wts", 7168, {{1536, false}, {576, false}, {1536, false}, {128, false}, {32, true}}},
        {"dsa q_b wq_b", 1536, {{2304, false}, {4096, false}}},
        {"moe router down", 7168, {{896, true}, {3584, false}}},
        {"moe router down (tp)", 7168, {{896, true}, {448, false}}},
        {"shared gate up (tp)", 7168, {{768, false}, {768, false}}},
        {"moe router down + shared gate up (tp)", 7168, {{896, true}, {448, false}, {768, false}, {768, false}}},
        {"dense gate up (tp)", 7168, {{4224, false}, {4224, false}}},
        {"shared gate up", 7168, {{6144, false}, {6144, false}}},
    };
    const int64_t kGroupRowsMax = 16;
    for (const auto& g : groups) {
      std::vector<DeviceBuffer> ws, ys;
      double wbytes = 0, obytes = 0;
      std::string shape;
      for (size_t j = 0; j < g.outs.size(); ++j) {
        const auto [out, f32] = g.outs[j];
        ys.emplace_back(kGroupRowsMax * out * 4);
        wbytes += double(out) * g.in * 2;
        obytes += double(out) * (f32 ? 4 : 2);
        shape += fmt::format("{}{}", j ? "+" : "", out);
      }
      // outs[c]: the group on weight copy c.
      std::vector<std::vector<cu::LinearOut>> outs(static_cast<size_t>(copies(wbytes)));
      for (size_t c = 0; c < outs.size(); ++c)
        for (size_t j = 0; j < g.outs.size(); ++j) {
          const auto [out, f32] = g.outs[j];
          ws.push_back(random_buffer(out * g.in * 2, 0, s, 20 + j + 10 * c));
          outs[c].push_back({ws.back().get<bf16>(), ys[j].get(), out, f32});
        }
      DeviceBuffer x = random_buffer(kGroupRowsMax * g.in * 2, 0, s, 3);
      for (const int64_t M : {1, 2, 4, 8, 16}) {
        double t[3];
        const cu::LinearGroupPath paths[3] = {cu::LinearGroupPath::Separate, cu::LinearGroupPath::Grouped,
                                              cu::LinearGroupPath::GroupedTc};
        for (int p = 0; p < 3; ++p)
          t[p] = time_us(s, [&](int i) {
            const auto& o = outs[i % outs.size()];
            K3_OK(cu::linear_group_via(ctx, paths[p], x.get<bf16>(), M, g.in, o.data(), static_cast<int>(o.size())));
          });
        const double bytes = wbytes + double(M) * (g.in * 2 + obytes), floor_us = bytes / bw * 1e6;
        fmt::print("{:>27}x{:<6} {:>4} {:>9.1f} {:>9.1f} {:>9.1f} {:>9.1f} {:>6.0f}% {:>6.0f}% {:>6.0f}%   {}\n", shape,
                   g.in, M, t[0], t[1], t[2], floor_us, 100 * floor_us / t[0], 100 * floor_us / t[1],
                   100 * floor_us / t[2], g.name);
        record("linear_group", fmt::format("{}x{} M{}", shape, g.in, M), t[1], bytes,
               {{"separate_us", t[0]}, {"tc_us", t[2]}, {"M", M}, {"group", g.name}});
      }
    }

  }
  // 2. Routed experts (MXFP4, 28 local experts of L 3584, I 3072), r rows per touched expert.
  if (want("moe")) {
    fmt::print("\nrouted experts: 28 local MXFP4 experts (3584 -> 3072 -> 3584), r rows on each of n experts\n");
    {
      const int64_t L = 3584, I = 3072, E = 28;
      std::vector<DeviceBuffer> mats;
      std::vector<const uint8_t*> ptrs[6];
      for (int e = 0; e < E; ++e)
        for (int j = 0; j < 3; ++j) {
          const int64_t N = j == 2 ? L : I, K = j == 2 ? I : L;
          mats.push_back(random_buffer(N * K / 2, 2, s, 10 + e * 3 + j));
          ptrs[2 * j].push_back(mats.back().get<uint8_t>());
          mats.push_back(random_buffer(N * K / 32, 3, s, 100 + e * 3 + j));
          ptrs[2 * j + 1].push_back(mats.back().get<uint8_t>());
        }
      std::vector<DeviceBuffer> tables;
      const uint8_t* const* dev[6];
      for (int j = 0; j < 6; ++j) {
        tables.emplace_back(E * sizeof(void*));
        h2d(tables.back().get(), ptrs[j].data(), E * sizeof(void*));
        dev[j] = tables.back().get<const uint8_t* const>();
      }
      const cu::Mxfp4ExpertTable table{dev[0], dev[1], dev[2], dev[3], dev[4], dev[5]};
      const double expert_bytes = 3.0 * (I * L / 2 + I * L / 32);
      // r rows on each of n experts; r = 0: the rank slice's pair counts (B = 32 q = 1 ... B = 64 q = 4: m k / 8
      // pairs) drawn uniformly over the 28 experts, so the experts' counts vary as in the step.
      struct Case {
        int n, r;
        int64_t drawn;
      };
      for (const Case c : std::vector<Case>{{2, 1, 0}, {16, 1, 0}, {28, 1, 0}, {28, 2, 0}, {28, 4, 0}, {28, 8, 0},
                                            {28, 16, 0}, {28, 32, 0}, {28, 64, 0}, {28, 0, 128}, {28, 0, 256},
                                            {28, 0, 512}}) {
        const int n = c.n, r = c.r;
        const int64_t rows = r > 0 ? int64_t{n} * r : c.drawn;
        std::vector<int32_t> idx(static_cast<size_t>(rows));
        uint64_t state = 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(rows);
        for (int64_t i = 0; i < rows; ++i) {
          state = state * 6364136223846793005ull + 1442695040888963407ull;  // LCG; the top bits pick the expert
          idx[i] = static_cast<int32_t>(r > 0 ? i % n : static_cast<int64_t>((state >> 33) % static_cast<uint64_t>(n)));
        }
        std::vector<float> wts(static_cast<size_t>(rows), 1.0f);
        DeviceBuffer d_idx(rows * 4), d_w(rows * 4), z = random_buffer(rows * L * 2, 0, s, 3), y(rows * L * 2);
        h2d(d_idx.get(), idx.data(), rows * 4);
        h2d(d_w.get(), wts.data(), rows * 4);
        DeviceBuffer scratch(cu::moe_experts_scratch_bytes(rows, 1, L, I));
        const double us = time_us(s, [&] {
          K3_OK(cu::moe_experts(ctx, z.get<bf16>(), d_idx.get<int32_t>(), d_w.get<float>(), table, 0, E, y.get<bf16>(),
                                scratch.get(), rows, 1, L, I, ops::SituParams{}));
        });
        std::vector<int32_t> touched = idx;
        std::sort(touched.begin(), touched.end());
        const double bytes = double(std::unique(touched.begin(), touched.end()) - touched.begin()) * expert_bytes;
        const double mma_us = double(rows) * 6.0 * double(I) * double(L) / flops * 1e6;  // W1, W3, W2 products
        const std::string label = r > 0 ? fmt::format("{} experts x {} rows", n, r)
                                        : fmt::format("{} experts, {} pairs drawn", n, rows);
        fmt::print("  {:>26}: {:>9.1f} us, floor {:>7.1f} us, {:>5.0f}% of bandwidth; compute floor {:>6.1f} us\n",
                   label, us, bytes / bw * 1e6, 100 * bytes / bw * 1e6 / us, mma_us);
        record("moe_experts", label, us, bytes, {{"experts", n}, {"rows", r}, {"pairs", rows}, {"compute_floor_us", mma_us}});
      }
    }

  }
  // 3. KDA: the step's prep (convs, norms, gate, beta in one kernel), then the recurrence: 12 heads of 128 x 128
  // FP32 state per request, q tokens.
  if (want("kda")) {
    fmt::print("\nKDA prep (12 heads, d 128, K 4): q, k, v convs + SiLU, q / k l2 norms, gate, beta, kept inputs\n");
    {
      const int H = 12, d = 128, K = 4, maxB = 64, maxq = 8;
      const int64_t C = int64_t{H} * d, P = (4 * C + d + H + 15) / 16 * 16, R = int64_t{maxB} * maxq;
      DeviceBuffer proj = random_buffer(R * P * 2, 0, s, 31), u = random_buffer(R * C * 2, 0, s, 32);
      DeviceBuffer conv_w = random_buffer(3 * C * K * 4, 1, s, 33);
      DeviceBuffer pool = random_buffer(3 * int64_t{maxB} * C * (K - 1) * 4, 1, s, 34);
      DeviceBuffer kept(3 * R * C * 4), A_log = random_buffer(H * 4, 1, s, 35), dt = random_buffer(C * 4, 1, s, 36);
      DeviceBuffer qn(R * C * 4), kn(R * C * 4), v(R * C * 2), g(R * C * 4), beta(R * H * 4), slots(maxB * 4);
      std::vector<int32_t> sl(maxB);
      for (int b = 0; b < maxB; ++b) sl[b] = b;
      h2d(slots.get(), sl.data(), maxB * 4);
      cu::KdaPrep p;
      p.proj = proj.get<bf16>();
      p.proj_ld = P;
      p.b_col = 4 * C + d;
      p.u = u.get<bf16>();
      for (int j = 0; j < 3; ++j) {
        p.conv_w[j] = conv_w.get<float>() + j * C * K;
        p.conv_pool[j] = pool.get<float>() + j * int64_t{maxB} * C * (K - 1);
        p.conv_kept[j] = kept.get<float>() + j * R * C;
      }
      p.slots = slots.get<int32_t>();
      p.A_log = A_log.get<float>();
      p.dt_bias = dt.get<float>();
      p.lower_bound = -5.0f;
      p.q_scale = 1.0f / std::sqrt(static_cast<float>(d));
      p.q = qn.get<float>();
      p.k = kn.get<float>();
      p.v = v.get<bf16>();
      p.g = g.get<float>();
      p.beta = beta.get<float>();
      for (int B : {1, 8, 64})
        for (int qq : {1, 2, 4, 8}) {
          const double us = time_us(s, [&] { K3_OK(cu::kda_prep(p, B, qq, maxq, H, d, K, s)); });
          const double rows = double(B) * qq;
          // Read: q | k | v, b, u, the conv states and weights, dt_bias; written: q, k, g (F32), v (BF16), beta,
          // the kept inputs (F32).
          const double bytes = rows * (3 * C + H + C) * 2 + 3.0 * B * C * (K - 1) * 4 + 3.0 * C * K * 4 + C * 4.0 +
                               rows * (3 * C * 4 + C * 2 + H * 4 + 3 * C * 4);
          fmt::print("  B {:>2} q {}: {:>8.1f} us, floor {:>7.1f} us, {:>5.0f}%\n", B, qq, us, bytes / bw * 1e6,
                     100 * bytes / bw * 1e6 / us);
          record("kda_prep", fmt::format("B{} q{}", B, qq), us, bytes, {{"B", B}, {"q", qq}});
        }
    }
    fmt::print("\nKDA recurrence (12 heads, d 128): state read once, the last token's state written once, "
               "q > 1 keeps k, g, v, beta\n");
    {
      const int H = 12, d = 128, maxB = 64, maxq = 8;
      const int64_t C = int64_t{H} * d, state = int64_t{H} * d * d;
      DeviceBuffer pool = random_buffer(2 * maxB * state * 4, 1, s, 4);
      DeviceBuffer kept_buf(int64_t{maxB} * maxq * (3 * C + H) * 4);
      float* kb = kept_buf.get<float>();
      const int64_t kn = int64_t{maxB} * maxq * C;
      const cu::KdaKept kept{kb, kb + kn, kb + 2 * kn, kb + 3 * kn};
      DeviceBuffer q = random_buffer(maxB * maxq * C * 4, 1, s, 5), k = random_buffer(maxB * maxq * C * 4, 1, s, 6);
      DeviceBuffer v = random_buffer(maxB * maxq * C * 2, 0, s, 7), g = random_buffer(maxB * maxq * C * 4, 1, s, 8);
      DeviceBuffer beta = random_buffer(maxB * maxq * H * 4, 1, s, 9), o(maxB * maxq * C * 4), slots(maxB * 4);
      DeviceBuffer idx(2 * maxB * 4), acc(maxB * 4);
      std::vector<int32_t> sl(maxB), ix(2 * maxB), ac(maxB);
      for (int b = 0; b < maxB; ++b) {
        sl[b] = b;
        ix[b] = 2 * b;
        ix[maxB + b] = 2 * b + 1;
      }
      h2d(slots.get(), sl.data(), maxB * 4);
      h2d(idx.get(), ix.data(), 2 * maxB * 4);
      const int32_t* rd = idx.get<int32_t>();
      const int32_t* wr = rd + maxB;
      for (int B : {1, 8, 64})
        for (int qq : {1, 2, 4, 8}) {
          const double us = time_us(s, [&] {
            K3_OK(cu::kda_recurrence(q.get<float>(), k.get<float>(), v.get<bf16>(), g.get<float>(), beta.get<float>(),
                                     pool.get<float>(), rd, wr, kept, slots.get<int32_t>(), o.get<float>(), B, qq,
                                     maxq, H, d, d, s));
          });
          const double bytes = double(B) * state * 4 * 2 + (qq > 1 ? double(B) * qq * (3 * C + H) * 4 : 0.0);
          fmt::print("  B {:>2} q {}: {:>8.1f} us, floor {:>7.1f} us, {:>5.0f}%\n", B, qq, us, bytes / bw * 1e6,
                     100 * bytes / bw * 1e6 / us);
          record("kda_recurrence", fmt::format("B{} q{}", B, qq), us, bytes, {{"B", B}, {"q", qq}});
        }
      // The commit of a partial accept: replay n = q - 1 of q kept tokens (state read, state written).
      for (int B : {1, 8, 64})
        for (int qq : {2, 4, 8}) {
          for (int b = 0; b < maxB; ++b) ac[b] = qq - 1;
          h2d(acc.get(), ac.data(), maxB * 4);
          const double us = time_us(s, [&] {
            K3_OK(cu::kda_replay(kept, pool.get<float>(), rd, wr, slots.get<int32_t>(), acc.get<int32_t>(), B, qq,
                                 maxq, H, d, d, s));
          });
          const double bytes = double(B) * state * 4 * 2 + double(B) * (qq - 1) * (3 * C + H) * 4;
          fmt::print("  replay B {:>2} n {}: {:>8.1f} us, floor {:>7.1f} us, {:>5.0f}%\n", B, qq - 1, us,
                     bytes / bw * 1e6, 100 * bytes / bw * 1e6 / us);
          record("kda_replay", fmt::format("B{} n{}", B, qq - 1), us, bytes, {{"B", B}, {"n", qq - 1}});
        }
    }

  }
  // 4. MLA decode over the paged latent cache, and DSA (indexer scores + top-k + sparse MLA).
  if (want("mla")) {
    // The per-token MLA kernels beside the attention: q absorption (W_uk read once per call), the split merge
    // (one request's splits: about one per SM) and the value unabsorption (W_uv).
    fmt::print("\nMLA absorb / merge / unabsorb (12 heads, dn 128, dv 128, R 512)\n");
    {
      const int H = 12, dn = 128, P = 64, dv = 128, R = 512, E = R + P;
      const int64_t maxT = 256;
      DeviceBuffer w = random_buffer(int64_t{H} * (dn + dv) * R * 2, 0, s, 21);
      DeviceBuffer q = random_buffer(maxT * H * (dn + P) * 2, 0, s, 22), qlat(maxT * H * E * 2);
      DeviceBuffer olat = random_buffer(maxT * H * R * 2, 0, s, 23), o(maxT * H * dv * 2);
      const double wbytes = double(H) * dn * R * 2;
      fmt::print("  tokens   absorb: kernel  cublasLt    auto   unabsorb: kernel  cublasLt    auto   "
                 "(W_uk, W_uv: {:.1f} us each at bandwidth)\n",
                 wbytes / bw * 1e6);
      for (int64_t T : {int64_t{1}, int64_t{4}, int64_t{8}, int64_t{16}, int64_t{64}, int64_t{256}}) {
        double ta[3], tu[3];
        const cu::LinearPath paths[3] = {cu::LinearPath::Kernel, cu::LinearPath::CublasLt, cu::LinearPath::Auto};
        for (int i = 0; i < 3; ++i) {
          ta[i] = time_us(s, [&] {
            K3_OK(cu::mla_absorb_q(ctx, q.get<bf16>(), w.get<bf16>(), qlat.get<bf16>(), T, H, dn, P, dv, R, paths[i]));
          });
          tu[i] = time_us(s, [&] {
            K3_OK(cu::mla_unabsorb(ctx, olat.get<bf16>(), w.get<bf16>(), o.get<bf16>(), T, H, dn, dv, R, paths[i]));
          });
        }
        fmt::print("  {:>6}   {:>14.1f} {:>9.1f} {:>7.1f}   {:>16.1f} {:>9.1f} {:>7.1f}\n", T, ta[0], ta[1], ta[2],
                   tu[0], tu[1], tu[2]);
        record("mla_absorb_q", fmt::format("T{}", T), ta[2], wbytes,
               {{"T", T}, {"kernel_us", ta[0]}, {"cublaslt_us", ta[1]}});
        record("mla_unabsorb", fmt::format("T{}", T), tu[2], wbytes,
               {{"T", T}, {"kernel_us", tu[0]}, {"cublaslt_us", tu[1]}});
      }
      // (132 parts: one request at 8k; 32, 4 and 2 parts: the splits of 8, 64 and 64 requests x q 4 at 8k.)
      for (auto [D, T] : std::vector<std::pair<int, int64_t>>{{132, 1}, {132, 4}, {33, 64}, {32, 8}, {4, 64}, {2, 256}}) {
        DeviceBuffer parts = random_buffer(int64_t{D} * T * H * R * 4, 1, s, 24),
                     lp = random_buffer(int64_t{D} * T * H * 4, 1, s, 25);
        DeviceBuffer om(T * H * R * 4), lm(T * H * 4);
        const double tm = time_us(s, [&] {
          K3_OK(cu::lse_merge(parts.get<float>(), lp.get<float>(), D, T, H, R, om.get<float>(), lm.get<float>(), s));
        });
        const double mbytes = double(D) * T * H * (R + 1) * 4;
        fmt::print("  merge {:>3} parts, T {:>3}: {:>6.1f} us, floor {:>5.1f} us\n", D, T, tm, mbytes / bw * 1e6);
        record("lse_merge", fmt::format("D{} T{}", D, T), tm, mbytes, {{"D", D}, {"T", T}});
      }
    }
    fmt::print("\nMLA / DSA decode (12 heads, 576-value latent entries, page 64), q = 1\n");
    for (int64_t ctxlen : {int64_t{8192}, int64_t{65536}}) {
      const int H = 12, R = 512, P = 64, E = R + P, page = 64, Hi = 32, Di = 128, topk = 2048;
      for (int B : {1, 8, 32, 64}) {
        const int64_t pages_per = ctxlen / page, pages = B * pages_per;
        DeviceBuffer kv = random_buffer(pages * page * E * 2, 0, s, 11),
                     keys = random_buffer(pages * page * Di * 2, 0, s, 12);
        std::vector<int32_t> tables(static_cast<size_t>(pages)), ctxv(B, static_cast<int32_t>(ctxlen));
        for (int64_t i = 0; i < pages; ++i) tables[i] = static_cast<int32_t>((i * 7919) % pages);  // scattered pages
        DeviceBuffer d_tables(pages * 4), d_ctx(B * 4);
        h2d(d_tables.get(), tables.data(), pages * 4);
        h2d(d_ctx.get(), ctxv.data(), B * 4);
        DeviceBuffer qlat = random_buffer(int64_t{B} * H * E * 2, 0, s, 13), olat(int64_t{B} * H * R * 4),
                     lse(B * H * 4);
        const size_t sb = cu::mla_attend_paged_scratch_bytes(B, 1, H, R, static_cast<int>(ctxlen));
        DeviceBuffer scratch(std::max<size_t>(sb, 256));
        const float scale = 0.0722f;
        const double us = time_us(s, [&] {
          K3_OK(cu::mla_attend_paged(qlat.get<bf16>(), kv.get<bf16>(), d_tables.get<int32_t>(),
                                     static_cast<int>(pages_per), page, d_ctx.get<int32_t>(), B, 1,
                                     static_cast<int>(ctxlen), H, R, P, scale, olat.get<float>(), lse.get<float>(),
                                     scratch.get(), sb, s));
        });
        const double bytes = double(B) * ctxlen * E * 2;
        fmt::print("  MLA ctx {:>6} B {:>2}: {:>8.1f} us, floor {:>7.1f} us, {:>5.0f}%\n", ctxlen, B, us,
                   bytes / bw * 1e6, 100 * bytes / bw * 1e6 / us);
        record("mla_attend", fmt::format("ctx{} B{}", ctxlen, B), us, bytes, {{"context", ctxlen}, {"B", B}});
        // DSA: scores over every cached key, top-2048, attention over the selection.
        DeviceBuffer qi = random_buffer(int64_t{B} * Hi * Di * 2, 0, s, 14), wi = random_buffer(B * Hi * 4, 1, s, 15);
        DeviceBuffer scores(int64_t{B} * ctxlen * 4), sel(int64_t{B} * topk * 4), cnt(B * 4);
        DeviceBuffer topk_scratch(cu::topk_indices_scratch_bytes(B));
        CUDA_CHECK(cudaMemsetAsync(topk_scratch.get(), 0, topk_scratch.bytes(), s));
        const size_t sbi = cu::mla_attend_indexed_scratch_bytes(B, H, R, topk);
        DeviceBuffer scratch_i(std::max<size_t>(sbi, 256));
        const double t_scores = time_us(s, [&] {
          K3_OK(cu::dsa_index_scores_paged(qi.get<bf16>(), wi.get<float>(), keys.get<bf16>(), d_tables.get<int32_t>(),
                                           static_cast<int>(pages_per), page, d_ctx.get<int32_t>(), B, 1,
                                           static_cast<int>(ctxlen), Hi, Di, scores.get<float>(), s));
        });
        const double t_topk = time_us(s, [&] {
          K3_OK(cu::topk_indices(scores.get<float>(), ctxlen, d_ctx.get<int32_t>(), B, topk, sel.get<int32_t>(),
                                 cnt.get<int32_t>(), topk_scratch.get(), topk_scratch.bytes(), s));
        });
        const double t_sparse = time_us(s, [&] {
          K3_OK(cu::mla_attend_indexed(qlat.get<bf16>(), kv.get<bf16>(), d_tables.get<int32_t>(),
                                       static_cast<int>(pages_per), page, sel.get<int32_t>(), cnt.get<int32_t>(), topk,
                                       B, 1, H, R, P, scale, olat.get<float>(), lse.get<float>(), scratch_i.get(), sbi,
                                       s));
        });
        const double dbytes = double(B) * (ctxlen * Di * 2 + topk * E * 2);
        const double dus = t_scores + t_topk + t_sparse;
        fmt::print("  DSA ctx {:>6} B {:>2}: scores {:.1f} + top-k {:.1f} + sparse MLA {:.1f} = {:>8.1f} us, "
                   "floor {:>7.1f} us, "
                   "{:>5.0f}%\n",
                   ctxlen, B, t_scores, t_topk, t_sparse, dus, dbytes / bw * 1e6, 100 * dbytes / bw * 1e6 / dus);
        record("dsa_decode", fmt::format("ctx{} B{}", ctxlen, B), dus, dbytes,
               {{"context", ctxlen}, {"B", B}, {"scores_us", t_scores}, {"topk_us", t_topk}, {"sparse_us", t_sparse}});
      }
    }
    // Verify widths: q tokens of a request share every cache entry (q x 12 query rows per request).
    fmt::print("\nMLA decode, q = 2 and 4 (24 and 48 query rows per request)\n");
    for (int64_t ctxlen : {int64_t{8192}, int64_t{65536}})
      for (int q : {2, 4})
        for (int B : {1, 8, 64}) {
          const int H = 12, R = 512, P = 64, E = R + P, page = 64;
          const int64_t pages_per = ctxlen / page, pages = B * pages_per;
          DeviceBuffer kv = random_buffer(pages * page * E * 2, 0, s, 16);
          std::vector<int32_t> tables(static_cast<size_t>(pages)), ctxv(static_cast<size_t>(B) * q);
          for (int64_t i = 0; i < pages; ++i) tables[i] = static_cast<int32_t>((i * 7919) % pages);  // scattered
          for (size_t i = 0; i < ctxv.size(); ++i) ctxv[i] = static_cast<int32_t>(ctxlen - q + 1 + i % q);  // causal
          DeviceBuffer d_tables(pages * 4), d_ctx(int64_t{B} * q * 4);
          h2d(d_tables.get(), tables.data(), pages * 4);
          h2d(d_ctx.get(), ctxv.data(), ctxv.size() * 4);
          DeviceBuffer qlat = random_buffer(int64_t{B} * q * H * E * 2, 0, s, 17),
                       olat(int64_t{B} * q * H * R * 4), lse(int64_t{B} * q * H * 4);
          const size_t sb = cu::mla_attend_paged_scratch_bytes(B, q, H, R, static_cast<int>(ctxlen));
          DeviceBuffer scratch(std::max<size_t>(sb, 256));
          const double us = time_us(s, [&] {
            K3_OK(cu::mla_attend_paged(qlat.get<bf16>(), kv.get<bf16>(), d_tables.get<int32_t>(),
                                       static_cast<int>(pages_per), page, d_ctx.get<int32_t>(), B, q,
                                       static_cast<int>(ctxlen), H, R, P, 0.0722f, olat.get<float>(), lse.get<float>(),
                                       scratch.get(), sb, s));
          });
          const double bytes = double(B) * ctxlen * E * 2;
          fmt::print("  MLA ctx {:>6} B {:>2} q {}: {:>8.1f} us, floor {:>7.1f} us, {:>5.0f}%\n", ctxlen, B, q, us,
                     bytes / bw * 1e6, 100 * bytes / bw * 1e6 / us);
          record("mla_attend", fmt::format("ctx{} B{} q{}", ctxlen, B, q), us, bytes,
                 {{"context", ctxlen}, {"B", B}, {"q", q}});
        }
  }
  // 5. Token sampling on the step's logits (K3's vocab, FP32), the floor one read of the logits: greedy (one
  // launch), greedy with log-probs, nucleus sampling with a draft and log-probs.
  if (want("sampling")) {
    fmt::print("\nsample_rows (vocab 163840, FP32 logits): us per call\n");
    const int64_t V = 163840, maxR = 256;
    DeviceBuffer logits(maxR * V * 4), out(maxR * sizeof(ops::SampleResult));
    K3_OK(bench::fill(logits.get(), maxR * V, 1, 0.0f, 8.0f, 31, s));  // uniform in [-8, 8]
    DeviceBuffer spec(maxR * sizeof(ops::SampleSpec)), scratch(cu::sample_rows_scratch_bytes(maxR, V));
    CUDA_CHECK(cudaMemsetAsync(scratch.get(), 0, scratch.bytes(), s));
    Rng rng(32);
    for (int64_t rows : {int64_t{1}, int64_t{8}, int64_t{64}, int64_t{256}}) {
      for (int mode = 0; mode < 3; ++mode) {
        std::vector<ops::SampleSpec> specs(static_cast<size_t>(rows));
        for (auto& sp : specs) {
          sp.temperature = mode == 2 ? 0.7f : 0.0f;
          sp.top_p = mode == 2 ? 0.9f : 1.0f;
          sp.draft = mode == 2 ? static_cast<int32_t>(rng.below(V)) : -1;
          sp.logprob = mode >= 1;
          sp.u_accept = rng.uniform();
          sp.u_draw = rng.uniform();
        }
        h2d(spec.get(), specs.data(), rows * sizeof(ops::SampleSpec));
        const ops::SampleNeeds needs = ops::sample_needs(specs.data(), rows);
        const double split_us = time_us(s, [&] {
          K3_OK(cu::sample_rows(logits.get<float>(), rows, V, spec.get<ops::SampleSpec>(), out.get<ops::SampleResult>(),
                                scratch.get(), scratch.bytes(), s, needs));
        });
        const char* what = mode == 0 ? "greedy" : mode == 1 ? "greedy logprob" : "T 0.7 top_p 0.9 draft logprob";
        const double bytes = double(rows) * V * 4;
        fmt::print("  rows {:>3} {:<30}: {:>8.1f} us, floor {:>6.1f} us, {:>5.0f}%\n", rows, what, split_us,
                   bytes / bw * 1e6, 100 * bytes / bw * 1e6 / split_us);
        record("sample_rows", fmt::format("rows{} {}", rows, what), split_us, bytes,
               {{"rows", rows}, {"vocab", V}, {"mode", what}});
      }
    }
  }
  // 6. DSA top-k alone (top-2048 of each row's scores, in column order): the automatic choice, and the same
  // kernel forced to one CTA per row (what the automatic rule weighs the split against). Floor: one read of
  // the scores and the indices written. Rows of uniform random scores (one histogram pass and the gather),
  // and rows of one repeated value (every pass, the tie broken on the index bits: the worst case). Scores
  // under 50 MB stay in L2 across the 20 launches of a graph.
  if (want("dsa")) {
    fmt::print("\nDSA top-k (k = 2048 of each row's scores, F32): automatic split vs one CTA per row\n");
    const int topk = 2048;
    for (int64_t ctxlen : {int64_t{8192}, int64_t{65536}, int64_t{131072}})
      for (int rows : {1, 8, 64, 256})
        for (int ties = 0; ties < 2; ++ties) {
          if (ties && rows != 8) continue;
          const int64_t n = int64_t{rows} * ctxlen;
          DeviceBuffer scores = random_buffer(n * 4, 1, s, 21 + ties);
          if (ties) CUDA_CHECK(static_cast<cudaError_t>(bench::fill(scores.get(), n, 1, 0.5f, 0.0f, 22, s)));
          std::vector<int32_t> ctxv(static_cast<size_t>(rows), static_cast<int32_t>(ctxlen));
          DeviceBuffer d_n(int64_t{rows} * 4), sel(int64_t{rows} * topk * 4), cnt(int64_t{rows} * 4);
          h2d(d_n.get(), ctxv.data(), ctxv.size() * 4);
          DeviceBuffer scratch(cu::topk_indices_scratch_bytes(rows));
          CUDA_CHECK(cudaMemsetAsync(scratch.get(), 0, scratch.bytes(), s));
          const double us = time_us(s, [&] {
            K3_OK(cu::topk_indices(scores.get<float>(), ctxlen, d_n.get<int32_t>(), rows, topk, sel.get<int32_t>(),
                                   cnt.get<int32_t>(), scratch.get(), scratch.bytes(), s));
          });
          const double us_one = time_us(s, [&] {
            K3_OK(cu::topk_indices(scores.get<float>(), ctxlen, d_n.get<int32_t>(), rows, topk, sel.get<int32_t>(),
                                   cnt.get<int32_t>(), scratch.get(), scratch.bytes(), s, /*ctas_per_row=*/1));
          });
          const double bytes = double(n) * 4 + double(rows) * topk * 4;
          const double floor_us = bytes / bw * 1e6;
          fmt::print("  ctx {:>6} rows {:>3}{}: auto {:>7.1f} us, one CTA/row {:>7.1f} us, floor {:>6.1f} us, {:>5.0f}%\n",
                     ctxlen, rows, ties ? " (ties)" : "       ", us, us_one, floor_us, 100 * floor_us / us);
          record("dsa_topk", fmt::format("ctx{} rows{}{}", ctxlen, rows, ties ? " ties" : ""), us, bytes,
                 {{"context", ctxlen}, {"rows", rows}, {"k", topk}, {"ties", ties != 0}, {"one_cta_us", us_one}});
        }
  }
  if (!args.json.empty()) {
    std::ofstream out(args.json);
    K3_CHECK(out.good(), "bench: cannot write {}", args.json);
    out << records.dump(1) << "\n";
  }
  return 0;
}

}  // namespace k3
