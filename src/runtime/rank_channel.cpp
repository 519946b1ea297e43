// ChannelRanks / follow_commands (runtime/rank_channel.h): rank 0's commands to the other processes.
#include "runtime/rank_channel.h"

#include <numeric>

namespace k3 {

namespace {

// Rank 0's msg to every rank (the others' msg is replaced). The length goes first, by broadcast_idle: a follower
// waits there between commands, for as long as the server is idle, without spinning a core.
void broadcast_bytes(Comm& c, std::vector<char>& msg) {
  int64_t n = static_cast<int64_t>(msg.size());
  c.broadcast_idle(&n, 1, DType::I64, 0);
  K3_CHECK(n >= 0, "rank channel: bad message length {}", n);
  msg.resize(static_cast<size_t>(n));
  if (n > 0) c.broadcast(msg.data(), n, DType::U8, 0);
}

// Every rank's `mine`, on rank 0 in rank order (the others get nothing).
std::vector<std::vector<char>> gather_bytes(Comm& c, const std::vector<char>& mine) {
  const int W = c.size();
  const int64_t n = static_cast<int64_t>(mine.size());
  std::vector<int64_t> sizes(static_cast<size_t>(W));
  c.all_gather(&n, sizes.data(), 1, DType::I64);
  std::vector<int64_t> send(static_cast<size_t>(W), 0), recv(static_cast<size_t>(W), 0);
  send[0] = n;
  if (c.rank() == 0) recv = sizes;
  std::vector<char> all(static_cast<size_t>(std::accumulate(recv.begin(), recv.end(), int64_t{0})));
  c.all_to_all_v(mine.data(), send.data(), all.data(), recv.data(), DType::U8);
  std::vector<std::vector<char>> out;
  if (c.rank() != 0) return out;
  int64_t at = 0;
  for (int p = 0; p < W; ++p) {
    out.emplace_back(all.begin() + at, all.begin() + at + recv[p]);
    at += recv[p];
  }
  return out;
}

}  // namespace

ChannelRanks::ChannelRanks(Decoder& local, Comm& channel) : local_(local), channel_(channel) {
  K3_CHECK(channel_.rank() == 0 && local_.world_rank() == 0,
           "rank channel: the facade runs on world rank 0 (this is channel rank {}, decoder rank {})", channel_.rank(),
           local_.world_rank());
  const Layout& L = local_.layout();
  K3_CHECK(channel_.size() == L.world(), "rank channel: a channel of {} ranks for a world of {} (tp {} x dp {})",
           channel_.size(), L.world(), L.tp, L.dp);
}

ChannelRanks::~ChannelRanks() {
  try {
    run(RankCommand{RankCommand::Op::Quit});
  } catch (...) {  // a destructor does not throw; the followers' loops end with the job
  }
}

std::vector<RankReply> ChannelRanks::run(const RankCommand& cmd) {
  std::vector<char> msg = encode(cmd);
  broadcast_bytes(channel_, msg);
  const std::vector<std::vector<char>> bytes = gather_bytes(channel_, encode(execute(cmd, local_.layout(), 0, local_)));
  std::vector<RankReply> replies;
  replies.reserve(bytes.size());
  for (const auto& b : bytes) replies.push_back(decode_reply(b));
  return replies;
}

int64_t follow_commands(Decoder& d, Comm& channel) {
  const Layout L = d.layout();
  const int w = d.world_rank();
  K3_CHECK(w != 0 && channel.rank() == w && channel.size() == L.world(),
           "rank channel: follower is decoder rank {}, channel rank {} of {} (a world of {})", w, channel.rank(),
           channel.size(), L.world());
  for (int64_t n = 1;; ++n) {
    std::vector<char> msg;
    broadcast_bytes(channel, msg);
    RankReply reply;
    RankCommand cmd;
    try {
      cmd = decode_command(msg);
      reply = execute(cmd, L, w, d);
    } catch (const std::exception& e) {  // a message that does not decode: answered, never run
      reply = RankReply::failure(RankReply::Status::Error, e.what());
      cmd.op = RankCommand::Op::Info;
    }
    gather_bytes(channel, encode(reply));
    if (cmd.op == RankCommand::Op::Quit) return n;
  }
}

}  // namespace k3
