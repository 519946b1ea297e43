// The tokenizer (io/tokenizer.h) against the reference tiktoken: byte-exact ids
// for a varied corpus under cl100k_base, o200k_base and Kimi's pattern (the
// expected ids come from the npm package tiktoken, written by
// tests/node/reference.cjs into the ctest fixture directory), round trips of
// arbitrary bytes, malformed files refused with the file and line named, and
// the small tokenizer writer. Without node or the npm package the reference
// tests report SKIPPED (FAILED under K3_REQUIRE_TOKENIZER_REFERENCE=1, as in CI).
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/tokenizer.h"
#include "fuzz_util.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using k3::Tokenizer;

std::string from_hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return out;
}

std::string show(const std::string& bytes) {
  std::string out;
  for (unsigned char c : bytes) out += (c >= 0x20 && c < 0x7f && c != '\\') ? std::string(1, c) : fmt::format("\\x{:02x}", c);
  return out.size() > 120 ? out.substr(0, 120) + "..." : out;
}

// The reference directory written by the fixture, or skip / fail with why not.
#define K3_REQUIRE_REFERENCE(dir)                                                                    \
  fs::path dir = K3_TOKREF_DIR;                                                                      \
  do {                                                                                               \
    std::string why;                                                                                 \
    if (fs::exists(dir / "UNAVAILABLE")) {                                                           \
      std::ifstream in(dir / "UNAVAILABLE");                                                         \
      std::getline(in, why);                                                                         \
    } else if (!fs::exists(dir / "reference.json")) {                                               \
      why = "no reference at " + dir.string() + " (run through ctest, or tests/node/make_reference.sh DIR)"; \
    }                                                                                                \
    if (!why.empty()) {                                                                              \
      if (std::getenv("K3_REQUIRE_TOKENIZER_REFERENCE")) FAIL() << "tiktoken reference: " << why;    \
      GTEST_SKIP() << "tiktoken reference unavailable: " << why;                                     \
    }                                                                                                \
  } while (0)

const json& reference(const fs::path& dir) {
  static json j = [&] {
    std::ifstream in(dir / "reference.json");
    return json::parse(in);
  }();
  return j;
}

const json& encoding(const fs::path& dir, const std::string& name) {
  for (const auto& e : reference(dir)["encodings"])
    if (e["name"] == name) return e;
  throw std::runtime_error("reference.json has no encoding " + name);
}

Tokenizer openai_tokenizer(const fs::path& dir, const std::string& name, const char* pattern) {
  const json& e = encoding(dir, name);
  std::vector<k3::SpecialToken> specials;
  for (const auto& [content, id] : e["special_tokens"].items()) specials.push_back({content, id.get<int32_t>()});
  return Tokenizer(Tokenizer::read_ranks(dir / (name + ".tiktoken")), specials, pattern);
}

// Every corpus text and invalid byte string: our ids against tiktoken's.
void expect_byte_exact(const Tokenizer& tok, const json& e) {
  size_t texts = 0, exact = 0, mismatches_shown = 0;
  auto check = [&](const std::string& bytes, const std::vector<int32_t>& got, const json& want, const char* what) {
    std::vector<int32_t> expected = want.get<std::vector<int32_t>>();
    if (got == expected) return true;
    if (mismatches_shown++ < 8) {
      size_t i = 0;
      while (i < got.size() && i < expected.size() && got[i] == expected[i]) ++i;
      ADD_FAILURE() << e["name"].get<std::string>() << " " << what << " of \"" << show(bytes) << "\": "
                    << got.size() << " ids, tiktoken " << expected.size() << "; first difference at " << i << ": "
                    << (i < got.size() ? std::to_string(got[i]) : "end") << " vs "
                    << (i < expected.size() ? std::to_string(expected[i]) : "end");
    } else {
      ADD_FAILURE() << "(further mismatch)";
    }
    return false;
  };
  for (const auto& c : e["cases"]) {
    std::string bytes = from_hex(c["hex"]);
    auto ordinary = tok.encode_ordinary(bytes);
    auto all = tok.encode(bytes);
    bool ok = check(bytes, ordinary, c["ordinary"], "encode_ordinary");
    ok = check(bytes, all, c["all"], "encode(all specials)") && ok;
    EXPECT_EQ(tok.decode(ordinary), bytes);
    EXPECT_EQ(tok.decode(all), bytes);
    ++texts;
    exact += ok;
  }
  for (const auto& c : e["invalid"]) {
    std::string bytes = from_hex(c["hex"]);
    auto ids = tok.encode_ordinary(bytes);
    exact += check(bytes, ids, c["ordinary"], "encode_ordinary (invalid UTF-8)");
    EXPECT_EQ(tok.decode(ids), bytes);
    ++texts;
  }
  std::printf("%s: %zu / %zu texts byte-exact against tiktoken (encode_ordinary and encode)\n",
              e["name"].get<std::string>().c_str(), exact, texts);
  EXPECT_EQ(exact, texts);
  EXPECT_GT(texts, 300u);
}

TEST(TokenizerReference, Cl100kByteExact) {
  K3_REQUIRE_REFERENCE(dir);
  Tokenizer tok = openai_tokenizer(dir, "cl100k_base", k3::kCl100kPattern);
  EXPECT_EQ(tok.n_ranks(), encoding(dir, "cl100k_base")["n_ranks"].get<size_t>());
  expect_byte_exact(tok, encoding(dir, "cl100k_base"));
}

TEST(TokenizerReference, O200kByteExact) {
  K3_REQUIRE_REFERENCE(dir);
  Tokenizer tok = openai_tokenizer(dir, "o200k_base", k3::kO200kPattern);
  expect_byte_exact(tok, encoding(dir, "o200k_base"));
}

// Kimi's pattern and special tokens through Tokenizer::load on a Kimi-format
// directory (o200k's ranks as tiktoken.model); tiktoken ran the upstream pattern.
TEST(TokenizerReference, KimiDirectoryByteExact) {
  K3_REQUIRE_REFERENCE(dir);
  Tokenizer tok = Tokenizer::load(dir / "kimi");
  const json& e = encoding(dir, "kimi");
  // The specials the loader derives equal the reference's (named + reserved).
  std::map<std::string, int32_t> want = e["special_tokens"].get<std::map<std::string, int32_t>>(), got;
  for (const auto& s : tok.specials()) got[s.content] = s.id;
  EXPECT_EQ(got, want);
  EXPECT_EQ(tok.special_id("[BOS]"), 199998);
  EXPECT_EQ(tok.special_id("<|im_end|>"), 200000);
  expect_byte_exact(tok, e);
}

// Kimi's pattern keeps Han runs apart from other letters (the split published
// with the pattern's purpose), and CJK punctuation out of them.
TEST(Tokenizer, KimiPatternSplitsHanRuns) {
  std::vector<std::pair<std::string, int32_t>> bytes;
  for (int b = 0; b < 256; ++b) bytes.emplace_back(std::string(1, static_cast<char>(b)), b);
  Tokenizer tok(bytes, {}, k3::kKimiPattern);
  auto split = [&](std::string_view s) {
    std::vector<std::string> out;
    for (auto p : tok.split(s)) out.emplace_back(p);
    return out;
  };
  EXPECT_EQ(split("中文English混合"), (std::vector<std::string>{"中文", "English", "混合"}));
  EXPECT_EQ(split("汉字abc"), (std::vector<std::string>{"汉字", "abc"}));
  EXPECT_EQ(split("你好、世界"), (std::vector<std::string>{"你好", "、", "世界"}));
  EXPECT_EQ(split("I'm here  now\n"), (std::vector<std::string>{"I'm", " here", " ", " now", "\n"}));
}

// decode(encode(x)) == x for arbitrary bytes, most of them not valid UTF-8.
TEST(TokenizerReference, RandomBytesRoundTrip) {
  K3_REQUIRE_REFERENCE(dir);
  Tokenizer tok = Tokenizer::load(dir / "kimi");
  std::mt19937 rng(7);
  for (int n = 0; n < 400; ++n) {
    std::string s(rng() % 200, '\0');
    const bool ascii_heavy = n % 2;
    for (auto& c : s) c = static_cast<char>(ascii_heavy && rng() % 4 ? 0x20 + rng() % 0x5f : rng() % 256);
    if (n % 7 == 0) s += "<|im_end|>";
    EXPECT_EQ(tok.decode(tok.encode_ordinary(s)), s) << show(s);
    EXPECT_EQ(tok.decode(tok.encode(s)), s) << show(s);
  }
}

// Very long pieces: one 200000-letter word (the heap merge; the JIT stack may
// overflow on the Kimi pattern and the interpreter takes over), a long run of
// spaces, and a long text after an invalid byte (all one merged piece).
TEST(TokenizerReference, LongPieces) {
  K3_REQUIRE_REFERENCE(dir);
  Tokenizer tok = Tokenizer::load(dir / "kimi");
  std::string word;
  for (int i = 0; i < 200000; ++i) word += "abcdefgh"[(i * 7 + i / 3) % 8];
  const std::vector<std::string> texts = {word, std::string(100000, ' ') + "x", "\xff" + word.substr(0, 50000),
                                          std::string(60000, 'z')};
  for (const auto& t : texts) {
    auto ids = tok.encode(t);
    EXPECT_LT(ids.size(), t.size());
    EXPECT_EQ(tok.decode(ids), t);
  }
}

// A fresh directory per test, removed afterwards.
class TokenizerFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    static int serial = 0;
    dir_ = fs::temp_directory_path() / fmt::format("k3_tok_{}_{}", ::getpid(), serial++);
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  // The 256 single bytes (rank = byte) plus extra lines, as tiktoken.model.
  void write_model(const std::string& extra_lines, bool all_bytes = true) {
    static const char* kB64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::ofstream out(dir_ / "tiktoken.model", std::ios::binary);
    for (int b = all_bytes ? 0 : 1; b < 256; ++b)
      out << kB64[b >> 2] << kB64[(b & 3) << 4] << "== " << b << "\n";
    out << extra_lines;
  }
  void write_config(const std::string& text) { std::ofstream(dir_ / "tokenizer_config.json") << text; }
  // Tokenizer::load must throw k3::Error whose message holds every fragment.
  void expect_refused(const std::vector<std::string>& fragments) {
    try {
      Tokenizer::load(dir_);
      ADD_FAILURE() << "loaded a malformed tokenizer";
    } catch (const k3::Error& e) {
      std::string msg = e.what();
      for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "message: " << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << "message: " << msg;
    }
  }
  fs::path dir_;
};

TEST_F(TokenizerFiles, MalformedRanksRefused) {
  write_model("YWI= 256\n!!!! 257\n");  // line 258: not base64
  expect_refused({"tiktoken.model:258", "not valid base64"});
  write_model("YWI= 256\nYWJj 256\n");  // duplicate rank
  expect_refused({"tiktoken.model:258", "rank 256 already given on line 257"});
  write_model("YWI= twelve\n");
  expect_refused({"tiktoken.model:257", "not a non-negative integer"});
  write_model("YWI= -3\n");
  expect_refused({"tiktoken.model:257", "not a non-negative integer"});
  write_model("YWI=\n");
  expect_refused({"tiktoken.model:257", "one field"});
  write_model("YWI= 256 7\n");
  expect_refused({"tiktoken.model:257", "more than two fields"});
  write_model("YWI 256\n");  // unpadded
  expect_refused({"tiktoken.model:257", "not valid base64"});
  write_model("YWI= 256\nYWI= 257\n");
  expect_refused({"tiktoken.model", "ranks 256 and 257 are the same bytes"});
  write_model("", /*all_bytes=*/false);
  expect_refused({"single byte 0x00"});
  fs::remove(dir_ / "tiktoken.model");
  expect_refused({"tiktoken.model is missing"});
}

TEST_F(TokenizerFiles, MalformedConfigRefused) {
  write_model("");
  write_config("{\"added_tokens_decoder\": {");
  expect_refused({"tokenizer_config.json", "not valid JSON"});
  write_config(R"({"added_tokens_decoder": {"256": {"special": true}}})");
  expect_refused({"tokenizer_config.json", "\"256\"", "content"});
  write_config(R"({"added_tokens_decoder": {"x12": {"content": "[BOS]"}}})");
  expect_refused({"tokenizer_config.json", "x12", "not a token id"});
  write_config(R"({"added_tokens_decoder": {"100": {"content": "[BOS]"}}})");
  expect_refused({"tokenizer_config.json", "below the 256 ranks"});
  write_config(R"({"added_tokens_decoder": {"256": {"content": "[BOS]"}, "257": {"content": "[BOS]"}}})");
  expect_refused({"[BOS] appears twice"});
  write_config(R"({"added_tokens_decoder": {"256": {"content": "[BOS]"}, "300": {"content": "<|im_end|>"}}})");
  Tokenizer tok = Tokenizer::load(dir_);
  EXPECT_EQ(tok.special_id("[BOS]"), 256);
  EXPECT_EQ(tok.special_id("<|reserved_token_257|>"), 257);
  EXPECT_EQ(tok.special_id("<|im_end|>"), 300);
  EXPECT_EQ(tok.n_vocab(), 256 + 258);
}

TEST_F(TokenizerFiles, SpecialTokensOnlyWhereAllowed) {
  write_model("");
  write_config(R"({"added_tokens_decoder": {"256": {"content": "[BOS]"}, "258": {"content": "<|im_end|>"}}})");
  Tokenizer tok = Tokenizer::load(dir_);
  const std::string text = "[BOS]hi<|im_end|>";
  // Single-byte ranks: ordinary text is one id per byte.
  std::vector<int32_t> bytes_of_text(text.begin(), text.end());
  EXPECT_EQ(tok.encode_ordinary(text), bytes_of_text);
  EXPECT_EQ(tok.encode(text, {}), bytes_of_text);
  EXPECT_EQ(tok.encode(text), (std::vector<int32_t>{256, 'h', 'i', 258}));
  std::vector<int32_t> only_end(text.begin(), text.end() - 10);
  only_end.push_back(258);
  EXPECT_EQ(tok.encode(text, {"<|im_end|>"}), only_end);
  EXPECT_EQ(tok.decode(tok.encode(text)), text);
  EXPECT_THROW(tok.decode(std::vector<int32_t>{100000}), k3::Error);
}

TEST_F(TokenizerFiles, SmallTokenizerWriter) {
  k3::write_small_tokenizer(dir_, 1024);
  Tokenizer tok = Tokenizer::load(dir_);
  EXPECT_EQ(tok.n_ranks(), 768u);
  EXPECT_EQ(tok.special_id("[BOS]"), 768);
  EXPECT_EQ(tok.special_id("[EOS]"), 769);
  EXPECT_EQ(tok.special_id("<|im_end|>"), 770);
  EXPECT_EQ(tok.special_id("<|im_user|>"), 771);
  EXPECT_EQ(tok.special_id("<|im_assistant|>"), 772);
  EXPECT_EQ(tok.special_id("<|im_system|>"), 778);
  EXPECT_EQ(tok.special_id("<|im_middle|>"), 785);
  const std::string text = "The model writes the next token. 你好，世界。";
  auto ids = tok.encode(text);
  EXPECT_LT(ids.size(), text.size() / 2) << "merges learned from the built-in text shorten English";
  EXPECT_EQ(tok.decode(ids), text);
  for (int32_t id : ids) EXPECT_LT(id, 768);
  // Deterministic: the same bytes on a second write.
  auto read = [](const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  std::string first = read(dir_ / "tiktoken.model");
  k3::write_small_tokenizer(dir_, 1024);
  EXPECT_EQ(read(dir_ / "tiktoken.model"), first);
  EXPECT_THROW(k3::write_small_tokenizer(dir_ / "tiny", 256), k3::Error);
  // Round trips of random bytes through the learned merges (heap path included).
  std::mt19937 rng(3);
  for (int n = 0; n < 200; ++n) {
    std::string s(rng() % 400, '\0');
    for (auto& c : s) c = static_cast<char>(n % 2 ? 'a' + rng() % 3 : rng() % 256);
    EXPECT_EQ(tok.decode(tok.encode(s)), s) << show(s);
  }
}

// Seeded mutations of a written tokenizer (bytes of tiktoken.model or tokenizer_config.json flipped, lines
// cut or doubled, the file truncated): each loads, or fails with a one-line k3::Error; no other exception, no
// crash (ASan in CI). A tokenizer that loads still round-trips text: decode(encode(x)) == x.
TEST_F(TokenizerFiles, MutatedFilesLoadOrFailCleanly) {
  k3::write_small_tokenizer(dir_, 1024);
  auto read = [](const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const std::string model = read(dir_ / "tiktoken.model"), config = read(dir_ / "tokenizer_config.json");
  const std::string text = "The model writes the next token. 你好，世界。 x = f(3) + 42;\n\t ok";
  std::mt19937 rng(19);
  int loaded = 0, refused = 0;
  for (int it = 0; it < 300; ++it) {
    std::string m = model, c = config;
    std::string& f = rng() % 3 == 0 ? c : m;
    switch (rng() % 4) {
      case 0:
        for (int k = 1 + rng() % 3; k > 0; --k) f[rng() % f.size()] ^= static_cast<char>(1u << (rng() % 8));
        break;
      case 1:
        f.resize(rng() % f.size());
        break;
      case 2: {  // a line doubled
        const size_t at = f.find('\n', rng() % f.size());
        const size_t from = f.rfind('\n', at == std::string::npos || at == 0 ? 0 : at - 1);
        if (at != std::string::npos) f.insert(at + 1, f.substr(from == std::string::npos ? 0 : from + 1, at - from));
        break;
      }
      default:
        f[rng() % f.size()] = "0123456789 =+/{}\":,\n"[rng() % 21];
    }
    std::ofstream(dir_ / "tiktoken.model", std::ios::binary | std::ios::trunc) << m;
    std::ofstream(dir_ / "tokenizer_config.json", std::ios::binary | std::ios::trunc) << c;
    SCOPED_TRACE(testing::Message() << "iteration " << it);
    const bool ok = k3::test::accepted_or_clean_error([&] {
      Tokenizer tok = Tokenizer::load(dir_);
      EXPECT_EQ(tok.decode(tok.encode(text)), text);
    });
    (ok ? loaded : refused)++;
  }
  EXPECT_GT(refused, 100);
  EXPECT_GT(loaded, 10);
}

TEST(Tokenizer, BadPatternRefused) {
  std::vector<std::pair<std::string, int32_t>> bytes;
  for (int b = 0; b < 256; ++b) bytes.emplace_back(std::string(1, static_cast<char>(b)), b);
  EXPECT_THROW(Tokenizer(bytes, {}, "(\\p{L}+"), k3::Error);
  EXPECT_THROW(Tokenizer(bytes, {}, "\\p{NoSuchProperty}"), k3::Error);
}

}  // namespace
