// LayoutDecoder: a whole TP x DP x DCP layout as ONE Decoder (the Scheduler's,
// `k3decode serve --tp/--dp/--dcp`).
//
// Every call of the facade (admit, release, step, commit) becomes one
// RankCommand (runtime/rank_command.h) that every rank of the world runs on its
// own rank Decoder, and the call returns when every rank answered: the ranks
// run the same command sequence, so their collectives match. A RankRunner
// carries the commands: ThreadRanks (below) to one thread per rank of this
// process (an EngineDecoder over LocalCluster, or a GpuDecoder over
// LocalGpuCluster, stepped eagerly), or ChannelRanks (runtime/rank_channel.h)
// to the processes of an mpirun job, rank 0 broadcasting each command.
//
// Slots: replica p's slot s is the facade's slot p * slots_per_replica() + s
// (max_slots() = dp * slots_per_replica()). admit() picks the replica with the
// most free slots whose ranks can set the pages aside (ties: the lowest
// replica) and admits on its ranks only. step(slots, q, tokens) splits the
// slots by replica, keeping their order; every replica steps (the MoE exchange
// spans every rank): a replica with none of the step's slots steps with B = 0
// and q = 1, as generate() does (runtime/generate.cpp). The logits returned are
// those of each replica's TP rank 0, in the order of the given slots.
// step_sample splits the specs alike: every rank samples its logits (B q
// records back from a GPU), and TP rank 0's records are returned. commit() runs
// on the replicas holding the slots. fits() needs no rank: each rank's largest
// fitting request is learnt once, at construction.
//
// Errors: bad facade input (a slot outside 0..max_slots-1 or not admitted, a
// token count that is not B q) is an Error before any rank is called. A rank's
// error is raised to the caller after every rank answered (the Engine /
// GpuRank agree on their input over the world, so all ranks of a bad step
// raise together and none waits in a collective): the lowest rank's own error,
// else PeerRejectedInput; the facade stays usable. One caller at a time (calls
// are serialised), except fits(), which any thread may call.
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
#include "runtime/rank_command.h"

namespace k3 {

class LocalCluster;

// How a LayoutDecoder reaches the ranks of its world.
class RankRunner {
 public:
  virtual ~RankRunner() = default;
  virtual int world_size() const = 0;
  // World rank 0's Decoder, which lives in this process (the config and layout come from it).
  virtual Decoder& local() = 0;
  // Every rank runs cmd (execute()); replies[w] is world rank w's. Returns when every rank answered.
  virtual std::vector<RankReply> run(const RankCommand& cmd) = 0;
};

// One thread per rank of this process. ranks[w]: world rank w's Decoder. on_thread(w), when given, runs first
// on rank w's thread (e.g. cudaSetDevice); an error there is thrown from the constructor. The rank threads block
// asynchronous signals (a process-directed SIGTERM goes to a thread that waits for it).
class ThreadRanks : public RankRunner {
 public:
  explicit ThreadRanks(std::vector<std::unique_ptr<Decoder>> ranks, std::function<void(int)> on_thread = {});
  ~ThreadRanks() override;
  ThreadRanks(const ThreadRanks&) = delete;
  ThreadRanks& operator=(const ThreadRanks&) = delete;
  int world_size() const override { return static_cast<int>(ranks_.size()); }
  Decoder& local() override { return *ranks_[0]; }
  std::vector<RankReply> run(const RankCommand& cmd) override;

 private:
  void loop(int w);
  void shutdown();

  std::vector<std::unique_ptr<Decoder>> ranks_;
  std::function<void(int)> on_thread_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  const RankCommand* cmd_ = nullptr;
  uint64_t gen_ = 0;
  int done_ = 0;
  bool quit_ = false;
  std::vector<RankReply> replies_;
  std::vector<std::thread> threads_;
};

class LayoutDecoder : public Decoder {
 public:
  // The ranks behind `runner` have one layout (world rank w is rank w) and the same cache sizes: checked here.
  explicit LayoutDecoder(std::unique_ptr<RankRunner> runner);
  // Rank threads of this process (ThreadRanks).
  explicit LayoutDecoder(std::vector<std::unique_ptr<Decoder>> ranks, std::function<void(int)> on_thread = {});
  ~LayoutDecoder() override;
  LayoutDecoder(const LayoutDecoder&) = delete;
  LayoutDecoder& operator=(const LayoutDecoder&) = delete;

  const ModelConfig& config() const override { return runner_->local().config(); }
  const Layout& layout() const override { return layout_; }
  int world_rank() const override { return 0; }
  bool whole_world() const override { return true; }
  int max_slots() const override { return layout_.dp * per_replica_; }
  int max_q() const override { return max_q_; }
  int64_t max_context() const override { return max_context_; }
  int admit(int64_t reserve_tokens) override;
  bool can_admit(int64_t tokens) const override;
  bool fits(int64_t tokens) const override { return tokens <= fit_limit_; }
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
  int replica_of(int slot) const { return slot / per_replica_; }

 private:
  // Runs cmd on every rank; raises the lowest rank's own error (PeerRejectedInput only when no rank has another).
  std::vector<RankReply> run(const RankCommand& cmd) const;
  // Per replica: whether every one of its ranks could admit `tokens` now.
  std::vector<char> replicas_can_admit(int64_t tokens) const;
  void check_slot(int slot, const char* what) const;
  // The step's slots split by replica (their order kept); index[p][j]: where replica p's j-th slot came from.
  RankCommand split(RankCommand::Op op, std::span<const int> slots, int q, std::vector<std::vector<int>>* index) const;

  std::unique_ptr<RankRunner> runner_;
  Layout layout_;
  int per_replica_ = 0, max_q_ = 0;
  int64_t max_context_ = 0, fit_limit_ = -1;
  std::vector<std::vector<char>> used_;  // [replica][local slot]: admitted through the facade
  mutable std::mutex call_mu_;           // one facade call at a time
};

// The CPU backend: every Engine of `cluster` (which must outlive the decoder) behind one facade.
std::unique_ptr<LayoutDecoder> make_layout_decoder(LocalCluster& cluster);

}  // namespace k3
