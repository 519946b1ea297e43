// Comm: the collectives of one process group (kimi-k3 deployment groups: the
// TP group of a DP replica, a DCP group inside it, the world / EP group).
//
// Buffers are typed by DType (F32, BF16, I32, U8, ...); reductions (sum) exist
// for F32 and BF16 and accumulate in FP32 in rank order, so every rank of a
// group gets bitwise the same result. Counts are in elements. No call
// allocates memory; every call is collective (all ranks of the group call it,
// in the same order, with consistent counts). Backends: local (ranks as
// threads of one process), mpi (one process per rank, Open MPI); nccl (GPUs)
// comes with the CUDA backend, which is why a stream can be set.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace k3 {

enum class CollKind { AllReduce, AllGather, ReduceScatter, AllToAllV, Broadcast, Barrier };
const char* coll_kind_name(CollKind k);

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string name() const = 0;  // "tp", "dcp", "world" (+ backend)

  // In place: data [count] <- sum over ranks.
  virtual void all_reduce(void* data, int64_t count, DType dt) = 0;
  // send [count] -> recv [size, count], rank order. send may alias recv + rank * count.
  virtual void all_gather(const void* send, void* recv, int64_t count, DType dt) = 0;
  // send [size, count] -> recv [count] = sum over ranks of their send[rank].
  virtual void reduce_scatter(const void* send, void* recv, int64_t count, DType dt) = 0;
  // send holds size() consecutive pieces of send_counts[p] elements (piece p goes to
  // rank p); recv receives recv_counts[p] elements from each rank p, in rank order.
  virtual void all_to_all_v(const void* send, const int64_t* send_counts, void* recv, const int64_t* recv_counts,
                            DType dt) = 0;
  virtual void broadcast(void* data, int64_t count, DType dt, int root) = 0;
  // The same broadcast for ranks that may wait long for the root (a server's followers between requests):
  // the mpi backend polls a non-blocking broadcast and, once the wait passes a few ms, sleeps between polls
  // instead of spinning a core. Every rank uses this method for the message (MPI does not match a
  // non-blocking collective with a blocking one).
  virtual void broadcast_idle(void* data, int64_t count, DType dt, int root) { broadcast(data, count, dt, root); }
  virtual void barrier() = 0;
  // The CUDA stream collectives are enqueued on (nccl backend); ignored on the CPU.
  virtual void set_stream(void* /*stream*/) {}
  // True when the calls can be captured in a CUDA graph on the set stream (nccl); the
  // local GPU backend rendezvous on the host in every call and cannot be.
  virtual bool capturable() const { return false; }
};

// The groups one rank belongs to. Layout of world rank w (G = tp, D = dcp):
// replica = w / G, tp rank t = w % G; DCP group = the D consecutive TP ranks
// [t - t % D, t - t % D + D), dcp rank = t % D.
struct RankGroups {
  std::unique_ptr<Comm> tp;     // the G ranks of this DP replica
  std::unique_ptr<Comm> dcp;    // D ranks inside the TP group
  std::unique_ptr<Comm> world;  // all G x DP ranks (the EP group)
};

struct Layout {
  int tp = 1, dp = 1, dcp = 1;
  int world() const { return tp * dp; }
  int replica(int w) const { return w / tp; }
  int tp_rank(int w) const { return w % tp; }
  int dcp_rank(int w) const { return w % tp % dcp; }
  void validate() const;  // Error naming the bad value
};

// Counts calls and bytes per collective kind (tests assert collective counts per step).
class CountingComm : public Comm {
 public:
  explicit CountingComm(std::unique_ptr<Comm> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string name() const override { return inner_->name(); }
  void all_reduce(void* data, int64_t count, DType dt) override;
  void all_gather(const void* send, void* recv, int64_t count, DType dt) override;
  void reduce_scatter(const void* send, void* recv, int64_t count, DType dt) override;
  void all_to_all_v(const void* send, const int64_t* send_counts, void* recv, const int64_t* recv_counts,
                    DType dt) override;
  void broadcast(void* data, int64_t count, DType dt, int root) override;
  void broadcast_idle(void* data, int64_t count, DType dt, int root) override;
  void barrier() override;
  void set_stream(void* s) override { inner_->set_stream(s); }
  bool capturable() const override { return inner_->capturable(); }

  int64_t calls(CollKind k) const { return calls_[static_cast<int>(k)]; }
  int64_t bytes(CollKind k) const { return bytes_[static_cast<int>(k)]; }  // bytes this rank sent
  void reset();

 private:
  void count(CollKind k, int64_t bytes) {
    ++calls_[static_cast<int>(k)];
    bytes_[static_cast<int>(k)] += bytes;
  }
  std::unique_ptr<Comm> inner_;
  int64_t calls_[6] = {};
  int64_t bytes_[6] = {};
};

// Sums `n` ranks' buffers (F32 or BF16) into out in rank order with FP32
// accumulation: the one reduction every backend uses on the CPU.
void reduce_sum(const void* const* parts, int n, void* out, int64_t count, DType dt);

}  // namespace k3

namespace k3 {

// CPU-path helpers: activations live in float arrays of BF16 values and travel
// as BF16 (what the GPU path moves); sums accumulate in FP32 in rank order.
void all_reduce_bf16(Comm& comm, float* data, int64_t count);
void all_gather_bf16(Comm& comm, const float* send, float* recv, int64_t count);
void reduce_scatter_bf16(Comm& comm, const float* send, float* recv, int64_t count);
void all_to_all_v_bf16(Comm& comm, const float* send, const int64_t* send_counts, float* recv,
                       const int64_t* recv_counts);

}  // namespace k3
