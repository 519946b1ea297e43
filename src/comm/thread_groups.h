// The groups of every rank of a layout whose ranks are threads of one process (comm/local.h and
// comm/local_gpu.h): one shared State per group (State(n): a group of n members) and one CommT per
// (rank, group), CommT(state, rank in group, name). Group membership as in comm.h's Layout.
#pragma once

#include <memory>
#include <vector>

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

}  // namespace k3
