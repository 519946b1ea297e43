// The local backend: G x DP ranks as threads of one process. make_local_world
// builds every rank's groups; rank w's RankGroups are used by the thread that
// plays rank w. A collective publishes each member's pointers, waits at the
// group's barrier, copies / reduces from the peers, and waits again.
#pragma once

#include <vector>

#include "comm/comm.h"

namespace k3 {

std::vector<RankGroups> make_local_world(const Layout& layout);

}  // namespace k3
