// k3decode: the command line.
//   generate    decode a prompt on a model directory or the embedded tiny model
//   make-model  write a synthetic checkpoint in the published K3 layout
//   inspect     print a config's layer plan and parameter count
//   serve       an OpenAI-compatible HTTP server (cli/serve.h)
// Exit code 0 on success; on any error one line on stderr and exit code 1.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdio>
#include <filesystem>
#include <iostream>
#include <optional>
#include <nlohmann/json.hpp>

#include "config/schema.h"
#include "io/safetensors.h"
#include "io/synthetic.h"
#include "io/tokenizer.h"
#include "ops/sampling.h"
#include "runtime/cluster.h"
#include "runtime/generate.h"
#include "runtime/layout_decoder.h"
#include "runtime/rank_channel.h"
#include "cli/serve.h"
#ifdef K3_MPI
#include "comm/mpi.h"
#endif
#ifdef K3_CUDA
#include "bench/bench.h"
#include "core/cuda.h"
#include "runtime/gpu/cluster.h"
#include "runtime/gpu/decoder.h"
#ifdef K3_NCCL
#include "comm/nccl.h"
#endif
#endif

namespace {

using namespace k3;

std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  size_t at = 0;
  while (at <= s.size()) {
    size_t end = s.find(',', at);
    if (end == std::string::npos) end = s.size();
    const std::string item = s.substr(at, end - at);
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    K3_CHECK(!item.empty() && used == item.size() && v >= INT32_MIN && v <= INT32_MAX,
             "--prompt: \"{}\" is not a comma-separated list of token ids", s);
    ids.push_back(static_cast<int32_t>(v));
    at = end + 1;
  }
  return ids;
}

struct ModelArgs {
  std::string dir;
  std::string preset = "tiny";
  std::string variant = "k3";
  uint64_t seed = 0;
};

void add_model_args(CLI::App* cmd, ModelArgs& m) {
  cmd->add_option("--model", m.dir, "model directory (config.json + safetensors); default: the embedded tiny model");
  cmd->add_option("--preset", m.preset, "embedded model preset when no --model: tiny | small")->capture_default_str();
  cmd->add_option("--variant", m.variant, "embedded model variant: k3 (MLA) | k3.1 (DSA)")->capture_default_str();
  cmd->add_option("--model-seed", m.seed, "embedded model seed")->capture_default_str();
}

std::pair<std::shared_ptr<const TensorSource>, ModelConfig> open_model(const ModelArgs& m) {
  if (!m.dir.empty()) {
    std::shared_ptr<Checkpoint> ck = Checkpoint::open(m.dir);
    ModelConfig c = ck->config();
    return {std::move(ck), c};
  }
  ModelConfig c = preset_config(m.preset, m.variant);
  return {make_synthetic(c, m.seed), c};
}

#ifdef K3_CUDA
// The GPU rank's capacities from the cache options a command parsed (every request slot in one step).
GpuRankOptions gpu_rank_options(const CacheOptions& c, const StepOptions& steps) {
  GpuRankOptions go;
  go.max_slots = c.max_slots;
  go.max_batch = c.max_slots;
  go.max_q = c.max_q;
  go.max_context = c.max_context;
  go.page_size = c.page_size;
  go.num_pages = c.num_pages;
  go.steps = steps;
  return go;
}
#endif

#ifdef K3_NCCL
// This process's rank of an mpirun job, on its GPU: the NCCL groups, the CUDA context, the rank's weights and
// a Decoder over them (CUDA graphs: NCCL collectives can be captured). Needs a running MpiRuntime.
struct NcclRank {
  RankGroups groups;
  ops::cuda::ScopedContext ctx;
  GpuRankOptions o;
  GpuRank rank;
  GpuDecoder decoder;
  NcclRank(const TensorSource& src, const ModelConfig& config, const GpuRankOptions& go, const Layout& L, int w)
      : groups(make_nccl_groups(L)),
        o(sharded(go, L, w, &groups)),
        rank(config, load_gpu_weights(src, config, o.shard), o, ctx.get()),
        decoder(rank, config, o, L, w, *groups.world, /*graphs=*/true) {}
  static GpuRankOptions sharded(GpuRankOptions o, const Layout& L, int w, RankGroups* g) {
    o.shard = ShardSpec{L.tp, L.tp_rank(w), L.world(), w, o.steps.shared == SharedExperts::Tp};
    o.groups = g;
    return o;
  }
};
#endif

std::string join(const std::vector<int32_t>& v, const char* sep) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + std::to_string(v[i]);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"k3decode: Kimi K3 / K3.1 decode runtime"};
  app.require_subcommand(1);

  ModelArgs gm;
  std::vector<std::string> prompts = {"1,2,3"};
  std::string dump, step = "auto", comm = "local", shared_experts;
  Layout layout;
  int max_new = 16;
  bool json_out = false;
  EngineOptions eopts;
  CacheOptions& cache = eopts.cache;
  SamplingParams sp;
  float temperature = 0, top_p = 1;
  auto* gen = app.add_subcommand("generate", "decode a prompt (greedy unless --temperature > 0)");
  add_model_args(gen, gm);
  auto* prompt_opt = gen->add_option("--prompt", prompts, "prompt token ids, comma separated; repeat for more requests")
                        ->capture_default_str();
  std::vector<std::string> texts;
  gen->add_option("--text", texts, "prompt text, encoded by the --model directory's tokenizer (tiktoken.model); "
                                   "prints the generated text; repeat for more requests")
      ->excludes(prompt_opt);
  gen->add_option("--tp", layout.tp, "tensor-parallel group size G")->capture_default_str();
  gen->add_option("--dp", layout.dp, "data-parallel replicas (requests are spread over them)")->capture_default_str();
  gen->add_option("--dcp", layout.dcp, "decode context parallel size inside the TP group")->capture_default_str();
  gen->add_option("--step", step, "decode step: auto | stock | hybrid")->capture_default_str();
  gen->add_option("--shared-experts", shared_experts,
                  "shared experts, dense MLP and the routed latent down: replicated | tp (TP-sharded, hybrid "
                  "step only); default: tp with --step hybrid, else replicated");
  gen->add_option("--comm", comm,
                  "collectives: local (ranks as threads) | mpi (one process per rank) | nccl (--device gpu, one "
                  "process per GPU)")
      ->capture_default_str();
  std::string device = "cpu";
  gen->add_option("--device", device, "cpu | gpu (one GPU holds the whole model; CUDA builds)")->capture_default_str();
  gen->add_option("--max-slots", cache.max_slots, "concurrent requests per replica")->capture_default_str();
  gen->add_option("--aux-layers", eopts.aux_layers, "capture the hidden stream entering these layers (--json prints norms)");
  gen->add_option("--max-new", max_new, "tokens to generate")->capture_default_str();
  gen->add_flag("--json", json_out, "print one JSON object (key tokens: the generated ids)");
  gen->add_option("--dump-logits", dump, "write the logits of every fed position to a safetensors file (F32 logits [positions, vocab])");
  gen->add_option("--temperature", temperature, "sampling temperature; 0 = greedy")->capture_default_str();
  gen->add_option("--top-p", top_p, "nucleus sampling threshold")->capture_default_str();
  gen->add_option("--seed", sp.seed, "sampling seed")->capture_default_str();
  bool ignore_eos = false;
  gen->add_flag("--ignore-eos", ignore_eos, "keep generating past the eos token");
  gen->add_option("--max-context", cache.max_context, "cache capacity in tokens")->capture_default_str();

  std::string preset = "tiny", variant = "k3", out;
  uint64_t seed = 0;
  double shard_mb = 4096;
  auto* mk = app.add_subcommand("make-model", "write a synthetic K3 / K3.1 checkpoint");
  mk->add_option("--preset", preset, "tiny | small")->capture_default_str();
  mk->add_option("--variant", variant, "k3 | k3.1")->capture_default_str();
  mk->add_option("--seed", seed, "weight seed")->capture_default_str();
  mk->add_option("--out", out, "output directory")->required();
  mk->add_option("--shard-mb", shard_mb, "largest safetensors file (MB); more go through an index")->capture_default_str();
  bool with_tokenizer = false;
  mk->add_flag("--tokenizer", with_tokenizer, "also write a small Kimi-format tokenizer (tiktoken.model + "
                                              "tokenizer_config.json; presets with a vocabulary of 768+ ids)");

  ModelArgs im;
  std::string config_path;
  auto* ins = app.add_subcommand("inspect", "print the layer plan and parameter count of a config");
  add_model_args(ins, im);
  ins->add_option("--config", config_path, "a config.json file");

  ModelArgs sm;
  ServeOptions so;
  SchedulerOptions sched_opts;
  CacheOptions scache;
  scache.max_context = 4096;
  std::string sstep = "auto", sdevice = "cpu", scomm = "local", sshared;
  Layout slayout;
  auto* srv = app.add_subcommand("serve", "an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                                          "/v1/models, /health, /metrics)");
  add_model_args(srv, sm);
  srv->add_option("--host", so.host, "address to listen on")->capture_default_str();
  srv->add_option("--port", so.port, "port (0: any free port, printed on stderr)")->capture_default_str();
  srv->add_option("--max-slots", scache.max_slots, "concurrent requests (decode batch)")->capture_default_str();
  srv->add_option("--max-context", scache.max_context, "tokens per request (prompt + output)")->capture_default_str();
  srv->add_option("--kv-pages", scache.num_pages,
                  "KV cache pages per rank, --page-size tokens each (0: every slot can hold --max-context); a "
                  "request waits until the pages of its prompt + max_tokens can be set aside")
      ->capture_default_str();
  srv->add_option("--page-size", scache.page_size, "tokens per KV page")->capture_default_str();
  srv->add_option("--max-q", scache.max_q, "tokens per request per step (prefill chunk, verify width)")
      ->capture_default_str();
  srv->add_option("--max-queue", sched_opts.max_queue, "requests waiting for a slot before 429")->capture_default_str();
  srv->add_option("--draft", sched_opts.draft_tokens, "n-gram (prompt lookup) draft tokens per step; 0 = off")
      ->capture_default_str();
  srv->add_option("--ngram", sched_opts.ngram_max, "longest suffix matched by the drafter")->capture_default_str();
  srv->add_option("--step", sstep, "decode step: auto | stock | hybrid")->capture_default_str();
  srv->add_option("--shared-experts", sshared,
                  "shared experts, dense MLP and the routed latent down: replicated | tp (TP-sharded, hybrid "
                  "step only); default: tp with --step hybrid, else replicated");
  srv->add_option("--device", sdevice, "cpu | gpu (one GPU; with --tp/--dp every rank on it; CUDA builds)")->capture_default_str();
  srv->add_option("--tp", slayout.tp, "tensor-parallel group size G (ranks as threads of the server)")
      ->capture_default_str();
  srv->add_option("--dp", slayout.dp, "data-parallel replicas (--max-slots each; requests go to the freest)")
      ->capture_default_str();
  srv->add_option("--dcp", slayout.dcp, "decode context parallel size inside the TP group")->capture_default_str();
  srv->add_option("--comm", scomm, "collectives: local (ranks as threads) | mpi (a process per rank under mpirun, "
                  "rank 0 serving) | nccl (--device gpu, a process per GPU under mpirun)")
      ->capture_default_str();
  srv->add_option("--served-model-name", so.model_name, "the model id in responses (default: the directory name)");

#ifdef K3_CUDA
  BenchArgs ba;
  auto* bench = app.add_subcommand("bench", "time decode steps on the GPU against their HBM floor");
  bench->add_option("--preset", ba.preset, "k3-rank-slice | tiny | small")->capture_default_str();
  bench->add_option("--model", ba.model_dir,
                    "a model directory instead of a preset: the whole model on this GPU, or with --tp/--dp/--rank "
                    "the shard of that rank (loopback collectives)");
  bench->add_option("--variant", ba.variant, "k3 | k3.1")->capture_default_str();
  auto* bench_tp = bench->add_option("--tp", ba.tp, "rank slice / --model: TP size of the deployment")
                      ->capture_default_str();
  auto* bench_dp = bench->add_option("--dp", ba.dp, "rank slice / --model: DP replicas of the deployment")
                      ->capture_default_str();
  bench->add_option("--rank", ba.rank, "rank slice: world rank whose weights are built")->capture_default_str();
  bench->add_option("--batches", ba.batches, "requests per step")->capture_default_str();
  bench->add_option("--q", ba.qs, "tokens per request")->capture_default_str();
  bench->add_option("--steps", ba.steps, "stock and/or hybrid")->capture_default_str();
  bench->add_option("--shared-experts", ba.shared_experts,
                    "auto (stock: replicated, hybrid: tp) | replicated | tp")->capture_default_str();
  bench->add_option("--context", ba.context, "cached tokens per request")->capture_default_str();
  bench->add_option("--layer-copies", ba.layer_copies,
                    "rank slice: the layers of one kind share this many sets of weights, so that the slice fits "
                    "an 80 GB GPU (every layer's weights are still read from HBM; the floor is unchanged); "
                    "0: every layer its own")
      ->capture_default_str();
  bench->add_option("--iters", ba.iters, "timed graph replays per point")->capture_default_str();
  bench->add_option("--warmup", ba.warmup, "untimed replays first")->capture_default_str();
  bench->add_option("--json", ba.json, "write one record per point");
  bench->add_flag("--profile", ba.profile, "per-op-group breakdown of every point");
  bench->add_flag("--ops", ba.ops, "the decode kernels one by one at K3 per-rank shapes, beside their floors");
  bench->add_option("--ops-only", ba.ops_only, "with --ops: one section only (linear, moe, kda, mla, sampling or dsa)");
  bench->add_option("--commit", ba.commit, "commit id recorded in the JSON");
#endif

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
#ifdef K3_CUDA
  // --model without --tp / --dp: the whole model on the GPU (the defaults describe the rank slice).
  if (!ba.model_dir.empty() && bench_tp->count() == 0 && bench_dp->count() == 0) ba.tp = ba.dp = 1;
#endif

  try {
    if (*gen) {
      std::vector<std::vector<int32_t>> ids;
      k3::ops::check_sampling_params(temperature, top_p);  // NaN / inf / negative: refused, not greedy
      std::optional<Tokenizer> tok;
      if (!texts.empty()) {
        K3_CHECK(!gm.dir.empty() && Tokenizer::present(gm.dir),
                 "--text needs --model DIR with a tokenizer (DIR/tiktoken.model){}; or pass token ids with --prompt",
                 gm.dir.empty() ? "" : fmt::format(": {} has none", gm.dir));
        tok = Tokenizer::load(gm.dir);
        for (const auto& t : texts) ids.push_back(tok->encode(t));
      } else {
        for (const auto& p : prompts) ids.push_back(parse_ids(p));
      }
      if (temperature > 0) {
        sp.greedy = false;
        sp.temperature = temperature;
        sp.top_p = top_p;
      }
      sp.stop_at_eos = !ignore_eos;
      K3_CHECK(step == "auto" || step == "stock" || step == "hybrid", "--step {}: expected auto | stock | hybrid", step);
      eopts.step = step == "stock" ? StepKind::Stock : step == "hybrid" ? StepKind::Hybrid : StepKind::Auto;
      eopts.shared = parse_shared_experts(shared_experts, eopts.step);
      validate(StepOptions{eopts.step, eopts.moe_capacity, eopts.shared});
      layout.validate();
      auto [src, config] = open_model(gm);
      std::vector<GenerateResult> results;
      bool printer = true;
      K3_CHECK(device == "cpu" || device == "gpu", "--device {}: expected cpu | gpu", device);
      if (device == "gpu") {
#ifdef K3_CUDA
        K3_CHECK(eopts.aux_layers.empty(), "--aux-layers: not captured by --device gpu (use --device cpu)");
        K3_CHECK(comm == "local" || comm == "nccl", "--device gpu --comm {}: expected local (ranks as threads on one "
                 "GPU) | nccl (a process per GPU, under mpirun)", comm);
        K3_CHECK(cuda_device_available(), "--device gpu: no usable CUDA device on this machine");
        const GpuRankOptions go = gpu_rank_options(cache, StepOptions{eopts.step, eopts.moe_capacity, eopts.shared});
        if (layout.world() == 1 && comm == "local") {
          GpuDecoder decoder(*src, config, go);
          results = generate(decoder, ids, max_new, sp, !dump.empty());
        } else if (comm == "local") {
          LocalGpuCluster cluster(*src, config, go, layout);
          std::vector<std::vector<GenerateResult>> per_rank(layout.world());
          cluster.run([&](int w, GpuRank& r) {
            GpuDecoder d(r, config, go, layout, w, *cluster.groups(w).world, /*graphs=*/false);
            per_rank[w] = generate(d, ids, max_new, sp, !dump.empty());
          });
          results = std::move(per_rank[0]);
        } else {
#ifdef K3_NCCL
          MpiRuntime mpi(&argc, &argv);
          const int w = mpi.world_rank();
          K3_CHECK(mpi.world_size() == layout.world(), "--comm nccl: {} processes for a world of {} (--tp {} x --dp {})",
                   mpi.world_size(), layout.world(), layout.tp, layout.dp);
          NcclRank mine(*src, config, go, layout, w);
          results = generate(mine.decoder, ids, max_new, sp, !dump.empty());
          printer = w == 0;
#else
          fail("--comm nccl: this build has no NCCL backend (needs NCCL and Open MPI; see CMake option K3_NCCL)");
#endif
        }
#else
        fail("--device gpu: this build has no CUDA backend (build with nvcc present)");
#endif
      } else if (comm == "local") {
        LocalCluster cluster(src, config, eopts, layout);
        std::vector<std::vector<GenerateResult>> per_rank(layout.world());
        cluster.run([&](int w, Engine& e) { per_rank[w] = generate(e, ids, max_new, sp, !dump.empty()); });
        results = std::move(per_rank[0]);
      } else if (comm == "mpi") {
#ifdef K3_MPI
        MpiRuntime mpi(&argc, &argv);
        int w = mpi.world_rank();
        Engine engine(src, config, eopts, layout, w, make_mpi_groups(layout));
        results = generate(engine, ids, max_new, sp, !dump.empty());
        printer = w == 0;
#else
        fail("--comm mpi: this build has no MPI (install libopenmpi-dev and rebuild)");
#endif
      } else {
        fail("--comm {}: expected local | mpi (nccl: with --device gpu)", comm);
      }
      if (!printer) return 0;
      const GenerateResult& r = results[0];
      if (!dump.empty()) {
        TensorView v{r.logits.data(), DType::F32, {r.positions, config.vocab_size}};
        write_safetensors(dump, {{"logits", v}}, {{"prompt", join(ids[0], ",")}, {"tokens", join(r.tokens, ",")}});
      }
      if (json_out) {
        nlohmann::json reqs = nlohmann::json::array();
        for (const auto& x : results) {
          reqs.push_back({{"tokens", x.tokens}, {"stop", x.hit_eos ? "eos" : "length"}});
          if (tok) reqs.back()["text"] = tok->decode(x.tokens);
        }
        nlohmann::json j = {{"tokens", r.tokens},
                            {"prompt", ids[0]},
                            {"stop", r.hit_eos ? "eos" : "length"},
                            {"requests", reqs},
                            {"layout", {{"tp", layout.tp}, {"dp", layout.dp}, {"dcp", layout.dcp}}},
                            {"step", step},
                            {"shared_experts", shared_experts_name(eopts.shared)},
                            {"comm", comm},
                            {"model", gm.dir.empty() ? "embedded:" + gm.preset + ":" + gm.variant : gm.dir}};
        if (tok) j["text"] = tok->decode(r.tokens);
        // Decoded text may cut a UTF-8 character: replaced (U+FFFD) in JSON.
        std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
      } else {
        for (const auto& x : results) std::cout << (tok ? tok->decode(x.tokens) : join(x.tokens, " ")) << "\n";
      }
    } else if (*srv) {
      K3_CHECK(sstep == "auto" || sstep == "stock" || sstep == "hybrid", "--step {}: expected auto | stock | hybrid",
               sstep);
      K3_CHECK(sdevice == "cpu" || sdevice == "gpu", "--device {}: expected cpu | gpu", sdevice);
      K3_CHECK(scomm == "local" || scomm == "mpi" || scomm == "nccl", "--comm {}: expected local | mpi | nccl", scomm);
      K3_CHECK(scomm != "nccl" || sdevice == "gpu", "--comm nccl: with --device gpu (the CPU's is --comm mpi)");
      K3_CHECK(scomm != "mpi" || sdevice == "cpu", "--comm mpi: with --device cpu (the GPU's is --comm nccl)");
      K3_CHECK(so.port >= 0 && so.port <= 65535, "--port {}: expected 0 (any free port) to 65535", so.port);
      slayout.validate();
      const StepKind kind = sstep == "stock" ? StepKind::Stock : sstep == "hybrid" ? StepKind::Hybrid : StepKind::Auto;
      const SharedExperts shared = parse_shared_experts(sshared, kind);
      validate(StepOptions{kind, EngineOptions{}.moe_capacity, shared});
      auto [src, config] = open_model(sm);
      std::optional<Tokenizer> tok;
      if (!sm.dir.empty() && Tokenizer::present(sm.dir)) tok = Tokenizer::load(sm.dir);
      if (so.model_name.empty() || so.model_name == "k3")
        so.model_name = sm.dir.empty() ? "embedded-" + sm.preset + "-" + sm.variant
                                       : std::filesystem::path(sm.dir).lexically_normal().filename().string();
      if (so.model_name.empty()) so.model_name = sm.dir;
      if (scomm != "local") {
#ifdef K3_MPI
        // A process per rank: rank 0 serves through a LayoutDecoder whose commands reach the other processes
        // on a channel of their own (runtime/rank_channel.h); they follow until rank 0's server stops.
        // Blocked before MPI starts its threads: on rank 0 serve()'s signal thread drains on SIGINT / SIGTERM;
        // the other ranks leave at rank 0's Quit (mpirun ends the job on a signal of its own).
        block_stop_signals();
        MpiRuntime mpi(&argc, &argv);
        const int w = mpi.world_rank();
        K3_CHECK(mpi.world_size() == slayout.world(), "serve --comm {}: {} processes for a world of {} (--tp {} x "
                 "--dp {})", scomm, mpi.world_size(), slayout.world(), slayout.tp, slayout.dp);
        RankGroups channel = make_mpi_groups(slayout);
        auto serve_rank = [&](Decoder& mine) {
          if (w != 0) {
            follow_commands(mine, *channel.world);
            return 0;
          }
          LayoutDecoder facade(std::make_unique<ChannelRanks>(mine, *channel.world));
          return serve(facade, std::move(tok), sched_opts, so);
        };
        if (sdevice == "cpu") {
          EngineOptions eo(scache);
          eo.step = kind;
          eo.shared = shared;
          Engine engine(src, config, eo, slayout, w, make_mpi_groups(slayout));
          EngineDecoder mine(engine);
          return serve_rank(mine);
        }
#ifdef K3_NCCL
        K3_CHECK(cuda_device_available(), "--device gpu: no usable CUDA device on this machine");
        NcclRank mine(*src, config, gpu_rank_options(scache, StepOptions{kind, EngineOptions{}.moe_capacity, shared}),
                      slayout, w);
        return serve_rank(mine.decoder);
#else
        fail("--comm nccl: this build has no NCCL backend (needs CUDA, NCCL and Open MPI)");
#endif
#else
        fail("serve --comm {}: this build has no MPI (install libopenmpi-dev and rebuild)", scomm);
#endif
      }
      if (sdevice == "gpu") {
#ifdef K3_CUDA
        K3_CHECK(cuda_device_available(), "--device gpu: no usable CUDA device on this machine");
        const GpuRankOptions go = gpu_rank_options(scache, StepOptions{kind, EngineOptions{}.moe_capacity, shared});
        if (slayout.world() == 1) {
          GpuDecoder decoder(*src, config, go);
          return serve(decoder, std::move(tok), sched_opts, so);
        }
        LocalGpuCluster cluster(*src, config, go, slayout);
        auto decoder = make_layout_decoder(cluster, config, go);
        return serve(*decoder, std::move(tok), sched_opts, so);
#else
        fail("--device gpu: this build has no CUDA backend (build with nvcc present)");
#endif
      }
      EngineOptions eo(scache);
      eo.step = kind;
      eo.shared = shared;
      if (slayout.world() > 1) {
        LocalCluster cluster(src, config, eo, slayout);
        auto decoder = make_layout_decoder(cluster);
        return serve(*decoder, std::move(tok), sched_opts, so);
      }
      Engine engine(src, config, eo);
      EngineDecoder decoder(engine);
      return serve(decoder, std::move(tok), sched_opts, so);
#ifdef K3_CUDA
    } else if (*bench) {
      return run_bench(ba);
#endif
    } else if (*mk) {
      ModelConfig c = preset_config(preset, variant);
      auto src = make_synthetic(c, seed);
      K3_CHECK(!with_tokenizer || c.vocab_size >= 768,
               "--tokenizer: the {} preset's vocabulary ({} ids) is too small for a tokenizer (768+; use --preset small)",
               preset, c.vocab_size);
      write_checkpoint(out, c, *src, static_cast<size_t>(shard_mb * 1e6));
      if (with_tokenizer) write_small_tokenizer(out, c.vocab_size);
      std::cerr << fmt::format("wrote {} ({} {}, seed {}, {} tensors)\n", out, preset, variant, seed, src->names().size());
    } else if (*ins) {
      ModelConfig c = !config_path.empty() ? ModelConfig::from_file(config_path)
                      : !im.dir.empty()    ? ModelConfig::from_file(im.dir + "/config.json")
                                           : preset_config(im.preset, im.variant);
      const LayerPlan plan = LayerPlan::from(c);
      fmt::print("layers {}  hidden {}  vocab {}  AttnRes blocks {} (size {})\n", c.num_layers, c.hidden_size,
                 c.vocab_size, plan.num_blocks, c.attn_res_block_size);
      fmt::print("attention: {} KDA, {} {}  |  experts {} (top {}), shared {}, latent {}\n", plan.count(AttnKind::KDA),
                 plan.count(c.is_dsa() ? AttnKind::DSA : AttnKind::MLA), c.is_dsa() ? "DSA" : "MLA",
                 c.moe.num_experts, c.moe.experts_per_token, c.moe.num_shared_experts, c.moe.latent_size);
      for (int l = 0; l < c.num_layers; ++l) {
        const LayerInfo& li = plan.layers[l];
        fmt::print("  layer {:3}  {:3}  {:5}  blocks mixed {}/{}{}\n", l, attn_kind_name(li.attn),
                   li.ffn == FfnKind::Dense ? "dense" : "moe", li.blocks_before_attn, li.blocks_after_attn,
                   li.block_start ? fmt::format("  block {} starts", li.block_write_idx) : "");
      }
      const int64_t params = parameter_count(c), active = active_parameter_count(c);
      fmt::print("parameters: {} ({:.3f}T)  active per token: {} ({:.1f}B)\n", params, params / 1e12, active,
                 active / 1e9);
    }
  } catch (const std::exception& e) {
    std::cerr << "k3decode: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
