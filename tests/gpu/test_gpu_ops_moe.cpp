// GPU tests of the MoE CUDA ops, each against its CPU reference on random inputs (fixed seeds): situ_glu,
// mxfp4_linear, expert_mlp, mlp, moe_experts (the K3 rank slice: 28 of 896 experts, k = 16; also through
// the warp-specialized wgmma kernel, moe_experts_force_wg) and route
// (the CPU tests: tests/test_ops_moe.cpp).
//
// Tolerances come from the output dtype. BF16 keeps 8 significant bits: an FP32 result that the GPU
// sums in another order rounds to the CPU's value or a neighbour, at most one ulp apart, and one ulp
// is at most 2^-7 of the largest output (kOneRounding). A BF16 result computed from BF16 intermediates
// that may each sit one ulp off moves by up to one more ulp (kChained). FP32 results: 1e-4 relative.
// The router's indices must match exactly.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "core/mxfp4.h"
#include "gpu_test_util.h"
#include "ops/linear.h"
#include "ops/moe.h"
#include "ops/rmsnorm.h"
#include "ops/router.h"

namespace k3 {
namespace {

using namespace gputest;

constexpr double kF32Rel = 1e-4;


DeviceBuffer upload_bf16(const std::vector<float>& v) { return upload(to_bf16_vec(v)); }
std::vector<float> download_bf16(const DeviceBuffer& d, size_t n) { return to_float_vec(download<bf16>(d, n)); }

// ---------------------------------------------------------------------------------------------
// MoE: situ_glu, mxfp4_linear, expert_mlp, mlp, moe_experts

const ops::SituParams kSitu{4.0f, 25.0f};

TEST(CudaMoe, SituGluMatchesCpu) {
  K3_REQUIRE_GPU();
  for (int64_t n : {1, 7, 1000, 3 * 3072}) {
    const auto a = random_bf16_values(static_cast<size_t>(n), 4000 + n, 8.0);
    const auto b = random_bf16_values(static_cast<size_t>(n), 5000 + n, 40.0);
    std::vector<float> want(static_cast<size_t>(n));
    ops::situ_glu(a.data(), b.data(), want.data(), n, kSitu);
    DeviceBuffer da = upload_bf16(a), db = upload_bf16(b), dout(static_cast<size_t>(n) * 2);
    ASSERT_EQ(ops::cuda::situ_glu(da.get<bf16>(), db.get<bf16>(), dout.get<bf16>(), n, kSitu, st()), 0);
    expect_close(download_bf16(dout, want.size()), want, kOneRounding, 0.0, "situ_glu");
    // out aliasing a
    ASSERT_EQ(ops::cuda::situ_glu(da.get<bf16>(), db.get<bf16>(), da.get<bf16>(), n, kSitu, st()), 0);
    expect_close(download_bf16(da, want.size()), want, kOneRounding, 0.0, "situ_glu in place");
  }
}

struct Mxfp4Host {
  int64_t N = 0, K = 0;
  std::vector<uint8_t> packed, scale;
  ops::Mxfp4Matrix view() const { return {packed.data(), scale.data()}; }
};

// Random codes (every nibble, both signs); scales 2^(smin - 127) .. 2^(smax - 127).
Mxfp4Host random_mxfp4(int64_t N, int64_t K, uint64_t seed, int smin = 118, int smax = 123) {
  Mxfp4Host m;
  m.N = N;
  m.K = K;
  m.packed.resize(static_cast<size_t>(N * K / 2));
  m.scale.resize(static_cast<size_t>(N * K / 32));
  Rng rng(seed);
  for (size_t i = 0; i < m.packed.size(); i += 8) {
    const uint64_t v = rng.next_u64();
    for (size_t j = 0; j < 8 && i + j < m.packed.size(); ++j) m.packed[i + j] = static_cast<uint8_t>(v >> (8 * j));
  }
  for (auto& s : m.scale) s = static_cast<uint8_t>(smin + static_cast<int>(rng.below(smax - smin + 1)));
  return m;
}

struct Mxfp4Device {
  DeviceBuffer packed, scale;
  explicit Mxfp4Device(const Mxfp4Host& h) : packed(upload(h.packed)), scale(upload(h.scale)) {}
  ops::Mxfp4Matrix view() const { return {packed.get<uint8_t>(), scale.get<uint8_t>()}; }
};

TEST(CudaMoe, Mxfp4LinearDecodesEveryCodeExactly) {
  K3_REQUIRE_GPU();
  // W [1, 32]: the 16 codes twice; x one-hot per row, so y[r] = W[0, r] exactly (no sums).
  for (int s : {0, 1, 64, 127, 130, 200}) {
    Mxfp4Host m;
    m.N = 1;
    m.K = 32;
    for (int i = 0; i < 16; ++i) m.packed.push_back(static_cast<uint8_t>((2 * i % 16) | (((2 * i + 1) % 16) << 4)));
    m.scale.push_back(static_cast<uint8_t>(s));
    std::vector<float> x(32 * 32, 0.f);
    for (int r = 0; r < 32; ++r) x[r * 32 + r] = 1.f;
    Mxfp4Device d(m);
    DeviceBuffer dx = upload_bf16(x), dy(32 * 2);
    ASSERT_EQ(ops::cuda::mxfp4_linear(dx.get<bf16>(), d.packed.get<uint8_t>(), d.scale.get<uint8_t>(), dy.get<bf16>(),
                                      32, 32, 1, st()),
              0);
    std::vector<float> want(32);
    ops::mxfp4_linear(x.data(), m.packed.data(), m.scale.data(), want.data(), 32, 32, 1);
    for (int r = 0; r < 32; ++r) ASSERT_EQ(want[r], round_bf16(mxfp4_at(m.packed.data(), m.scale.data(), 32, 0, r)));
    EXPECT_EQ(download_bf16(dy, 32), want) << "scale byte " << s;
  }
}

TEST(CudaMoe, Mxfp4LinearMatchesCpu) {
  K3_REQUIRE_GPU();
  struct Case {
    int64_t rows, K, N;
  };
  const Case cases[] = {{1, 32, 1}, {3, 96, 7}, {5, 3584, 100}, {9, 3072, 33}, {1, 3584, 3072}, {2, 3072, 3584}};
  uint64_t seed = 6000;
  for (const auto& c : cases) {
    SCOPED_TRACE(testing::Message() << "rows " << c.rows << " K " << c.K << " N " << c.N);
    const Mxfp4Host m = random_mxfp4(c.N, c.K, seed++);
    const auto x = random_bf16_values(static_cast<size_t>(c.rows * c.K), seed++);
    std::vector<float> want(static_cast<size_t>(c.rows * c.N));
    ops::mxfp4_linear(x.data(), m.packed.data(), m.scale.data(), want.data(), c.rows, c.K, c.N);
    Mxfp4Device d(m);
    DeviceBuffer dx = upload_bf16(x), dy(want.size() * 2);
    ASSERT_EQ(ops::cuda::mxfp4_linear(dx.get<bf16>(), d.packed.get<uint8_t>(), d.scale.get<uint8_t>(), dy.get<bf16>(),
                                      c.rows, c.K, c.N, st()),
              0);
    expect_close(download_bf16(dy, want.size()), want, kOneRounding, 0.0, "mxfp4_linear");

    // Packed weights at an odd address: the byte-wise load path.
    std::vector<uint8_t> shifted(m.packed.size() + 1);
    std::copy(m.packed.begin(), m.packed.end(), shifted.begin() + 1);
    DeviceBuffer dsh = upload(shifted);
    ASSERT_EQ(ops::cuda::mxfp4_linear(dx.get<bf16>(), dsh.get<uint8_t>() + 1, d.scale.get<uint8_t>(), dy.get<bf16>(),
                                      c.rows, c.K, c.N, st()),
              0);
    expect_close(download_bf16(dy, want.size()), want, kOneRounding, 0.0, "mxfp4_linear unaligned packed");
  }
}

TEST(CudaMoe, ExpertMlpMatchesCpu) {
  K3_REQUIRE_GPU();
  struct Case {
    int64_t rows, D, I;
  };
  const Case cases[] = {{1, 64, 96}, {4, 256, 128}, {2, 3584, 3072}};
  uint64_t seed = 7000;
  for (const auto& c : cases) {
    SCOPED_TRACE(testing::Message() << "rows " << c.rows << " D " << c.D << " I " << c.I);
    const Mxfp4Host w1 = random_mxfp4(c.I, c.D, seed++), w3 = random_mxfp4(c.I, c.D, seed++);
    const Mxfp4Host w2 = random_mxfp4(c.D, c.I, seed++);
    const auto z = random_bf16_values(static_cast<size_t>(c.rows * c.D), seed++);
    std::vector<float> want(static_cast<size_t>(c.rows * c.D)), scratch(static_cast<size_t>(2 * c.rows * c.I));
    ops::expert_mlp(z.data(), w1.view(), w3.view(), w2.view(), want.data(), c.rows, c.D, c.I, kSitu, scratch.data());
    Mxfp4Device d1(w1), d3(w3), d2(w2);
    DeviceBuffer dz = upload_bf16(z), dout(want.size() * 2), dscr(scratch.size() * 2);
    ASSERT_EQ(ops::cuda::expert_mlp(dz.get<bf16>(), d1.view(), d3.view(), d2.view(), dout.get<bf16>(), c.rows, c.D, c.I,
                                    kSitu, dscr.get<bf16>(), st()),
              0);
    expect_close(download_bf16(dout, want.size()), want, kChained, 0.0, "expert_mlp");
  }
}

TEST(CudaMoe, MlpMatchesCpu) {
  K3_REQUIRE_GPU();
  struct Case {
    int64_t rows, D, I;
  };
  // (5, 100, 36): D % 8 != 0 (element-wise kernel); 65 and 128 rows: the cuBLASLt path.
  const Case cases[] = {{1, 256, 384}, {5, 100, 36}, {64, 512, 256}, {65, 256, 128}, {128, 7168, 256}};
  uint64_t seed = 8000;
  for (const auto& c : cases) {
    SCOPED_TRACE(testing::Message() << "rows " << c.rows << " D " << c.D << " I " << c.I);
    const auto x = random_bf16_values(static_cast<size_t>(c.rows * c.D), seed++);
    const auto wg = random_bf16_values(static_cast<size_t>(c.I * c.D), seed++, 2.0 / std::sqrt(double(c.D)));
    const auto wu = random_bf16_values(static_cast<size_t>(c.I * c.D), seed++, 2.0 / std::sqrt(double(c.D)));
    const auto wd = random_bf16_values(static_cast<size_t>(c.D * c.I), seed++, 2.0 / std::sqrt(double(c.I)));
    std::vector<bf16> wgb = to_bf16_vec(wg), wub = to_bf16_vec(wu), wdb = to_bf16_vec(wd);
    std::vector<float> want(static_cast<size_t>(c.rows * c.D)), scratch(static_cast<size_t>(2 * c.rows * c.I));
    ops::mlp(x.data(), wgb.data(), wub.data(), wdb.data(), want.data(), c.rows, c.D, c.I, kSitu, scratch.data());
    DeviceBuffer dx = upload_bf16(x), dg = upload(wgb), du = upload(wub), dd = upload(wdb);
    DeviceBuffer dout(want.size() * 2), dscr(scratch.size() * 2);
    ASSERT_EQ(ops::cuda::mlp(ctx(), dx.get<bf16>(), dg.get<bf16>(), du.get<bf16>(), dd.get<bf16>(), dout.get<bf16>(),
                             c.rows, c.D, c.I, kSitu, dscr.get<bf16>()),
              0);
    expect_close(download_bf16(dout, want.size()), want, kChained, 0.0, "mlp");
  }
}

// linear_glu: the fused one-launch kernels (the rows kernel's group at 1-2 rows, the tensor-core group at 3-8)
// bitwise against the group of the two projections then situ_glu (fused = false), both against the CPU
// linear_glu; the K3 per-rank shapes of the shared experts (TP-sharded 768, replicated 6144) and the dense MLP
// (TP-sharded 4224), odd shapes (I odd: a CTA with one feature), x unaligned (element-wise loads), gate and up
// unequally aligned (not fused).
TEST(CudaMoe, LinearGluFusedIsTheGroupAndSituBitwise) {
  K3_REQUIRE_GPU();
  struct Case {
    int64_t rows, D, I;
    int x_off, up_off;  // elements the device x and w_up start past a 256-byte boundary
  };
  const Case cases[] = {{1, 256, 384, 0, 0},  {1, 100, 37, 0, 0},  {1, 7168, 768, 0, 0}, {1, 7168, 4224, 0, 0},
                        {1, 7168, 6144, 0, 0}, {1, 264, 33, 1, 0}, {1, 264, 40, 0, 1},  {3, 512, 96, 0, 0},
                        // Two rows: the rows kernel's group of one GLU member (a 2-row tile per CTA).
                        {2, 7168, 768, 0, 0},  {2, 100, 37, 0, 0},  {2, 264, 33, 1, 0},  {2, 264, 40, 0, 1},
                        // The tensor-core kernel's GLU member (rows 3-8), and where it does not fit (x or w_up off
                        // their 16-byte alignment, k not a multiple of 8): the group and situ_glu.
                        {3, 7168, 768, 0, 0},  {5, 264, 33, 0, 0},  {8, 7168, 4224, 0, 0}, {4, 7168, 768, 1, 0},
                        {7, 264, 40, 0, 1},    {6, 100, 37, 0, 0}};
  uint64_t seed = 8500;
  // The GLU member where it takes the rows (whatever K3_LINEAR_GLU_TC says), the environment's again after.
  struct GluTcOn {
    GluTcOn() { ops::cuda::linear_glu_tc_force(1); }
    ~GluTcOn() { ops::cuda::linear_glu_tc_force(-1); }
  } glu_tc_on;
  for (const auto& c : cases) {
    SCOPED_TRACE(testing::Message() << "rows " << c.rows << " D " << c.D << " I " << c.I << " x+" << c.x_off
                                    << " up+" << c.up_off);
    const auto x = random_bf16_values(static_cast<size_t>(c.rows * c.D), seed++);
    const auto wg = random_bf16_values(static_cast<size_t>(c.I * c.D), seed++, 2.0 / std::sqrt(double(c.D)));
    const auto wu = random_bf16_values(static_cast<size_t>(c.I * c.D), seed++, 2.0 / std::sqrt(double(c.D)));
    std::vector<bf16> xb = to_bf16_vec(x), wgb = to_bf16_vec(wg), wub = to_bf16_vec(wu);
    std::vector<float> want(static_cast<size_t>(c.rows * c.I)), scratch(want.size());
    ops::linear_glu(x.data(), wgb.data(), wub.data(), want.data(), c.rows, c.D, c.I, kSitu, scratch.data());
    xb.insert(xb.begin(), static_cast<size_t>(c.x_off), bf16{});
    wub.insert(wub.begin(), static_cast<size_t>(c.up_off), bf16{});
    DeviceBuffer dx = upload(xb), dg = upload(wgb), du = upload(wub);
    DeviceBuffer dh(want.size() * 2), dref(want.size() * 2), dscr(2 * want.size() * 2);
    const bf16* xp = dx.get<bf16>() + c.x_off;
    const bf16* up = du.get<bf16>() + c.up_off;
    CUDA_CHECK(cudaMemsetAsync(dh.get(), 0xff, dh.bytes(), st()));  // NaN: an output left unwritten fails
    ASSERT_EQ(ops::cuda::linear_glu(ctx(), xp, dg.get<bf16>(), up, dh.get<bf16>(), c.rows, c.D, c.I, kSitu,
                                    dscr.get<bf16>()),
              0);
    ASSERT_EQ(ops::cuda::linear_glu(ctx(), xp, dg.get<bf16>(), up, dref.get<bf16>(), c.rows, c.D, c.I, kSitu,
                                    dscr.get<bf16>(), /*fused=*/false),
              0);
    const auto got = download<bf16>(dh, want.size()), ref = download<bf16>(dref, want.size());
    size_t differ = 0;
    for (size_t i = 0; i < got.size(); ++i) differ += got[i].bits != ref[i].bits;
    EXPECT_EQ(differ, 0u) << "fused and group + situ_glu outputs differ";
    expect_close(to_float_vec(got), want, kChained, 0.0, "linear_glu");
  }
  DeviceBuffer dummy(64);
  EXPECT_NE(ops::cuda::linear_glu(ctx(), dummy.get<bf16>(), dummy.get<bf16>(), dummy.get<bf16>(), dummy.get<bf16>(), 1,
                                  8, 0, kSitu, dummy.get<bf16>()),
            0)
      << "I = 0";
}

// A group with a GLU member beside plain ones (the router's FP32 logits, the latent down, the shared experts'
// gate / up: GpuRank::moe's group), launched by glu(x, rows, in, outs, 3), against four(x, rows, in, outs, 4)
// on the gate and up as two plain members then situ_glu, bitwise, and against the CPU linear_glu; for each
// shape of `cases` at each row count of `rows_list`.
struct GluGroupCase {
  int64_t in, f32_out, bf16_out, I;
};
template <typename Glu, typename Four>
void check_glu_group(const std::vector<GluGroupCase>& cases, const std::vector<int64_t>& rows_list, uint64_t seed,
                     Glu glu, Four four) {
  namespace cu = ops::cuda;
  for (const auto& c : cases) {
    const double ws = 2.0 / std::sqrt(double(c.in));
    const auto wr = random_bf16_values(static_cast<size_t>(c.f32_out * c.in), seed++, ws);
    const auto wd = random_bf16_values(static_cast<size_t>(c.bf16_out * c.in), seed++, ws);
    const auto wg = random_bf16_values(static_cast<size_t>(c.I * c.in), seed++, ws);
    const auto wu = random_bf16_values(static_cast<size_t>(c.I * c.in), seed++, ws);
    DeviceBuffer dr = upload_bf16(wr), dd = upload_bf16(wd), dg = upload_bf16(wg), du = upload_bf16(wu);
    for (const int64_t rows : rows_list) {
      SCOPED_TRACE(testing::Message() << "in " << c.in << " I " << c.I << " rows " << rows);
      const auto x = random_bf16_values(static_cast<size_t>(rows * c.in), seed++);
      DeviceBuffer dx = upload_bf16(x);
      const size_t nr = static_cast<size_t>(rows * c.f32_out), nd = static_cast<size_t>(rows * c.bf16_out),
                   nh = static_cast<size_t>(rows * c.I);
      DeviceBuffer r1(nr * 4), d1(nd * 2), h1(nh * 2), r2(nr * 4), d2(nd * 2), a2(nh * 2), b2(nh * 2);
      for (DeviceBuffer* b : {&r1, &d1, &h1}) CUDA_CHECK(cudaMemsetAsync(b->get(), 0xff, b->bytes(), st()));
      const cu::LinearOut three[3] = {{dr.get<bf16>(), r1.get(), c.f32_out, true},
                                      {dd.get<bf16>(), d1.get(), c.bf16_out},
                                      cu::glu_member(dg.get<bf16>(), du.get<bf16>(), h1.get<bf16>(), c.I, kSitu)};
      ASSERT_EQ(glu(dx.get<bf16>(), rows, c.in, three, 3), 0);
      const cu::LinearOut plain[4] = {{dr.get<bf16>(), r2.get(), c.f32_out, true},
                                      {dd.get<bf16>(), d2.get(), c.bf16_out},
                                      {dg.get<bf16>(), a2.get(), c.I},
                                      {du.get<bf16>(), b2.get(), c.I}};
      ASSERT_EQ(four(dx.get<bf16>(), rows, c.in, plain, 4), 0);
      ASSERT_EQ(cu::situ_glu(a2.get<bf16>(), b2.get<bf16>(), a2.get<bf16>(), static_cast<int64_t>(nh), kSitu, st()),
                0);
      const auto hr1 = download<float>(r1, nr), hr2 = download<float>(r2, nr);
      const auto hd1 = download<bf16>(d1, nd), hd2 = download<bf16>(d2, nd);
      const auto hh1 = download<bf16>(h1, nh), hh2 = download<bf16>(a2, nh);
      size_t differ = 0;
      for (size_t i = 0; i < nr; ++i) differ += std::memcmp(&hr1[i], &hr2[i], 4) != 0;
      EXPECT_EQ(differ, 0u) << "FP32 member beside a GLU member differs";
      differ = 0;
      for (size_t i = 0; i < nd; ++i) differ += hd1[i].bits != hd2[i].bits;
      EXPECT_EQ(differ, 0u) << "BF16 member beside a GLU member differs";
      differ = 0;
      for (size_t i = 0; i < nh; ++i) differ += hh1[i].bits != hh2[i].bits;
      EXPECT_EQ(differ, 0u) << "GLU member differs from the two projections then situ_glu";
      std::vector<float> want(nh), scratch(nh);
      const std::vector<bf16> wgb = to_bf16_vec(wg), wub = to_bf16_vec(wu);
      ops::linear_glu(x.data(), wgb.data(), wub.data(), want.data(), rows, c.in, c.I, kSitu, scratch.data());
      expect_close(to_float_vec(hh1), want, kChained, 0.0, "GLU member");
    }
  }
}

// linear_rows_tc with a GLU member beside plain ones against the same kernel on four plain members
// (check_glu_group); rows past one tile and odd feature counts.
TEST(CudaLinearRowsTc, GluMemberIsTheGroupAndSituBitwise) {
  K3_REQUIRE_GPU();
  namespace cu = ops::cuda;
  const auto tc = [](const bf16* x, int64_t rows, int64_t in, const cu::LinearOut* outs, int n) {
    return cu::linear_rows_tc(ctx(), x, in, rows, in, outs, n);
  };
  check_glu_group({{264, 33, 40, 37}, {7168, 896, 448, 768}, {136, 5, 16, 8}}, {3, 5, 8, 13, 32, 40}, 8700, tc, tc);
  // What it refuses: a GLU member with FP32 output or w_up off its alignment (nothing enqueued), an add with a
  // GLU member.
  DeviceBuffer dx(8 * 64 * 2), dw(64 * 16 * 2 + 16), dy(8 * 16 * 4);
  cu::LinearOut o{dw.get<bf16>(), dy.get(), 16, false};
  o.w_up = dw.get<bf16>();
  o.y_f32 = true;
  EXPECT_EQ(cu::linear_rows_tc(ctx(), dx.get<bf16>(), 64, 4, 64, &o, 1), cudaErrorNotSupported);
  o.y_f32 = false;
  o.w_up = dw.get<bf16>() + 1;
  EXPECT_EQ(cu::linear_rows_tc(ctx(), dx.get<bf16>(), 64, 4, 64, &o, 1), cudaErrorNotSupported);
  o.w_up = dw.get<bf16>();
  EXPECT_EQ(cu::linear_rows_tc(ctx(), dx.get<bf16>(), 64, 4, 64, &o, 1, /*add=*/true), cudaErrorInvalidValue);
}

// linear_group with a GLU member in the rows kernel's group (GpuRank::moe's router + latent down + shared gate /
// up at 1-2 rows on Auto; at any row count on Grouped) against the Grouped path on four plain members
// (check_glu_group); odd feature counts, x element-wise (in odd). Then what it refuses, with nothing written.
TEST(CudaLinearGroup, GluMemberIsTheGroupAndSituBitwise) {
  K3_REQUIRE_GPU();
  namespace cu = ops::cuda;
  using Path = cu::LinearGroupPath;
  const auto via = [](Path path) {
    return [path](const bf16* x, int64_t rows, int64_t in, const cu::LinearOut* outs, int n) {
      return cu::linear_group_via(ctx(), path, x, rows, in, outs, n);
    };
  };
  const std::vector<GluGroupCase> cases = {{264, 33, 40, 37}, {7168, 896, 448, 768}, {135, 5, 16, 9}};
  check_glu_group(cases, {1, 2}, 8900, via(Path::Auto), via(Path::Grouped));
  check_glu_group(cases, {3, 8, 11}, 8950, via(Path::Grouped), via(Path::Grouped));
  // What it refuses with cudaErrorNotSupported and nothing written: a GLU member where only separate calls would
  // take the group (Auto past the GLU rows and the tensor-core rows; Separate), one with FP32 output, one with
  // w_up off w's alignment.
  const int64_t in = 64, out = 16, rows = 40;
  DeviceBuffer dx(rows * in * 2), dw(out * in * 2 + 16), dy(rows * out * 4);
  CUDA_CHECK(cudaMemsetAsync(dx.get(), 0, dx.bytes(), st()));
  CUDA_CHECK(cudaMemsetAsync(dw.get(), 0, dw.bytes(), st()));
  CUDA_CHECK(cudaMemsetAsync(dy.get(), 0x5a, dy.bytes(), st()));
  cu::LinearOut o = cu::glu_member(dw.get<bf16>(), dw.get<bf16>(), dy.get<bf16>(), out, kSitu);
  const cu::LinearOut two[2] = {{dw.get<bf16>(), dy.get(), out}, o};
  EXPECT_EQ(cu::linear_group(ctx(), dx.get<bf16>(), rows, in, two, 2), cudaErrorNotSupported) << "Auto at 40 rows";
  EXPECT_EQ(cu::linear_group_via(ctx(), Path::Separate, dx.get<bf16>(), 2, in, &o, 1), cudaErrorNotSupported);
  o.y_f32 = true;
  EXPECT_EQ(cu::linear_group_via(ctx(), Path::Grouped, dx.get<bf16>(), 1, in, &o, 1), cudaErrorNotSupported);
  o.y_f32 = false;
  o.w_up = dw.get<bf16>() + 1;
  EXPECT_EQ(cu::linear_group_via(ctx(), Path::Grouped, dx.get<bf16>(), 1, in, &o, 1), cudaErrorNotSupported);
  const auto y = download<uint8_t>(dy, static_cast<size_t>(dy.bytes()));
  size_t written = 0;
  for (uint8_t v : y) written += v != 0x5a;
  EXPECT_EQ(written, 0u) << "a refused group wrote its output";
}

// The routed experts of one rank against the CPU model's recipe (layers.cpp moe_ffn): each local expert
// runs ops::expert_mlp on the rows that chose it, then every row sums w * output over its local j in order.
struct MoeCase {
  int64_t rows;
  int k;
  int64_t L, I;
  int num_experts, expert_begin, expert_count;
  int max_local_per_row;  // each row takes 0..max of its k experts from the local range
};

void check_moe_experts(const MoeCase& c, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << "rows " << c.rows << " k " << c.k << " L " << c.L << " I " << c.I
                                  << " local " << c.expert_count);
  Rng rng(seed);
  const int64_t pairs = c.rows * c.k;
  // Routing: k distinct experts per row, 1..max_local_per_row of them local (row 0 none when rows > 1 and
  // some experts are remote; all when every expert is local).
  std::vector<int32_t> idx(static_cast<size_t>(pairs));
  std::vector<float> w(static_cast<size_t>(pairs));
  const bool all_local = c.expert_count == c.num_experts;
  const bool empty_row0 = !all_local && c.rows > 1;
  for (int64_t r = 0; r < c.rows; ++r) {
    const int want_local = all_local    ? c.k
                           : r == 0 && empty_row0 ? 0
                                                  : std::min<int>(c.k, 1 + static_cast<int>(rng.below(c.max_local_per_row)));
    std::vector<int32_t> chosen;
    while (static_cast<int>(chosen.size()) < c.k) {
      const bool local = static_cast<int>(chosen.size()) < want_local;
      int32_t e;
      if (local) {
        e = c.expert_begin + static_cast<int32_t>(rng.below(c.expert_count));
      } else {
        e = static_cast<int32_t>(rng.below(c.num_experts - c.expert_count));
        if (e >= c.expert_begin) e += c.expert_count;  // outside the local range
      }
      if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
    }
    for (int j = c.k - 1; j > 0; --j) std::swap(chosen[j], chosen[rng.below(j + 1)]);  // local ones anywhere
    for (int j = 0; j < c.k; ++j) {
      idx[r * c.k + j] = chosen[j];
      w[r * c.k + j] = static_cast<float>(rng.uniform(0.02, 0.3));
    }
  }
  const auto z = random_bf16_values(static_cast<size_t>(c.rows * c.L), seed + 1);
  std::vector<Mxfp4Host> w1, w3, w2;
  for (int e = 0; e < c.expert_count; ++e) {
    w1.push_back(random_mxfp4(c.I, c.L, seed + 10 + 3 * e));
    w3.push_back(random_mxfp4(c.I, c.L, seed + 11 + 3 * e));
    w2.push_back(random_mxfp4(c.L, c.I, seed + 12 + 3 * e));
  }

  // CPU: each local expert on its rows (pair order), then the combine in j order.
  std::vector<float> expert_out(static_cast<size_t>(pairs * c.L), 0.f);
  for (int e = 0; e < c.expert_count; ++e) {
    std::vector<int64_t> members;
    for (int64_t p = 0; p < pairs; ++p)
      if (idx[p] == c.expert_begin + e) members.push_back(p);
    if (members.empty()) continue;
    const auto n = static_cast<int64_t>(members.size());
    std::vector<float> zin(static_cast<size_t>(n * c.L)), zout(zin.size()), scratch(static_cast<size_t>(2 * n * c.I));
    for (int64_t j = 0; j < n; ++j) std::copy_n(&z[(members[j] / c.k) * c.L], c.L, &zin[j * c.L]);
    ops::expert_mlp(zin.data(), w1[e].view(), w3[e].view(), w2[e].view(), zout.data(), n, c.L, c.I, kSitu,
                    scratch.data());
    for (int64_t j = 0; j < n; ++j) std::copy_n(&zout[j * c.L], c.L, &expert_out[members[j] * c.L]);
  }
  std::vector<float> want(static_cast<size_t>(c.rows * c.L), 0.f);
  double weighted_max = 0;  // max over rows of sum_j w |expert output|: the scale the ulps of the outputs move
  for (int64_t r = 0; r < c.rows; ++r) {
    double row_scale = 0;
    for (int j = 0; j < c.k; ++j) {
      const int64_t p = r * c.k + j;
      if (idx[p] < c.expert_begin || idx[p] >= c.expert_begin + c.expert_count) continue;
      double omax = 0;
      for (int64_t i = 0; i < c.L; ++i) {
        want[r * c.L + i] += w[p] * expert_out[p * c.L + i];
        omax = std::max(omax, std::fabs(double(expert_out[p * c.L + i])));
      }
      row_scale += w[p] * omax;
    }
    weighted_max = std::max(weighted_max, row_scale);
  }
  round_bf16_inplace(want.data(), static_cast<int64_t>(want.size()));

  // GPU: all experts' tensors in one allocation, the pointer tables beside.
  const size_t b1 = w1[0].packed.size(), s1 = w1[0].scale.size(), b2 = w2[0].packed.size(), s2 = w2[0].scale.size();
  const size_t per_expert = 2 * (b1 + s1) + b2 + s2;
  std::vector<uint8_t> blob(per_expert * c.expert_count);
  std::vector<size_t> off1(c.expert_count), off1s(c.expert_count), off3(c.expert_count), off3s(c.expert_count),
      off2(c.expert_count), off2s(c.expert_count);
  for (int e = 0; e < c.expert_count; ++e) {
    size_t at = per_expert * e;
    const auto put = [&](const std::vector<uint8_t>& v, size_t& off) {
      off = at;
      std::copy(v.begin(), v.end(), blob.begin() + static_cast<int64_t>(at));
      at += v.size();
    };
    put(w1[e].packed, off1[e]);
    put(w1[e].scale, off1s[e]);
    put(w3[e].packed, off3[e]);
    put(w3[e].scale, off3s[e]);
    put(w2[e].packed, off2[e]);
    put(w2[e].scale, off2s[e]);
  }
  DeviceBuffer dblob = upload(blob);
  const auto table = [&](const std::vector<size_t>& off) {
    std::vector<const uint8_t*> p(off.size());
    for (size_t i = 0; i < off.size(); ++i) p[i] = dblob.get<uint8_t>() + off[i];
    return upload(p);
  };
  DeviceBuffer t1 = table(off1), t1s = table(off1s), t3 = table(off3), t3s = table(off3s), t2 = table(off2),
               t2s = table(off2s);
  ops::cuda::Mxfp4ExpertTable ex;
  ex.w1_packed = t1.get<const uint8_t*>();
  ex.w1_scale = t1s.get<const uint8_t*>();
  ex.w3_packed = t3.get<const uint8_t*>();
  ex.w3_scale = t3s.get<const uint8_t*>();
  ex.w2_packed = t2.get<const uint8_t*>();
  ex.w2_scale = t2s.get<const uint8_t*>();
  DeviceBuffer dz = upload_bf16(z), didx = upload(idx), dw = upload(w), dy(want.size() * 2);
  CUDA_CHECK(cudaMemsetAsync(dy.get(), 0xff, dy.bytes(), st()));  // NaN: a row left unwritten fails
  DeviceBuffer dscr(ops::cuda::moe_experts_scratch_bytes(c.rows, c.k, c.L, c.I));
  ASSERT_EQ(ops::cuda::moe_experts(ctx(), dz.get<bf16>(), didx.get<int32_t>(), dw.get<float>(), ex, c.expert_begin,
                                   c.expert_count, dy.get<bf16>(), dscr.get(), c.rows, c.k, c.L, c.I, kSitu),
            0);
  const auto got = download_bf16(dy, want.size());
  // Each expert output may sit kChained of its own scale off; the sum rounds once more.
  expect_close(got, want, kOneRounding, kChained * weighted_max, "moe_experts");
  if (empty_row0) {
    for (int64_t i = 0; i < c.L; ++i) ASSERT_EQ(got[i], 0.f) << "row 0 has no local expert";
  }
  // The latent norm folded into the combine: the bits of moe_experts followed by cuda::rmsnorm, and the CPU
  // rmsnorm of the (checked) GPU sums within the two roundings the norm's FP32 sum order can move. Row 0
  // with no local expert is all zeros: the norm keeps it 0 (eps > 0).
  const auto gamma = gputest::random_bf16_values(static_cast<size_t>(c.L), seed + 7);
  const float eps = 1e-5f;
  DeviceBuffer dgamma = upload_bf16(gamma), dyn(want.size() * 2);
  ASSERT_EQ(ops::cuda::moe_experts(ctx(), dz.get<bf16>(), didx.get<int32_t>(), dw.get<float>(), ex, c.expert_begin,
                                   c.expert_count, dyn.get<bf16>(), dscr.get(), c.rows, c.k, c.L, c.I, kSitu,
                                   {dgamma.get<bf16>(), eps}),
            0);
  ASSERT_EQ(ops::cuda::rmsnorm(dy.get<bf16>(), dgamma.get<bf16>(), dy.get<bf16>(), c.rows, c.L, eps, ctx().stream), 0);
  const auto fused = download_bf16(dyn, want.size());
  EXPECT_EQ(fused, download_bf16(dy, want.size())) << "moe_experts + norm vs moe_experts, then rmsnorm";
  std::vector<float> yn(got.size());
  ops::rmsnorm(got.data(), to_bf16_vec(gamma).data(), yn.data(), c.rows, c.L, eps);
  double worst = 0;
  for (size_t i = 0; i < yn.size(); ++i)
    worst = std::max(worst, std::fabs(double(fused[i]) - yn[i]) / (1e-6 + std::fabs(double(yn[i]))));
  EXPECT_LE(worst, 1.0 / 64) << "moe_experts + norm vs the CPU rmsnorm of its sums";
}

TEST(CudaMoe, MoeExpertsMatchesCpuSmall) {
  K3_REQUIRE_GPU();
  // 16 experts, 8 local ([4, 12)): many pairs per expert, so pair tiles of several rows.
  for (int64_t rows : {1, 7, 33}) check_moe_experts({rows, 4, 64, 96, 16, 4, 8, 4}, 9000 + rows);
  // Every expert local, a non-power-of-two k.
  check_moe_experts({5, 3, 96, 64, 6, 0, 6, 3}, 9100);
  // 96 pairs on each of 4 experts: several passes of 24 tokens; K = 96 and 160 end inside a 128-value
  // chunk; 10 and 3 row tiles leave warps of a CTA idle.
  check_moe_experts({96, 4, 96, 160, 4, 0, 4, 4}, 9150);
  // 12 pairs per expert: two token tiles per pass.
  check_moe_experts({24, 2, 64, 96, 4, 0, 4, 2}, 9160);
}

// K3's chunking: the cases of the two WholeChunks tests.
void check_moe_experts_whole_chunks() {
  // K a multiple of 128 both ways (every chunk whole, as at the K3 shapes). 96 pairs per expert: 4 passes
  // of 24 tokens; UP 24 row tiles, DOWN 8.
  check_moe_experts({96, 4, 256, 384, 4, 0, 4, 4}, 9300);
  // 12 pairs per expert (two token tiles per pass); DOWN 4 row tiles.
  check_moe_experts({24, 2, 128, 256, 4, 0, 4, 2}, 9310);
  // 6 experts x 192 UP row tiles, more than one CTA range per slot; 32 pairs per expert: 2 passes.
  check_moe_experts({64, 3, 256, 3072, 6, 0, 6, 3}, 9320);
  // 2 pairs per expert (split K): 8 experts x 192 UP row tiles, more items than one wave of CTAs (teams of
  // 4 warps); DOWN 8 x 16 items (teams of 8).
  check_moe_experts({8, 2, 512, 3072, 8, 0, 8, 2}, 9330);
}

TEST(CudaMoe, MoeExpertsMatchesCpuWholeChunks) {
  K3_REQUIRE_GPU();
  check_moe_experts_whole_chunks();
}

// The same cases through the warp-specialized wgmma kernel (moe_experts_wg.cu; L and I multiples of 64,
// else moe_experts takes today's kernels), then back to what K3_MOE_WG asks for.
struct ForceWg {
  ForceWg() { ops::cuda::moe_experts_force_wg(true); }
  ~ForceWg() {
    const char* e = std::getenv("K3_MOE_WG");
    ops::cuda::moe_experts_force_wg(e != nullptr && std::string(e) == "1");
  }
};

TEST(CudaMoe, MoeExpertsWgMatchesCpuSmall) {
  K3_REQUIRE_GPU();
  const ForceWg wg;
  // Shapes it takes: one row tile and one stage (L 64), several of each; 1..33 rows; passes of 32 columns.
  for (int64_t rows : {1, 7, 33}) check_moe_experts({rows, 4, 64, 128, 16, 4, 8, 4}, 9400 + rows);
  check_moe_experts({5, 3, 128, 64, 6, 0, 6, 3}, 9410);
  // 96 pairs on each of 4 experts: 3 passes of 32 columns.
  check_moe_experts({96, 4, 128, 192, 4, 0, 4, 4}, 9420);
  // UP: one stage per item and several items per CTA, so the load cursor crosses items within its depth.
  check_moe_experts({40, 4, 64, 4096, 16, 0, 16, 4}, 9430);
  // Shapes it leaves to today's kernels (I = 96, 160: not multiples of 64).
  check_moe_experts({33, 4, 64, 96, 16, 4, 8, 4}, 9033);
  check_moe_experts({96, 4, 96, 160, 4, 0, 4, 4}, 9150);
}

TEST(CudaMoe, MoeExpertsWgMatchesCpuWholeChunks) {
  K3_REQUIRE_GPU();
  const ForceWg wg;
  check_moe_experts_whole_chunks();
}

TEST(CudaMoe, MoeExpertsWgMatchesCpuK3RankSlice) {
  K3_REQUIRE_GPU();
  const ForceWg wg;
  check_moe_experts({1, 16, 3584, 3072, 896, 280, 28, 2}, 9200);
  check_moe_experts({64, 16, 3584, 3072, 896, 280, 28, 3}, 9201);
}

// The split-K kernel with each team size forced (moe_experts_force_team: 1 = teams of 4 warps, 2 = of 8,
// whatever the wave), on the cases that take it (1-2 pairs per expert: the K3 rank slice at one row, 8 x 2
// pairs at K3's I), then back to what K3_MOE_TEAM asks for.
TEST(CudaMoe, MoeExpertsMatchesCpuWithEitherTeamSize) {
  K3_REQUIRE_GPU();
  struct Restore {
    ~Restore() {
      const char* e = std::getenv("K3_MOE_TEAM");
      ops::cuda::moe_experts_force_team(e != nullptr ? std::atoi(e) : 0);
    }
  } restore;
  for (int team : {1, 2}) {
    SCOPED_TRACE(testing::Message() << "team choice " << team);
    ops::cuda::moe_experts_force_team(team);
    check_moe_experts({8, 2, 512, 3072, 8, 0, 8, 2}, 9340 + team);
    check_moe_experts({1, 16, 3584, 3072, 896, 280, 28, 2}, 9350 + team);
  }
}

// One choice per row (k = 1, as the EP owner and the loopback call it): the split-K kernel (1-2 pairs per
// expert, the K3 shapes) and the ring kernel (6 and 24 pairs per expert), a row with no local expert (row 0).
TEST(CudaMoe, MoeExpertsOneChoicePerRow) {
  K3_REQUIRE_GPU();
  check_moe_experts({7, 1, 64, 96, 16, 4, 8, 1}, 9500);
  check_moe_experts({3, 1, 3584, 3072, 896, 280, 28, 1}, 9501);
  check_moe_experts({24, 1, 64, 96, 4, 0, 4, 1}, 9502);
  check_moe_experts({96, 1, 96, 160, 4, 0, 4, 1}, 9503);
}

TEST(CudaMoe, MoeExpertsRejectsBadArguments) {
  K3_REQUIRE_GPU();
  const int64_t rows = 2, L = 64, I = 32;
  DeviceBuffer z(rows * L * 2), y(rows * L * 2 + 16), idx(rows * 4), w(rows * 4),
      scr(ops::cuda::moe_experts_scratch_bytes(rows, 1, L, I));
  const ops::cuda::Mxfp4ExpertTable ex;  // never read: every call below fails its checks first
  const auto call = [&](bf16* out, int64_t l) {
    return ops::cuda::moe_experts(ctx(), z.get<bf16>(), idx.get<int32_t>(), w.get<float>(), ex, 0, 1, out, scr.get(),
                                  rows, 1, l, I, kSitu);
  };
  EXPECT_EQ(call(y.get<bf16>() + 1, L), static_cast<int>(cudaErrorMisalignedAddress)) << "y 2 bytes off 16";
  EXPECT_EQ(call(y.get<bf16>(), 48), static_cast<int>(cudaErrorInvalidValue)) << "L not a multiple of 32";
}

TEST(CudaMoe, MoeExpertsMatchesCpuK3RankSlice) {
  K3_REQUIRE_GPU();
  // EP32: 28 of 896 experts (ids [280, 308)), k = 16, L = 3584, I = 3072.
  check_moe_experts({1, 16, 3584, 3072, 896, 280, 28, 2}, 9200);
  check_moe_experts({64, 16, 3584, 3072, 896, 280, 28, 3}, 9201);
}

// ---------------------------------------------------------------------------------------------
// router

// Logits (and bias) whose biased scores are, per row, a permutation of evenly spaced values (0.8 / E
// apart, far above FP32 rounding), so the selection is unambiguous for any correctly rounded-ish expf.
void margin_inputs(int64_t T, int E, bool with_bias, uint64_t seed, std::vector<float>& logits,
                   std::vector<float>& bias) {
  Rng rng(seed);
  logits.resize(static_cast<size_t>(T * E));
  bias.assign(static_cast<size_t>(E), 0.f);
  if (with_bias) {
    for (auto& b : bias) b = static_cast<float>(rng.uniform(-0.05, 0.05));
  }
  std::vector<int> perm(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    for (int i = E - 1; i > 0; --i) std::swap(perm[i], perm[rng.below(i + 1)]);
    for (int e = 0; e < E; ++e) {
      const double s = 0.1 + 0.8 * perm[e] / E - bias[e];  // s + bias is the spaced target
      logits[t * E + e] = static_cast<float>(std::log(s / (1 - s)));
    }
  }
}

void check_route(const std::vector<float>& logits, const std::vector<float>* bias, int64_t T, int E, int k, bool renorm,
                 float scale, const char* what) {
  SCOPED_TRACE(testing::Message() << what << ": T " << T << " E " << E << " k " << k << " renorm " << renorm
                                  << " bias " << (bias != nullptr));
  std::vector<int32_t> idx(static_cast<size_t>(T * k));
  std::vector<float> w(idx.size());
  ops::route(logits.data(), bias ? bias->data() : nullptr, T, E, k, renorm, scale, idx.data(), w.data());
  DeviceBuffer dl = upload(logits), db = bias ? upload(*bias) : DeviceBuffer(), di(idx.size() * 4), dw(w.size() * 4);
  ASSERT_EQ(ops::cuda::route(dl.get<float>(), bias ? db.get<float>() : nullptr, T, E, k, renorm, scale,
                             di.get<int32_t>(), dw.get<float>(), st()),
            0);
  EXPECT_EQ(download<int32_t>(di, idx.size()), idx);
  expect_close(download<float>(dw, w.size()), w, kF32Rel, 0.0, "route weights");
}

TEST(CudaRouter, MatchesCpuSelectionAndWeights) {
  K3_REQUIRE_GPU();
  struct Case {
    int64_t T;
    int E, k;
  };
  // The network path (k <= 32, E <= 4096) with lists of 16 (k <= 16) and of 32, one warp (E <= 128) and
  // many, E = 1, k = E, E = 4096 (32 warps); the round path for k > 32 or E > 4096 (up to the limit).
  const Case cases[] = {{1, 8, 1},     {2, 1, 1},     {5, 64, 6},     {3, 32, 32},   {3, 33, 33},
                        {7, 100, 7},   {4, 100, 20},  {1, 896, 16},   {64, 896, 16}, {4, 896, 32},
                        {5, 1000, 16}, {2, 4096, 32}, {2, 4097, 16},  {9, 2000, 40}, {1, 12032, 16}};
  uint64_t seed = 10000;
  for (const auto& c : cases) {
    for (bool with_bias : {false, true}) {
      std::vector<float> logits, bias;
      margin_inputs(c.T, c.E, with_bias, seed++, logits, bias);
      for (bool renorm : {true, false}) {
        check_route(logits, with_bias ? &bias : nullptr, c.T, c.E, c.k, renorm, 2.827f, "margins");
      }
    }
  }
}

TEST(CudaRouter, TiesGoToTheLowerIndexAndNanNeverWins) {
  K3_REQUIRE_GPU();
  const int E = 96;
  const int64_t T = 5;
  std::vector<float> logits(static_cast<size_t>(T * E));
  for (int e = 0; e < E; ++e) {
    logits[e] = 0.25f;                                              // row 0: all equal
    logits[E + e] = 0.1f * static_cast<float>(e % 5);               // row 1: groups of equal scores
    logits[2 * E + e] = e == 0 || e == 50 ? NAN : 0.01f * e;        // row 2: NaNs
    logits[3 * E + e] = e % 4 == 1 ? INFINITY : -INFINITY;          // row 3: s exactly 1 or 0, many ties
    logits[4 * E + e] = e % 2 == 0 ? -INFINITY : NAN;               // row 4: s = 0 ties above NaN's -inf
  }
  std::vector<float> bias(static_cast<size_t>(E));
  for (int e = 0; e < E; ++e) bias[e] = (e % 3 == 0) ? 0.5f : 0.f;  // the bias steers ties too
  // k = 16 and 32: the network's two list sizes; k = 48: the round path.
  for (int k : {16, 32, 48}) {
    check_route(logits, nullptr, T, E, k, true, 1.0f, "ties");
    check_route(logits, &bias, T, E, k, true, 1.0f, "ties with bias");
  }
}

}  // namespace
}  // namespace k3
