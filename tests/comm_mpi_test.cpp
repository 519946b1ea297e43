// k3_comm_mpi_test: the collective checks of tests/comm_checks.h (the same the
// local backend runs in test_comm.cpp) through the mpi backend, one process
// per world rank:
//
//   mpirun -np 4 k3_comm_mpi_test --tp 4 --dp 1 --dcp 2
//
// (as root: --allow-run-as-root and OMPI_ALLOW_RUN_AS_ROOT=1,
// OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; on fewer cores than ranks: --oversubscribe).
// Every rank prints its failures (at most 20) to stderr; rank 0 prints one
// summary line. Exit status: 0 when every check on every rank passed, 1 on
// any failure or error (e.g. a world size other than tp x dp), 2 on bad
// arguments. A rank that cannot go on (an unexpected exception) aborts the
// whole job instead of leaving its peers in a collective.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "comm/mpi.h"
#include "comm_checks.h"

int main(int argc, char** argv) {
  k3::Layout L;
  if (!k3test::parse_layout_args(argc, argv, &L)) return 2;

  std::unique_ptr<k3::MpiRuntime> mpi;
  try {
    mpi = std::make_unique<k3::MpiRuntime>(&argc, &argv);
  } catch (const k3::Error& e) {
    std::fprintf(stderr, "k3_comm_mpi_test: error: %s\n", e.what());
    return 1;
  }
  const int w = mpi->world_rank();
  int64_t checks = 0, failures = 0, all_checks = 0, all_failures = 0, ranks = 0;
  {
    k3::RankGroups groups;
    try {
      groups = k3::make_mpi_groups(L);  // every rank raises the same error, if any
    } catch (const k3::Error& e) {
      std::fprintf(stderr, "k3_comm_mpi_test: world rank %d: error: %s\n", w, e.what());
      return 1;  // ~MpiRuntime finalizes (every rank got here)
    }
    k3test::Checker ck;
    ck.where = fmt::format("world rank {}", w);
    k3test::SuiteOptions o;
    o.a2a_mismatch_throws_everywhere = true;
    o.int_max_guards = true;
    // The exact names of the groups, then everything run_rank_suite checks.
    ck.expect(groups.tp->name() == "tp/mpi" && groups.dcp->name() == "dcp/mpi" && groups.world->name() == "world/mpi",
              "group names {} {} {}", groups.tp->name(), groups.dcp->name(), groups.world->name());
    try {
      k3test::run_rank_suite(ck, L, w, groups, o);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "k3_comm_mpi_test: world rank %d: unexpected exception, aborting the job: %s\n", w,
                   e.what());
      std::fflush(stderr);
      k3::MpiRuntime::abort(1);
    }
    int shown = 0;
    for (const auto& f : ck.failures)
      if (shown++ < 20) std::fprintf(stderr, "FAIL %s\n", f.c_str());
    if (ck.failures.size() > 20) std::fprintf(stderr, "world rank %d: %zu more failures\n", w, ck.failures.size() - 20);
    std::fflush(stderr);
    checks = ck.checks;
    failures = static_cast<int64_t>(ck.failures.size());

    // Totals over the world (gathered, summed here: the check counts are I64).
    std::vector<int64_t> all(3 * static_cast<size_t>(mpi->world_size()));
    const int64_t mine[3] = {checks, failures, 1};
    groups.world->all_gather(mine, all.data(), 3, k3::DType::I64);
    for (int p = 0; p < mpi->world_size(); ++p) {
      all_checks += all[3 * p];
      all_failures += all[3 * p + 1];
      ranks += all[3 * p + 2];
    }
    if (w == 0)
      std::printf("k3_comm_mpi_test: mpi tp=%d dp=%d dcp=%d: %lld checks on %lld ranks, %lld failures: %s\n", L.tp,
                  L.dp, L.dcp, static_cast<long long>(all_checks), static_cast<long long>(ranks),
                  static_cast<long long>(all_failures), all_failures == 0 && ranks == L.tp * L.dp ? "PASS" : "FAIL");
    std::fflush(stdout);
  }  // groups freed before MPI_Finalize
  return all_failures == 0 && ranks == L.tp * L.dp ? 0 : 1;
}
