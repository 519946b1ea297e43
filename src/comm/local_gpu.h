// The local backend on one GPU: the G x DP ranks are threads of one process
// that share one device; each rank has its own stream (set_stream, required
// before the first collective) and its buffers are device pointers.
//
// A collective: every member records a `ready` event on its stream and
// publishes its pointers; the host threads meet at the group's barrier; each
// member makes its stream wait for its peers' `ready` events and then reads
// the peers' buffers directly (device copies, ops/reduce.h's rank-order sum
// kernel); a `done` event and a second barrier keep every buffer from being
// reused before all peers have read it. Nothing is synchronized on the host
// (no cudaStreamSynchronize): the host threads only rendezvous, the streams
// wait on each other's events.
//
//   all_reduce     reduce-scatter of slices in place (member r sums slice r of
//                  every member's buffer into its own), then each member copies
//                  the other slices from their owners: no scratch, and each
//                  element is the FP32 rank-order sum (k3::reduce_sum's bits)
//   all_gather     copies from every member's send buffer
//   reduce_scatter member r sums piece r of every member's send buffer
//   all_to_all_v   copies piece r of every member's send buffer (counts on the host)
//   broadcast      copies from the root's buffer
//
// Not capturable in a CUDA graph (capturable() is false): the streams wait on
// events recorded by other threads' streams outside the capture, and the host
// barriers are part of every call. Multi-GPU and graph-captured steps take the
// nccl backend.
#pragma once

#include <vector>

#include "comm/comm.h"

namespace k3 {

// Every world rank's groups (element w for the thread that plays rank w), on the current device.
std::vector<RankGroups> make_local_gpu_world(const Layout& layout);

}  // namespace k3
