// The nccl backend: one process per GPU (any number of hosts), NCCL
// communicators bootstrapped through MPI. Buffers are device pointers; every
// call is enqueued on the stream given by set_stream() (required) with no host
// synchronization, so a step's collectives can be captured in a CUDA graph
// (capturable() is true).
//
//   k3::MpiRuntime mpi(&argc, &argv);
//   k3::RankGroups g = k3::make_nccl_groups(layout);  // picks this process's GPU first
//   g.tp->set_stream(stream); ...
//   // g is destroyed before mpi
//
// Sums keep the semantics of every other backend (FP32 accumulation in rank
// order, BF16 rounded once: k3::reduce_sum's bits on every rank); no NCCL
// reduction is used (NCCL does not fix its summation order):
//   all_reduce     grouped ncclSend / ncclRecv of slices (rank r receives slice
//                  r of every rank's buffer), ops::cuda::reduce_sum_* in rank
//                  order into slice r, then the slices exchanged back (the
//                  bytes of a ring reduce-scatter + all-gather);
//   reduce_scatter grouped send / recv of the pieces, then the rank-order sum;
//   all_gather     ncclAllGather (in place when send = recv + rank * count);
//   all_to_all_v   grouped ncclSend / ncclRecv (the own piece by a device copy);
//                  counts are NOT checked across ranks (that needs a host round
//                  trip): a mismatch is undefined (typically a hang), only the
//                  own piece's counts are checked;
//   broadcast      ncclBroadcast;
//   barrier        a 4-byte ncclAllReduce: stream-ordered, not a host barrier.
// All data moves as bytes (ncclInt8). The sums use a device scratch of
// `scratch_bytes` per group, allocated once: a call that needs more is a
// k3::Error naming both sizes (all_reduce needs about count x dtype bytes,
// reduce_scatter size x count x dtype bytes).
//
// Devices: make_nccl_groups sets this process's device to its rank on the host
// (MPI_COMM_TYPE_SHARED) and raises a k3::Error when a host runs more ranks
// than it has GPUs: NCCL refuses two ranks on one device, so a multi-process
// run needs >= 2 GPUs (issue 6); on one GPU, use the local GPU backend
// (comm/local_gpu.h). This header exists only when K3_NCCL is on.
#pragma once

#include <cstddef>

#include "comm/comm.h"

namespace k3 {

// This process's tp / dcp / world groups: world from an ncclUniqueId broadcast
// over MPI_COMM_WORLD, tp and dcp by ncclCommSplit (keyed by the rank in the
// group). Validates the layout and the MPI world size first (needs a running
// k3::MpiRuntime; call from its thread).
RankGroups make_nccl_groups(const Layout& layout, size_t scratch_bytes = size_t{16} << 20);

}  // namespace k3
