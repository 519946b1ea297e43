// The benchmark's byte model (src/bench/bench.h step_bytes_by_op), host code only: the op groups sum to
// the step's floor bytes, and the groups that carry the floor match formulas written here from the K3
// spec (kimi-k3.md: 896 MXFP4 experts of 3584 -> 3072, k = 16, MLA latent entries of 512 + 64 BF16).
#include <gtest/gtest.h>

#include <cmath>

#include "bench/bench.h"
#include "bench/trace.h"
#include "io/synthetic.h"

namespace k3 {
namespace {

TEST(BenchBytes, OpGroupsSumToTheStepAndMatchTheSpec) {
  for (const char* variant : {"k3", "k3.1"}) {
    const ModelConfig c = preset_config("full", variant);
    const ShardSpec rank0{8, 0, 32, 0};  // TP8 x DP4, EP32
    int moe_layers = 0, mla_layers = 0;
    for (int l = 0; l < c.num_layers; ++l) {
      moe_layers += l >= c.moe.first_k_dense_replace;
      mla_layers += c.attn_kinds[l] != AttnKind::KDA;
    }
    ASSERT_EQ(moe_layers, 92);
    const int kda_layers = c.num_layers - mla_layers;
    ASSERT_EQ(kda_layers, 69);
    for (int B : {1, 8, 64})
      for (int q : {1, 4}) {
        const auto by = step_bytes_by_op(c, rank0, B, q, 8192);
        double sum = 0;
        for (const auto& [op, b] : by) {
          EXPECT_GT(b, 0) << op;
          sum += b;
        }
        EXPECT_DOUBLE_EQ(sum, step_bytes(c, rank0, B, q, 8192));
        // Routed experts: the pairs an EP32 exchange brings one rank, ceil(B q 16 / 8), at most its 28 experts;
        // each expert 3 MXFP4 matrices of 3584 x 3072 (half a byte per value, a scale byte per 32).
        const double pairs = std::ceil(B * q * 16.0 / 8), touched = std::min(28.0, pairs);
        const double expert = 3 * (3584.0 * 3072 / 2 + 3584.0 * 3072 / 32);
        EXPECT_DOUBLE_EQ(by.at("moe.experts"), moe_layers * touched * expert) << variant << " B " << B << " q " << q;
        // KDA recurrence, per layer and request: one state of 12 heads x 128 x 128 F32 read (the current
        // buffer) and one written (the state after the last token, whatever q); a verify (q > 1) also keeps
        // each token's k, g, v (3 x 12 x 128 F32) and beta (12 F32) for a partial commit.
        const double kept = q > 1 ? double(B) * q * (3 * 12 * 128 + 12) * 4 : 0.0;
        EXPECT_DOUBLE_EQ(by.at("kda.recurrence"), kda_layers * (B * 2 * 12 * 128 * 128 * 4.0 + kept))
            << variant << " B " << B << " q " << q;
        // The merged shared experts: gate, up, down of 2 x 3072 by 7168, BF16, on every MoE layer.
        EXPECT_DOUBLE_EQ(by.at("moe.shared"), moe_layers * 3 * 6144.0 * 7168 * 2);
        // The router (896 x 7168 BF16 and its F32 bias) and the latent down (3584 x 7168 BF16).
        EXPECT_DOUBLE_EQ(by.at("moe.router_down"), moe_layers * ((896.0 + 3584) * 7168 * 2 + 896 * 4));
        // The hybrid step's tp mode: the shared experts and the latent down are 1/8 per rank, the router whole.
        const auto tp = step_bytes_by_op(c, ShardSpec{8, 0, 32, 0, true}, B, q, 8192);
        EXPECT_DOUBLE_EQ(tp.at("moe.shared"), moe_layers * 3 * 768.0 * 7168 * 2);
        EXPECT_DOUBLE_EQ(tp.at("moe.router_down"), moe_layers * ((896.0 + 448) * 7168 * 2 + 896 * 4));
        if (std::string(variant) == "k3") {
          // MLA reads each request's whole latent cache (context + q entries of 576 BF16) once per layer.
          const double grow = by.at("mla.attend") - step_bytes_by_op(c, rank0, B, q, 0).at("mla.attend");
          EXPECT_DOUBLE_EQ(grow, mla_layers * double(B) * 8192 * 576 * 2);
          EXPECT_EQ(by.count("dsa.indexer_attend"), 0u);
        } else {
          EXPECT_EQ(by.count("mla.attend"), 0u);
          EXPECT_GT(by.at("dsa.indexer_attend"), 0);
        }
      }
  }
}

// The trace counts the driver's kernels for graph copy / set nodes with the copies, and every other kernel
// (ours, cuBLASLt's, the library kernels whose names merely contain "memcpy") with the kernels.
TEST(BenchTrace, CopyNodeKernelsAreTheDriversMemcpyAndMemsetOnly) {
  for (const char* n : {"memcpy32_post", "memcpy64_post", "memset32_aligned1D", "memcpy"})
    EXPECT_TRUE(bench::is_copy_node_kernel(n)) << n;
  for (const char* n : {"k3::ops::cuda::(anonymous namespace)::rmsnorm_kernel<k3::bf16, 8>",
                        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>",
                        "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT", "k3::bench::memcpy_like_kernel", "_memcpy", ""})
    EXPECT_FALSE(bench::is_copy_node_kernel(n)) << n;
}

}  // namespace
}  // namespace k3
