// StepBackend: what a decode step asks of a backend, the seam between the one
// step loop (runtime/steps.h) and the places the work runs: the CPU reference
// (runtime/cpu_backend.h: host buffers, the CPU modules of model/layers.h,
// Comm) and the GPU (runtime/gpu/rank.h: device buffers, the CUDA ops,
// GpuCollectives). Every call enqueues work on the backend's activations, named
// by Act; nothing is read back until the step ends.
//
// Rows: a replica's step has m = B q rows; G = TP size, t = this rank's TP
// index, cs = ceil(m / G) rows per shard, rank t's shard is rows
// [r0, r0 + real) of the m, zero-padded to cs (sp_shard).
#pragma once

#include <cstdint>

#include "core/bf16.h"
#include "model/weights.h"

namespace k3 {

enum class StepKind { Auto, Stock, Hybrid };
const char* step_kind_name(StepKind k);

// The activations of a step (D = hidden size, nb = AttnRes blocks).
enum class Act {
  P,         // [res_rows, D] the residual partial sum (stock: this rank's shard)
  Blocks,    // [res_rows, nb, D] completed AttnRes block snapshots
  X,         // [G cs, D] the normalised input of the next module
  A,         // [G cs, D] attention output (hybrid: all rows; stock: the reduce-scattered shard)
  F,         // [G cs, D] FFN output
  Gathered,  // [G cs, D] stock: the TP all-gather of X's shards
  Partial,   // [G cs, D] stock: o_proj partials of all rows before the reduce-scatter (rows >= m zero)
  Sharded,   // [cs, D] hybrid: the MoE output of this rank's shard
};

// Where moe() puts the shared experts (its comment below).
enum class SharedPart { Own, TpAllRows };

struct StepRows {
  int64_t m = 0;     // rows of the replica's step
  int G = 1, t = 0;  // TP size and rank
  int64_t cs = 0;    // rows per shard
  int64_t r0 = 0;    // this rank's first row
  int64_t real = 0;  // real rows of this rank's shard
};
StepRows step_rows(int64_t m, int G, int t);

// One AttnRes call (ops/attn_res.h): P += delta (if any), the block snapshot
// written at block_write_idx (if >= 0), X = [RMSNorm](mix of the blocks and P).
struct ResMix {
  int layer = -1;                    // -1: the final AttnRes before the norm
  Act delta = Act::F;
  bool has_delta = false;
  const bf16* norm_w = nullptr;      // [D] *_res_norm.weight (the backend's pointer)
  const bf16* proj_w = nullptr;      // [D] *_res_proj.weight
  const bf16* out_norm_w = nullptr;  // [D] or null
  int num_blocks = 0;
  int block_write_idx = -1;
  int64_t rows = 0;
};

class StepBackend {
 public:
  virtual ~StepBackend() = default;
  virtual const ModelWeights& weights() const = 0;  // this rank's shard (host or device pointers)

  // Sets up the step's buffers (rows x D activations; stock: Partial's padding rows zero).
  virtual void begin(StepKind kind, const StepRows& r) = 0;
  // P rows [0, rows) = the embeddings of the step's tokens [row0, row0 + rows); rows [rows, res_rows) zero.
  virtual void embed(int64_t row0, int64_t rows, int64_t res_rows) = 0;
  virtual void attn_res(const ResMix& r) = 0;
  virtual void rmsnorm(Act x, const bf16* w, int64_t rows) = 0;  // in place
  virtual void copy_rows(Act dst, Act src, int64_t rows) = 0;
  // The attention of layer l on all m rows: out = the o_proj partial of the local heads.
  virtual void attention(int layer, Act x, Act out) = 0;
  // The MoE of layer l on rows [row0, row0 + real) of x (a shard of cs rows, the rest padding). shared = Own:
  // out [cs, D] = routed + shared experts of those rows (replicated shared weights). shared = TpAllRows: out's
  // first m rows = this rank's TP partial sum of the shared experts on all m rows of x (x from row 0, rows
  // >= m untouched), the routed part of rows [row0, row0 + real) added into it (one all-reduce then sums
  // both). Collective over the world (EP): every rank calls it in every MoE layer, real = 0 included.
  virtual void moe(int layer, Act x, int64_t row0, int64_t cs, int64_t real, Act out, SharedPart shared) = 0;
  // The dense MLP on the first `rows` rows of x -> out (TP-sharded: this rank's partial sum).
  virtual void dense(int layer, Act x, int64_t rows, Act out) = 0;
  // The vocab-parallel lm_head on m rows of h: logits [m, V] on every TP rank.
  virtual void lm_head(Act h, int64_t m) = 0;
  // TP-group collectives on row shards (steps.h): shard [cs, D] of every rank -> all [G cs, D];
  // partial [G cs, D] summed over the group -> this rank's shard [cs, D]; in-place sum of [m, D].
  virtual void all_gather_rows(Act shard, Act all, int64_t m) = 0;
  virtual void reduce_scatter_rows(Act partial, Act shard, int64_t m) = 0;
  virtual void all_reduce(Act a, int64_t m) = 0;
  // Aux hidden states: the stream bf16(P + F) (or P alone) of `rows` rows, gathered over TP when `gather`.
  virtual void capture_aux(bool with_delta, int64_t rows, bool gather) = 0;
};

}  // namespace k3
