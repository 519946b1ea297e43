// LayoutDecoder: a whole TP x DP x DCP layout, ranks as threads, as ONE Decoder
// (the Scheduler's, `k3decode serve --tp/--dp/--dcp`).
//
// It owns one thread per world rank; each runs a loop executing the commands
// it is given on its own rank Decoder (an EngineDecoder over LocalCluster, or a
// GpuDecoder over LocalGpuCluster, stepped eagerly). Every call of the facade
// (admit, release, step, commit) is one command given to every rank thread at
// once, and the call returns when every rank finished it: the ranks execute
// the same command sequence, so their collectives match.
//
// Slots: replica p's slot s is the facade's slot p * slots_per_replica() + s
// (max_slots() = dp * slots_per_replica()). admit() picks the replica with the
// most free slots (ties: the lowest replica) and admits on its ranks only.
// step(slots, q, tokens) splits the slots by replica, keeping their order;
// every replica steps (the MoE exchange spans every rank): a replica with none
// of the step's slots steps with B = 0 and q = 1, as generate() does
// (runtime/generate.cpp). Each replica with slots steps with the given q. The
// logits returned are those of each replica's TP rank 0, in the order of the
// given slots. step_sample splits the specs alike: every rank samples its logits (B q records back from a
// GPU), and TP rank 0's records are returned. commit() runs on the replicas holding the slots.
//
// Errors: bad facade input (a slot outside 0..max_slots-1 or not admitted, a
// token count that is not B q) is an Error before any rank is called. A rank's
// exception is rethrown to the caller after every rank finished the command
// (the Engine / GpuRank agree on their input over the world, so all ranks of a
// bad step raise together and none waits in a collective); the facade stays
// usable. One caller at a time (calls are serialised). The rank threads block asynchronous signals (a
// process-directed SIGTERM goes to a thread that waits for it).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "runtime/generate.h"

namespace k3 {

class LocalCluster;

class LayoutDecoder : public Decoder {
 public:
  // ranks[w]: world rank w's Decoder (the same layout on every rank, world_rank() == w). on_thread(w), when
  // given, runs first on rank w's thread (e.g. cudaSetDevice); an error there is thrown from the constructor.
  explicit LayoutDecoder(std::vector<std::unique_ptr<Decoder>> ranks, std::function<void(int)> on_thread = {});
  ~LayoutDecoder() override;
  LayoutDecoder(const LayoutDecoder&) = delete;
  LayoutDecoder& operator=(const LayoutDecoder&) = delete;

  const ModelConfig& config() const override { return ranks_[0]->config(); }
  const Layout& layout() const override { return layout_; }
  int world_rank() const override { return 0; }
  bool whole_world() const override { return true; }
  int max_slots() const override { return layout_.dp * per_replica_; }
  int max_q() const override { return ranks_[0]->max_q(); }
  int64_t max_context() const override { return ranks_[0]->max_context(); }
  int admit(int64_t reserve_tokens) override;
  bool can_admit(int64_t tokens) const override;
  bool fits(int64_t tokens) const override;
  void release(int slot) override;
  std::vector<float> step(std::span<const int> slots, int q, std::span<const int32_t> tokens) override;
  // Each rank samples its own logits (a GpuDecoder on the device); TP rank 0's records are returned.
  std::vector<ops::SampleResult> step_sample(std::span<const int> slots, int q, std::span<const int32_t> tokens,
                                             std::span<const ops::SampleSpec> spec) override;
  void commit(std::span<const int> slots, int q) override;
  void commit(std::span<const int> slots, std::span<const int> counts) override;
  // The facade is the only caller of its world: a sum over one caller is the identity.
  void world_sum(float*, int64_t) override {}

  int slots_per_replica() const { return per_replica_; }
  int free_slots(int replica) const;
  bool replica_can_admit(int replica, int64_t tokens) const;
  int replica_of(int slot) const { return slot / per_replica_; }
  Decoder& rank(int world_rank) { return *ranks_.at(static_cast<size_t>(world_rank)); }

 private:
  // Runs fn(w, rank w's Decoder) on every rank thread; returns when all finished; rethrows the lowest rank's own
  // error (a PeerRejectedInput only when no rank has another).
  void run(const std::function<void(int, Decoder&)>& fn);
  void loop(int w);
  void check_slot(int slot, const char* what) const;
  void shutdown();

  Layout layout_;
  int per_replica_ = 0;
  std::vector<std::unique_ptr<Decoder>> ranks_;
  std::vector<std::vector<char>> used_;  // [replica][local slot]: admitted through the facade

  mutable std::mutex call_mu_;  // one facade call at a time
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int, Decoder&)>* cmd_ = nullptr;
  uint64_t gen_ = 0;
  int done_ = 0;
  bool quit_ = false;
  std::vector<std::exception_ptr> errors_;
  std::vector<std::thread> threads_;
};

// The CPU backend: every Engine of `cluster` (which must outlive the decoder) behind one facade.
std::unique_ptr<LayoutDecoder> make_layout_decoder(LocalCluster& cluster);

}  // namespace k3
