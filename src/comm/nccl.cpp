// The nccl backend (comm/nccl.h): NCCL communicators from MPI, rank-order sums
// by grouped send / recv + ops::cuda::reduce_sum_*.
#include "comm/nccl.h"

#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <fmt/format.h>
#include <vector>

#include "core/cuda.h"
#include "ops/reduce.h"

namespace k3 {

namespace {

#define NCCL_CHECK(expr)                                                                                      \
  do {                                                                                                        \
    ncclResult_t k3_rc_ = (expr);                                                                             \
    if (k3_rc_ != ncclSuccess)                                                                                \
      ::k3::fail("nccl: {} failed: {} ({}) at {}:{}", #expr, ncclGetErrorString(k3_rc_), ncclGetLastError(nullptr), \
                 __FILE__, __LINE__);                                                                         \
  } while (0)

class NcclComm : public Comm {
 public:
  NcclComm(ncclComm_t comm, std::string name, size_t scratch_bytes)
      : comm_(comm), name_(std::move(name)), scratch_(scratch_bytes), one_(4) {
    NCCL_CHECK(ncclCommUserRank(comm_, &rank_));
    NCCL_CHECK(ncclCommCount(comm_, &size_));
    const int32_t one = 1;
    CUDA_CHECK(cudaMemcpy(one_.get(), &one, 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaDeviceSynchronize());  // landed before a non-blocking stream reads it
  }
  ~NcclComm() override {
    if (stream_) cudaStreamSynchronize(stream_);
    ncclCommDestroy(comm_);
  }
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return name_ + "/nccl"; }
  void set_stream(void* s) override { stream_ = static_cast<cudaStream_t>(s); }
  bool capturable() const override { return true; }

  void all_reduce(void* data, int64_t count, DType dt) override {
    const size_t es = summable("all_reduce", dt);
    ready();
    if (count <= 0) return;
    const int n = size_;
    const int64_t chunk = (count + n - 1) / n;
    scratch("all_reduce", static_cast<size_t>(n * chunk) * es);
    auto off = [&](int p) { return std::min<int64_t>(count, p * chunk); };
    auto len = [&](int p) { return std::min<int64_t>(count, off(p) + chunk) - off(p); };
    char* d = static_cast<char*>(data);
    char* s = scratch_.get<char>();
    // Slice r of every rank's buffer to rank r.
    NCCL_CHECK(ncclGroupStart());
    for (int p = 0; p < n; ++p) {
      if (p == rank_) continue;
      if (len(p) > 0) NCCL_CHECK(ncclSend(d + off(p) * es, len(p) * es, ncclInt8, p, comm_, stream_));
      if (len(rank_) > 0) NCCL_CHECK(ncclRecv(s + p * chunk * es, len(rank_) * es, ncclInt8, p, comm_, stream_));
    }
    NCCL_CHECK(ncclGroupEnd());
    const void* parts[ops::cuda::kReduceMaxParts];
    for (int p = 0; p < n; ++p) parts[p] = p == rank_ ? d + off(rank_) * es : s + p * chunk * es;
    sum(parts, d + off(rank_) * es, len(rank_), dt);
    // Every rank's summed slice to every rank.
    NCCL_CHECK(ncclGroupStart());
    for (int p = 0; p < n; ++p) {
      if (p == rank_) continue;
      if (len(rank_) > 0) NCCL_CHECK(ncclSend(d + off(rank_) * es, len(rank_) * es, ncclInt8, p, comm_, stream_));
      if (len(p) > 0) NCCL_CHECK(ncclRecv(d + off(p) * es, len(p) * es, ncclInt8, p, comm_, stream_));
    }
    NCCL_CHECK(ncclGroupEnd());
  }

  void all_gather(const void* send, void* recv, int64_t count, DType dt) override {
    ready();
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(count, 0)) * dtype_size(dt);
    if (bytes == 0) return;
    NCCL_CHECK(ncclAllGather(send, recv, bytes, ncclInt8, comm_, stream_));
  }

  void reduce_scatter(const void* send, void* recv, int64_t count, DType dt) override {
    const size_t es = summable("reduce_scatter", dt);
    ready();
    if (count <= 0) return;
    const int n = size_;
    const size_t piece = static_cast<size_t>(count) * es;
    scratch("reduce_scatter", n * piece);
    const char* sd = static_cast<const char*>(send);
    char* s = scratch_.get<char>();
    NCCL_CHECK(ncclGroupStart());
    for (int p = 0; p < n; ++p) {
      if (p == rank_) continue;
      NCCL_CHECK(ncclSend(sd + p * piece, piece, ncclInt8, p, comm_, stream_));
      NCCL_CHECK(ncclRecv(s + p * piece, piece, ncclInt8, p, comm_, stream_));
    }
    NCCL_CHECK(ncclGroupEnd());
    const void* parts[ops::cuda::kReduceMaxParts];
    for (int p = 0; p < n; ++p) parts[p] = p == rank_ ? sd + rank_ * piece : s + p * piece;
    sum(parts, recv, count, dt);
  }

  void all_to_all_v(const void* send, const int64_t* send_counts, void* recv, const int64_t* recv_counts,
                    DType dt) override {
    ready();
    const size_t es = dtype_size(dt);
    K3_CHECK(send_counts[rank_] == recv_counts[rank_],
             "comm {}: all_to_all_v rank {} sends {} elements to rank {}, which expects {}", name(), rank_,
             send_counts[rank_], rank_, recv_counts[rank_]);
    const char* sd = static_cast<const char*>(send);
    char* rv = static_cast<char*>(recv);
    int64_t so = 0, ro = 0, self_so = 0, self_ro = 0;
    NCCL_CHECK(ncclGroupStart());
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) {
        self_so = so;
        self_ro = ro;
      } else {
        if (send_counts[p] > 0) NCCL_CHECK(ncclSend(sd + so * es, send_counts[p] * es, ncclInt8, p, comm_, stream_));
        if (recv_counts[p] > 0) NCCL_CHECK(ncclRecv(rv + ro * es, recv_counts[p] * es, ncclInt8, p, comm_, stream_));
      }
      so += send_counts[p];
      ro += recv_counts[p];
    }
    NCCL_CHECK(ncclGroupEnd());
    if (send_counts[rank_] > 0)
      CUDA_CHECK(cudaMemcpyAsync(rv + self_ro * es, sd + self_so * es, send_counts[rank_] * es,
                                 cudaMemcpyDeviceToDevice, stream_));
  }

  void broadcast(void* data, int64_t count, DType dt, int root) override {
    K3_CHECK(root >= 0 && root < size_, "comm {}: broadcast root {} outside 0..{}", name(), root, size_ - 1);
    ready();
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(count, 0)) * dtype_size(dt);
    if (bytes == 0) return;
    NCCL_CHECK(ncclBroadcast(data, data, bytes, ncclInt8, root, comm_, stream_));
  }

  void barrier() override {
    ready();
    NCCL_CHECK(ncclAllReduce(one_.get(), one_.get(), 1, ncclInt32, ncclMax, comm_, stream_));
  }

 private:
  void ready() const { K3_CHECK(stream_ != nullptr, "comm {}: set_stream() before the first collective", name()); }
  size_t summable(const char* what, DType dt) const {
    K3_CHECK(dt == DType::F32 || dt == DType::BF16, "comm {}: {} of {} is not supported (F32, BF16)", name(), what,
             dtype_name(dt));
    K3_CHECK(size_ <= ops::cuda::kReduceMaxParts, "comm {}: {} over {} ranks (at most {})", name(), what, size_,
             ops::cuda::kReduceMaxParts);
    return dtype_size(dt);
  }
  void scratch(const char* what, size_t need) const {
    K3_CHECK(need <= scratch_.bytes(), "comm {}: {} needs {} bytes of scratch, the group has {} (make_nccl_groups)",
             name(), what, need, scratch_.bytes());
  }
  void sum(const void* const* parts, void* out, int64_t count, DType dt) {
    if (count <= 0) return;
    const int rc = dt == DType::F32
                       ? ops::cuda::reduce_sum_f32(reinterpret_cast<const float* const*>(parts), size_,
                                                   static_cast<float*>(out), count, stream_)
                       : ops::cuda::reduce_sum_bf16(reinterpret_cast<const bf16* const*>(parts), size_,
                                                    static_cast<bf16*>(out), count, stream_);
    CUDA_CHECK(static_cast<cudaError_t>(rc));
  }

  ncclComm_t comm_;
  std::string name_;
  DeviceBuffer scratch_, one_;
  int rank_ = 0, size_ = 1;
  cudaStream_t stream_ = nullptr;
};

}  // namespace

RankGroups make_nccl_groups(const Layout& L, size_t scratch_bytes) {
  L.validate();
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  K3_CHECK(init && !fin, "nccl: make_nccl_groups needs MPI running (construct a k3::MpiRuntime)");
  int world_size = 0, w = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  MPI_Comm_rank(MPI_COMM_WORLD, &w);
  K3_CHECK(world_size == L.world(), "nccl: world size {} does not equal --tp {} x --dp {} = {} (run mpirun -np {})",
           world_size, L.tp, L.dp, L.world(), L.world());
  // One GPU per process: the rank on this host picks the device. Every rank
  // learns whether any host is short of GPUs, so all raise the same error.
  MPI_Comm host = MPI_COMM_NULL;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, w, MPI_INFO_NULL, &host);
  int local = 0, local_size = 1, devices = 0;
  MPI_Comm_rank(host, &local);
  MPI_Comm_size(host, &local_size);
  MPI_Comm_free(&host);
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  int short_here = local_size > devices ? 1 : 0, short_any = 0;
  MPI_Allreduce(&short_here, &short_any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  K3_CHECK(!short_any,
           "nccl: a host runs more ranks than it has GPUs (this one: {} ranks, {} GPUs); NCCL needs one GPU per "
           "rank: a multi-process run needs as many GPUs (on one GPU use the local GPU backend)",
           local_size, devices);
  CUDA_CHECK(cudaSetDevice(local));
  ncclUniqueId id{};
  if (w == 0) NCCL_CHECK(ncclGetUniqueId(&id));
  MPI_Bcast(&id, static_cast<int>(sizeof id), MPI_BYTE, 0, MPI_COMM_WORLD);
  ncclComm_t world = nullptr, tp = nullptr, dcp = nullptr;
  NCCL_CHECK(ncclCommInitRank(&world, L.world(), id, w));
  const int rep = L.replica(w), t = L.tp_rank(w), dcp_groups_per_replica = L.tp / L.dcp;
  NCCL_CHECK(ncclCommSplit(world, rep, t, &tp, nullptr));
  NCCL_CHECK(ncclCommSplit(world, rep * dcp_groups_per_replica + t / L.dcp, t % L.dcp, &dcp, nullptr));
  RankGroups g;
  g.world = std::make_unique<NcclComm>(world, "world", scratch_bytes);
  g.tp = std::make_unique<NcclComm>(tp, "tp", scratch_bytes);
  g.dcp = std::make_unique<NcclComm>(dcp, "dcp", scratch_bytes);
  K3_CHECK(g.world->rank() == w && g.world->size() == L.world() && g.tp->rank() == t && g.tp->size() == L.tp &&
               g.dcp->rank() == L.dcp_rank(w) && g.dcp->size() == L.dcp,
           "nccl: world rank {}: groups came out as world {}/{}, tp {}/{}, dcp {}/{} (expected {}/{}, {}/{}, {}/{})", w,
           g.world->rank(), g.world->size(), g.tp->rank(), g.tp->size(), g.dcp->rank(), g.dcp->size(), w, L.world(), t,
           L.tp, L.dcp_rank(w), L.dcp);
  return g;
}

}  // namespace k3
