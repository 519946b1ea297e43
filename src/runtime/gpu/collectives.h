// The collectives of a GpuRank step, in one place, in three modes:
//   Single    one rank (tp 1, world 1): every collective is the identity
//             (and the callers skip them);
//   Loopback  the rank-slice benchmark (design.md section 6): each call moves
//             the bytes the real collective would move through device copies
//             on this rank's stream, with this rank's data standing in for
//             its peers';
//   Real      the rank's groups (RankGroups of device comms: comm/local_gpu.h
//             on one GPU, nccl across GPUs), stream set to the rank's.
// Row shards follow steps.h: m rows, G ranks, c = ceil(m / G) rows per shard.
#pragma once

#include <cstdint>

#include "comm/comm.h"
#include "core/bf16.h"

struct CUstream_st;

namespace k3 {

class GpuCollectives {
 public:
  enum class Mode { Single, Loopback, Real };
  GpuCollectives() = default;
  // groups: required in Real mode (its comms get `stream`), ignored otherwise.
  GpuCollectives(Mode mode, RankGroups* groups, int tp_size, int tp_rank, CUstream_st* stream);

  Mode mode() const { return mode_; }
  bool real() const { return mode_ == Mode::Real; }
  // True when a step's collectives can be captured in a CUDA graph.
  bool capturable() const;
  int dcp_size() const { return real() ? groups_->dcp->size() : 1; }
  int dcp_rank() const { return real() ? groups_->dcp->rank() : 0; }
  int world_size() const { return real() ? groups_->world->size() : 1; }

  // TP all-reduce in place: data BF16 [n] (loopback: the bytes of a ring's two passes through `scratch` [n]).
  void tp_all_reduce(bf16* data, int64_t n, bf16* scratch);
  // TP all-gather of row shards: shard BF16 [c, D] -> all [G c, D] (rows >= m are padding; loopback: this
  // shard in every slot, the first m rows only).
  void tp_all_gather_rows(const bf16* shard, bf16* all, int64_t m, int64_t D);
  // Loopback helper: rows [0, filled) of buf [total, D] repeated up to `total` rows by doubling copies
  // (the bytes of total - filled rows in about log2(total / filled) graph nodes instead of one per piece).
  void replicate_rows(bf16* buf, int64_t filled, int64_t total, int64_t D);
  // TP reduce-scatter: partial BF16 [G c, D] (rows >= m zero) -> shard [c, D] = sum of every rank's rows
  // [t c, (t+1) c) (loopback: this rank's own rows, plus G - 1 copies of the shard's bytes into `scratch`).
  void tp_reduce_scatter_rows(const bf16* partial, bf16* shard, int64_t m, int64_t D, bf16* scratch);
  // Vocab all-gather of the lm_head: slices F32 [G, m, Vl] with this rank's slice at index t (in place),
  // -> logits [m, G Vl] (loopback: this rank's slice in every column block).
  void vocab_all_gather(float* slices, int64_t m, int64_t Vl, float* logits);
  // Loopback's EP dispatch (the rank-slice benchmark): sends the n_in latent elements of z out (whole rows,
  // or this member's columns of the group's rows) and receives n_out elements of latent rows (this rank's
  // own latents standing in for its peers') into exchange. (The combine's stand-in, the latent norm from the
  // received rows into y, is GpuRank::moe's.)
  void ep_loopback_dispatch(const bf16* z, bf16* exchange, int64_t n_in, int64_t n_out);
  // Real mode only: the DCP group's all_gather / equal-count all-to-all and the world's (EP) equal-count
  // all-to-all; count = elements per member.
  void dcp_all_gather(const void* send, void* recv, int64_t count, DType dt);
  void dcp_all_to_all(const void* send, void* recv, int64_t count, DType dt);
  void world_all_to_all(const void* send, void* recv, int64_t count, DType dt);

 private:
  void all_to_all(Comm& c, const void* send, void* recv, int64_t count, DType dt);
  Mode mode_ = Mode::Single;
  RankGroups* groups_ = nullptr;
  int G_ = 1, t_ = 0;
  CUstream_st* stream_ = nullptr;
  std::vector<int64_t> counts_;  // host counts of the equal-count all-to-alls
};

}  // namespace k3
