// RankCommand: one call of a LayoutDecoder (runtime/layout_decoder.h) as every rank of the layout runs it,
// and RankReply, what a rank answers. Both are plain data with a byte encoding, so the same command reaches
// rank threads of one process (by pointer) or the processes of an mpirun job (broadcast by rank 0).
//
// A command carries the step's work split by DP replica ([replica][...]); rank w runs the part of its
// replica (Layout::replica(w)). Only the ranks whose answer the facade reads fill the reply's payload: TP rank
// 0 of each replica returns the logits / samples, every rank returns its own error.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "ops/sampling.h"
#include "runtime/generate.h"

namespace k3 {

struct RankCommand {
  enum class Op : int32_t {
    Info,        // the rank's sizes (RankReply::info)
    Admit,       // replica `replica` admits with `reserve` tokens set aside (the others do nothing)
    CanAdmit,    // whether the rank could admit `reserve` tokens now
    Release,     // replica `replica` releases its slot `slot`
    Step,        // every replica steps its slots (none: B = 0, q = 1) -> logits
    StepSample,  // the same with sampling -> samples
    Commit,      // every replica with slots commits counts
    Quit,        // a follower process leaves its loop (runtime/rank_channel.h)
  };
  RankCommand() = default;
  explicit RankCommand(Op o) : op(o) {}
  Op op = Op::Info;
  int32_t replica = -1;
  int32_t slot = -1;
  int32_t q = 1;
  int64_t reserve = 0;
  std::vector<std::vector<int32_t>> slots, tokens, counts;  // [replica][B_p], [replica][B_p q], [replica][B_p]
  std::vector<std::vector<ops::SampleSpec>> specs;          // [replica][B_p q]
};

struct RankReply {
  enum class Status : int32_t { Ok, Error, PeerRejected };
  Status status = Status::Ok;
  std::string message;                    // the error's message
  int64_t value = 0;                      // Admit: the slot; CanAdmit: 1 when the rank can admit
  std::vector<int64_t> info;              // Info: RankInfo's fields
  std::vector<float> logits;              // Step, TP rank 0: [B_p q, V]
  std::vector<ops::SampleResult> samples; // StepSample, TP rank 0: [B_p q]
  static RankReply failure(Status s, std::string message) {
    RankReply r;
    r.status = s;
    r.message = std::move(message);
    return r;
  }
};

// What Info returns, in RankReply::info's order.
struct RankInfo {
  int64_t world_rank, tp, dp, dcp, max_slots, max_q, max_context;
  int64_t fit_limit;  // the most tokens Decoder::fits accepts (fits is monotone in the token count)
  static RankInfo from(std::span<const int64_t> v);
};

// Runs cmd on world rank w's Decoder d (of layout L). Never throws: an error is the reply's status and message
// (PeerRejectedInput: PeerRejected).
RankReply execute(const RankCommand& cmd, const Layout& L, int w, Decoder& d);

std::vector<char> encode(const RankCommand& c);
std::vector<char> encode(const RankReply& r);
// Errors on a truncated or malformed message.
RankCommand decode_command(std::span<const char> bytes);
RankReply decode_reply(std::span<const char> bytes);

}  // namespace k3
