// StepProfiler: events recorded between a step's op groups (eager mode), so
// `bench --profile` can say how long each group took: mark(label) starts the
// group `label`; finish() returns the milliseconds per label, summed over a
// step, in first-seen order.
#pragma once

#include <string>
#include <utility>
#include <vector>

struct CUstream_st;
struct CUevent_st;

namespace k3 {

class StepProfiler {
 public:
  StepProfiler() = default;
  ~StepProfiler();
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  bool on() const { return on_; }
  void start() {
    on_ = true;
    n_ = 0;
  }
  void stop() { on_ = false; }
  void mark(const char* label, CUstream_st* s);  // no-op unless on
  // Synchronizes `s`; the time of each label.
  std::vector<std::pair<std::string, double>> finish(CUstream_st* s);

 private:
  bool on_ = false;
  std::vector<CUevent_st*> events_;
  std::vector<const char*> labels_;
  size_t n_ = 0;
};

}  // namespace k3
