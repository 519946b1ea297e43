// The local backend on one GPU (comm/local_gpu.h): ranks as threads, each with
// its own stream, device buffers.
//   GpuCommLocal.EveryCollectiveOnEveryGroup  the checks of tests/comm_checks.h
//       (membership, sums on exact and order-sensitive data, gathers,
//       broadcasts, all-to-all-v, errors, CountingComm) through a wrapper that
//       stages the host buffers on the device, with device canaries past
//       every receive buffer
//   GpuCommLocal.BackToBackNoHostSync  50 rounds of (upload, all_reduce,
//       all_gather, reduce_scatter, copy out) with no host synchronization in
//       between: a member that reused or overwrote a buffer before its peers
//       had read it gives wrong sums
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include "../comm_checks.h"
#include "comm/local_gpu.h"
#include "gpu_test_util.h"
#include "host_staged.h"

namespace k3 {
namespace {

using k3test::Checker;

// One thread per rank; a hang ends the process with a message instead of blocking ctest.
void run_ranks(int W, const std::function<void(int)>& body) {
  std::mutex m;
  std::condition_variable cv;
  int done = 0;
  std::vector<std::thread> threads;
  for (int w = 0; w < W; ++w)
    threads.emplace_back([&, w] {
      body(w);
      std::lock_guard lk(m);
      ++done;
      cv.notify_all();
    });
  {
    std::unique_lock lk(m);
    if (!cv.wait_for(lk, std::chrono::seconds(300), [&] { return done == W; })) {
      std::fprintf(stderr, "FATAL: only %d of %d rank threads finished within 300 s: a collective hangs\n", done, W);
      std::fflush(stderr);
      std::_Exit(3);
    }
  }
  for (auto& t : threads) t.join();
}

struct Streams {
  explicit Streams(int n) : s(n) {
    for (auto& x : s) CUDA_CHECK(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking));
  }
  ~Streams() {
    for (auto& x : s) cudaStreamDestroy(x);
  }
  std::vector<cudaStream_t> s;
};

class GpuCommLocal : public ::testing::TestWithParam<Layout> {};

TEST_P(GpuCommLocal, EveryCollectiveOnEveryGroup) {
  K3_REQUIRE_GPU();
  const Layout L = GetParam();
  const int W = L.world();
  auto dev = make_local_gpu_world(L);
  Streams st(W);
  std::vector<RankGroups> groups(W);
  for (int w = 0; w < W; ++w) {
    EXPECT_EQ(dev[w].tp->name(), "tp/local_gpu");
    groups[w].tp = std::make_unique<HostStaged>(std::move(dev[w].tp), st.s[w]);
    groups[w].dcp = std::make_unique<HostStaged>(std::move(dev[w].dcp), st.s[w]);
    groups[w].world = std::make_unique<HostStaged>(std::move(dev[w].world), st.s[w]);
  }
  std::vector<Checker> cks(W);
  k3test::SuiteOptions o;
  run_ranks(W, [&](int w) {
    cks[w].where = "world rank " + std::to_string(w);
    try {
      k3test::run_rank_suite(cks[w], L, w, groups[w], o);
    } catch (const std::exception& e) {
      cks[w].fail("threw: {}", e.what());
    }
  });
  int shown = 0;
  for (const auto& ck : cks) {
    EXPECT_GE(ck.checks, 100) << ck.where << " ran too few checks";
    for (const auto& f : ck.failures)
      if (shown++ < 40) ADD_FAILURE() << f;
  }
}

// Rank w's value of element i in round r (exact in BF16 sums of up to 8 ranks: small integers).
float value(int r, int w, int64_t i) { return static_cast<float>((r * 7 + w * 3 + i) % 13 - 6); }

TEST_P(GpuCommLocal, BackToBackNoHostSync) {
  K3_REQUIRE_GPU();
  const Layout L = GetParam();
  const int W = L.world(), G = L.tp, rounds = 50;
  const int64_t n = 1000;  // per rank and round; not a multiple of G (uneven all_reduce slices)
  auto groups = make_local_gpu_world(L);
  Streams st(W);
  std::vector<std::string> failures(W);
  run_ranks(W, [&](int w) {
    try {
      cudaStream_t s = st.s[w];
      Comm& tp = *groups[w].tp;
      tp.set_stream(s);
      // Host inputs of every round (pinned), device buffers reused every round.
      std::vector<bf16> in(static_cast<size_t>(rounds * n));
      for (int r = 0; r < rounds; ++r)
        for (int64_t i = 0; i < n; ++i) in[r * n + i] = to_bf16(value(r, w, i));
      DeviceBuffer d_in(rounds * n * 2), buf(n * 2), gath(G * n * 2), rs(n / G * 2 + 2), out(rounds * (n + G * n + n / G) * 2);
      CUDA_CHECK(cudaMemcpy(d_in.get(), in.data(), in.size() * 2, cudaMemcpyHostToDevice));
      CUDA_CHECK(cudaDeviceSynchronize());  // landed before the non-blocking stream s reads it
      const int64_t per = n + G * n + n / G;
      for (int r = 0; r < rounds; ++r) {
        CUDA_CHECK(cudaMemcpyAsync(buf.get(), d_in.get<bf16>() + r * n, n * 2, cudaMemcpyDeviceToDevice, s));
        tp.all_gather(buf.get(), gath.get(), n, DType::BF16);        // the inputs, before the sum overwrites buf
        tp.all_reduce(buf.get(), n, DType::BF16);
        tp.reduce_scatter(gath.get(), rs.get(), n / G, DType::BF16);  // pieces of the gathered inputs
        bf16* o = out.get<bf16>() + r * per;
        CUDA_CHECK(cudaMemcpyAsync(o, buf.get(), n * 2, cudaMemcpyDeviceToDevice, s));
        CUDA_CHECK(cudaMemcpyAsync(o + n, gath.get(), G * n * 2, cudaMemcpyDeviceToDevice, s));
        CUDA_CHECK(cudaMemcpyAsync(o + n + G * n, rs.get(), n / G * 2, cudaMemcpyDeviceToDevice, s));
      }
      std::vector<bf16> got(static_cast<size_t>(rounds * per));
      CUDA_CHECK(cudaStreamSynchronize(s));
      CUDA_CHECK(cudaMemcpy(got.data(), out.get(), got.size() * 2, cudaMemcpyDeviceToHost));
      const int base = w - w % G;
      for (int r = 0; r < rounds && failures[w].empty(); ++r) {
        const bf16* o = got.data() + r * per;
        for (int64_t i = 0; i < n; ++i) {
          float sum = 0;
          for (int p = 0; p < G; ++p) sum += value(r, base + p, i);
          if (to_float(o[i]) != sum) {
            failures[w] = fmt::format("round {} all_reduce element {}: {} expected {}", r, i, to_float(o[i]), sum);
            break;
          }
        }
        for (int p = 0; p < G && failures[w].empty(); ++p)
          for (int64_t i = 0; i < n; ++i)
            if (to_float(o[n + p * n + i]) != value(r, base + p, i)) {
              failures[w] = fmt::format("round {} all_gather piece {} element {}", r, p, i);
              break;
            }
        // Every member's gathered buffer is the same [G, n]; reduce_scatter sums its first G pieces of
        // n / G elements: piece t = member 0's inputs [t c, (t+1) c), G times.
        const int t = w % G;
        const int64_t c = n / G;
        for (int64_t i = 0; i < c && failures[w].empty(); ++i) {
          const float want = static_cast<float>(G) * value(r, base, t * c + i);
          if (to_float(o[n + G * n + i]) != want)
            failures[w] = fmt::format("round {} reduce_scatter element {}: {} expected {}", r, i,
                                      to_float(o[n + G * n + i]), want);
        }
      }
    } catch (const std::exception& e) {
      failures[w] = std::string("threw: ") + e.what();
    }
  });
  for (int w = 0; w < W; ++w) EXPECT_TRUE(failures[w].empty()) << "tp" << L.tp << "_dp" << L.dp << "_dcp" << L.dcp << " world rank " << w << ": " << failures[w];
}

INSTANTIATE_TEST_SUITE_P(Layouts, GpuCommLocal,
                         ::testing::Values(Layout{1, 1, 1}, Layout{2, 1, 1}, Layout{3, 1, 1}, Layout{4, 1, 2},
                                           Layout{2, 2, 2}, Layout{4, 2, 2}, Layout{8, 1, 8}),
                         [](const auto& info) {
                           return "tp" + std::to_string(info.param.tp) + "_dp" + std::to_string(info.param.dp) +
                                  "_dcp" + std::to_string(info.param.dcp);
                         });

}  // namespace
}  // namespace k3
