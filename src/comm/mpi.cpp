// The mpi comm backend (comm/mpi.h): one process per rank, collectives through Open MPI.
#include "comm/mpi.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <fmt/format.h>
#include <vector>

namespace k3 {

namespace {

bool mpi_initialized() {
  int f = 0;
  MPI_Initialized(&f);
  return f != 0;
}

bool mpi_finalized() {
  int f = 0;
  MPI_Finalized(&f);
  return f != 0;
}

std::string mpi_error_string(int rc) {
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) return fmt::format("MPI error {}", rc);
  return std::string(msg, static_cast<size_t>(len));
}

class MpiComm : public Comm {
 public:
  // Takes ownership of comm (freed in the destructor).
  MpiComm(MPI_Comm comm, std::string name) : comm_(comm), name_(std::move(name)) {
    check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
    const size_t n = static_cast<size_t>(size_);
    parts_.resize(n);
    meta_.resize(2 * n * n);
    send_bytes_.resize(n);
    send_displs_.resize(n);
    recv_bytes_.resize(n);
    recv_displs_.resize(n);
  }
  ~MpiComm() override {
    if (comm_ != MPI_COMM_NULL && !mpi_finalized()) MPI_Comm_free(&comm_);
  }
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return name_ + "/mpi"; }
  MPI_Comm handle() const { return comm_; }

  // Allgather of every rank's buffer, then the rank-order FP32 sum here.
  void all_reduce(void* data, int64_t count, DType dt) override {
    require_sum("all_reduce", dt);
    const int b = message_bytes("all_reduce", count, dt);
    grow_scratch(static_cast<size_t>(b) * static_cast<size_t>(size_));
    check(MPI_Allgather(data, b, MPI_BYTE, scratch_.data(), b, MPI_BYTE, comm_), "MPI_Allgather");
    for (int p = 0; p < size_; ++p) parts_[p] = scratch_.data() + static_cast<size_t>(p) * b;
    reduce_sum(parts_.data(), size_, data, count, dt);
  }

  void all_gather(const void* send, void* recv, int64_t count, DType dt) override {
    const int b = message_bytes("all_gather", count, dt);
    const char* mine = static_cast<const char*>(recv) + static_cast<size_t>(rank_) * b;
    if (send == mine)
      check(MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv, b, MPI_BYTE, comm_), "MPI_Allgather");
    else
      check(MPI_Allgather(send, b, MPI_BYTE, recv, b, MPI_BYTE, comm_), "MPI_Allgather");
  }

  // Each rank receives its piece of every rank's send (MPI_Alltoall), then sums
  // them here in rank order (FP32 accumulation).
  void reduce_scatter(const void* send, void* recv, int64_t count, DType dt) override {
    require_sum("reduce_scatter", dt);
    const int b = message_bytes("reduce_scatter", count, dt);
    grow_scratch(static_cast<size_t>(b) * static_cast<size_t>(size_));
    check(MPI_Alltoall(send, b, MPI_BYTE, scratch_.data(), b, MPI_BYTE, comm_), "MPI_Alltoall");
    for (int p = 0; p < size_; ++p) parts_[p] = scratch_.data() + static_cast<size_t>(p) * b;
    reduce_sum(parts_.data(), size_, recv, count, dt);
  }

  // One small MPI_Allgather of every rank's send and recv counts first: every
  // rank checks the whole count matrix (agreement, sign, INT_MAX bytes), so a
  // bad call is the same k3::Error on every rank instead of a hang or a
  // truncated message; then MPI_Alltoallv moves the bytes.
  void all_to_all_v(const void* send, const int64_t* send_counts, void* recv, const int64_t* recv_counts,
                    DType dt) override {
    const int n = size_;
    const int64_t es = static_cast<int64_t>(dtype_size(dt));
    int64_t* mine = meta_.data() + static_cast<size_t>(rank_) * 2 * n;
    for (int p = 0; p < n; ++p) {
      mine[p] = send_counts[p];
      mine[n + p] = recv_counts[p];
    }
    check(MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, meta_.data(), 2 * n, MPI_INT64_T, comm_),
          "MPI_Allgather");
    auto sent = [&](int p, int q) { return meta_[static_cast<size_t>(p) * 2 * n + q]; };          // p -> q
    auto expected = [&](int p, int q) { return meta_[static_cast<size_t>(q) * 2 * n + n + p]; };  // q expects from p
    for (int p = 0; p < n; ++p)
      for (int q = 0; q < n; ++q) {
        const int64_t c = sent(p, q), e = expected(p, q);
        K3_CHECK(c == e, "comm {}: all_to_all_v rank {} sends {} elements to rank {}, which expects {}", name(), p, c, q,
                 e);
        K3_CHECK(c >= 0, "comm {}: all_to_all_v rank {} sends {} elements to rank {}", name(), p, c, q);
      }
    const int64_t max_elems = INT_MAX / es;  // displacements are int bytes too: a rank's total must fit
    for (int p = 0; p < n; ++p) {
      int64_t out = 0, in = 0;
      for (int q = 0; q < n; ++q) {
        out += std::min(sent(p, q), max_elems + 1);  // clamped: no int64 overflow
        in += std::min(sent(q, p), max_elems + 1);
      }
      K3_CHECK(out <= max_elems && in <= max_elems,
               "comm {}: all_to_all_v rank {} sends {} and receives {} bytes in all; the mpi limit is INT_MAX = {} bytes",
               name(), p, out > max_elems ? fmt::format("more than {}", INT_MAX) : fmt::format("{}", out * es),
               in > max_elems ? fmt::format("more than {}", INT_MAX) : fmt::format("{}", in * es), INT_MAX);
    }
    int sd = 0, rd = 0;
    for (int p = 0; p < n; ++p) {
      send_bytes_[p] = static_cast<int>(sent(rank_, p) * es);
      send_displs_[p] = sd;
      sd += send_bytes_[p];
      recv_bytes_[p] = static_cast<int>(sent(p, rank_) * es);
      recv_displs_[p] = rd;
      rd += recv_bytes_[p];
    }
    check(MPI_Alltoallv(send, send_bytes_.data(), send_displs_.data(), MPI_BYTE, recv, recv_bytes_.data(),
                        recv_displs_.data(), MPI_BYTE, comm_),
          "MPI_Alltoallv");
  }

  void broadcast(void* data, int64_t count, DType dt, int root) override {
    K3_CHECK(root >= 0 && root < size_, "comm {}: broadcast root {} outside 0..{}", name(), root, size_ - 1);
    const int b = message_bytes("broadcast", count, dt);
    check(MPI_Bcast(data, b, MPI_BYTE, root, comm_), "MPI_Bcast");
  }

  // MPI_Ibcast polled by MPI_Test: spinning for the first 2 ms (a busy server's next command comes sooner),
  // then sleeping 50 us between polls, 1 ms once the wait passes 100 ms (a blocking MPI call spins a core).
  void broadcast_idle(void* data, int64_t count, DType dt, int root) override {
    K3_CHECK(root >= 0 && root < size_, "comm {}: broadcast root {} outside 0..{}", name(), root, size_ - 1);
    const int b = message_bytes("broadcast", count, dt);
    MPI_Request req = MPI_REQUEST_NULL;
    check(MPI_Ibcast(data, b, MPI_BYTE, root, comm_, &req), "MPI_Ibcast");
    const auto t0 = std::chrono::steady_clock::now();
    for (;;) {
      int done = 0;
      check(MPI_Test(&req, &done, MPI_STATUS_IGNORE), "MPI_Test");
      if (done) return;
      const auto waited = std::chrono::steady_clock::now() - t0;
      if (waited < std::chrono::milliseconds(2)) continue;
      std::this_thread::sleep_for(waited < std::chrono::milliseconds(100) ? std::chrono::microseconds(50)
                                                                         : std::chrono::microseconds(1000));
    }
  }

  void barrier() override { check(MPI_Barrier(comm_), "MPI_Barrier"); }

 private:
  void check(int rc, const char* what) const {
    if (rc != MPI_SUCCESS) fail("comm {}: {} failed: {}", name(), what, mpi_error_string(rc));
  }
  void require_sum(const char* what, DType dt) const {
    K3_CHECK(dt == DType::F32 || dt == DType::BF16, "comm {}: {} of {} is not supported (F32, BF16)", name(), what,
             dtype_name(dt));
  }
  // count elements of dt as one MPI message of MPI_BYTE.
  int message_bytes(const char* what, int64_t count, DType dt) const {
    const int64_t es = static_cast<int64_t>(dtype_size(dt));
    K3_CHECK(count >= 0, "comm {}: {} count {} is negative", name(), what, count);
    K3_CHECK(count <= INT_MAX / es, "comm {}: {} of {} elements of {} = {} bytes is beyond the mpi limit of INT_MAX = {} bytes",
             name(), what, count, dtype_name(dt), count * es, INT_MAX);
    return static_cast<int>(count * es);
  }
  void grow_scratch(size_t bytes) {
    if (scratch_.size() < bytes) scratch_.resize(bytes);
  }

  MPI_Comm comm_;
  std::string name_;
  int rank_ = 0, size_ = 0;
  std::vector<char> scratch_;
  std::vector<const void*> parts_;
  std::vector<int64_t> meta_;  // [rank][send_counts(size), recv_counts(size)]
  std::vector<int> send_bytes_, send_displs_, recv_bytes_, recv_displs_;
};

}  // namespace

MpiRuntime::MpiRuntime(int* argc, char*** argv) {
  if (!mpi_initialized()) {
    K3_CHECK(!mpi_finalized(), "mpi: MPI was already finalized; it cannot be initialized again");
    const int rc = MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided_);
    K3_CHECK(rc == MPI_SUCCESS, "mpi: MPI_Init_thread failed: {}", mpi_error_string(rc));
    owns_ = true;
  } else {
    MPI_Query_thread(&provided_);
  }
  if (provided_ < MPI_THREAD_FUNNELED) {
    if (owns_) MPI_Finalize();
    fail("mpi: MPI provides thread level {}, k3 needs MPI_THREAD_FUNNELED ({})", provided_, MPI_THREAD_FUNNELED);
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
}

MpiRuntime::~MpiRuntime() {
  if (owns_ && !mpi_finalized()) MPI_Finalize();
}

void MpiRuntime::abort(int code) noexcept {
  MPI_Abort(MPI_COMM_WORLD, code);
  std::abort();
}

RankGroups make_mpi_groups(const Layout& L) {
  L.validate();
  K3_CHECK(mpi_initialized() && !mpi_finalized(), "mpi: make_mpi_groups needs MPI running (construct a k3::MpiRuntime)");
  int world_size = 0, w = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  MPI_Comm_rank(MPI_COMM_WORLD, &w);
  K3_CHECK(world_size == L.world(), "mpi: world size {} does not equal --tp {} x --dp {} = {} (run mpirun -np {})",
           world_size, L.tp, L.dp, L.world(), L.world());

  // world: a dup of MPI_COMM_WORLD (its own context, errors return); tp and
  // dcp: splits of it, keyed by the rank inside the group.
  auto wrap = [](int rc, MPI_Comm c, const char* name) {
    K3_CHECK(rc == MPI_SUCCESS, "mpi: creating the {} communicator failed: {}", name, mpi_error_string(rc));
    return std::make_unique<MpiComm>(c, name);
  };
  const int rep = L.replica(w), t = L.tp_rank(w), dcp_groups_per_replica = L.tp / L.dcp;
  RankGroups g;
  MPI_Comm c = MPI_COMM_NULL;
  int rc = MPI_Comm_dup(MPI_COMM_WORLD, &c);
  g.world = wrap(rc, c, "world");
  const MPI_Comm world = static_cast<MpiComm*>(g.world.get())->handle();
  rc = MPI_Comm_split(world, rep, t, &c);
  g.tp = wrap(rc, c, "tp");
  rc = MPI_Comm_split(world, rep * dcp_groups_per_replica + t / L.dcp, t % L.dcp, &c);
  g.dcp = wrap(rc, c, "dcp");
  K3_CHECK(g.world->rank() == w && g.world->size() == L.world() && g.tp->rank() == t && g.tp->size() == L.tp &&
               g.dcp->rank() == L.dcp_rank(w) && g.dcp->size() == L.dcp,
           "mpi: world rank {}: groups came out as world {}/{}, tp {}/{}, dcp {}/{} (expected {}/{}, {}/{}, {}/{})", w,
           g.world->rank(), g.world->size(), g.tp->rank(), g.tp->size(), g.dcp->rank(), g.dcp->size(), w, L.world(), t,
           L.tp, L.dcp_rank(w), L.dcp);
  return g;
}

}  // namespace k3
