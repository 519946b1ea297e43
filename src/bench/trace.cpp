// CUPTI activity tracing of step replays (trace.h).
#include "bench/trace.h"

#include <cuda_runtime.h>
#include <cupti.h>
#include <cxxabi.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "bench/bench.h"

namespace k3::bench {
namespace {

struct Interval {
  uint64_t start, end;
  bool kernel;
  std::string name;  // the kernel's, or memcpy / memset
};

// "ns::kernel<T>(args)" from a mangled name: the demangled name up to its argument list.
std::string short_name(const char* mangled) {
  if (mangled == nullptr) return "?";
  int status = 0;
  char* d = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string s = status == 0 && d != nullptr ? d : mangled;
  std::free(d);
  int depth = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '<') ++depth;
    if (s[i] == '>') --depth;
    if (s[i] == '(' && depth == 0 && s.compare(i, 21, "(anonymous namespace)") != 0) return s.substr(0, i);
  }
  return s;
}

std::vector<Interval>* g_sink = nullptr;  // the replay being traced (tracing is single-threaded)

constexpr size_t kBufferBytes = size_t{8} << 20;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* rec = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    if (g_sink == nullptr) continue;
    switch (rec->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
      case CUPTI_ACTIVITY_KIND_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
        std::string name = short_name(k->name);
        const bool kernel = !is_copy_node_kernel(name);
        g_sink->push_back({k->start, k->end, kernel, std::move(name)});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
        g_sink->push_back({m->start, m->end, false, "memcpy"});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
        g_sink->push_back({m->start, m->end, false, "memset"});
        break;
      }
      default:
        break;
    }
  }
  std::free(buffer);
}

const CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                     CUPTI_ACTIVITY_KIND_MEMSET};

}  // namespace

bool is_copy_node_kernel(const std::string& name) {
  return name.rfind("memcpy", 0) == 0 || name.rfind("memset", 0) == 0;
}

TraceSummary trace_steps(const std::function<void()>& replay, int reps) {
  TraceSummary out;
  static bool registered = false;
  if (!registered) {
    if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS) return out;
    registered = true;
  }
  std::vector<double> kernels, copies, kernel_us, busy, span;
  std::vector<Interval> iv;
  std::map<std::string, std::pair<double, double>> per_kernel;  // name -> (calls, us) over all replays
  std::map<std::string, std::pair<double, double>> per_gap;     // next operation -> (gaps, us) over all replays
  for (int r = 0; r < reps; ++r) {
    if (cudaDeviceSynchronize() != cudaSuccess) return out;
    iv.clear();
    g_sink = &iv;
    bool ok = true;
    for (auto k : kKinds) ok = ok && cuptiActivityEnable(k) == CUPTI_SUCCESS;
    if (ok) replay();
    const bool synced = cudaDeviceSynchronize() == cudaSuccess;
    for (auto k : kKinds) cuptiActivityDisable(k);
    cuptiActivityFlushAll(1);
    g_sink = nullptr;
    if (!ok || !synced || iv.empty()) return out;
    std::sort(iv.begin(), iv.end(), [](const Interval& a, const Interval& b) { return a.start < b.start; });
    double nk = 0, kus = 0, covered = 0;
    uint64_t cur_s = iv[0].start, cur_e = iv[0].end, last = 0;
    for (const Interval& i : iv) {
      nk += i.kernel;
      if (i.kernel) {
        kus += (i.end - i.start) * 1e-3;
        auto& [calls, us] = per_kernel[i.name];
        calls += 1;
        us += (i.end - i.start) * 1e-3;
      }
      if (i.start > cur_e) {
        covered += (cur_e - cur_s) * 1e-3;
        auto& [gaps, gus] = per_gap[i.name];
        gaps += 1;
        gus += (i.start - cur_e) * 1e-3;
        cur_s = i.start;
        cur_e = i.end;
      } else {
        cur_e = std::max(cur_e, i.end);
      }
      last = std::max(last, i.end);
    }
    covered += (cur_e - cur_s) * 1e-3;
    kernels.push_back(nk);
    copies.push_back(static_cast<double>(iv.size()) - nk);
    kernel_us.push_back(kus);
    busy.push_back(covered);
    span.push_back((last - iv[0].start) * 1e-3);
  }
  out.available = true;
  out.kernels = k3::median(kernels);
  out.copies = k3::median(copies);
  out.kernel_us = k3::median(kernel_us);
  out.busy_us = k3::median(busy);
  out.span_us = k3::median(span);
  std::vector<double> gaps;
  for (size_t i = 0; i < span.size(); ++i) gaps.push_back(span[i] - busy[i]);
  out.gap_us = k3::median(gaps);
  for (const auto& [name, cu] : per_kernel) out.by_kernel.push_back({name, cu.first / reps, cu.second / reps});
  for (const auto& [name, gu] : per_gap) out.gap_before.push_back({name, gu.first / reps, gu.second / reps});
  const auto by_time = [](const TraceSummary::Kernel& a, const TraceSummary::Kernel& b) { return a.us > b.us; };
  std::sort(out.by_kernel.begin(), out.by_kernel.end(), by_time);
  std::sort(out.gap_before.begin(), out.gap_before.end(), by_time);
  return out;
}

}  // namespace k3::bench
