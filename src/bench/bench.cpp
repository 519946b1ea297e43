// k3decode bench: the rank slice / a model on one GPU timed as CUDA graph replays against its HBM floor (bench.h).
#include "bench/bench.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>

#include "bench/kernels.h"
#include "bench/trace.h"
#include "config/schema.h"
#include "core/cuda.h"
#include "core/rng.h"
#include "io/synthetic.h"
#include "ops/linear.h"
#include "runtime/gpu/rank.h"

namespace k3 {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

namespace {

// Median seconds of `timed` eager runs of fn (which enqueues on s) after `warmup` untimed ones, each
// between two events.
double median_seconds(cudaStream_t s, int warmup, int timed, const std::function<void()>& fn) {
  cudaEvent_t a, b;
  CUDA_CHECK(cudaEventCreate(&a));
  CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> t;
  for (int i = 0; i < warmup + timed; ++i) {
    CUDA_CHECK(cudaEventRecord(a, s));
    fn();
    CUDA_CHECK(cudaEventRecord(b, s));
    CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    if (i >= warmup) t.push_back(ms * 1e-3);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(t);
}

// HBM read bandwidth (bytes/s): median of 20 reads of a 4 GiB buffer.
double measure_bandwidth(cudaStream_t s, int sms) {
  const size_t bytes = size_t{4} << 30;
  DeviceBuffer buf(bytes), sink(64);
  CUDA_CHECK(cudaMemsetAsync(buf.get(), 1, bytes, s));
  const double sec = median_seconds(s, 3, 20, [&] {
    CUDA_CHECK(static_cast<cudaError_t>(bench::stream_read(buf.get(), bytes, sink.get<unsigned>(), sms, s)));
  });
  return static_cast<double>(bytes) / sec;
}

// Dense BF16 matrix rate (FLOP/s): cuBLASLt on 8192 x 8192 x 8192 (FP32 accumulation, BF16 out), random
// operands, median of 10 timed runs after 2 warm-ups. The compute floor of a kernel is its FLOPs / this.
double measure_matrix_rate(const ops::cuda::Context& ctx) {
  cudaStream_t s = reinterpret_cast<cudaStream_t>(ctx.stream);
  const int64_t n = 8192;
  DeviceBuffer x(n * n * 2), w(n * n * 2), y(n * n * 2);
  CUDA_CHECK(static_cast<cudaError_t>(bench::fill(x.get(), n * n, 0, 0.0f, 0.05f, 21, s)));
  CUDA_CHECK(static_cast<cudaError_t>(bench::fill(w.get(), n * n, 0, 0.0f, 0.05f, 22, s)));
  const double sec = median_seconds(s, 2, 10, [&] {
    CUDA_CHECK(static_cast<cudaError_t>(ops::cuda::linear_via(ctx, ops::cuda::LinearPath::CublasLt, x.get<bf16>(),
                                                              w.get<bf16>(), y.get(), false, n, n, n)));
  });
  return 2.0 * static_cast<double>(n) * n * n / sec;
}

}  // namespace

std::map<std::string, double> step_bytes_by_op(const ModelConfig& c, const ShardSpec& sh, int B, int q,
                                               int64_t context) {
  std::map<std::string, double> by;
  const double D = c.hidden_size, G = sh.tp_size, m = double(B) * q;
  const double d = c.kda.head_dim, Hk = c.kda.num_heads / G, C = Hk * d, K = c.kda.conv_kernel;
  const auto& a = c.mla;
  const double Hm = a.num_heads / G, Q = a.q_lora_rank, R = a.kv_lora_rank, P = a.qk_rope_head_dim,
               dn = a.qk_nope_head_dim, dv = a.v_head_dim, E = R + P;
  const auto& e = c.moe;
  const double L = e.latent_size, I = e.intermediate_size, k = e.experts_per_token;
  // The shared experts, the dense MLP and the routed experts' latent down: 1/G of them per rank when
  // TP-sharded (the hybrid step's tp mode).
  const double ffn_parts = sh.ffn_tp ? G : 1, S = e.shared_intermediate() / ffn_parts;
  const double local_experts = double(e.num_experts) / sh.world_size;
  // Pairs this rank's experts receive (gpu/rank.h): ceil(m k / G) for a rank slice.
  const double touched = std::min(local_experts, std::ceil(m * k / G));
  const double expert = 3 * (I * L / 2 + I * L / 32);
  const double ctx = double(context) + q;
  for (int l = 0; l < c.num_layers; ++l) {
    by["attn_res"] += 6 * D * 2;  // the two AttnRes calls' norm and projection vectors and the layer norms
    if (c.attn_kinds[l] == AttnKind::KDA) {
      const double in_rows = std::ceil((4 * C + d + Hk) / 16) * 16;
      by["kda.in_proj"] += in_rows * D * 2;
      // conv states read, the step's pre-conv inputs kept (F32, every token)
      by["kda.conv_gate"] += 3 * C * K * 4 + C * d * 2 + Hk * 4 + C * 4 + B * 3 * C * (K - 1) * 4 + m * 3 * C * 4;
      // the current state read, the state after the last token written, and (q > 1) the kept k, g, v, beta
      by["kda.recurrence"] += B * Hk * d * d * 4 * 2 + (q > 1 ? m * (3 * C + Hk) * 4 : 0);
      by["kda.norm_o_proj"] += d * 4 + D * C * 2;
    } else {
      by["mla.proj"] += (Q * D + Q + Hm * (dn + P) * Q + E * D + R + Hm * dn * R) * 2;
      by["mla.out"] += (Hm * dv * R + 2 * Hm * dv * D) * 2;
      if (c.dsa) {
        const double Hi = c.dsa->index_n_heads, Di = c.dsa->index_head_dim;
        by["dsa.indexer_attend"] += (Hi * Di * Q + Di * D + Hi * D + 2 * Di) * 2 +
                                    m * (ctx * Di * 2 + std::min<double>(c.dsa->index_topk, ctx) * E * 2) +
                                    m * (E + Di) * 2;
      } else {
        by["mla.attend"] += B * ctx * E * 2 + m * E * 2;
      }
    }
    if (l < e.first_k_dense_replace) {
      by["dense_mlp"] += 3 * double(c.dense_intermediate_size) / ffn_parts * D * 2;
    } else {
      by["moe.router_down"] += (e.num_experts * D + L / ffn_parts * D) * 2 + e.num_experts * 4;
      by["moe.experts"] += touched * expert;
      by["moe.norm_up"] += (L + L * D) * 2;
      by["moe.shared"] += 3 * S * D * 2;
    }
  }
  by["lm_head"] += (double(c.vocab_size) / G) * D * 2 + 3 * D * 2 + m * D * 2;  // + the embedding rows read
  return by;
}

double step_bytes(const ModelConfig& c, const ShardSpec& sh, int B, int q, int64_t context) {
  double total = 0;
  for (const auto& [op, bytes] : step_bytes_by_op(c, sh, B, q, context)) total += bytes;
  return total;
}

namespace {

// Random device fill by role (bench weights: values of a sane scale; speed does not depend on them).
GpuFill random_fill(uint64_t seed, cudaStream_t s) {
  auto counter = std::make_shared<uint64_t>(0);
  return [=](void* dev, const void*, size_t bytes, DType dt, const std::string& role) {
    const uint64_t sd = seed * 1315423911ull + (*counter)++;
    int kind = dt == DType::BF16 ? 0 : dt == DType::F32 ? 1 : role == "e8m0" ? 3 : 2;
    const int64_t n = static_cast<int64_t>(bytes / dtype_size(dt));
    float center = 0, half = 0.02f;
    if (role == "norm") center = 0.5f, half = 0.1f;
    if (role == "A_log") half = 0.5f;
    if (role == "conv") half = 0.5f;
    if (role == "embed") half = 1.0f;
    CUDA_CHECK(static_cast<cudaError_t>(bench::fill(dev, n, kind, center, half, sd, s)));
  };
}

}  // namespace

void check_bench_args(const BenchArgs& args) {
  const bool slice = args.preset == "k3-rank-slice" && args.model_dir.empty();
  if (args.model_dir.empty()) {
    K3_CHECK(args.preset == "k3-rank-slice" || args.preset == "tiny" || args.preset == "small",
             "bench: --preset {}: expected k3-rank-slice, tiny or small", args.preset);
    K3_CHECK(args.variant == "k3" || args.variant == "k3.1", "bench: --variant {}: expected k3 or k3.1", args.variant);
  }
  K3_CHECK(args.tp >= 1, "bench: --tp {}: expected 1 or more", args.tp);
  K3_CHECK(args.dp >= 1, "bench: --dp {}: expected 1 or more", args.dp);
  K3_CHECK(args.rank >= 0 && args.rank < args.tp * args.dp, "bench: --rank {}: expected 0..{} (tp {} x dp {})",
           args.rank, args.tp * args.dp - 1, args.tp, args.dp);
  K3_CHECK(!args.batches.empty(), "bench: --batches: expected at least one number of requests");
  for (int b : args.batches) K3_CHECK(b >= 1, "bench: --batches {}: expected 1 or more requests", b);
  K3_CHECK(!args.qs.empty(), "bench: --q: expected at least one number of tokens per request");
  for (int q : args.qs) K3_CHECK(q >= 1, "bench: --q {}: expected 1 or more tokens per request", q);
  K3_CHECK(args.context >= 0, "bench: --context {}: expected 0 or more cached tokens", args.context);
  K3_CHECK(args.iters >= 1, "bench: --iters {}: expected 1 or more timed replays", args.iters);
  K3_CHECK(args.warmup >= 0, "bench: --warmup {}: expected 0 or more replays", args.warmup);
  K3_CHECK(args.shared_experts == "auto" || args.shared_experts == "replicated" || args.shared_experts == "tp",
           "bench: --shared-experts {}: expected auto, replicated or tp", args.shared_experts);
  K3_CHECK(!args.steps.empty(), "bench: --steps: expected stock and/or hybrid");
  for (const std::string& st : args.steps) {
    K3_CHECK(st == "stock" || st == "hybrid", "bench: --steps {}: expected stock or hybrid", st);
    const StepKind kind = st == "stock" ? StepKind::Stock : StepKind::Hybrid;
    const SharedExperts mode = parse_shared_experts(args.shared_experts, kind);
    validate(StepOptions{kind, 256, mode});
    // The rank slice's layout, as this step's weights would be cut (heads, experts, vocabulary over the ranks).
    if (slice && !args.ops)
      check_shardable(preset_config("full", args.variant),
                      ShardSpec{args.tp, args.rank % args.tp, args.tp * args.dp, args.rank, mode == SharedExperts::Tp});
  }
  K3_CHECK(args.ops || args.ops_only.empty(), "bench: --ops-only {} needs --ops", args.ops_only);
  K3_CHECK(args.ops_only.empty() || args.ops_only == "linear" || args.ops_only == "moe" || args.ops_only == "kda" ||
               args.ops_only == "mla" || args.ops_only == "sampling" || args.ops_only == "dsa",
           "bench: --ops-only takes linear, moe, kda, mla, sampling or dsa, not '{}'", args.ops_only);
  K3_CHECK(args.layer_copies >= 0, "bench: --layer-copies {}: expected 0 (every layer its own) or a positive count",
           args.layer_copies);
  K3_CHECK(args.layer_copies == 0 || (!args.ops && slice),
           "bench: --layer-copies is for the rank slice's random weights (--preset k3-rank-slice, no --model, no --ops)");
  if (!args.json.empty()) {
    std::ofstream out(args.json);
    K3_CHECK(out.good(), "bench: --json {}: cannot write the file", args.json);
    out << "[]\n";
  }
}

int run_bench(const BenchArgs& args) {
  check_bench_args(args);  // no GPU needed to refuse them
  ops::cuda::ScopedContext owned;
  ops::cuda::Context& ctx = owned.get();
  cudaStream_t s = reinterpret_cast<cudaStream_t>(ctx.stream);
  const double bw = measure_bandwidth(s, ctx.sm_count);
  fmt::print("HBM read bandwidth (streaming kernel, 4 GiB): {:.0f} GB/s\n", bw / 1e9);
  const double flops = measure_matrix_rate(ctx);
  fmt::print("BF16 matrix rate (cuBLASLt, 8192 x 8192 x 8192, FP32 accumulation): {:.0f} TFLOP/s\n", flops / 1e12);
  if (args.ops) return run_ops_bench(args, bw, flops, ctx);

  ModelConfig c;
  ShardSpec shard;
  GpuRankOptions go;
  std::shared_ptr<const TensorSource> src;
  bool slice = args.preset == "k3-rank-slice" && args.model_dir.empty();
  if (slice) {
    c = preset_config("full", args.variant);
    shard = ShardSpec{args.tp, args.rank % args.tp, args.tp * args.dp, args.rank};
    go.loopback = true;
  } else if (!args.model_dir.empty()) {
    // A model directory: the whole model on this GPU, or (tp x dp > 1) the shard of world rank `rank`
    // with loopback collectives, as the rank slice.
    std::shared_ptr<Checkpoint> ck = Checkpoint::open(args.model_dir);
    c = ck->config();
    src = ck;
    if (args.tp * args.dp > 1) {
      shard = ShardSpec{args.tp, args.rank % args.tp, args.tp * args.dp, args.rank};
      check_shardable(c, shard);
      go.loopback = true;
    }
  } else {
    c = preset_config(args.preset, args.variant);
    src = make_synthetic(c, args.seed);
  }
  const int maxB = *std::max_element(args.batches.begin(), args.batches.end());
  const int maxq = *std::max_element(args.qs.begin(), args.qs.end());
  go.shard = shard;
  go.max_slots = maxB;
  go.max_batch = maxB;
  go.max_q = maxq;
  go.page_size = 64;
  go.max_context = args.context + maxq;
  const std::string what = slice ? "the rank slice" : !args.model_dir.empty() ? args.model_dir : args.preset;
  // A model directory names its own variant (DSA or not); --variant picks the presets'.
  const std::string variant = args.model_dir.empty() ? args.variant : c.is_dsa() ? "k3.1" : "k3";
  fmt::print("building {} ({} {}, tp {} dp {} rank {}) ...\n", what, variant,
             slice ? "full K3 shapes" : args.model_dir.empty() ? "preset" : "checkpoint", shard.tp_size,
             shard.world_size / shard.tp_size, shard.world_rank);
  // The rank of a step's shared-experts mode (stock: replicated; hybrid: --shared-experts, tp by default),
  // rebuilt when the mode changes between steps.
  std::unique_ptr<GpuRank> rank;
  std::vector<int> slots;
  auto build_rank = [&](bool ffn_tp) {
    rank.reset();
    ShardSpec sh = shard;
    sh.ffn_tp = ffn_tp;
    GpuRankOptions o = go;
    o.shard = sh;
    GpuWeights weights = slice ? build_gpu_weights(c, sh, nullptr, random_fill(args.seed, s), args.layer_copies)
                               : load_gpu_weights(*src, c, sh);
    const double wbytes = static_cast<double>(weights.bytes);
    rank = std::make_unique<GpuRank>(c, std::move(weights), o, ctx);
    for (auto& p : rank->cache_pools())
      CUDA_CHECK(static_cast<cudaError_t>(
          bench::fill(p.ptr, static_cast<int64_t>(p.bytes / (p.f32 ? 4 : 2)), p.f32 ? 1 : 0, 0.0f, 0.05f, 7, s)));
    slots.clear();
    for (int b = 0; b < maxB; ++b) {
      slots.push_back(rank->admit());
      rank->set_context(slots.back(), args.context);
    }
    CUDA_CHECK(cudaStreamSynchronize(s));
    fmt::print("weights {:.1f} GB ({} shared experts / dense MLP{}), caches {:.1f} GB on the device\n", wbytes / 1e9,
               ffn_tp ? "TP-sharded" : "replicated",
               args.layer_copies > 0 ? fmt::format("; {} copies per layer kind", args.layer_copies) : "",
               rank->cache_bytes() / 1e9);
  };
  // What did not fit names what was being built (the caches and workspace grow with the largest B, q and
  // context asked for).
  auto build = [&](bool ffn_tp) {
    try {
      build_rank(ffn_tp);
    } catch (const OutOfDeviceMemory& e) {
      rank.reset();
      fail("bench: {} ({}, shared experts / dense MLP {}) for up to {} requests x {} tokens at context {} does not "
           "fit this GPU: {}; ask for fewer --batches, a smaller --context, --layer-copies 2 (the rank slice), or run "
           "it on a larger GPU",
           what, variant, ffn_tp ? "TP-sharded" : "replicated", maxB, maxq, args.context, e.what());
    }
  };
  fmt::print("{:>7} {:>5} {:>3} {:>7} {:>7} {:>11} {:>11} {:>11} {:>10} {:>11} {:>7}\n", "step", "B", "q", "rows",
             "ctx", "median_us", "min_us", "max_us", "MB", "floor_us", "ratio");
  nlohmann::json records = nlohmann::json::array();
  Rng rng(args.seed);
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  for (const std::string& st : args.steps) {
    const StepKind kind = st == "stock" ? StepKind::Stock : StepKind::Hybrid;
    const SharedExperts mode = parse_shared_experts(args.shared_experts, kind);  // (checked: check_bench_args)
    if (!rank || shard.ffn_tp != (mode == SharedExperts::Tp)) {
      shard.ffn_tp = mode == SharedExperts::Tp;
      build(shard.ffn_tp);
    }
    for (int q : args.qs)
      for (int B : args.batches) {
        std::vector<int32_t> tokens(static_cast<size_t>(B) * q);
        for (auto& t : tokens) t = static_cast<int32_t>(rng.below(static_cast<uint64_t>(c.vocab_size)));
        rank->prepare(std::span<const int>(slots.data(), static_cast<size_t>(B)), q, tokens);
        for (int i = 0; i < args.warmup; ++i) rank->run_graph(kind);
        std::vector<double> us;
        for (int i = 0; i < args.iters; ++i) {
          CUDA_CHECK(cudaEventRecord(e0, s));
          rank->run_graph(kind);
          CUDA_CHECK(cudaEventRecord(e1, s));
          CUDA_CHECK(cudaEventSynchronize(e1));
          float ms = 0;
          CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
          us.push_back(ms * 1e3);
        }
        const double bytes = step_bytes(c, shard, B, q, args.context);
        const double floor_us = bytes / bw * 1e6, med = median(us);
        const double mn = *std::min_element(us.begin(), us.end()), mx = *std::max_element(us.begin(), us.end());
        fmt::print("{:>7} {:>5} {:>3} {:>7} {:>7} {:>11.1f} {:>11.1f} {:>11.1f} {:>10.1f} {:>11.1f} {:>7.2f}\n", st, B, q,
                   B * q, args.context, med, mn, mx, bytes / 1e6, floor_us, med / floor_us);
        // What the GPU does inside one graph replay (CUPTI): operations per step and the time they leave uncovered.
        const bench::TraceSummary tr = bench::trace_steps([&] { rank->run_graph(kind); }, 5);
        if (tr.available)
          fmt::print("          graph: {:.0f} kernels + {:.0f} copies per step; traced span {:.0f}us, busy {:.0f}us, "
                     "not covered {:.0f}us ({:.1f}%)\n",
                     tr.kernels, tr.copies, tr.span_us, tr.busy_us, tr.gap_us, 100 * tr.gap_us / tr.span_us);
        nlohmann::json kernels = nlohmann::json::array();
        for (size_t i = 0; i < tr.by_kernel.size(); ++i) {
          const auto& k = tr.by_kernel[i];
          if (args.profile && i < 12)
            fmt::print("            {:>9.0f}us {:>5.1f}% {:>5.0f}x {}\n", k.us, 100 * k.us / tr.kernel_us, k.calls,
                       k.name.substr(0, 90));
          kernels.push_back({{"name", k.name}, {"calls", k.calls}, {"us", k.us}});
        }
        nlohmann::json gaps = nlohmann::json::array();
        for (size_t i = 0; i < tr.gap_before.size(); ++i) {
          const auto& k = tr.gap_before[i];
          if (args.profile && i < 5)
            fmt::print("            gap {:>7.0f}us {:>5.0f}x before {}\n", k.us, k.calls, k.name.substr(0, 90));
          gaps.push_back({{"before", k.name}, {"gaps", k.calls}, {"us", k.us}});
        }
        nlohmann::json breakdown = nlohmann::json::object(), op_bytes_json = nlohmann::json::object();
        if (args.profile) {
          std::vector<std::pair<std::string, double>> prof;
          for (int i = 0; i < 3; ++i) prof = rank->profile(kind);  // the last of three eager runs
          double total = 0;
          for (auto& [name, ms] : prof) total += ms;
          std::string line = "         ";
          // Each op group's time beside its bytes (step_bytes_by_op): the bandwidth it reached, in % of the HBM figure.
          const auto op_bytes = step_bytes_by_op(c, shard, B, q, args.context);
          for (auto& [name, ms] : prof) {
            const auto it = op_bytes.find(name);
            const double ob = it == op_bytes.end() ? 0.0 : it->second;
            line += ob > 0 ? fmt::format(" {} {:.0f}us ({:.0f}%) {:.0f}MB {:.0f}%bw", name, ms * 1e3, 100 * ms / total,
                                         ob / 1e6, 100 * ob / bw / (ms * 1e-3))
                           : fmt::format(" {} {:.0f}us ({:.0f}%)", name, ms * 1e3, 100 * ms / total);
            breakdown[name] = ms * 1e3;
            if (ob > 0) op_bytes_json[name] = ob;
          }
          fmt::print("{}  [eager total {:.0f}us]\n", line, total * 1e3);
        }
        std::fflush(stdout);
        records.push_back({{"preset", slice ? "k3-rank-slice" : args.model_dir.empty() ? args.preset : "model"},
                           {"model", args.model_dir},
                           {"variant", variant},
                           {"step", st},
                           {"shared_experts", shared_experts_name(mode)},
                           {"requests", B},
                           {"q", q},
                           {"rows", B * q},
                           {"context", args.context},
                           {"layer_copies", args.layer_copies},
                           {"median_us", med},
                           {"min_us", mn},
                           {"max_us", mx},
                           {"bytes", bytes},
                           {"floor_us", floor_us},
                           {"ratio", med / floor_us},
                           {"hbm_gbps", bw / 1e9},
                           {"matrix_tflops", flops / 1e12},
                           {"iters", args.iters},
                           {"profile_us", breakdown},
                           {"profile_bytes", op_bytes_json},
                           {"kernels_per_step", tr.kernels},
                           {"copies_per_step", tr.copies},
                           {"trace_span_us", tr.span_us},
                           {"trace_busy_us", tr.busy_us},
                           {"trace_gap_us", tr.gap_us},
                           {"trace_kernels", kernels},
                           {"trace_gaps_before", gaps},
                           {"commit", args.commit}});
        if (!args.json.empty()) {  // rewritten after every point: a run cut short keeps what it measured
          std::ofstream out(args.json);
          K3_CHECK(out.good(), "bench: cannot write {}", args.json);
          out << records.dump(1) << "\n";
        }
      }
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return 0;
}

}  // namespace k3
