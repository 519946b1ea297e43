// The device scratch of a GpuRank: one work area, carved into named pieces by
// one function per module. The same functions size the area (at the largest
// step, with no base pointer) and hand out the pointers of a step (at its row
// count, on the allocated base), so sizing and use cannot drift apart.
//
// Work area = [per-layer scratch | step buffers]: the per-layer part is reused
// by every module in turn (an upper bound of KDA, MLA / DSA, MoE and dense at
// max_batch x max_q rows); the step buffers (TP gathers, the reduce-scatter
// input, the MoE shard, the lm_head slices) live for the whole step.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/bf16.h"
#include "runtime/gpu/options.h"

namespace k3 {

// Hands out 256-byte aligned pieces of `base` (or only counts them when base is null).
class Carve {
 public:
  explicit Carve(char* base = nullptr, size_t limit = SIZE_MAX) : base_(base), limit_(limit) {}
  template <typename T>
  T* take(int64_t n) {
    T* p = base_ ? reinterpret_cast<T*>(base_ + at_) : nullptr;
    at_ += (static_cast<size_t>(n) * sizeof(T) + 255) / 256 * 256;
    check();
    return p;
  }
  size_t bytes() const { return at_; }

 private:
  void check() const;
  char* base_;
  size_t limit_;
  size_t at_ = 0;
};

// What the carving needs to know of the config and the options.
struct GpuDims {
  GpuDims(const ModelConfig& c, const GpuRankOptions& o);
  int G = 1, W = 1, Dc = 1;  // TP, world (EP), DCP sizes
  int Hk = 0, Hm = 0;        // local KDA / MLA heads
  bool real = false, loopback = false;
  int64_t max_rows = 0;      // max_batch x max_q
  int64_t ep_cap = 0;        // EP slots per (row owner, peer) (real collectives; ops/ep.h's cap)
  int ep_slices = 1;         // Gs: G when the latent down is TP-sharded (ffn_tp), else 1
  int64_t max_context = 0;
  int64_t shared_rows = 0;   // the shared experts' intermediate rows here (S, or S / G when TP-sharded)
  int64_t dense_rows = 0;    // the dense MLP's (I, or I / G)
};

struct KdaScratch {
  bf16* proj;     // [rows, in_rows] in_proj output
  float* qn;      // [rows, C] conv + SiLU of q, l2-normalised, scaled
  float* kn;      // [rows, C] conv + SiLU of k, l2-normalised
  bf16* v;        // [rows, C] conv + SiLU of v
  bf16* u;        // [rows, C] f_b f_a (f_a read in place from proj)
  float* g;       // [rows, C] gate
  float* beta;    // [rows, Hk]
  float* o;       // [rows, C] recurrence output
  bf16* normed;   // [rows, C] gated norm
};
KdaScratch carve_kda(Carve& s, const ModelConfig& c, const GpuDims& d, int64_t rows);

struct MlaScratch {
  bf16* cq;       // [rows, Q]
  bf16* qf;       // [rows, Hm (dn + P)]
  bf16* kv;       // [rows, R + P]
  bf16* qlat;     // [rows, Hm, R + P]
  float* olat;    // [rows, Hm, R]
  float* lse;     // [rows, Hm]
  bf16* olat_bf;  // [rows, Hm, R]
  bf16* o;        // [rows, Hm dv]
  bf16* gate;     // [rows, Hm dv]
  // DCP (Dc > 1): every member's queries and partial (o, lse), sent and received.
  bf16* qall;     // [Dc, rows, Hm, R + P]
  float* po;      // [Dc, rows, Hm, R]
  float* got_o;   // [Dc, rows, Hm, R]
  float* pl;      // [Dc, rows, Hm]
  float* got_lse; // [Dc, rows, Hm]
  // DSA's indexer.
  bf16* qi;       // [rows, Hi Di]
  float* wi;      // [rows, Hi]
  bf16* ki;       // [rows, Di]
  float* scores;  // [rows, max_context]
  int32_t* sel;   // [rows, topk]
  int32_t* cnt;   // [rows]
  // DSA with DCP: the local candidates, every member's, and the global selection.
  float* cand_s;  // [rows, topk]
  int32_t* cand_p;
  float* all_s;   // [Dc, rows, topk]
  int32_t* all_p;
  int32_t* sel_g; // [rows, topk]
  int32_t* cnt_g; // [rows]
};
MlaScratch carve_mla(Carve& s, const ModelConfig& c, const GpuDims& d, int64_t rows);

// rows: the rows routed (the own rows, or with the latent down TP-sharded all m rows of the group).
struct MoeScratch {
  float* logits;   // [rows, E] router logits
  int32_t* idx;    // [rows, k] chosen experts
  float* wts;      // [rows, k] their weights
  bf16* z;         // [rows, Ll] latent down (Ll = L / Gs)
  bf16* y;         // [rows, L] routed sum (own rows)
  bf16* mlp;       // [2 rows Sl] shared experts' gate / up
  void* experts;   // moe_experts scratch (local experts; loopback)
  bf16* exchange;  // [2 rows k, L] loopback: sent rows, then received outputs
  // The EP exchange (real collectives, ops/ep.h): W peers, M = cap (Gs = 1) or 2 Gs cap meta per peer.
  int32_t* slot;       // [max_rows k] own pairs' return slots
  int32_t* send_slot;  // [max_rows k] routed pairs' send slots
  int32_t* send_meta;  // [W, M]
  int32_t* recv_meta;  // [W, M]
  int32_t* ids;        // [W cap] assembled rows' experts (Gs > 1)
  int32_t* codes;      // [W cap] their owners' return slots (Gs > 1)
  bf16* send;          // [W cap L]: packed slices; the assembled rows (Gs > 1); the outputs that come back
  bf16* recv;          // [W cap L]: received slices; the outputs sorted to their owners (Gs > 1)
  bf16* out;           // [W cap, L] expert outputs
  void* ep_experts;
};
MoeScratch carve_moe(Carve& s, const ModelConfig& c, const GpuDims& d, int64_t rows);

bf16* carve_dense(Carve& s, const GpuDims& d, int64_t rows);   // [2 rows Il] the dense MLP's gate / up
bf16* carve_shared(Carve& s, const GpuDims& d, int64_t rows);  // [2 rows Sl] the shared experts' gate / up

struct StepScratch {
  bf16* gathered;  // [G cs, D] stock: X's shards gathered
  bf16* partial;   // [G cs, D] stock: o_proj partials (hybrid loopback: the all-reduce's scratch)
  bf16* sharded;   // [cs, D] hybrid: the MoE shard (loopback: a reduce-scatter scratch [m, D])
  float* lm;       // [G, m, V / G] lm_head slices
};
StepScratch carve_step(Carve& s, const ModelConfig& c, const GpuDims& d);

struct GpuWorkspace {
  size_t work_bytes = 0;   // the per-layer area (layer_bytes) + the step buffers
  size_t layer_bytes = 0;  // the per-layer area alone
  size_t attention_bytes = 0;  // the attention kernels' split-K partials
};
GpuWorkspace gpu_workspace(const ModelConfig& c, const GpuRankOptions& o);

}  // namespace k3
