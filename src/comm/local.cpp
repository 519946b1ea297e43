// The local comm backend (comm/local.h): ranks as threads of one process, collectives through shared memory.
#include "comm/local.h"
#include "comm/thread_groups.h"

#include <barrier>
#include <cstring>
#include <fmt/format.h>

namespace k3 {

namespace {

struct GroupState {
  explicit GroupState(int n) : n(n), bar(n), send(n), recv(n), counts(n) {}
  int n;
  std::barrier<> bar;
  std::vector<const void*> send;
  std::vector<void*> recv;
  std::vector<const int64_t*> counts;
};

class LocalComm : public Comm {
 public:
  LocalComm(std::shared_ptr<GroupState> g, int rank, std::string name) : g_(std::move(g)), rank_(rank), name_(name) {}
  int rank() const override { return rank_; }
  int size() const override { return g_->n; }
  std::string name() const override { return name_ + "/local"; }

  void all_reduce(void* data, int64_t count, DType dt) override {
    const size_t bytes = static_cast<size_t>(count) * dtype_size(dt);
    if (scratch_.size() < bytes) scratch_.resize(bytes);
    publish(data, nullptr);
    reduce_sum(g_->send.data(), g_->n, scratch_.data(), count, dt);
    g_->bar.arrive_and_wait();  // every rank has read every buffer
    if (bytes) std::memcpy(data, scratch_.data(), bytes);
    g_->bar.arrive_and_wait();
  }

  void all_gather(const void* send, void* recv, int64_t count, DType dt) override {
    const size_t bytes = static_cast<size_t>(count) * dtype_size(dt);
    publish(send, nullptr);
    for (int p = 0; p < g_->n; ++p) {
      char* dst = static_cast<char*>(recv) + p * bytes;
      if (dst != g_->send[p] && bytes) std::memcpy(dst, g_->send[p], bytes);
    }
    g_->bar.arrive_and_wait();
  }

  void reduce_scatter(const void* send, void* recv, int64_t count, DType dt) override {
    const size_t bytes = static_cast<size_t>(count) * dtype_size(dt);
    publish(send, nullptr);
    if (parts_.size() < static_cast<size_t>(g_->n)) parts_.resize(g_->n);
    for (int p = 0; p < g_->n; ++p) parts_[p] = static_cast<const char*>(g_->send[p]) + rank_ * bytes;
    reduce_sum(parts_.data(), g_->n, recv, count, dt);
    g_->bar.arrive_and_wait();
  }

  void all_to_all_v(const void* send, const int64_t* send_counts, void* recv, const int64_t* recv_counts,
                    DType dt) override {
    const size_t es = dtype_size(dt);
    publish(send, send_counts);
    auto copy = [&](int p, int64_t off, int64_t at, int64_t n) {
      std::memcpy(static_cast<char*>(recv) + at * es, static_cast<const char*>(g_->send[p]) + off * es, n * es);
    };
    const std::string bad = receive_pieces(g_->counts, rank_, recv_counts, name(), copy);
    g_->bar.arrive_and_wait();
    K3_CHECK(bad.empty(), "{}", bad);
  }

  void broadcast(void* data, int64_t count, DType dt, int root) override {
    K3_CHECK(root >= 0 && root < g_->n, "comm {}: broadcast root {} outside 0..{}", name(), root, g_->n - 1);
    publish(data, nullptr);
    if (rank_ != root && count) std::memcpy(data, g_->send[root], static_cast<size_t>(count) * dtype_size(dt));
    g_->bar.arrive_and_wait();
  }

  void barrier() override { g_->bar.arrive_and_wait(); }

 private:
  void publish(const void* send, const int64_t* counts) {
    g_->send[rank_] = send;
    g_->counts[rank_] = counts;
    g_->bar.arrive_and_wait();
  }
  std::shared_ptr<GroupState> g_;
  int rank_;
  std::string name_;
  std::vector<char> scratch_;
  std::vector<const void*> parts_;
};

}  // namespace

std::vector<RankGroups> make_local_world(const Layout& L) { return make_thread_groups<GroupState, LocalComm>(L); }

}  // namespace k3
