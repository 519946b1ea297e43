// ChannelRanks: a LayoutDecoder's ranks in other processes (an mpirun job), reached over a world Comm.
//
// World rank 0 holds the facade (a server's scheduler) and its own rank Decoder; every other rank runs
// follow_commands(). Per facade call rank 0 broadcasts the RankCommand's bytes (runtime/rank_command.h), every
// rank runs it on its own Decoder, and the replies' bytes come back to rank 0 (an all_to_all_v in which only
// rank 0 receives). `channel` is a world group of its own (its communicator is not one the engines' collectives
// use), called only from the thread that drives the facade (an mpi group: the MpiRuntime's thread).
//
//   rank 0:  LayoutDecoder facade(std::make_unique<ChannelRanks>(my_decoder, *channel_groups.world));
//            ... serve(facade, ...) ...   // the facade's destruction sends Quit
//   others:  follow_commands(my_decoder, *channel_groups.world);   // returns at Quit
#pragma once

#include "comm/comm.h"
#include "runtime/layout_decoder.h"

namespace k3 {

class ChannelRanks : public RankRunner {
 public:
  // local: world rank 0's Decoder; channel: the world (rank 0 of it is this process). Both outlive this object.
  ChannelRanks(Decoder& local, Comm& channel);
  ~ChannelRanks() override;  // sends Quit
  ChannelRanks(const ChannelRanks&) = delete;
  ChannelRanks& operator=(const ChannelRanks&) = delete;
  int world_size() const override { return channel_.size(); }
  Decoder& local() override { return local_; }
  std::vector<RankReply> run(const RankCommand& cmd) override;

 private:
  Decoder& local_;
  Comm& channel_;
};

// A rank other than 0: runs rank 0's commands on d until Quit. Returns the number of commands run.
int64_t follow_commands(Decoder& d, Comm& channel);

}  // namespace k3
