// The local backend on one GPU (comm/local_gpu.h): host barriers + stream events
// + device copies / ops::cuda::reduce_sum on peers' device buffers.
#include "comm/local_gpu.h"
#include "comm/thread_groups.h"

#include <barrier>
#include <fmt/format.h>

#include "core/cuda.h"
#include "ops/reduce.h"

namespace k3 {

namespace {

struct GpuGroupState {
  explicit GpuGroupState(int n) : n(n), bar(n), send(n), counts(n), ready(n), mid(n), done(n) {
    for (auto* v : {&ready, &mid, &done})
      for (auto& e : *v) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  ~GpuGroupState() {
    for (auto* v : {&ready, &mid, &done})
      for (auto& e : *v)
        if (e) cudaEventDestroy(e);
  }
  GpuGroupState(const GpuGroupState&) = delete;
  GpuGroupState& operator=(const GpuGroupState&) = delete;
  int n;
  std::barrier<> bar;
  std::vector<const void*> send;        // each member's published buffer
  std::vector<const int64_t*> counts;   // all_to_all_v send counts (host)
  std::vector<cudaEvent_t> ready, mid, done;
};

class LocalGpuComm : public Comm {
 public:
  LocalGpuComm(std::shared_ptr<GpuGroupState> g, int rank, std::string name)
      : g_(std::move(g)), rank_(rank), name_(std::move(name)) {}
  int rank() const override { return rank_; }
  int size() const override { return g_->n; }
  std::string name() const override { return name_ + "/local_gpu"; }
  void set_stream(void* s) override { stream_ = static_cast<cudaStream_t>(s); }

  void all_reduce(void* data, int64_t count, DType dt) override {
    const size_t es = summable(dt, "all_reduce");
    enter(data, nullptr);
    const int64_t chunk = (count + g_->n - 1) / g_->n;
    auto slice = [&](int p, int64_t& off, int64_t& n) {
      off = std::min<int64_t>(count, p * chunk);
      n = std::min<int64_t>(count, off + chunk) - off;
    };
    int64_t off, n;
    slice(rank_, off, n);
    const void* parts[ops::cuda::kReduceMaxParts];
    for (int p = 0; p < g_->n; ++p) parts[p] = static_cast<const char*>(g_->send[p]) + off * es;
    sum(parts, static_cast<char*>(data) + off * es, n, dt);
    // Every slice is summed (and every member has read every buffer) before the copies.
    step(g_->mid);
    for (int p = 0; p < g_->n; ++p) {
      if (p == rank_) continue;
      slice(p, off, n);
      if (n > 0)
        CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(data) + off * es, static_cast<const char*>(g_->send[p]) + off * es,
                                   n * es, cudaMemcpyDeviceToDevice, stream_));
    }
    leave();
  }

  void all_gather(const void* send, void* recv, int64_t count, DType dt) override {
    const size_t bytes = static_cast<size_t>(count) * dtype_size(dt);
    enter(send, nullptr);
    for (int p = 0; p < g_->n; ++p) {
      char* dst = static_cast<char*>(recv) + p * bytes;
      if (dst != g_->send[p] && bytes)
        CUDA_CHECK(cudaMemcpyAsync(dst, g_->send[p], bytes, cudaMemcpyDeviceToDevice, stream_));
    }
    leave();
  }

  void reduce_scatter(const void* send, void* recv, int64_t count, DType dt) override {
    const size_t es = summable(dt, "reduce_scatter");
    enter(send, nullptr);
    const void* parts[ops::cuda::kReduceMaxParts];
    for (int p = 0; p < g_->n; ++p) parts[p] = static_cast<const char*>(g_->send[p]) + rank_ * count * es;
    sum(parts, recv, count, dt);
    leave();
  }

  void all_to_all_v(const void* send, const int64_t* send_counts, void* recv, const int64_t* recv_counts,
                    DType dt) override {
    const size_t es = dtype_size(dt);
    enter(send, send_counts);
    auto copy = [&](int p, int64_t off, int64_t at, int64_t n) {
      CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(recv) + at * es, static_cast<const char*>(g_->send[p]) + off * es,
                                 n * es, cudaMemcpyDeviceToDevice, stream_));
    };
    const std::string bad = receive_pieces(g_->counts, rank_, recv_counts, name(), copy);
    leave();
    K3_CHECK(bad.empty(), "{}", bad);
  }

  void broadcast(void* data, int64_t count, DType dt, int root) override {
    K3_CHECK(root >= 0 && root < g_->n, "comm {}: broadcast root {} outside 0..{}", name(), root, g_->n - 1);
    enter(data, nullptr);
    if (rank_ != root && count)
      CUDA_CHECK(cudaMemcpyAsync(data, g_->send[root], static_cast<size_t>(count) * dtype_size(dt),
                                 cudaMemcpyDeviceToDevice, stream_));
    leave();
  }

  void barrier() override {
    enter(nullptr, nullptr);
    leave();
  }

 private:
  size_t summable(DType dt, const char* what) const {
    K3_CHECK(dt == DType::F32 || dt == DType::BF16, "comm {}: {} of {} is not supported (F32, BF16)", name(), what,
             dtype_name(dt));
    K3_CHECK(g_->n <= ops::cuda::kReduceMaxParts, "comm {}: {} over {} ranks (at most {})", name(), what, g_->n,
             ops::cuda::kReduceMaxParts);
    return dtype_size(dt);
  }
  void sum(const void* const* parts, void* out, int64_t count, DType dt) {
    if (count <= 0) return;
    int rc = dt == DType::F32
                 ? ops::cuda::reduce_sum_f32(reinterpret_cast<const float* const*>(parts), g_->n,
                                             static_cast<float*>(out), count, stream_)
                 : ops::cuda::reduce_sum_bf16(reinterpret_cast<const bf16* const*>(parts), g_->n,
                                              static_cast<bf16*>(out), count, stream_);
    CUDA_CHECK(static_cast<cudaError_t>(rc));
  }
  // Records ev[rank] on this stream, meets the peers, waits for theirs.
  void step(std::vector<cudaEvent_t>& ev) {
    CUDA_CHECK(cudaEventRecord(ev[rank_], stream_));
    g_->bar.arrive_and_wait();
    for (int p = 0; p < g_->n; ++p)
      if (p != rank_) CUDA_CHECK(cudaStreamWaitEvent(stream_, ev[p], 0));
  }
  void enter(const void* buf, const int64_t* counts) {
    K3_CHECK(stream_ != nullptr, "comm {}: set_stream() before the first collective", name());
    g_->send[rank_] = buf;
    g_->counts[rank_] = counts;
    step(g_->ready);
  }
  // No member's buffers are touched again before every peer has finished reading them.
  void leave() { step(g_->done); }

  std::shared_ptr<GpuGroupState> g_;
  int rank_;
  std::string name_;
  cudaStream_t stream_ = nullptr;
};

}  // namespace

std::vector<RankGroups> make_local_gpu_world(const Layout& L) {
  return make_thread_groups<GpuGroupState, LocalGpuComm>(L);
}

}  // namespace k3
