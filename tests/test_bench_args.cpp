// k3decode bench's argument checks (src/bench/bench.h check_bench_args), host code only: every bad flag is
// refused with a one-line error naming the flag and the value before anything touches a GPU, and the
// defaults and the documented runs (the rank slice's table, --ops sections, a tiny preset) pass.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>

#include "bench/bench.h"
#include "core/error.h"

namespace k3 {
namespace {

// The message of the Error check_bench_args raises for `a`, or "" when it accepts them.
std::string refusal(const BenchArgs& a) {
  try {
    check_bench_args(a);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

BenchArgs with(const std::function<void(BenchArgs&)>& edit) {
  BenchArgs a;
  edit(a);
  return a;
}

TEST(BenchArgs, TheDocumentedRunsPass) {
  EXPECT_EQ(refusal(BenchArgs{}), "");  // the rank slice of TP8 x DP4, both steps, B 1 8 32 64, q 1 4
  EXPECT_EQ(refusal(with([](BenchArgs& a) {
              a.variant = "k3.1";
              a.steps = {"hybrid"};
              a.shared_experts = "replicated";
              a.layer_copies = 8;
              a.rank = 31;
            })),
            "");
  EXPECT_EQ(refusal(with([](BenchArgs& a) {
              a.ops = true;
              a.ops_only = "moe";
            })),
            "");
  EXPECT_EQ(refusal(with([](BenchArgs& a) {
              a.preset = "tiny";
              a.tp = a.dp = 1;
              a.context = 0;
              a.warmup = 0;
            })),
            "");
  // A model directory names its own variant: --variant is not read.
  EXPECT_EQ(refusal(with([](BenchArgs& a) {
              a.model_dir = "/some/model";
              a.variant = "whatever";
              a.tp = a.dp = 1;
            })),
            "");
}

TEST(BenchArgs, EachBadFlagIsNamedWithItsValue) {
  struct Case {
    const char* what;
    std::function<void(BenchArgs&)> edit;
    const char* expect;  // a part of the message
  };
  const Case cases[] = {
      {"unknown preset", [](BenchArgs& a) { a.preset = "huge"; }, "--preset huge"},
      {"unknown variant", [](BenchArgs& a) { a.variant = "k4"; }, "--variant k4"},
      {"tp 0", [](BenchArgs& a) { a.tp = 0; }, "--tp 0"},
      {"dp -1", [](BenchArgs& a) { a.dp = -1; }, "--dp -1"},
      {"rank past the world", [](BenchArgs& a) { a.rank = 32; }, "--rank 32: expected 0..31"},
      {"negative rank", [](BenchArgs& a) { a.rank = -1; }, "--rank -1"},
      {"no batches", [](BenchArgs& a) { a.batches.clear(); }, "--batches"},
      {"batch of 0", [](BenchArgs& a) { a.batches = {1, 0}; }, "--batches 0"},
      {"no q", [](BenchArgs& a) { a.qs.clear(); }, "--q"},
      {"q of -2", [](BenchArgs& a) { a.qs = {-2}; }, "--q -2"},
      {"negative context", [](BenchArgs& a) { a.context = -5; }, "--context -5"},
      {"iters 0", [](BenchArgs& a) { a.iters = 0; }, "--iters 0"},
      {"negative warmup", [](BenchArgs& a) { a.warmup = -1; }, "--warmup -1"},
      {"a misspelt step", [](BenchArgs& a) { a.steps = {"stock", "hybird"}; }, "--steps hybird"},
      {"no steps", [](BenchArgs& a) { a.steps.clear(); }, "--steps"},
      {"unknown shared experts", [](BenchArgs& a) { a.shared_experts = "half"; }, "--shared-experts half"},
      {"stock with TP-sharded shared experts",
       [](BenchArgs& a) {
         a.steps = {"stock"};
         a.shared_experts = "tp";
       },
       "stock"},
      {"ops-only without ops", [](BenchArgs& a) { a.ops_only = "moe"; }, "--ops-only moe needs --ops"},
      {"unknown ops section",
       [](BenchArgs& a) {
         a.ops = true;
         a.ops_only = "attention";
       },
       "not 'attention'"},
      {"negative layer copies", [](BenchArgs& a) { a.layer_copies = -2; }, "--layer-copies -2"},
      {"layer copies off the rank slice",
       [](BenchArgs& a) {
         a.preset = "tiny";
         a.layer_copies = 2;
       },
       "--layer-copies is for the rank slice"},
      // K3 has 96 attention and KDA heads: a TP size that does not divide them cannot cut the slice.
      {"a TP the heads do not divide", [](BenchArgs& a) { a.tp = 5; }, "do not divide over --tp 5"},
  };
  for (const Case& c : cases) {
    const std::string msg = refusal(with(c.edit));
    EXPECT_NE(msg.find(c.expect), std::string::npos) << c.what << ": '" << msg << "'";
    EXPECT_EQ(msg.find('\n'), std::string::npos) << c.what << ": not one line: '" << msg << "'";
  }
}

TEST(BenchArgs, TheJsonPathIsWrittenFirst) {
  const auto dir = std::filesystem::temp_directory_path() / "k3_bench_args_test";
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "points.json").string();
  {
    std::ofstream old(path);
    old << "stale";
  }
  EXPECT_EQ(refusal(with([&](BenchArgs& a) { a.json = path; })), "");
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_EQ(text.str(), "[]\n");  // an empty list of points: valid JSON until the first point replaces it
  const std::string bad = (dir / "no-such-dir" / "points.json").string();
  EXPECT_NE(refusal(with([&](BenchArgs& a) { a.json = bad; })).find("--json " + bad), std::string::npos);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace k3
