// StepProfiler (runtime/gpu/profile.h).
#include "runtime/gpu/profile.h"

#include <algorithm>

#include "core/cuda.h"

namespace k3 {

StepProfiler::~StepProfiler() {
  for (auto* e : events_) cudaEventDestroy(e);
}

void StepProfiler::mark(const char* label, CUstream_st* s) {
  if (!on_) return;
  if (n_ == events_.size()) {
    cudaEvent_t e;
    CUDA_CHECK(cudaEventCreate(&e));
    events_.push_back(e);
    labels_.push_back(nullptr);
  }
  CUDA_CHECK(cudaEventRecord(events_[n_], s));
  labels_[n_++] = label;
}

std::vector<std::pair<std::string, double>> StepProfiler::finish(CUstream_st* s) {
  mark("end", s);
  on_ = false;
  CUDA_CHECK(cudaStreamSynchronize(s));
  std::vector<std::pair<std::string, double>> out;
  for (size_t i = 0; i + 1 < n_; ++i) {
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, events_[i], events_[i + 1]));
    auto it = std::find_if(out.begin(), out.end(), [&](const auto& p) { return p.first == labels_[i]; });
    if (it == out.end())
      out.emplace_back(labels_[i], ms);
    else
      it->second += ms;
  }
  return out;
}

}  // namespace k3
