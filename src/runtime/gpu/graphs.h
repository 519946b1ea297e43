// GraphCache: a step's CUDA graph per key (step kind, B, q), captured on the
// first run of that key and replayed after. The step issues kernels and async
// copies on one stream with no host synchronization, so capture is exact.
#pragma once

#include <functional>
#include <vector>

struct CUstream_st;
struct CUgraphExec_st;

namespace k3 {

class GraphCache {
 public:
  GraphCache() = default;
  ~GraphCache();
  GraphCache(const GraphCache&) = delete;
  GraphCache& operator=(const GraphCache&) = delete;

  // Replays the graph of `key` on `stream`, first capturing `enqueue` (thread-local mode) if there is none.
  void run(int kind, int B, int q, CUstream_st* stream, const std::function<void()>& enqueue);

 private:
  struct Graph {
    int kind, B, q;
    CUgraphExec_st* exec;
  };
  std::vector<Graph> graphs_;
};

}  // namespace k3
