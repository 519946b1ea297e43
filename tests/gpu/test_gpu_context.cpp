// The CUDA Context (ops/cuda_context.h): a stream, a cuBLASLt handle and its workspace on the current device.
#include "gpu_test_util.h"

namespace k3 {
namespace {

TEST(CudaContext, CreatesStreamAndCublasLt) {
  K3_REQUIRE_GPU();
  auto& c = gputest::ctx();
  EXPECT_NE(c.stream, nullptr);
  EXPECT_NE(c.lt, nullptr);
  EXPECT_GT(c.sm_count, 0);
}

}  // namespace
}  // namespace k3
