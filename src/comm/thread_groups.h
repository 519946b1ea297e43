// The groups of every rank of a layout whose ranks are threads of one process (comm/local.h and
// comm/local_gpu.h): one shared State per group (State(n): a group of n members) and one CommT per
// (rank, group), CommT(state, rank in group, name). Group membership as in comm.h's Layout.
#pragma once

#include <algorithm>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "comm/comm.h"

namespace k3 {

template <class State, class CommT>
std::vector<RankGroups> make_thread_groups(const Layout& L) {
  L.validate();
  const int W = L.world(), per_tp = L.tp / L.dcp;
  auto world = std::make_shared<State>(W);
  std::vector<std::shared_ptr<State>> tp(static_cast<size_t>(L.dp)), dcp(static_cast<size_t>(L.dp * per_tp));
  for (auto& g : tp) g = std::make_shared<State>(L.tp);
  for (auto& g : dcp) g = std::make_shared<State>(L.dcp);
  std::vector<RankGroups> out(static_cast<size_t>(W));
  for (int w = 0; w < W; ++w) {
    const int rep = L.replica(w), t = L.tp_rank(w);
    out[w].tp = std::make_unique<CommT>(tp[rep], t, "tp");
    out[w].dcp = std::make_unique<CommT>(dcp[rep * per_tp + t / L.dcp], t % L.dcp, "dcp");
    out[w].world = std::make_unique<CommT>(world, w, "world");
  }
  return out;
}

// The receive side of all_to_all_v among thread ranks: peer p published its send counts in counts[p];
// its piece for `rank` starts after its pieces for the lower ranks. copy(p, src_elem, dst_elem, n) is
// called for every non-empty piece, clipped to what the receiver expects (recv_counts[p], laid out in
// rank order). Returns the first count mismatch as a message naming the comm, "" when there is none.
template <class Copy>
std::string receive_pieces(const std::vector<const int64_t*>& counts, int rank, const int64_t* recv_counts,
                           const std::string& comm_name, Copy&& copy) {
  int64_t at = 0;
  std::string bad;
  for (size_t p = 0; p < counts.size(); ++p) {
    int64_t off = 0;
    for (int q = 0; q < rank; ++q) off += counts[p][q];
    const int64_t n = counts[p][rank];
    if (n != recv_counts[p] && bad.empty())
      bad = fmt::format("comm {}: all_to_all_v rank {} sends {} elements to rank {}, which expects {}", comm_name, p,
                        n, rank, recv_counts[p]);
    const int64_t take = std::min(n, recv_counts[p]);
    if (take > 0) copy(static_cast<int>(p), off, at, take);
    at += recv_counts[p];
  }
  return bad;
}

// Runs fn(rank) for ranks 0..n-1 on one thread each, joins them all, and rethrows the first error.
inline void run_rank_threads(int n, const std::function<void(int)>& fn) {
  std::exception_ptr first;
  std::mutex mu;
  std::vector<std::thread> threads;
  for (int w = 0; w < n; ++w)
    threads.emplace_back([&, w] {
      try {
        fn(w);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

}  // namespace k3
