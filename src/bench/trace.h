// Step trace (bench-only): what the GPU does during one replay of a step, from CUPTI's activity
// records (kernels, memcpy and memset, with GPU timestamps):
//   kernels, copies:  operations per step (a step is one CUDA graph: these are its nodes that ran; a copy
//                     node the driver runs as a kernel counts as a copy, is_copy_node_kernel);
//   busy_us:          the union of the operations' [start, end] intervals;
//   span_us:          first start to last end;
//   gap_us:           span - busy, the time inside the step not covered by any kernel or copy
//                     (launch latency between dependent nodes, host work, waits), and by the operation
//                     that ended each gap (gap_before).
// Each replay is traced on its own (CUPTI enabled around it, flushed after); the summary is the
// median over replays. Tracing adds overhead per operation, so trace times are reported beside the
// untraced CUDA-event medians, not in their place.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace k3::bench {

struct TraceSummary {
  bool available = false;  // false: CUPTI could not be enabled (the fields are 0)
  double kernels = 0, copies = 0;
  double kernel_us = 0;  // sum of kernel durations
  double busy_us = 0, span_us = 0, gap_us = 0;
  struct Kernel {
    std::string name;  // demangled, without the argument list
    double calls = 0, us = 0;  // per step (mean over the traced replays)
  };
  std::vector<Kernel> by_kernel;  // descending time
  // The uncovered time by the operation that ended it (kernel name, "memcpy" or "memset"): each gap
  // between the busy intervals is charged to the operation starting after it (calls: gaps per step).
  std::vector<Kernel> gap_before;  // descending time
};

// Whether a kernel record is the driver running one of the graph's copy or set nodes as a kernel (at small
// sizes, e.g. `memcpy32_post`: no namespace, the name begins "memcpy" or "memset"). The trace counts those
// with the copies, so that kernels per step means the same at every point.
bool is_copy_node_kernel(const std::string& name);

// Runs `replay` (it enqueues one step; tracing synchronizes the device after it) `reps` times under CUPTI.
TraceSummary trace_steps(const std::function<void()>& replay, int reps);

}  // namespace k3::bench
