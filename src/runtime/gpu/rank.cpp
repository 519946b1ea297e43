// GpuRank (runtime/gpu/rank.h): construction, the slots and the step's
// metadata, and the StepBackend calls that are not modules (embedding,
// AttnRes, norms, copies, collectives, lm_head). The modules are in
// gpu/attention.cpp and gpu/moe.cpp.
#include "runtime/gpu/rank.h"

#include <algorithm>

#include "ops/attn_res.h"
#include "ops/dsa.h"
#include "ops/embedding.h"
#include "ops/linear.h"
#include "ops/rmsnorm.h"
#include "ops/sampling.h"

namespace k3 {

namespace cu = ops::cuda;

#define K3_LAUNCH(expr) CUDA_CHECK(static_cast<cudaError_t>(expr))

namespace {
SlotTableOptions table_options(const GpuRankOptions& o, const GpuDims& d, const RankGroups* g) {
  return {o.max_slots, o.max_context, o.max_q, o.page_size, o.num_pages, d.Dc, d.Dc > 1 ? g->dcp->rank() : 0};
}
}  // namespace

GpuRank::GpuRank(const ModelConfig& c, GpuWeights weights, const GpuRankOptions& o, cu::Context& ctx)
    : c_(c),
      weights_(std::move(weights)),
      o_(o),
      ctx_(ctx),
      plan_(LayerPlan::from(c)),
      dims_(c, o),
      G_(o.shard.tp_size),
      table_(table_options(o, dims_, o.groups)),
      caches_(c, dims_.Hk, o.max_slots, o.max_q, table_.num_pages(), o.page_size) {
  K3_CHECK(weights_.w.ffn_tp == o.shard.ffn_tp, "gpu: weights with {} FFNs for a rank of {} FFNs",
           weights_.w.ffn_tp ? "TP-sharded" : "replicated", o.shard.ffn_tp ? "TP-sharded" : "replicated");
  K3_CHECK(o.max_batch >= 1 && o.max_batch <= o.max_slots, "gpu: max_batch {} outside 1..max_slots ({})",
           o.max_batch, o.max_slots);
  const auto mode = collective_mode(o);
  K3_CHECK(mode != GpuCollectives::Mode::Real || o.groups,
           "gpu: a multi-rank shard needs its groups (GpuRankOptions::groups) or loopback collectives");
  coll_ = GpuCollectives(mode, o.groups, G_, o.shard.tp_rank, ctx.stream);
  if (coll_.real()) {
    K3_CHECK(o.groups->world->size() == o.shard.world_size && o.groups->world->rank() == o.shard.world_rank,
             "gpu: world group of rank {} of {} for the shard of world rank {} of {}", o.groups->world->rank(),
             o.groups->world->size(), o.shard.world_rank, o.shard.world_size);
    const std::vector<float> ones(static_cast<size_t>(o.shard.world_size * dims_.ep_cap), 1.0f);
    ep_ones_ = DeviceBuffer(ones.size() * 4);
    CUDA_CHECK(cudaMemcpy(ep_ones_.get(), ones.data(), ones.size() * 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaDeviceSynchronize());  // landed before a non-blocking stream reads it
  }
  max_pages_ = static_cast<int>(table_.max_pages_per_slot());
  const int64_t D = c.hidden_size, V = c.vocab_size, R = dims_.max_rows;
  // Step metadata and its pinned staging.
  d_tokens_ = DeviceBuffer(R * 4);
  d_slots_ = DeviceBuffer(o.max_batch * 4);
  d_pos0_ = DeviceBuffer(o.max_batch * 4);
  d_ctx_ = DeviceBuffer(R * 4);
  d_ctx_local_ = DeviceBuffer(R * 4);
  d_tables_ = DeviceBuffer(int64_t{o.max_batch} * std::max(max_pages_, 1) * 4);
  d_accepted_ = DeviceBuffer(o.max_batch * 4);
  d_state_idx_ = DeviceBuffer(2 * o.max_batch * 4);
  d_agree_ = DeviceBuffer(256);
  d_spec_ = DeviceBuffer(R * sizeof(ops::SampleSpec));
  d_sampled_ = DeviceBuffer(R * sizeof(ops::SampleResult));
  sample_scratch_ = DeviceBuffer(cu::sample_rows_scratch_bytes(R, V));
  CUDA_CHECK(cudaMemsetAsync(sample_scratch_.get(), 0, sample_scratch_.bytes(), ctx_.stream));
  const size_t pinned = static_cast<size_t>(R * 4 * 3 + o.max_batch * 4 * 5 + int64_t{o.max_batch} * max_pages_ * 4);
  CUDA_CHECK(cudaMallocHost(&pinned_, std::max<size_t>(pinned, 256)));
  // Activations.
  const int64_t Rp = G_ * ((R + G_ - 1) / G_);
  P_ = DeviceBuffer(R * D * 2);
  blocks_ = DeviceBuffer(R * plan_.num_blocks * D * 2);
  x_ = DeviceBuffer(Rp * D * 2);
  a_ = DeviceBuffer(Rp * D * 2);
  f_ = DeviceBuffer(Rp * D * 2);  // the hybrid MoE gathers G shards into it
  logits_ = DeviceBuffer(R * V * 4);
  const GpuWorkspace ws = gpu_workspace(c, o);
  layer_bytes_ = ws.layer_bytes;
  work_ = DeviceBuffer(ws.work_bytes);
  Carve tail(work_.get<char>() + layer_bytes_, ws.work_bytes - layer_bytes_);
  step_ = carve_step(tail, c, dims_);
  attn_scratch_bytes_ = ws.attention_bytes;
  attn_scratch_ = DeviceBuffer(std::max<size_t>(attn_scratch_bytes_, 256));
  if (c.dsa) {  // the split top-k's counters and histograms: zero before its first call, left zero by every call
    topk_scratch_ = DeviceBuffer(cu::topk_indices_scratch_bytes(R));
    CUDA_CHECK(cudaMemsetAsync(topk_scratch_.get(), 0, topk_scratch_.bytes(), ctx_.stream));
  }
}

GpuRank::~GpuRank() {
  if (pinned_) cudaFreeHost(pinned_);
}

int GpuRank::admit(int64_t reserve_tokens) {
  const int s = table_.admit(reserve_tokens);
  caches_.reset_slot(s, ctx_.stream);
  return s;
}

void GpuRank::release(int slot) { table_.release(slot); }

void GpuRank::set_context(int slot, int64_t length) { table_.set_length(slot, length); }

void GpuRank::world_sum(float* v) {
  CUDA_CHECK(cudaMemcpyAsync(d_agree_.get(), v, 4, cudaMemcpyHostToDevice, ctx_.stream));
  o_.groups->world->all_reduce(d_agree_.get(), 1, DType::F32);
  CUDA_CHECK(cudaMemcpyAsync(v, d_agree_.get(), 4, cudaMemcpyDeviceToHost, ctx_.stream));
  CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
}

void GpuRank::prepare(std::span<const int> slots, int q, std::span<const int32_t> tokens) {
  const int B = static_cast<int>(slots.size());
  const bool multi = coll_.real() && o_.shard.world_size > 1;  // an idle replica steps with B = 0
  std::function<void(float*)> agree;
  if (multi) agree = [this](float* v) { world_sum(v); };
  agree_on_input(
      [&] {
        K3_CHECK(B <= o_.max_batch, "step: {} requests for a batch of at most {}", B, o_.max_batch);
        table_.validate_step(slots, q, tokens, c_.vocab_size, multi, /*restep=*/true);
      },
      agree);
  const std::vector<int64_t> pos0 = table_.begin_step(slots, q);
  B_ = B;
  q_ = q;
  prepared_ = true;
  const int64_t rows = int64_t{B} * q;
  auto* p = static_cast<int32_t*>(pinned_);
  int32_t* tok = p;
  int32_t* ctx = tok + rows;
  int32_t* sl = ctx + rows;
  int32_t* ps = sl + B;
  int32_t* tables = ps + B;
  int32_t* ctx_local = tables + int64_t{B} * max_pages_;  // DCP: positions of this rank visible to each row
  int32_t* state_idx = ctx_local + rows;                   // [2][B]: KDA states read, written
  max_ctx_ = 0;
  for (int b = 0; b < B; ++b) {
    const std::vector<int32_t>& pages = table_.pages(slots[b]);
    sl[b] = slots[b];
    state_idx[b] = caches_.read_state(slots[b]);
    state_idx[B + b] = caches_.write_state(slots[b]);
    ps[b] = static_cast<int32_t>(pos0[b]);
    for (int i = 0; i < q; ++i) ctx[b * q + i] = static_cast<int32_t>(pos0[b] + i + 1);
    for (int j = 0; j < max_pages_; ++j)
      tables[b * max_pages_ + j] = j < static_cast<int>(pages.size()) ? pages[j] : 0;
    max_ctx_ = std::max<int64_t>(max_ctx_, pos0[b] + q);
  }
  std::copy(tokens.begin(), tokens.end(), tok);
  auto* s = ctx_.stream;
  CUDA_CHECK(cudaMemcpyAsync(d_tokens_.get(), tok, rows * 4, cudaMemcpyHostToDevice, s));
  CUDA_CHECK(cudaMemcpyAsync(d_ctx_.get(), ctx, rows * 4, cudaMemcpyHostToDevice, s));
  if (dims_.Dc > 1) {
    // DCP rank r of D holds positions p = j D + r: row at position t sees local j <= (t - r) / D.
    const int64_t D = dims_.Dc, r = coll_.dcp_rank();
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t t = ctx[i] - 1;
      ctx_local[i] = static_cast<int32_t>(t >= r ? (t - r) / D + 1 : 0);
    }
    CUDA_CHECK(cudaMemcpyAsync(d_ctx_local_.get(), ctx_local, rows * 4, cudaMemcpyHostToDevice, s));
  }
  CUDA_CHECK(cudaMemcpyAsync(d_slots_.get(), sl, B * 4, cudaMemcpyHostToDevice, s));
  upload_state_idx(state_idx, B);
  CUDA_CHECK(cudaMemcpyAsync(d_pos0_.get(), ps, B * 4, cudaMemcpyHostToDevice, s));
  CUDA_CHECK(cudaMemcpyAsync(d_tables_.get(), tables, int64_t{B} * max_pages_ * 4, cudaMemcpyHostToDevice, s));
  // The staging is reused by the next prepare(): finish these copies first.
  CUDA_CHECK(cudaStreamSynchronize(s));
}

void GpuRank::upload_state_idx(const int32_t* idx, int B) {
  // reads at [0, max_batch), writes at [max_batch, 2 max_batch): fixed addresses for the graphs
  int32_t* d = d_state_idx_.get<int32_t>();
  CUDA_CHECK(cudaMemcpyAsync(d, idx, B * 4, cudaMemcpyHostToDevice, ctx_.stream));
  CUDA_CHECK(cudaMemcpyAsync(d + o_.max_batch, idx + B, B * 4, cudaMemcpyHostToDevice, ctx_.stream));
}

void GpuRank::enqueue(StepKind kind) {
  K3_CHECK(prepared_, "step: prepare() first");
  run_step(kind, *this, c_, plan_, step_rows(int64_t{B_} * q_, G_, o_.shard.tp_rank), {});
}

void GpuRank::run_graph(StepKind kind) {
  K3_CHECK(coll_.capturable(),
           "gpu: this rank's collectives ({}) cannot be captured in a CUDA graph; run the step with enqueue()",
           o_.groups ? o_.groups->tp->name() : std::string("?"));
  K3_CHECK(prepared_, "step: prepare() first");
  graphs_.run(static_cast<int>(kind), B_, q_, ctx_.stream, [&] {
    const int64_t keep = max_ctx_;
    max_ctx_ = o_.max_context;  // a graph serves any context up to the capacity
    try {
      enqueue(kind);
    } catch (...) {
      max_ctx_ = keep;
      throw;
    }
    max_ctx_ = keep;
  });
}

std::vector<std::pair<std::string, double>> GpuRank::profile(StepKind kind) {
  prof_.start();
  try {
    enqueue(kind);
  } catch (...) {
    prof_.stop();
    throw;
  }
  return prof_.finish(ctx_.stream);
}

std::vector<float> GpuRank::logits() {
  const int64_t n = int64_t{B_} * q_ * c_.vocab_size;
  std::vector<float> out(static_cast<size_t>(n));
  CUDA_CHECK(cudaMemcpyAsync(out.data(), logits_.get(), n * 4, cudaMemcpyDeviceToHost, ctx_.stream));
  CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
  return out;
}

std::vector<ops::SampleResult> GpuRank::sample(std::span<const ops::SampleSpec> spec) {
  const int64_t rows = int64_t{B_} * q_;
  K3_CHECK(static_cast<int64_t>(spec.size()) == rows, "sample: {} specs for the step's {} rows", spec.size(), rows);
  ops::check_specs(spec.data(), rows, c_.vocab_size);
  std::vector<ops::SampleResult> out(static_cast<size_t>(rows));
  if (rows == 0) return out;
  CUDA_CHECK(cudaMemcpyAsync(d_spec_.get(), spec.data(), rows * sizeof(ops::SampleSpec), cudaMemcpyHostToDevice,
                             ctx_.stream));
  K3_LAUNCH(cu::sample_rows(logits_.get<float>(), rows, c_.vocab_size, d_spec_.get<ops::SampleSpec>(),
                            d_sampled_.get<ops::SampleResult>(), sample_scratch_.get(), sample_scratch_.bytes(),
                            ctx_.stream, ops::sample_needs(spec.data(), rows)));
  CUDA_CHECK(cudaMemcpyAsync(out.data(), d_sampled_.get(), rows * sizeof(ops::SampleResult), cudaMemcpyDeviceToHost,
                             ctx_.stream));
  CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
  return out;
}

void GpuRank::commit(std::span<const int> slots, std::span<const int> accepted) {
  const int B = static_cast<int>(slots.size());
  K3_CHECK(B == B_ && static_cast<int>(accepted.size()) == B, "commit: {} slots for the last step's {}", B, B_);
  auto* p = static_cast<int32_t*>(pinned_);
  for (int b = 0; b < B; ++b) {
    table_.check_slot(slots[b], "commit");
    K3_CHECK(table_.pending(slots[b]), "commit: slot {} has no pending step", slots[b]);
    K3_CHECK(accepted[b] >= 0 && accepted[b] <= q_, "commit: {} tokens accepted of {}", accepted[b], q_);
    p[b] = accepted[b];
    p[B + b] = slots[b];
    p[2 * B + b] = caches_.read_state(slots[b]);
    p[3 * B + b] = caches_.write_state(slots[b]);
  }
  CUDA_CHECK(cudaMemcpyAsync(d_accepted_.get(), p, B * 4, cudaMemcpyHostToDevice, ctx_.stream));
  CUDA_CHECK(cudaMemcpyAsync(d_slots_.get(), p + B, B * 4, cudaMemcpyHostToDevice, ctx_.stream));
  upload_state_idx(p + 2 * B, B);
  const int32_t* d_idx = d_state_idx_.get<int32_t>();
  caches_.commit(slots, accepted, q_, d_slots_.get<int32_t>(), d_accepted_.get<int32_t>(), d_idx, d_idx + o_.max_batch,
                 ctx_.stream);
  CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
  for (int b = 0; b < B; ++b) table_.commit(slots[b], accepted[b]);
}

// ------------------------------------------------------------ StepBackend

bf16* GpuRank::act(Act a) {
  // On one TP rank the gathers and the shard are the buffers themselves (the collectives skip equal pointers).
  const bool one = G_ == 1;
  switch (a) {
    case Act::P: return P_.get<bf16>();
    case Act::Blocks: return blocks_.get<bf16>();
    case Act::X: return x_.get<bf16>();
    case Act::A: return a_.get<bf16>();
    case Act::F: return f_.get<bf16>();
    case Act::Gathered: return one ? x_.get<bf16>() : step_.gathered;
    case Act::Partial: return one ? a_.get<bf16>() : step_.partial;
    case Act::Sharded: return one ? f_.get<bf16>() : step_.sharded;
  }
  return nullptr;
}

void GpuRank::begin(StepKind kind, const StepRows& r) {
  kind_ = kind;
  rows_ = r;
  // The reduce-scatter sums G cs rows; attention writes the first m.
  if (kind == StepKind::Stock && G_ > 1 && r.m > 0)
    CUDA_CHECK(cudaMemsetAsync(step_.partial + r.m * c_.hidden_size, 0, (G_ * r.cs - r.m) * c_.hidden_size * 2,
                               ctx_.stream));
}

void GpuRank::embed(int64_t row0, int64_t rows, int64_t res_rows) {
  const int64_t D = c_.hidden_size;
  bf16* P = P_.get<bf16>();
  if (kind_ == StepKind::Stock) CUDA_CHECK(cudaMemsetAsync(P, 0, res_rows * D * 2, ctx_.stream));
  K3_LAUNCH(cu::embedding(d_tokens_.get<int32_t>() + row0, rows, weights_.w.embed, c_.vocab_size, D, P, ctx_.stream));
}

void GpuRank::attn_res(const ResMix& r) {
  mark(r.layer < 0 ? "lm_head" : "attn_res");
  cu::AttnResCudaArgs a;
  a.prefix = P_.get<bf16>();
  a.delta = r.has_delta ? act(r.delta) : nullptr;
  a.blocks = blocks_.get<bf16>();
  a.max_blocks = plan_.num_blocks;
  a.norm_w = r.norm_w;
  a.proj_w = r.proj_w;
  a.out_norm_w = r.out_norm_w;
  a.num_blocks = r.num_blocks;
  a.block_write_idx = r.block_write_idx;
  a.eps = c_.rms_norm_eps;
  a.out_eps = c_.rms_norm_eps;
  a.out = x_.get<bf16>();
  a.rows = r.rows;
  a.dim = c_.hidden_size;
  K3_LAUNCH(cu::attn_res(a, ctx_.stream));
}

void GpuRank::rmsnorm(Act x, const bf16* w, int64_t rows) {
  K3_LAUNCH(cu::rmsnorm(act(x), w, act(x), rows, c_.hidden_size, c_.rms_norm_eps, ctx_.stream));
}

void GpuRank::copy_rows(Act dst, Act src, int64_t rows) {
  CUDA_CHECK(cudaMemcpyAsync(act(dst), act(src), rows * c_.hidden_size * 2, cudaMemcpyDeviceToDevice, ctx_.stream));
}

void GpuRank::all_gather_rows(Act shard, Act all, int64_t m) {
  mark("collectives");
  if (act(shard) == act(all)) return;
  coll_.tp_all_gather_rows(act(shard), act(all), m, c_.hidden_size);
}

void GpuRank::reduce_scatter_rows(Act partial, Act shard, int64_t m) {
  mark("collectives");
  if (act(partial) == act(shard)) return;
  coll_.tp_reduce_scatter_rows(act(partial), act(shard), m, c_.hidden_size, step_.sharded);
}

void GpuRank::all_reduce(Act a, int64_t m) {
  mark("collectives");
  coll_.tp_all_reduce(act(a), m * c_.hidden_size, step_.partial);
}

void GpuRank::lm_head(Act h, int64_t m) {
  const int64_t D = c_.hidden_size, Vl = weights_.w.vocab_count;
  float* out = logits_.get<float>();
  if (G_ == 1) {
    K3_LAUNCH(cu::linear(ctx_, act(h), weights_.w.lm_head, out, true, m, D, Vl));
  } else {
    K3_LAUNCH(cu::linear(ctx_, act(h), weights_.w.lm_head, step_.lm + o_.shard.tp_rank * m * Vl, true, m, D, Vl));
    coll_.vocab_all_gather(step_.lm, m, Vl, out);
  }
}

void GpuRank::capture_aux(bool, int64_t, bool) {
  fail("gpu: aux hidden states are not captured on the GPU (use the CPU engine)");
}

}  // namespace k3
