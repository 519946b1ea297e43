// The mpi backend: one process per world rank (Open MPI), any number of hosts.
//
//   k3::MpiRuntime mpi(&argc, &argv);           // MPI_Init_thread / MPI_Finalize
//   k3::RankGroups g = k3::make_mpi_groups(layout);
//   ... g.tp->all_reduce(...) ...
//   // g is destroyed before mpi (its communicators are freed before MPI_Finalize)
//
// Threading: MpiRuntime asks for MPI_THREAD_FUNNELED. The process may have many
// threads, but every MPI call (every Comm method of an mpi group) must come
// from the thread that constructed the MpiRuntime.
//
// Reductions: MPI has no bf16 and does not promise an order of summation, so
// no MPI reduction is used. all_reduce all-gathers the ranks' buffers and
// reduce_scatter exchanges the pieces each rank needs (MPI_Alltoall); the rank
// then sums them with k3::reduce_sum in rank order with FP32 accumulation:
// bitwise the results of the local backend. It moves (ranks - 1) x the bytes
// of a ring all-reduce, which is fine at decode sizes (KB to a few MB).
// All data moves as MPI_BYTE; one message (per peer, and a rank's total in
// all_to_all_v) is limited to INT_MAX bytes, beyond which a call is a
// k3::Error raised on every rank of the group before anything moves.
//
// This header does not include <mpi.h>; it exists only when K3_MPI is on.
#pragma once

#include "comm/comm.h"

namespace k3 {

class MpiRuntime {
 public:
  // Initializes MPI (MPI_THREAD_FUNNELED) unless it already is; then it only
  // checks the thread level and does not finalize.
  MpiRuntime(int* argc, char*** argv);
  MpiRuntime() : MpiRuntime(nullptr, nullptr) {}
  ~MpiRuntime();  // MPI_Finalize when this object initialized MPI
  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;

  int world_rank() const { return rank_; }
  int world_size() const { return size_; }
  int thread_level() const { return provided_; }  // MPI_THREAD_* provided
  // MPI_Abort on MPI_COMM_WORLD: ends every rank (a rank that cannot go on
  // alone must not leave the others waiting in a collective).
  [[noreturn]] static void abort(int code) noexcept;

 private:
  bool owns_ = false;
  int rank_ = 0, size_ = 1, provided_ = 0;
};

// This process's tp / dcp / world groups (layout in comm.h), each on its own
// communicator (MPI_Comm_dup of MPI_COMM_WORLD, then MPI_Comm_split), with
// MPI_ERRORS_RETURN: a failed MPI call is a k3::Error. Validates the layout
// and that the MPI world size is tp x dp before creating anything.
RankGroups make_mpi_groups(const Layout& layout);

}  // namespace k3
