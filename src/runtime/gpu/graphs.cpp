// GraphCache (runtime/gpu/graphs.h).
#include "runtime/gpu/graphs.h"

#include "core/cuda.h"

namespace k3 {

GraphCache::~GraphCache() {
  for (auto& g : graphs_) cudaGraphExecDestroy(g.exec);
}

void GraphCache::run(int kind, int B, int q, CUstream_st* stream, const std::function<void()>& enqueue) {
  for (auto& g : graphs_)
    if (g.kind == kind && g.B == B && g.q == q) {
      CUDA_CHECK(cudaGraphLaunch(g.exec, stream));
      return;
    }
  cudaGraph_t graph;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    enqueue();
  } catch (...) {
    cudaStreamEndCapture(stream, &graph);
    throw;
  }
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_CHECK(cudaGraphDestroy(graph));
  graphs_.push_back({kind, B, q, exec});
  CUDA_CHECK(cudaGraphLaunch(exec, stream));
}

}  // namespace k3
