// safetensors reader/writer and checkpoint directories: round trips of random
// tensors, hand-built files checked against the format independently, and
// every malformed input rejected with a one-line k3::Error naming the culprit.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "config/model_config.h"
#include "core/error.h"
#include "core/rng.h"
#include "core/tensor.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "fuzz_util.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A fresh directory per test, removed afterwards.
class TempDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Not named after the test: messages are checked for words that test names contain.
    static int serial = 0;
    dir_ = fs::temp_directory_path() / fmt::format("k3_io_{}_{}", ::getpid(), serial++);
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string file(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::string u64_le(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

// A safetensors file from raw parts: u64 header length + header + data_bytes of a known pattern.
void write_raw(const std::string& path, const std::string& header, size_t data_bytes) {
  std::string data(data_bytes, '\0');
  for (size_t i = 0; i < data_bytes; ++i) data[i] = static_cast<char>(i * 7 + 1);
  write_bytes(path, u64_le(header.size()) + header + data);
}

k3::Tensor random_tensor(k3::DType dtype, k3::Shape shape, k3::Rng& rng) {
  k3::Tensor t(dtype, std::move(shape));
  auto* p = static_cast<unsigned char*>(t.data());
  for (size_t i = 0; i < t.nbytes(); ++i) p[i] = static_cast<unsigned char>(rng.next_u64() >> 56);
  return t;
}

// Reads every byte of v (a view into a mapped file: out of the mapping it faults, under ASan too). The sum
// goes to a volatile, so the reads are not optimised away.
void read_all(const k3::TensorView& v) {
  static volatile uint64_t sink = 0;
  const auto* bytes = static_cast<const unsigned char*>(v.data);
  uint64_t sum = 0;
  for (size_t i = 0; i < v.nbytes(); ++i) sum += bytes[i];
  sink = sink + sum;
}

bool same_bytes(const k3::TensorView& a, const k3::TensorView& b) {
  return a.dtype == b.dtype && a.shape == b.shape && a.nbytes() == b.nbytes() &&
         (a.nbytes() == 0 || std::memcmp(a.data, b.data, a.nbytes()) == 0);
}

// Runs f, which must throw k3::Error with a one-line message containing every one of `parts`.
template <typename F>
void expect_error(F&& f, const std::vector<std::string>& parts) {
  std::string msg;
  EXPECT_THROW(
      {
        try {
          f();
        } catch (const k3::Error& e) {
          msg = e.what();
          throw;
        }
      },
      k3::Error);
  EXPECT_EQ(msg.find('\n'), std::string::npos) << "multi-line message: " << msg;
  for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "message lacks \"" << p << "\": " << msg;
}

k3::ModelConfig shared_config() {
  return k3::ModelConfig::from_file(std::string(K3_CONFIG_DIR) + "/kimi-k3.config.json");
}

// ---------------------------------------------------------------- round trips

using SafetensorsTest = TempDirTest;

TEST_F(SafetensorsTest, RoundTripRandomTensorsAndMetadata) {
  k3::Rng rng(1234);
  // Deliberately not in name order: the writer keeps the given order.
  std::vector<std::pair<std::string, k3::Tensor>> src;
  src.emplace_back("z.first.bf16", random_tensor(k3::DType::BF16, {3, 5}, rng));
  src.emplace_back("b.f32", random_tensor(k3::DType::F32, {7}, rng));
  src.emplace_back("c.u8.odd", random_tensor(k3::DType::U8, {3, 1, 11}, rng));
  src.emplace_back("d.i32.empty", random_tensor(k3::DType::I32, {0}, rng));
  src.emplace_back("e.bf16.empty", random_tensor(k3::DType::BF16, {4, 0, 3}, rng));
  src.emplace_back("f.f32.scalar", random_tensor(k3::DType::F32, {}, rng));
  src.emplace_back("g.i32", random_tensor(k3::DType::I32, {2, 3}, rng));
  src.emplace_back("h.u8.one", random_tensor(k3::DType::U8, {1}, rng));
  src.emplace_back("a.f32.big", random_tensor(k3::DType::F32, {64, 33}, rng));
  src.emplace_back("model.layers.0.bf16.odd", random_tensor(k3::DType::BF16, {13}, rng));
  std::vector<std::pair<std::string, k3::TensorView>> views;
  for (const auto& [n, t] : src) views.emplace_back(n, t.view());
  const std::map<std::string, std::string> meta{{"format", "pt"}, {"note", "quote \" and ünïcode"}};

  const std::string path = file("rt.safetensors");
  k3::write_safetensors(path, views, meta);
  EXPECT_FALSE(fs::exists(path + ".tmp." + std::to_string(::getpid())));

  auto f = k3::SafetensorsFile::open(path);
  EXPECT_EQ(f->path(), path);
  std::vector<std::string> want_names;
  for (const auto& [n, t] : src) want_names.push_back(n);
  std::sort(want_names.begin(), want_names.end());
  EXPECT_EQ(f->names(), want_names);
  for (const auto& [n, t] : src) {
    ASSERT_TRUE(f->has(n)) << n;
    k3::TensorView v = f->get(n);
    EXPECT_EQ(v.dtype, t.dtype()) << n;
    EXPECT_EQ(v.shape, t.shape()) << n;
    EXPECT_TRUE(same_bytes(v, t.view())) << n;
  }
  EXPECT_EQ(f->metadata(), meta);
  EXPECT_FALSE(f->has("absent"));
}

TEST_F(SafetensorsTest, WrittenLayoutMatchesTheFormat) {
  k3::Rng rng(99);
  k3::Tensor a = random_tensor(k3::DType::U8, {5}, rng);
  k3::Tensor b = random_tensor(k3::DType::BF16, {2, 3}, rng);
  k3::Tensor c = random_tensor(k3::DType::I32, {0, 4}, rng);
  k3::Tensor d = random_tensor(k3::DType::F32, {3}, rng);
  const std::string path = file("layout.safetensors");
  k3::write_safetensors(path, {{"w.a", a.view()}, {"w.b", b.view()}, {"w.c", c.view()}, {"w.d", d.view()}},
                        {{"k", "v"}});

  const std::string raw = read_bytes(path);
  ASSERT_GE(raw.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(raw[i]);
  EXPECT_EQ(n % 8, 0u) << "header padded to 8 bytes";
  ASSERT_EQ(raw.size(), 8 + n + 5 + 12 + 0 + 12);
  const std::string header = raw.substr(8, n);
  const size_t close = header.rfind('}');
  ASSERT_NE(close, std::string::npos);
  EXPECT_EQ(header.find_first_not_of(' ', close + 1), std::string::npos) << "padding is spaces";

  auto j = nlohmann::ordered_json::parse(header);
  std::vector<std::string> keys;
  for (const auto& [k, v] : j.items()) keys.push_back(k);
  EXPECT_EQ(keys, (std::vector<std::string>{"__metadata__", "w.a", "w.b", "w.c", "w.d"}));
  EXPECT_EQ(j["__metadata__"], nlohmann::ordered_json({{"k", "v"}}));
  EXPECT_EQ(j["w.a"]["dtype"], "U8");
  EXPECT_EQ(j["w.b"]["dtype"], "BF16");
  EXPECT_EQ(j["w.c"]["dtype"], "I32");
  EXPECT_EQ(j["w.d"]["dtype"], "F32");
  EXPECT_EQ(j["w.b"]["shape"], nlohmann::ordered_json({2, 3}));
  EXPECT_EQ(j["w.c"]["shape"], nlohmann::ordered_json({0, 4}));
  // Contiguous, in the given order.
  EXPECT_EQ(j["w.a"]["data_offsets"], nlohmann::ordered_json({0, 5}));
  EXPECT_EQ(j["w.b"]["data_offsets"], nlohmann::ordered_json({5, 17}));
  EXPECT_EQ(j["w.c"]["data_offsets"], nlohmann::ordered_json({17, 17}));
  EXPECT_EQ(j["w.d"]["data_offsets"], nlohmann::ordered_json({17, 29}));
  const char* data = raw.data() + 8 + n;
  EXPECT_EQ(std::memcmp(data, a.data(), 5), 0);
  EXPECT_EQ(std::memcmp(data + 5, b.data(), 12), 0);
  EXPECT_EQ(std::memcmp(data + 17, d.data(), 12), 0);
}

TEST_F(SafetensorsTest, ReadsHandBuiltFile) {
  // Unpadded header, entries out of offset order, a zero-size tensor inside another's range.
  const std::string header =
      R"({"second":{"dtype":"U8","shape":[2,2],"data_offsets":[8,12]},)"
      R"("first":{"dtype":"I32","shape":[2],"data_offsets":[0,8]},)"
      R"("empty":{"dtype":"F32","shape":[0,7],"data_offsets":[4,4]},)"
      R"("__metadata__":{"format":"pt1"}})";
  ASSERT_NE(header.size() % 8, 0u);
  const std::string path = file("hand.safetensors");
  write_raw(path, header, 12);
  auto f = k3::SafetensorsFile::open(path);
  EXPECT_EQ(f->names(), (std::vector<std::string>{"empty", "first", "second"}));
  EXPECT_EQ(f->metadata().at("format"), "pt1");
  // write_raw's data byte i is i * 7 + 1.
  k3::TensorView first = f->get("first");
  EXPECT_EQ(first.dtype, k3::DType::I32);
  EXPECT_EQ(first.shape, (k3::Shape{2}));
  int32_t v[2];
  std::memcpy(v, first.data, 8);
  EXPECT_EQ(v[0], int32_t(0x160F0801));
  EXPECT_EQ(v[1], int32_t(0x322B241D));
  k3::TensorView second = f->get("second");
  const auto* s = static_cast<const uint8_t*>(second.data);
  EXPECT_EQ(s[0], 8 * 7 + 1);
  EXPECT_EQ(s[3], 11 * 7 + 1);
  EXPECT_EQ(f->get("empty").numel(), 0);
}

TEST_F(SafetensorsTest, EmptyFileOfNoTensors) {
  const std::string path = file("none.safetensors");
  k3::write_safetensors(path, {});
  auto f = k3::SafetensorsFile::open(path);
  EXPECT_TRUE(f->names().empty());
  EXPECT_TRUE(f->metadata().empty());
}

TEST_F(SafetensorsTest, OverwritesAnExistingFile) {
  k3::Rng rng(5);
  const std::string path = file("over.safetensors");
  k3::Tensor a = random_tensor(k3::DType::F32, {100}, rng);
  k3::write_safetensors(path, {{"a", a.view()}});
  k3::Tensor b = random_tensor(k3::DType::U8, {3}, rng);
  k3::write_safetensors(path, {{"b", b.view()}});
  auto f = k3::SafetensorsFile::open(path);
  EXPECT_EQ(f->names(), std::vector<std::string>{"b"});
  EXPECT_TRUE(same_bytes(f->get("b"), b.view()));
}

// ---------------------------------------------------------------- writer errors

TEST_F(SafetensorsTest, WriteErrorsNameThePath) {
  k3::Tensor t(k3::DType::F32, {2});
  const std::string bad = (dir_ / "no_such_dir" / "x.safetensors").string();
  expect_error([&] { k3::write_safetensors(bad, {{"t", t.view()}}); }, {bad});
  const std::string path = file("dup.safetensors");
  expect_error([&] { k3::write_safetensors(path, {{"t", t.view()}, {"t", t.view()}}); }, {path, "t"});
  expect_error([&] { k3::write_safetensors(path, {{"__metadata__", t.view()}}); }, {path, "__metadata__"});
  EXPECT_FALSE(fs::exists(path));
}

// ---------------------------------------------------------------- reader errors

TEST_F(SafetensorsTest, MissingTensorLookupNamesTensorAndFile) {
  k3::Tensor t(k3::DType::BF16, {4});
  const std::string path = file("one.safetensors");
  k3::write_safetensors(path, {{"present", t.view()}});
  auto f = k3::SafetensorsFile::open(path);
  expect_error([&] { f->get("model.layers.7.absent.weight"); }, {path, "model.layers.7.absent.weight"});
}

TEST_F(SafetensorsTest, NonexistentFile) {
  const std::string path = file("missing.safetensors");
  expect_error([&] { k3::SafetensorsFile::open(path); }, {path});
}

TEST_F(SafetensorsTest, FileShorterThan8Bytes) {
  for (size_t n : {0, 1, 7}) {
    const std::string path = file(fmt::format("short{}.safetensors", n));
    write_bytes(path, std::string(n, '\x01'));
    expect_error([&] { k3::SafetensorsFile::open(path); }, {path, "8"});
  }
}

TEST_F(SafetensorsTest, HeaderSizeLargerThanFile) {
  const std::string path = file("long_header.safetensors");
  const std::string header = R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})";
  write_bytes(path, u64_le(header.size() + 2) + header + "x");
  expect_error([&] { k3::SafetensorsFile::open(path); }, {path, "header size"});
}

TEST_F(SafetensorsTest, AbsurdHeaderSize) {
  // Past the 100 MB limit, and so large that 8 + N wraps around.
  for (uint64_t n : {uint64_t{100'000'001}, uint64_t{1} << 62, ~uint64_t{0}, ~uint64_t{0} - 7}) {
    const std::string path = file("absurd.safetensors");
    write_bytes(path, u64_le(n) + "{}      ");
    expect_error([&] { k3::SafetensorsFile::open(path); }, {path, "header size"});
  }
}

TEST_F(SafetensorsTest, TruncatedData) {
  // A valid file cut short: the last tensor's end lies past the data.
  k3::Rng rng(3);
  k3::Tensor a = random_tensor(k3::DType::F32, {16}, rng);
  k3::Tensor b = random_tensor(k3::DType::BF16, {7}, rng);
  const std::string path = file("cut.safetensors");
  k3::write_safetensors(path, {{"model.a", a.view()}, {"model.norm.weight", b.view()}});
  const std::string raw = read_bytes(path);
  write_bytes(path, raw.substr(0, raw.size() - 3));
  expect_error([&] { k3::SafetensorsFile::open(path); }, {path, "model.norm.weight", "beyond"});
}

// Seeded mutations of a valid file (bytes of the header flipped or replaced by JSON punctuation and digits, the
// size field moved, the file cut or extended): each opens, or fails with a one-line k3::Error naming the file;
// no other exception, no crash (run under ASan in CI), and every tensor of a file that opens reads in full
// within the file.
TEST_F(SafetensorsTest, MutatedFilesOpenOrFailCleanly) {
  k3::Rng rng(41);
  k3::Tensor a = random_tensor(k3::DType::F32, {3, 5}, rng);
  k3::Tensor b = random_tensor(k3::DType::BF16, {7}, rng);
  k3::Tensor c = random_tensor(k3::DType::U8, {2, 2, 3}, rng);
  const std::string good = file("good.safetensors");
  k3::write_safetensors(good, {{"model.a", a.view()}, {"model.b", b.view()}, {"model.c", c.view()}},
                        {{"format", "pt"}});
  const std::string raw = read_bytes(good);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(raw[i]);
  ASSERT_LT(8 + n, raw.size());
  const char alphabet[] = "{}[]\":,0123456789-.eE \\x";
  int opened = 0, refused = 0;
  for (int it = 0; it < 600; ++it) {
    std::string m = raw;
    const int kind = static_cast<int>(rng.below(5));
    const size_t hpos = 8 + static_cast<size_t>(rng.below(n));  // a byte of the header
    if (kind == 0) {
      for (int f = 1 + static_cast<int>(rng.below(3)); f > 0; --f)
        m[8 + rng.below(n)] ^= static_cast<char>(1u << rng.below(8));
    } else if (kind == 1) {
      m[hpos] = alphabet[rng.below(sizeof alphabet - 1)];
    } else if (kind == 2) {
      const uint64_t size = n + static_cast<uint64_t>(rng.below(33)) - 16;
      for (int i = 0; i < 8; ++i) m[i] = static_cast<char>((size >> (8 * i)) & 0xff);
    } else if (kind == 3) {
      m.resize(static_cast<size_t>(rng.below(raw.size())));
    } else {
      m.insert(hpos, std::string(1 + rng.below(4), alphabet[rng.below(sizeof alphabet - 1)]));
      m.erase(m.size() - 1);  // keep the size
    }
    const std::string path = file("mutated.safetensors");
    write_bytes(path, m);
    SCOPED_TRACE(testing::Message() << "iteration " << it << " kind " << kind);
    const bool ok = k3::test::accepted_or_clean_error(
        [&] {
          auto f = k3::SafetensorsFile::open(path);
          for (const std::string& name : f->names()) read_all(f->get(name));
        },
        path);
    (ok ? opened : refused)++;
  }
  EXPECT_GT(refused, 100);
  EXPECT_GT(opened, 10);  // harmless mutations (whitespace, metadata strings) still open
}

struct BadHeader {
  std::string label;
  std::string header;
  size_t data_bytes;
  std::vector<std::string> parts;  // the message must contain each
};

void PrintTo(const BadHeader& b, std::ostream* os) { *os << b.label; }

class SafetensorsBadHeader : public TempDirTest, public ::testing::WithParamInterface<BadHeader> {};

TEST_P(SafetensorsBadHeader, Rejected) {
  const std::string path = file("bad.safetensors");
  write_raw(path, GetParam().header, GetParam().data_bytes);
  auto parts = GetParam().parts;
  parts.push_back(path);
  expect_error([&] { k3::SafetensorsFile::open(path); }, parts);
}

const char* kNorm = "model.norm.weight";

std::string entry(const std::string& name, const std::string& dtype, const std::string& shape,
                  const std::string& offsets) {
  return fmt::format(R"("{}":{{"dtype":"{}","shape":{},"data_offsets":{}}})", name, dtype, shape, offsets);
}
std::string obj(const std::string& body) { return "{" + body + "}"; }

INSTANTIATE_TEST_SUITE_P(
    Safetensors, SafetensorsBadHeader,
    ::testing::Values(
        BadHeader{"not_json", R"({"model.norm.weight": {"dtype": )", 0, {"JSON"}},
        BadHeader{"not_json_garbage", "\x01\x02garbage", 0, {"JSON"}},
        BadHeader{"empty_header", "", 0, {"JSON"}},
        BadHeader{"not_object_array", "[1, 2, 3]", 0, {"array", "object"}},
        BadHeader{"not_object_string", R"("model")", 0, {"object"}},
        BadHeader{"entry_not_object", obj(R"("model.norm.weight": [1, 2])"), 0, {kNorm}},
        BadHeader{"unknown_dtype", obj(entry(kNorm, "BF17", "[7]", "[0, 14]")), 14, {kNorm, "BF17"}},
        BadHeader{"dtype_not_string", obj(R"("model.norm.weight":{"dtype":3,"shape":[1],"data_offsets":[0,1]})"), 1,
                  {kNorm, "dtype"}},
        BadHeader{"missing_dtype", obj(R"("model.norm.weight":{"shape":[1],"data_offsets":[0,1]})"), 1,
                  {kNorm, "dtype"}},
        BadHeader{"negative_shape", obj(entry(kNorm, "BF16", "[-7]", "[0, 14]")), 14, {kNorm, "shape"}},
        BadHeader{"negative_shape_2d", obj(entry(kNorm, "U8", "[-2, -3]", "[0, 6]")), 6, {kNorm, "shape"}},
        BadHeader{"fractional_shape", obj(entry(kNorm, "U8", "[2.5]", "[0, 2]")), 2, {kNorm, "shape"}},
        BadHeader{"shape_not_array", obj(entry(kNorm, "U8", "7", "[0, 7]")), 7, {kNorm, "shape"}},
        BadHeader{"missing_shape", obj(R"("model.norm.weight":{"dtype":"U8","data_offsets":[0,1]})"), 1,
                  {kNorm, "shape"}},
        BadHeader{"length_disagrees_with_shape", obj(entry(kNorm, "BF16", "[7]", "[0, 10]")), 14,
                  {kNorm, "hold 10 bytes", "needs 14"}},
        BadHeader{"length_too_long", obj(entry(kNorm, "F32", "[2, 2]", "[0, 20]")), 20, {kNorm, "needs 16"}},
        BadHeader{"huge_shape_overflows", obj(entry(kNorm, "F32", "[4294967296, 4294967296, 4294967296]", "[0, 8]")),
                  8, {kNorm, "too large"}},
        BadHeader{"shape_product_wraps_to_small", obj(entry(kNorm, "U8", "[4294967296, 4294967296, 2]", "[0, 0]")), 8,
                  {kNorm, "too large"}},
        BadHeader{"end_beyond_data", obj(entry(kNorm, "BF16", "[7]", "[4, 18]")), 14, {kNorm, "beyond"}},
        BadHeader{"begin_after_end", obj(entry(kNorm, "BF16", "[7]", "[14, 0]")), 14, {kNorm, "begin"}},
        BadHeader{"negative_offset", obj(entry(kNorm, "U8", "[2]", "[-2, 0]")), 4, {kNorm, "data_offsets"}},
        BadHeader{"offsets_wrong_arity", obj(entry(kNorm, "U8", "[2]", "[0, 2, 4]")), 4, {kNorm, "data_offsets"}},
        BadHeader{"offsets_missing", obj(R"("model.norm.weight":{"dtype":"U8","shape":[1]})"), 1,
                  {kNorm, "data_offsets"}},
        BadHeader{"overlap",
                  obj(entry("model.a", "BF16", "[7]", "[0, 14]") + "," + entry(kNorm, "BF16", "[7]", "[10, 24]")), 24,
                  {kNorm, "model.a", "overlap"}},
        BadHeader{"overlap_identical_ranges",
                  obj(entry("model.a", "U8", "[4]", "[0, 4]") + "," + entry(kNorm, "U8", "[4]", "[0, 4]")), 4,
                  {kNorm, "model.a", "overlap"}},
        BadHeader{"overlap_contained",
                  obj(entry("model.outer", "U8", "[10]", "[0, 10]") + "," + entry("model.x", "U8", "[2]", "[10, 12]") +
                      "," + entry(kNorm, "U8", "[2]", "[3, 5]")),
                  12, {kNorm, "model.outer", "overlap"}},
        BadHeader{"duplicate_name",
                  obj(entry(kNorm, "U8", "[2]", "[0, 2]") + "," + entry(kNorm, "U8", "[2]", "[2, 4]")), 4,
                  {kNorm, "twice"}},
        BadHeader{"metadata_not_string_valued", obj(R"("__metadata__":{"format":"pt","epoch":3})"), 0,
                  {"__metadata__", "epoch"}},
        BadHeader{"metadata_nested_object", obj(R"("__metadata__":{"format":{"a":"b"}})"), 0,
                  {"__metadata__", "format"}},
        BadHeader{"metadata_not_object", obj(R"("__metadata__":"pt")"), 0, {"__metadata__"}}),
    [](const ::testing::TestParamInfo<BadHeader>& info) { return info.param.label; });

// ---------------------------------------------------------------- checkpoints

using CheckpointTest = TempDirTest;

struct Source {
  k3::MemoryCheckpoint ck;
  std::vector<std::string> names;  // insertion order
};

// Tensors of several dtypes and sizes; `big` is larger than any small shard limit.
void fill_source(Source& s, uint64_t seed) {
  k3::Rng rng(seed);
  const std::vector<std::pair<k3::DType, k3::Shape>> specs = {
      {k3::DType::BF16, {5, 7}}, {k3::DType::F32, {9}},     {k3::DType::U8, {33}},  {k3::DType::I32, {0, 3}},
      {k3::DType::F32, {64, 4}}, {k3::DType::BF16, {11}},   {k3::DType::U8, {3, 5}}, {k3::DType::I32, {6}},
      {k3::DType::F32, {20}},    {k3::DType::BF16, {1, 13}}};
  for (size_t i = 0; i < specs.size(); ++i) {
    // Names out of sorted order, so that names() order and sorted order differ.
    std::string name = fmt::format("model.layers.{}.t{}.weight", (i * 7) % 10, i);
    s.ck.add(name, random_tensor(specs[i].first, specs[i].second, rng));
    s.names.push_back(name);
  }
}

size_t total_bytes(const Source& s) {
  size_t n = 0;
  for (const auto& name : s.names) n += s.ck.get(name).nbytes();
  return n;
}

void expect_same_tensors(const k3::TensorSource& got, const Source& want) {
  std::vector<std::string> sorted = want.names;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(got.names(), sorted);
  for (const auto& name : want.names) {
    ASSERT_TRUE(got.has(name)) << name;
    EXPECT_TRUE(same_bytes(got.get(name), want.ck.get(name))) << name;
  }
}

TEST_F(CheckpointTest, MemoryCheckpointKeepsInsertionOrder) {
  Source s;
  fill_source(s, 11);
  EXPECT_EQ(s.ck.names(), s.names);
  EXPECT_TRUE(s.ck.has(s.names[3]));
  EXPECT_FALSE(s.ck.has("nope"));
  expect_error([&] { s.ck.get("model.missing.weight"); }, {"model.missing.weight"});
  expect_error([&] { s.ck.mutable_tensor("model.missing.weight"); }, {"model.missing.weight"});
  expect_error([&] { s.ck.add(s.names[0], k3::Tensor(k3::DType::U8, {1})); }, {s.names[0]});
  s.ck.mutable_tensor(s.names[1]).as<float>()[0] = 42.0f;
  EXPECT_EQ(s.ck.get(s.names[1]).as<float>()[0], 42.0f);
}

TEST_F(CheckpointTest, SingleFileRoundTrip) {
  const k3::ModelConfig cfg = shared_config();
  Source s;
  fill_source(s, 21);
  const std::string dir = (dir_ / "model").string();
  k3::write_checkpoint(dir, cfg, s.ck, total_bytes(s));
  EXPECT_TRUE(fs::exists(dir_ / "model" / "model.safetensors"));
  EXPECT_FALSE(fs::exists(dir_ / "model" / "model.safetensors.index.json"));
  EXPECT_TRUE(fs::exists(dir_ / "model" / "config.json"));

  auto ck = k3::Checkpoint::open(dir);
  expect_same_tensors(*ck, s);
  EXPECT_EQ(ck->config().hidden_size, 7168);
  EXPECT_EQ(ck->config().num_layers, 93);
  EXPECT_EQ(ck->config().moe.num_experts, 896);
  EXPECT_EQ(ck->config().attn_kinds, cfg.attn_kinds);
  expect_error([&] { ck->get("model.layers.99.nope.weight"); }, {"model.layers.99.nope.weight"});
}

TEST_F(CheckpointTest, ShardedRoundTrip) {
  const k3::ModelConfig cfg = shared_config();
  Source s;
  fill_source(s, 31);
  const size_t max_shard = 100;  // the [64, 4] F32 tensor (1024 bytes) exceeds it alone
  const size_t total = total_bytes(s);
  ASSERT_GT(total, max_shard);
  const std::string dir = (dir_ / "sharded").string();
  k3::write_checkpoint(dir, cfg, s.ck, max_shard);
  EXPECT_FALSE(fs::exists(dir_ / "sharded" / "model.safetensors"));

  std::ifstream in(dir_ / "sharded" / "model.safetensors.index.json");
  ASSERT_TRUE(in.good());
  const json index = json::parse(in);
  EXPECT_EQ(index.at("metadata").at("total_size").get<size_t>(), total);
  const json& wm = index.at("weight_map");
  EXPECT_EQ(wm.size(), s.names.size());

  std::set<std::string> files;
  for (const auto& [name, f] : wm.items()) files.insert(f.get<std::string>());
  ASSERT_GE(files.size(), 3u);
  const size_t count = files.size();
  size_t i = 1;
  for (const auto& f : files) {
    EXPECT_EQ(f, fmt::format("model-{:05d}-of-{:05d}.safetensors", i++, count));
    auto shard = k3::SafetensorsFile::open((dir_ / "sharded" / f).string());
    size_t bytes = 0;
    for (const auto& n : shard->names()) {
      bytes += shard->get(n).nbytes();
      EXPECT_EQ(wm.at(n), f) << n;
    }
    EXPECT_TRUE(bytes <= max_shard || shard->names().size() == 1) << f << " holds " << bytes << " bytes";
  }
  // Shards follow names() order: walking the names visits shard files in non-decreasing order.
  std::string prev;
  for (const auto& name : s.names) {
    const std::string f = wm.at(name).get<std::string>();
    EXPECT_LE(prev, f) << name;
    prev = f;
  }

  auto ck = k3::Checkpoint::open(dir);
  expect_same_tensors(*ck, s);
  EXPECT_EQ(ck->config().attn_kinds, cfg.attn_kinds);
}

TEST_F(CheckpointTest, RewriteAsSingleFileReplacesShards) {
  const k3::ModelConfig cfg = shared_config();
  Source first, second;
  fill_source(first, 41);
  fill_source(second, 42);
  const std::string dir = (dir_ / "m").string();
  k3::write_checkpoint(dir, cfg, first.ck, 64);
  ASSERT_TRUE(fs::exists(dir_ / "m" / "model.safetensors.index.json"));
  k3::write_checkpoint(dir, cfg, second.ck, size_t{1} << 30);
  EXPECT_FALSE(fs::exists(dir_ / "m" / "model.safetensors.index.json"));
  auto ck = k3::Checkpoint::open(dir);
  expect_same_tensors(*ck, second);
}

// A hand-made sharded directory: config.json, shard files and an index.
void write_config(const fs::path& dir) {
  std::ofstream(dir / "config.json") << shared_config().to_json().dump(1);
}
void write_index(const fs::path& dir, const json& weight_map) {
  std::ofstream(dir / "model.safetensors.index.json") << json{{"metadata", {{"total_size", 0}}}, {"weight_map", weight_map}}.dump();
}

TEST_F(CheckpointTest, IndexReferencingMissingFile) {
  write_config(dir_);
  k3::Tensor t(k3::DType::F32, {3});
  k3::write_safetensors(file("model-00001-of-00002.safetensors"), {{"model.a", t.view()}});
  write_index(dir_, {{"model.a", "model-00001-of-00002.safetensors"}, {"model.b", "model-00002-of-00002.safetensors"}});
  expect_error([&] { k3::Checkpoint::open(dir_.string()); }, {"model-00002-of-00002.safetensors"});
}

TEST_F(CheckpointTest, TensorDuplicatedAcrossShards) {
  write_config(dir_);
  k3::Tensor t(k3::DType::F32, {3});
  k3::write_safetensors(file("s1.safetensors"), {{"model.dup", t.view()}, {"model.a", t.view()}});
  k3::write_safetensors(file("s2.safetensors"), {{"model.b", t.view()}, {"model.dup", t.view()}});
  write_index(dir_, {{"model.dup", "s1.safetensors"}, {"model.a", "s1.safetensors"}, {"model.b", "s2.safetensors"}});
  expect_error([&] { k3::Checkpoint::open(dir_.string()); }, {"model.dup", "s1.safetensors", "s2.safetensors"});
}

TEST_F(CheckpointTest, IndexPointsAtTheWrongShard) {
  write_config(dir_);
  k3::Tensor t(k3::DType::F32, {3});
  k3::write_safetensors(file("s1.safetensors"), {{"model.a", t.view()}});
  k3::write_safetensors(file("s2.safetensors"), {{"model.b", t.view()}});
  write_index(dir_, {{"model.a", "s2.safetensors"}, {"model.b", "s2.safetensors"}});
  expect_error([&] { k3::Checkpoint::open(dir_.string()); }, {"model.a", "s2.safetensors"});
}

TEST_F(CheckpointTest, ShardTensorMissingFromIndex) {
  write_config(dir_);
  k3::Tensor t(k3::DType::F32, {3});
  k3::write_safetensors(file("s1.safetensors"), {{"model.a", t.view()}, {"model.unlisted", t.view()}});
  write_index(dir_, {{"model.a", "s1.safetensors"}});
  expect_error([&] { k3::Checkpoint::open(dir_.string()); }, {"model.unlisted"});
}

TEST_F(CheckpointTest, MalformedIndex) {
  write_config(dir_);
  const std::string index = "model.safetensors.index.json";
  std::ofstream(dir_ / index) << "{\"weight_map\": ";
  expect_error([&] { k3::Checkpoint::open(dir_.string()); }, {index, "JSON"});
  std::ofstream(dir_ / index) << R"({"metadata": {}})";
  expect_error([&] { k3::Checkpoint::open(dir_.string()); }, {index, "weight_map"});
  std::ofstream(dir_ / index) << R"({"weight_map": {"model.a": 7}})";
  expect_error([&] { k3::Checkpoint::open(dir_.string()); }, {index, "model.a"});
  std::ofstream(dir_ / index) << R"({"weight_map": {"model.a": "../outside.safetensors"}})";
  expect_error([&] { k3::Checkpoint::open(dir_.string()); }, {index, "model.a"});
}

TEST_F(CheckpointTest, DirectoryWithoutConfig) {
  k3::Tensor t(k3::DType::F32, {3});
  k3::write_safetensors(file("model.safetensors"), {{"model.a", t.view()}});
  expect_error([&] { k3::Checkpoint::open(dir_.string()); }, {dir_.string(), "config.json"});
}

TEST_F(CheckpointTest, InvalidConfigIsRejected) {
  std::ofstream(dir_ / "config.json") << R"({"text_config": {"hidden_size": 16}})";
  k3::Tensor t(k3::DType::F32, {3});
  k3::write_safetensors(file("model.safetensors"), {{"model.a", t.view()}});
  expect_error([&] { k3::Checkpoint::open(dir_.string()); }, {"config.json", "num_hidden_layers"});
}

TEST_F(CheckpointTest, DirectoryWithoutWeights) {
  write_config(dir_);
  expect_error([&] { k3::Checkpoint::open(dir_.string()); }, {dir_.string(), "model.safetensors"});
}

TEST_F(CheckpointTest, NotADirectory) {
  const std::string missing = (dir_ / "nothing_here").string();
  expect_error([&] { k3::Checkpoint::open(missing); }, {missing});
}

TEST_F(CheckpointTest, CorruptShardNamesTheFile) {
  write_config(dir_);
  k3::Tensor t(k3::DType::F32, {3});
  k3::write_safetensors(file("model.safetensors"), {{"model.a", t.view()}});
  const std::string raw = read_bytes(file("model.safetensors"));
  write_bytes(file("model.safetensors"), raw.substr(0, raw.size() - 1));
  expect_error([&] { k3::Checkpoint::open(dir_.string()); }, {"model.safetensors", "model.a"});
}

// Seeded mutations of a sharded checkpoint's index (bytes of model.safetensors.index.json flipped or replaced
// by JSON punctuation, the file truncated, a shard name or tensor name changed): each opens and serves every
// tensor the index lists from within its shard, or fails with a one-line k3::Error; nothing else is thrown.
TEST_F(CheckpointTest, MutatedIndexOpensOrFailsCleanly) {
  const k3::ModelConfig cfg = shared_config();
  Source s;
  fill_source(s, 51);
  const std::string dir = (dir_ / "sharded").string();
  k3::write_checkpoint(dir, cfg, s.ck, 100);
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  const std::string raw = read_bytes(index.string());
  ASSERT_FALSE(raw.empty());
  const char alphabet[] = "{}[]\":,0123456789. xm";
  k3::Rng rng(53);
  int opened = 0, refused = 0;
  for (int it = 0; it < 300; ++it) {
    std::string m = raw;
    switch (rng.below(3)) {
      case 0:
        for (int f = 1 + static_cast<int>(rng.below(3)); f > 0; --f)
          m[rng.below(m.size())] ^= static_cast<char>(1u << rng.below(8));
        break;
      case 1:
        m[rng.below(m.size())] = alphabet[rng.below(sizeof alphabet - 1)];
        break;
      default:
        m.resize(rng.below(m.size()));
    }
    write_bytes(index.string(), m);
    SCOPED_TRACE(testing::Message() << "iteration " << it);
    const bool ok = k3::test::accepted_or_clean_error([&] {
      auto ck = k3::Checkpoint::open(dir);
      for (const std::string& name : ck->names()) read_all(ck->get(name));
    });
    (ok ? opened : refused)++;
  }
  write_bytes(index.string(), raw);
  EXPECT_GT(refused, 100);
  EXPECT_NO_THROW(k3::Checkpoint::open(dir));
}

}  // namespace
