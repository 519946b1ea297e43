// The CUDA Context (ops/cuda_context.h): a stream, a cuBLASLt handle and its workspace on the current device.
#include <string>

#include "core/cuda.h"
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

// An allocation larger than the device: OutOfDeviceMemory naming the size and the device's memory, and the
// failure is not left behind for the next launch check; a small allocation afterwards works.
TEST(DeviceBuffer, OutOfMemorySaysHowMuchAndLeavesNoError) {
  K3_REQUIRE_GPU();
  size_t free_b = 0, total_b = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_b, &total_b), cudaSuccess);
  const size_t too_much = total_b + (size_t{64} << 30);
  try {
    DeviceBuffer b(too_much);
    FAIL() << "allocated " << too_much << " bytes on a device of " << total_b;
  } catch (const OutOfDeviceMemory& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("out of GPU memory"), std::string::npos) << what;
    EXPECT_NE(what.find(fmt::format("{:.2f} GiB asked for", static_cast<double>(too_much) / (1 << 30))),
              std::string::npos)
        << what;
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  DeviceBuffer small(4096);
  EXPECT_NE(small.get(), nullptr);
}

}  // namespace
}  // namespace k3
