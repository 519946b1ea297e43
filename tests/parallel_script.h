// The teacher-forced scripts of the parallel-runtime matrix, shared by the CPU
// (test_parallel.cpp) and GPU (gpu/test_gpu_parallel.cpp) tests.
//
// Request i is served by replica i mod dp (as generate() does). Each replica's
// ops: prefill chunks (max_q = 4) of each request on its own, a batched q = 2
// step, decode steps of all / of one request (rows < G), a verify step (q = 3)
// with partial accepts (2, 1, 0), decode, a second verify (q = 4) accepting
// 1 / 3 / 2, decode. A replica with fewer ops steps with B = 0 while the
// others finish (the MoE exchange spans every rank).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "core/rng.h"

namespace k3::test {

// One step of a replica: requests (global ids) x q tokens, then commit[b] of each.
struct Op {
  std::vector<int> reqs;
  int q = 1;
  std::vector<int32_t> tokens;  // [B q]
  std::vector<int> commits;     // [B]
  std::string what;             // for failure messages
};

struct Script {
  int dp = 1;
  std::vector<int> prompt_len;
  std::vector<std::vector<int>> requests;  // per replica
  std::vector<std::vector<Op>> ops;        // per replica
  int rounds = 0;                          // the most ops of any replica
};

// n token ids uniform in [0, vocab).
inline std::vector<int32_t> random_tokens(Rng& rng, int n, int vocab) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = static_cast<int32_t>(rng.below(static_cast<uint64_t>(vocab)));
  return t;
}

inline Script make_script(int dp, int vocab) {
  Script s;
  s.dp = dp;
  s.prompt_len = dp == 1 ? std::vector<int>{7, 2, 5} : std::vector<int>{7, 2, 5, 3, 1};
  const int n = static_cast<int>(s.prompt_len.size());
  s.requests.resize(dp);
  s.ops.resize(dp);
  for (int i = 0; i < n; ++i) s.requests[i % dp].push_back(i);
  Rng rng(4242);
  for (int p = 0; p < dp; ++p) {
    const std::vector<int>& R = s.requests[p];
    const int B = static_cast<int>(R.size());
    auto all = [&](int q, std::vector<int> commits, const char* what) {
      Op op{R, q, random_tokens(rng, B * q, vocab), commits.empty() ? std::vector<int>(B, q) : commits, what};
      op.commits.resize(B);
      return op;
    };
    for (int id : R)
      for (int at = 0; at < s.prompt_len[id]; at += 4) {
        const int q = std::min(4, s.prompt_len[id] - at);
        s.ops[p].push_back(Op{{id}, q, random_tokens(rng, q, vocab), {q}, "prefill chunk"});
      }
    s.ops[p].push_back(all(2, {}, "q 2"));
    s.ops[p].push_back(all(1, {}, "decode"));
    s.ops[p].push_back(all(1, {}, "decode"));
    s.ops[p].push_back(Op{{R[0]}, 1, random_tokens(rng, 1, vocab), {1}, "one row"});
    s.ops[p].push_back(all(3, {2, 1, 0}, "verify q 3 accept 2/1/0"));
    s.ops[p].push_back(all(1, {}, "decode"));
    s.ops[p].push_back(all(1, {}, "decode"));
    s.ops[p].push_back(all(4, {1, 3, 2}, "verify q 4 accept 1/3/2"));
    s.ops[p].push_back(all(1, {}, "decode"));
    s.ops[p].push_back(all(1, {}, "decode"));
    s.rounds = std::max(s.rounds, static_cast<int>(s.ops[p].size()));
  }
  return s;
}

}  // namespace k3::test
