// Comm helpers (comm/comm.h): Layout, CountingComm and the BF16 collectives over any backend.
#include "comm/comm.h"

#include "ops/reduce.h"

namespace k3 {

const char* coll_kind_name(CollKind k) {
  static const char* names[] = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all_v", "broadcast", "barrier"};
  return names[static_cast<int>(k)];
}

void Layout::validate() const {
  K3_CHECK(tp >= 1, "layout: --tp {} must be >= 1", tp);
  K3_CHECK(dp >= 1, "layout: --dp {} must be >= 1", dp);
  K3_CHECK(dcp >= 1, "layout: --dcp {} must be >= 1", dcp);
  K3_CHECK(tp % dcp == 0, "layout: --dcp {} does not divide --tp {}", dcp, tp);
}

void reduce_sum(const void* const* parts, int n, void* out, int64_t count, DType dt) {
  if (dt == DType::F32)
    ops::reduce_sum_f32(reinterpret_cast<const float* const*>(parts), n, static_cast<float*>(out), count);
  else if (dt == DType::BF16)
    ops::reduce_sum_bf16(reinterpret_cast<const bf16* const*>(parts), n, static_cast<bf16*>(out), count);
  else
    fail("comm: sum of {} is not supported (F32, BF16)", dtype_name(dt));
}

void CountingComm::all_reduce(void* data, int64_t count, DType dt) {
  this->count(CollKind::AllReduce, count * static_cast<int64_t>(dtype_size(dt)));
  inner_->all_reduce(data, count, dt);
}
void CountingComm::all_gather(const void* send, void* recv, int64_t count, DType dt) {
  this->count(CollKind::AllGather, count * static_cast<int64_t>(dtype_size(dt)));
  inner_->all_gather(send, recv, count, dt);
}
void CountingComm::reduce_scatter(const void* send, void* recv, int64_t count, DType dt) {
  this->count(CollKind::ReduceScatter, count * size() * static_cast<int64_t>(dtype_size(dt)));
  inner_->reduce_scatter(send, recv, count, dt);
}
void CountingComm::all_to_all_v(const void* send, const int64_t* send_counts, void* recv, const int64_t* recv_counts,
                                DType dt) {
  int64_t n = 0;
  for (int p = 0; p < size(); ++p) n += send_counts[p];
  this->count(CollKind::AllToAllV, n * static_cast<int64_t>(dtype_size(dt)));
  inner_->all_to_all_v(send, send_counts, recv, recv_counts, dt);
}
void CountingComm::broadcast(void* data, int64_t count, DType dt, int root) {
  this->count(CollKind::Broadcast, rank() == root ? count * static_cast<int64_t>(dtype_size(dt)) : 0);
  inner_->broadcast(data, count, dt, root);
}
void CountingComm::broadcast_idle(void* data, int64_t count, DType dt, int root) {
  this->count(CollKind::Broadcast, rank() == root ? count * static_cast<int64_t>(dtype_size(dt)) : 0);
  inner_->broadcast_idle(data, count, dt, root);
}
void CountingComm::barrier() {
  this->count(CollKind::Barrier, 0);
  inner_->barrier();
}
void CountingComm::reset() {
  for (auto& c : calls_) c = 0;
  for (auto& b : bytes_) b = 0;
}

}  // namespace k3

namespace k3 {

namespace {
std::vector<bf16> pack_bf16(const float* x, int64_t n) {
  std::vector<bf16> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[i] = to_bf16(x[i]);
  return out;
}
void unpack_bf16(const std::vector<bf16>& v, float* out) {
  for (size_t i = 0; i < v.size(); ++i) out[i] = to_float(v[i]);
}
}  // namespace

void all_reduce_bf16(Comm& comm, float* data, int64_t count) {
  auto b = pack_bf16(data, count);
  comm.all_reduce(b.data(), count, DType::BF16);
  unpack_bf16(b, data);
}

void all_gather_bf16(Comm& comm, const float* send, float* recv, int64_t count) {
  auto s = pack_bf16(send, count);
  std::vector<bf16> r(static_cast<size_t>(count * comm.size()));
  comm.all_gather(s.data(), r.data(), count, DType::BF16);
  unpack_bf16(r, recv);
}

void reduce_scatter_bf16(Comm& comm, const float* send, float* recv, int64_t count) {
  auto s = pack_bf16(send, count * comm.size());
  std::vector<bf16> r(static_cast<size_t>(count));
  comm.reduce_scatter(s.data(), r.data(), count, DType::BF16);
  unpack_bf16(r, recv);
}

void all_to_all_v_bf16(Comm& comm, const float* send, const int64_t* send_counts, float* recv,
                       const int64_t* recv_counts) {
  int64_t ns = 0, nr = 0;
  for (int p = 0; p < comm.size(); ++p) {
    ns += send_counts[p];
    nr += recv_counts[p];
  }
  auto s = pack_bf16(send, ns);
  std::vector<bf16> r(static_cast<size_t>(nr));
  comm.all_to_all_v(s.data(), send_counts, r.data(), recv_counts, DType::BF16);
  unpack_bf16(r, recv);
}

}  // namespace k3
