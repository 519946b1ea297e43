// k3_comm_nccl_test: the nccl backend, one process per GPU:
//
//   mpirun -np 1 k3_comm_nccl_test --tp 1 --dp 1 --dcp 1      (one GPU)
//   mpirun -np 4 k3_comm_nccl_test --tp 2 --dp 2 --dcp 2      (four GPUs)
//
// (as root: --allow-run-as-root, or OMPI_ALLOW_RUN_AS_ROOT=1 and
// OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1). What it checks:
//   1. graph: the world group's all_reduce (BF16), all_gather, reduce_scatter,
//      all_to_all_v and a barrier captured once in a CUDA graph and replayed for
//      3 rounds of new inputs (exact small-integer data, expected values
//      computed here);
//   2. the collective checks of tests/comm_checks.h (the local and mpi backends'
//      suite) on every group, through device staging (tests/gpu/host_staged.h);
//      the all_to_all_v count-mismatch check is skipped (nccl cannot see it).
// Rank 0 prints one summary line. Exit status: 0 when every check on every rank
// passed, 1 on a failure or error (e.g. a host with fewer GPUs than ranks), 2 on
// bad arguments. Without a CUDA device it prints "[  SKIPPED ]" and exits 0.
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "../comm_checks.h"
#include "comm/mpi.h"
#include "comm/nccl.h"
#include "host_staged.h"

namespace {

float value(int round, int w, int64_t i) { return static_cast<float>((round * 5 + w * 3 + i) % 11 - 5); }

// Check 1: the world group's collectives in a CUDA graph, replayed.
void check_graph(k3test::Checker& ck, k3::RankGroups& g, cudaStream_t s) {
  using k3::bf16;
  k3::Comm& world = *g.world;
  const int n = world.size(), w = world.rank();
  const int64_t count = 1000;
  for (k3::Comm* c : {g.world.get(), g.tp.get(), g.dcp.get()}) c->set_stream(s);
  k3::DeviceBuffer in(count * 2), ar(count * 2), ag(n * count * 2), rs(count * 2), a2a_send(n * 4), a2a_recv(n * 4);
  std::vector<int64_t> ones(n, 1);
  cudaGraph_t graph;
  CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  CUDA_CHECK(cudaMemcpyAsync(ar.get(), in.get(), count * 2, cudaMemcpyDeviceToDevice, s));
  world.all_reduce(ar.get(), count, k3::DType::BF16);
  world.all_gather(in.get(), ag.get(), count, k3::DType::BF16);
  world.reduce_scatter(ag.get(), rs.get(), count, k3::DType::BF16);
  world.all_to_all_v(a2a_send.get(), ones.data(), a2a_recv.get(), ones.data(), k3::DType::I32);
  g.tp->barrier();
  CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_CHECK(cudaGraphDestroy(graph));
  for (int round = 0; round < 3; ++round) {
    std::vector<bf16> h(count);
    for (int64_t i = 0; i < count; ++i) h[i] = k3::to_bf16(value(round, w, i));
    std::vector<int32_t> a(n);
    for (int p = 0; p < n; ++p) a[p] = 1000 * round + 100 * w + p;
    CUDA_CHECK(cudaMemcpy(in.get(), h.data(), count * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(a2a_send.get(), a.data(), n * 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaDeviceSynchronize());  // landed before the non-blocking stream s reads them
    CUDA_CHECK(cudaGraphLaunch(exec, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
    std::vector<bf16> got_ar(count), got_ag(n * count), got_rs(count);
    std::vector<int32_t> got_a(n);
    CUDA_CHECK(cudaMemcpy(got_ar.data(), ar.get(), count * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(got_ag.data(), ag.get(), n * count * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(got_rs.data(), rs.get(), count * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(got_a.data(), a2a_recv.get(), n * 4, cudaMemcpyDeviceToHost));
    int bad = 0;
    for (int64_t i = 0; i < count; ++i) {
      float sum = 0;
      for (int p = 0; p < n; ++p) sum += value(round, p, i);
      bad += k3::to_float(got_ar[i]) != sum;
      for (int p = 0; p < n; ++p) bad += k3::to_float(got_ag[p * count + i]) != value(round, p, i);
      bad += k3::to_float(got_rs[i]) != static_cast<float>(n) * value(round, w, i);  // every rank's ag piece w
    }
    for (int p = 0; p < n; ++p) bad += got_a[p] != 1000 * round + 100 * p + w;
    ck.expect(bad == 0, "graph replay round {}: {} wrong elements", round, bad);
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
}

}  // namespace

int main(int argc, char** argv) {
  k3::Layout L;
  if (!k3test::parse_layout_args(argc, argv, &L)) return 2;
  std::unique_ptr<k3::MpiRuntime> mpi;
  try {
    mpi = std::make_unique<k3::MpiRuntime>(&argc, &argv);
  } catch (const k3::Error& e) {
    std::fprintf(stderr, "k3_comm_nccl_test: error: %s\n", e.what());
    return 1;
  }
  const int w = mpi->world_rank();
  int have = k3::cuda_device_available() ? 1 : 0, all_have = 0;
  MPI_Allreduce(&have, &all_have, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!all_have) {
    if (w == 0) std::printf("[  SKIPPED ] k3_comm_nccl_test: no CUDA device\n");
    return 0;
  }
  int64_t mine[2] = {0, 0}, all[2] = {0, 0};
  cudaStream_t s = nullptr;
  {
    k3::RankGroups dev;
    try {
      dev = k3::make_nccl_groups(L);  // every rank raises the same layout / device error, if any
    } catch (const k3::Error& e) {
      std::fprintf(stderr, "k3_comm_nccl_test: world rank %d: error: %s\n", w, e.what());
      return 1;
    }
    k3test::Checker ck;
    ck.where = fmt::format("world rank {}", w);
    try {
      CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      ck.expect(dev.tp->name() == "tp/nccl" && dev.dcp->name() == "dcp/nccl" && dev.world->name() == "world/nccl" &&
                    dev.world->capturable(),
                "group names {} {} {} (capturable: {})", dev.tp->name(), dev.dcp->name(), dev.world->name(),
                dev.world->capturable());
      check_graph(ck, dev, s);
      k3::RankGroups groups;
      groups.tp = std::make_unique<k3::HostStaged>(std::move(dev.tp), s);
      groups.dcp = std::make_unique<k3::HostStaged>(std::move(dev.dcp), s);
      groups.world = std::make_unique<k3::HostStaged>(std::move(dev.world), s);
      k3test::SuiteOptions o;
      o.a2a_mismatch_detected = false;
      k3test::run_rank_suite(ck, L, w, groups, o);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "k3_comm_nccl_test: world rank %d: unexpected exception, aborting the job: %s\n", w,
                   e.what());
      std::fflush(stderr);
      k3::MpiRuntime::abort(1);
    }
    int shown = 0;
    for (const auto& f : ck.failures)
      if (shown++ < 20) std::fprintf(stderr, "FAIL %s\n", f.c_str());
    std::fflush(stderr);
    mine[0] = ck.checks;
    mine[1] = static_cast<int64_t>(ck.failures.size());
  }  // communicators freed before the stream and MPI_Finalize
  if (s) cudaStreamDestroy(s);
  MPI_Allreduce(mine, all, 2, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  if (w == 0)
    std::printf("k3_comm_nccl_test: nccl tp=%d dp=%d dcp=%d: %lld checks on %d ranks, %lld failures: %s\n", L.tp, L.dp,
                L.dcp, static_cast<long long>(all[0]), mpi->world_size(), static_cast<long long>(all[1]),
                all[1] == 0 ? "PASS" : "FAIL");
  std::fflush(stdout);
  return all[1] == 0 ? 0 : 1;
}
