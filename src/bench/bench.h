// k3decode bench (bench-only code, apart from the engine): decode steps of a
// GpuRank timed as CUDA graph replays (warm-up, then the median of many
// replays timed one by one with CUDA events), each beside its floor:
//   floor = bytes the step touches / HBM read bandwidth measured in the same
//   run by a large read-only streaming kernel.
// Bytes touched: every weight the step reads (all attention, replicated MoE
// parts, dense MLP, lm_head slice, the embedding rows, the routed experts
// that receive at least one token: min(local experts, pairs) of them), the
// KDA states read and written (one recurrent state per request: the state
// after the step's last token) with the inputs a verify keeps for a partial
// commit (pre-conv q, k, v; with q > 1 the recurrence's k, g, v, beta), the
// latent cache (and
// DSA indexer keys) read; activations are ignored (they stay in L2).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "config/model_config.h"
#include "model/weights.h"

namespace k3 {

struct BenchArgs {
  std::string model_dir;          // a model directory (whole model, or with tp x dp > 1 one rank's shard), or
  std::string preset = "k3-rank-slice";  // k3-rank-slice | tiny | small
  std::string variant = "k3";
  int tp = 8, dp = 4, rank = 0;   // the deployment the rank slice is cut from
  std::vector<int> batches = {1, 8, 32, 64};  // requests per step
  std::vector<int> qs = {1, 4};               // tokens per request
  std::vector<std::string> steps = {"stock", "hybrid"};
  std::string shared_experts = "auto";  // auto (stock: replicated, hybrid: tp) | replicated | tp
  int64_t context = 8192;
  int layer_copies = 0;           // rank slice: weight sets per layer kind (LayerPlan::weight_sources); 0 = all distinct
  int warmup = 5;
  int iters = 50;
  uint64_t seed = 1;
  bool ops = false;               // the decode kernels one by one (ops_bench.cpp) instead of steps
  std::string ops_only;           // --ops: run this section only (linear, moe, kda, mla, sampling, dsa); empty: all
  bool profile = false;           // per-op-group breakdown of each point (eager, CUDA events)
  std::string json;               // write the records here
  std::string commit;             // recorded in the JSON
};

// Bytes one decode step of rank `shard` touches for B requests x q tokens at `context` cached tokens,
// by op group (the labels of GpuRank::profile: attn_res, kda.in_proj, kda.conv_gate, kda.recurrence,
// kda.norm_o_proj, mla.proj, mla.attend or dsa.indexer_attend, mla.out, dense_mlp, moe.router_down,
// moe.experts, moe.norm_up, moe.shared, lm_head), and their sum (the floor's numerator).
std::map<std::string, double> step_bytes_by_op(const ModelConfig& c, const ShardSpec& shard, int B, int q,
                                               int64_t context);
double step_bytes(const ModelConfig& c, const ShardSpec& shard, int B, int q, int64_t context);

// The median of repeated timings (the mean of the two middle values for an even count; 0 when empty).
double median(std::vector<double> v);

// Every argument checked before the GPU is touched (run_bench calls it first): a one-line k3::Error naming the
// flag and the value (an unknown --preset, --variant, --steps or --ops-only section; --tp, --dp, --rank that
// name no rank or a layout the rank slice cannot shard; --batches, --q, --iters below 1; --warmup or
// --context below 0; --shared-experts not auto | replicated | tp, or tp with a stock step; --layer-copies
// off the rank slice), so a typo never costs a weight build, nor runs another step under its name. With
// --json it writes an empty list there, so a path that cannot be written fails here too.
void check_bench_args(const BenchArgs& args);

// Runs the benchmark, prints a table, writes JSON; returns 0.
int run_bench(const BenchArgs& args);

namespace ops::cuda {
struct Context;
}
// The kernel microbenchmarks (--ops), against the bandwidth `bw` (bytes/s) measured by run_bench.
int run_ops_bench(const BenchArgs& args, double bw, double flops, ops::cuda::Context& ctx);

}  // namespace k3
