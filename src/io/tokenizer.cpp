// Kimi's tokenizer (tokenizer.h): tiktoken-format ranks, PCRE2 pre-tokenizer,
// rank-ordered byte-pair merges, the model-directory loader and the writer of a
// small tokenizer for synthetic checkpoints.
//
// Kimi's pattern in PCRE2. tokenization_kimi.py's pat_str is written for Rust's
// regex (through tiktoken's fancy-regex), which has class intersection:
//   [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]   (these letters, minus Han)
// PCRE2 has none, so each intersection with a negated class becomes a negative
// lookahead in front of the class, one character at a time:
//   (?:(?!\p{sc:Han})[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}])
// and \p{Han} becomes \p{sc:Han}: Rust's \p{Han} is the Script property, while
// PCRE2 (10.40+) reads a bare script name as Script_Extensions, which also holds
// common CJK punctuation such as U+3001 and would glue it to Han runs.
// Everything else (alternation order, greedy quantifiers, (?i:...), (?!\S)) has
// the same meaning in both engines. tests/test_tokenizer.cpp checks the result
// id for id against tiktoken built with the upstream pattern.
//
// Bytes that are not valid UTF-8 (tiktoken's _encode_bytes): the valid prefix is
// encoded as ordinary text; then its last regex piece (widened over preceding
// all-whitespace tokens when it is whitespace) is taken back and merged again
// together with every byte from the first invalid one on, as one byte-pair
// piece. Where the valid prefix gives no tokens (tiktoken would drop the bytes)
// the rest is merged alone, so nothing is ever lost. Likewise a stretch of text
// the pattern does not match (none of the three built-in patterns leaves any) is
// merged as its own piece instead of being dropped.
#include "io/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>

#include "core/error.h"

namespace k3 {

const char* const kKimiPattern =
    R"([\p{sc:Han}]+)"
    R"(|[^\r\n\p{L}\p{N}]?(?:(?!\p{sc:Han})[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}])*)"
    R"((?:(?!\p{sc:Han})[\p{Ll}\p{Lm}\p{Lo}\p{M}])+(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|[^\r\n\p{L}\p{N}]?(?:(?!\p{sc:Han})[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}])+)"
    R"((?:(?!\p{sc:Han})[\p{Ll}\p{Lm}\p{Lo}\p{M}])*(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|\p{N}{1,3})"
    R"(| ?[^\s\p{L}\p{N}]+[\r\n]*)"
    R"(|\s*[\r\n]+)"
    R"(|\s+(?!\S))"
    R"(|\s+)";

const char* const kCl100kPattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

const char* const kO200kPattern =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

namespace {

// Length of the longest valid UTF-8 prefix (the rules of Rust's str::from_utf8:
// no overlong forms, no surrogates, nothing above U+10FFFF).
size_t valid_utf8_prefix(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t i = 0, n = s.size();
  while (i < n) {
    unsigned c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    unsigned lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    } else {
      return i;
    }
    if (i + len > n) return i;
    if (p[i + 1] < lo || p[i + 1] > hi) return i;
    for (size_t k = 2; k < len; ++k)
      if (p[i + k] < 0x80 || p[i + k] > 0xBF) return i;
    i += len;
  }
  return n;
}

size_t utf8_char_len(unsigned char c) { return c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4; }

int base64_value(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

// Strict standard base64 (padded); nullopt when malformed.
std::optional<std::string> base64_decode(std::string_view s) {
  if (s.empty() || s.size() % 4 != 0) return std::nullopt;
  size_t pad = 0;
  if (s.back() == '=') pad = s[s.size() - 2] == '=' ? 2 : 1;
  std::string out;
  out.reserve(s.size() / 4 * 3);
  for (size_t i = 0; i < s.size(); i += 4) {
    int v[4];
    bool last = i + 4 == s.size();
    for (int k = 0; k < 4; ++k) {
      char c = s[i + k];
      if (c == '=' && last && k >= 4 - static_cast<int>(pad)) {
        v[k] = 0;
      } else {
        v[k] = base64_value(c);
        if (v[k] < 0) return std::nullopt;
      }
    }
    uint32_t w = (uint32_t(v[0]) << 18) | (uint32_t(v[1]) << 12) | (uint32_t(v[2]) << 6) | uint32_t(v[3]);
    out.push_back(static_cast<char>(w >> 16));
    if (!(last && pad == 2)) out.push_back(static_cast<char>((w >> 8) & 0xFF));
    if (!(last && pad >= 1)) out.push_back(static_cast<char>(w & 0xFF));
    // Non-canonical padding bits (e.g. "QR==") are malformed too.
    if (last && pad == 2 && (w & 0xFFFF) != 0) return std::nullopt;
    if (last && pad == 1 && (w & 0xFF) != 0) return std::nullopt;
  }
  if (out.empty()) return std::nullopt;
  return out;
}

std::string base64_encode(std::string_view s) {
  static const char* kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  for (size_t i = 0; i < s.size(); i += 3) {
    uint32_t w = uint32_t(uint8_t(s[i])) << 16;
    if (i + 1 < s.size()) w |= uint32_t(uint8_t(s[i + 1])) << 8;
    if (i + 2 < s.size()) w |= uint32_t(uint8_t(s[i + 2]));
    out.push_back(kAlphabet[(w >> 18) & 63]);
    out.push_back(kAlphabet[(w >> 12) & 63]);
    out.push_back(i + 1 < s.size() ? kAlphabet[(w >> 6) & 63] : '=');
    out.push_back(i + 2 < s.size() ? kAlphabet[w & 63] : '=');
  }
  return out;
}

bool all_whitespace_token(const std::string& bytes) {
  return std::all_of(bytes.begin(), bytes.end(), [](char c) { return c == ' ' || c == '\n' || c == '\t'; });
}

// Kimi K2's named special tokens, by offset past the ranks (its tokenizer_config.json).
constexpr std::array<std::pair<int, const char*>, 12> kKimiSpecials{{
    {0, "[BOS]"},
    {1, "[EOS]"},
    {2, "<|im_end|>"},
    {3, "<|im_user|>"},
    {4, "<|im_assistant|>"},
    {6, "<|start_header_id|>"},
    {7, "<|end_header_id|>"},
    {9, "[EOT]"},
    {10, "<|im_system|>"},
    {17, "<|im_middle|>"},
    {254, "[UNK]"},
    {255, "[PAD]"},
}};
constexpr int kKimiReservedSlots = 256 + 2;  // tokenization_kimi.py: num_reserved_special_tokens + 2

}  // namespace

// ---- the compiled pattern

struct Tokenizer::Regex {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Regex() {
    if (code) pcre2_code_free(code);
  }
};

namespace {

struct MatchData {
  pcre2_match_data* md;
  explicit MatchData(pcre2_code* code) : md(pcre2_match_data_create_from_pattern(code, nullptr)) {
    K3_CHECK(md != nullptr, "tokenizer: out of memory for PCRE2 match data");
  }
  ~MatchData() { pcre2_match_data_free(md); }
  MatchData(const MatchData&) = delete;
  MatchData& operator=(const MatchData&) = delete;
};

// Matches once from offset; returns false when there is no further match. The
// JIT's default stack may be too small for a very long piece: then the
// interpreter (heap frames) matches instead.
bool regex_next(pcre2_code* code, bool jit, MatchData& md, std::string_view subject, size_t offset, size_t& start,
                size_t& end) {
  auto subj = reinterpret_cast<PCRE2_SPTR>(subject.data());
  int rc = pcre2_match(code, subj, subject.size(), offset, PCRE2_NO_UTF_CHECK, md.md, nullptr);
  if (jit && rc == PCRE2_ERROR_JIT_STACKLIMIT)
    rc = pcre2_match(code, subj, subject.size(), offset, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md.md, nullptr);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(rc, msg, sizeof(msg));
    fail("tokenizer: pre-tokenizer regex failed at byte {}: {}", offset, reinterpret_cast<const char*>(msg));
  }
  PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.md);
  start = ov[0];
  end = ov[1];
  return true;
}

}  // namespace

// ---- construction

Tokenizer::Tokenizer(std::vector<std::pair<std::string, int32_t>> ranks, std::vector<SpecialToken> specials,
                     const std::string& pattern)
    : specials_(std::move(specials)), regex_(std::make_unique<Regex>()) {
  encoder_.reserve(ranks.size());
  decoder_.reserve(ranks.size() + specials_.size());
  for (auto& [bytes, rank] : ranks) {
    K3_CHECK(!bytes.empty(), "tokenizer: an empty token (rank {})", rank);
    K3_CHECK(rank >= 0, "tokenizer: negative rank {}", rank);
    auto [it, fresh] = decoder_.emplace(rank, bytes);
    K3_CHECK(fresh, "tokenizer: rank {} appears twice", rank);
    K3_CHECK(encoder_.emplace(std::move(bytes), rank).second, "tokenizer: token of rank {} appears twice", rank);
  }
  n_ranks_ = encoder_.size();
  for (int b = 0; b < 256; ++b)
    K3_CHECK(encoder_.count(std::string(1, static_cast<char>(b))), "tokenizer: the ranks lack the single byte 0x{:02x}",
             b);
  for (const auto& s : specials_) {
    K3_CHECK(!s.content.empty(), "tokenizer: special token {} is empty", s.id);
    K3_CHECK(s.id >= 0, "tokenizer: special token {} has negative id {}", s.content, s.id);
    K3_CHECK(decoder_.emplace(s.id, s.content).second, "tokenizer: special token {} has id {}, already taken",
             s.content, s.id);
    K3_CHECK(special_ids_.emplace(s.content, s.id).second, "tokenizer: special token {} appears twice", s.content);
  }
  for (const auto& [id, bytes] : decoder_) n_vocab_ = std::max(n_vocab_, id + 1);
  for (const auto& s : specials_) special_first_[static_cast<uint8_t>(s.content[0])] = true;
  // Longest first, so that at one position the longest special token wins.
  std::stable_sort(specials_.begin(), specials_.end(),
                   [](const SpecialToken& a, const SpecialToken& b) { return a.content.size() > b.content.size(); });

  int err = 0;
  PCRE2_SIZE err_off = 0;
  regex_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP,
                               &err, &err_off, nullptr);
  if (!regex_->code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof(msg));
    fail("tokenizer: pre-tokenizer pattern does not compile at offset {}: {}", err_off,
         reinterpret_cast<const char*>(msg));
  }
  regex_->jit = pcre2_jit_compile(regex_->code, PCRE2_JIT_COMPLETE) == 0;
}

Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

std::vector<std::pair<std::string, int32_t>> Tokenizer::read_ranks(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  K3_CHECK(in.good(), "{}: cannot open", file.string());
  std::vector<std::pair<std::string, int32_t>> ranks;
  std::unordered_map<int32_t, size_t> line_of_rank;
  std::string line;
  size_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    std::istringstream fields(line);
    std::string b64, rank_text, extra;
    fields >> b64 >> rank_text;
    K3_CHECK(!rank_text.empty(), "{}:{}: expected \"BASE64 RANK\", found one field", file.string(), line_no);
    K3_CHECK(!(fields >> extra), "{}:{}: expected \"BASE64 RANK\", found more than two fields", file.string(),
             line_no);
    int64_t rank = 0;
    auto [end, ec] = std::from_chars(rank_text.data(), rank_text.data() + rank_text.size(), rank);
    K3_CHECK(ec == std::errc() && end == rank_text.data() + rank_text.size() && rank >= 0 &&
                 rank <= std::numeric_limits<int32_t>::max(),
             "{}:{}: rank \"{}\" is not a non-negative integer below 2^31", file.string(), line_no, rank_text);
    auto bytes = base64_decode(b64);
    K3_CHECK(bytes.has_value(), "{}:{}: \"{}\" is not valid base64", file.string(), line_no, b64);
    auto [it, fresh] = line_of_rank.emplace(static_cast<int32_t>(rank), line_no);
    K3_CHECK(fresh, "{}:{}: rank {} already given on line {}", file.string(), line_no, rank, it->second);
    ranks.emplace_back(std::move(*bytes), static_cast<int32_t>(rank));
  }
  K3_CHECK(!ranks.empty(), "{}: no tokens", file.string());
  {
    // The same bytes twice: name both lines.
    std::unordered_map<std::string_view, size_t> seen;
    for (size_t i = 0; i < ranks.size(); ++i) {
      auto [it, fresh] = seen.emplace(ranks[i].first, i);
      K3_CHECK(fresh, "{}: ranks {} and {} are the same bytes", file.string(), ranks[it->second].second,
               ranks[i].second);
    }
  }
  return ranks;
}

bool Tokenizer::present(const std::filesystem::path& dir) {
  return std::filesystem::is_regular_file(dir / "tiktoken.model");
}

Tokenizer Tokenizer::load(const std::filesystem::path& dir) {
  auto model = dir / "tiktoken.model";
  K3_CHECK(std::filesystem::is_regular_file(model), "{}: no tokenizer here (tiktoken.model is missing)",
           dir.string());
  auto ranks = read_ranks(model);
  const int64_t n_base = static_cast<int64_t>(ranks.size());
  std::vector<SpecialToken> specials;
  auto config_path = dir / "tokenizer_config.json";
  if (std::filesystem::is_regular_file(config_path)) {
    const std::string where = config_path.string();
    std::ifstream in(config_path);
    nlohmann::json config;
    try {
      config = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      fail("{}: not valid JSON: {}", where, e.what());
    }
    K3_CHECK(config.is_object(), "{}: expected a JSON object", where);
    std::unordered_map<int64_t, std::string> named;
    if (config.contains("added_tokens_decoder")) {
      const auto& dec = config["added_tokens_decoder"];
      K3_CHECK(dec.is_object(), "{}: added_tokens_decoder is not an object", where);
      for (const auto& [key, entry] : dec.items()) {
        int64_t id = 0;
        auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), id);
        K3_CHECK(ec == std::errc() && end == key.data() + key.size() && id >= 0 &&
                     id <= std::numeric_limits<int32_t>::max(),
                 "{}: added_tokens_decoder key \"{}\" is not a token id", where, key);
        K3_CHECK(entry.is_object() && entry.contains("content") && entry["content"].is_string(),
                 "{}: added_tokens_decoder[\"{}\"] has no string \"content\"", where, key);
        K3_CHECK(!entry.contains("special") || entry["special"].is_boolean(),
                 "{}: added_tokens_decoder[\"{}\"].special is not a boolean", where, key);
        K3_CHECK(id >= n_base, "{}: added token {} (\"{}\") has an id below the {} ranks of tiktoken.model", where,
                 id, entry["content"].get<std::string>(), n_base);
        named[id] = entry["content"].get<std::string>();
      }
    }
    // tokenization_kimi.py: the 258 ids after the ranks are special, named by
    // added_tokens_decoder or <|reserved_token_ID|>.
    for (int64_t id = n_base; id < n_base + kKimiReservedSlots; ++id) {
      auto it = named.find(id);
      specials.push_back({it != named.end() ? it->second : fmt::format("<|reserved_token_{}|>", id),
                          static_cast<int32_t>(id)});
      if (it != named.end()) named.erase(it);
    }
    for (auto& [id, content] : named) specials.push_back({content, static_cast<int32_t>(id)});
    std::sort(specials.begin(), specials.end(), [](const auto& a, const auto& b) { return a.id < b.id; });
  }
  try {
    return Tokenizer(std::move(ranks), std::move(specials), kKimiPattern);
  } catch (const Error& e) {
    fail("{}: {}", dir.string(), e.what());
  }
}

// ---- encoding

int32_t Tokenizer::rank_of(std::string_view bytes) const {
  auto it = encoder_.find(bytes);
  return it == encoder_.end() ? -1 : it->second;
}

void Tokenizer::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.empty()) return;
  if (int32_t r = rank_of(piece); r >= 0) {
    out.push_back(r);
    return;
  }
  const size_t n = piece.size();
  constexpr int32_t kNone = std::numeric_limits<int32_t>::max();
  if (n <= 64) {
    // tiktoken's loop: parts as start offsets; rank[i] is the rank of parts i and
    // i + 1 joined. Merge the lowest (leftmost on ties) until none is a token.
    std::vector<size_t> start(n + 1);
    for (size_t i = 0; i <= n; ++i) start[i] = i;
    std::vector<int32_t> rank(n, kNone);
    auto pair_rank = [&](size_t i) -> int32_t {
      if (i + 2 >= start.size()) return kNone;
      int32_t r = rank_of(piece.substr(start[i], start[i + 2] - start[i]));
      return r < 0 ? kNone : r;
    };
    for (size_t i = 0; i + 1 < n; ++i) rank[i] = pair_rank(i);
    for (;;) {
      size_t best = 0;
      int32_t best_rank = kNone;
      for (size_t i = 0; i + 1 < rank.size(); ++i)
        if (rank[i] < best_rank) best_rank = rank[i], best = i;
      if (best_rank == kNone) break;
      start.erase(start.begin() + static_cast<std::ptrdiff_t>(best) + 1);
      rank.erase(rank.begin() + static_cast<std::ptrdiff_t>(best) + 1);
      rank[best] = pair_rank(best);
      if (best > 0) rank[best - 1] = pair_rank(best - 1);
    }
    for (size_t i = 0; i + 1 < start.size(); ++i) out.push_back(rank_of(piece.substr(start[i], start[i + 1] - start[i])));
    return;
  }
  // Long pieces: the same merge order through a heap of (rank, start) with a
  // linked list of parts, O(n log n) instead of O(n^2).
  std::vector<size_t> next(n), prev(n);
  std::vector<char> alive(n, 1);
  for (size_t i = 0; i < n; ++i) next[i] = i + 1, prev[i] = i == 0 ? SIZE_MAX : i - 1;
  std::vector<int32_t> rank(n, kNone);
  auto pair_rank = [&](size_t i) -> int32_t {
    size_t j = next[i];
    if (j >= n) return kNone;
    size_t k = next[j];
    int32_t r = rank_of(piece.substr(i, k - i));
    return r < 0 ? kNone : r;
  };
  using Item = std::pair<int32_t, size_t>;  // (rank, start): min-heap, leftmost on ties
  std::priority_queue<Item, std::vector<Item>, std::greater<>> heap;
  for (size_t i = 0; i + 1 < n; ++i) {
    rank[i] = pair_rank(i);
    if (rank[i] != kNone) heap.push({rank[i], i});
  }
  while (!heap.empty()) {
    auto [r, i] = heap.top();
    heap.pop();
    if (!alive[i] || rank[i] != r) continue;  // stale
    size_t j = next[i];
    alive[j] = 0;
    next[i] = next[j];
    if (next[j] < n) prev[next[j]] = i;
    rank[i] = pair_rank(i);
    if (rank[i] != kNone) heap.push({rank[i], i});
    if (prev[i] != SIZE_MAX) {
      size_t p = prev[i];
      rank[p] = pair_rank(p);
      if (rank[p] != kNone) heap.push({rank[p], p});
    }
  }
  for (size_t i = 0; i < n; i = next[i]) out.push_back(rank_of(piece.substr(i, next[i] - i)));
}

size_t Tokenizer::encode_segment(std::string_view text, std::vector<int32_t>& out) const {
  size_t last_piece = 0;
  size_t offset = 0, covered = 0;
  auto piece = [&](size_t b, size_t e) {
    size_t before = out.size();
    encode_piece(text.substr(b, e - b), out);
    last_piece = out.size() - before;
  };
  MatchData md(regex_->code);
  while (offset < text.size()) {
    size_t s = 0, e = 0;
    if (!regex_next(regex_->code, regex_->jit, md, text, offset, s, e)) break;
    if (s > covered) piece(covered, s);  // not matched: kept as its own piece
    if (e > s) {
      piece(s, e);
      covered = offset = e;
    } else {
      offset = s + utf8_char_len(static_cast<unsigned char>(text[s]));  // empty match: step one character
      covered = std::max(covered, s);
    }
  }
  if (covered < text.size()) piece(covered, text.size());
  return last_piece;
}

void Tokenizer::encode_bytes(std::string_view bytes, std::vector<int32_t>& out) const {
  const size_t valid = valid_utf8_prefix(bytes);
  if (valid == bytes.size()) {
    encode_segment(bytes, out);
    return;
  }
  const size_t first = out.size();
  size_t last = encode_segment(bytes.substr(0, valid), out);
  // tiktoken widens a last piece of whitespace tokens over the whitespace tokens before it.
  if (last > 0 && all_whitespace_token(decoder_.at(out[out.size() - last])))
    while (out.size() - first > last && all_whitespace_token(decoder_.at(out[out.size() - last - 1]))) ++last;
  std::string unstable;
  for (size_t i = out.size() - last; i < out.size(); ++i) unstable += decoder_.at(out[i]);
  out.resize(out.size() - last);
  unstable.append(bytes.substr(valid));
  encode_piece(unstable, out);
}

template <typename Allowed>
std::vector<int32_t> Tokenizer::encode_with(std::string_view text, const Allowed& allowed) const {
  std::vector<int32_t> out;
  size_t start = 0, pos = 0;
  while (pos < text.size()) {
    const SpecialToken* hit = nullptr;
    if (special_first_[static_cast<uint8_t>(text[pos])]) {
      for (const auto& s : specials_) {  // longest first
        if (text.compare(pos, s.content.size(), s.content) == 0 && allowed(s.content)) {
          hit = &s;
          break;
        }
      }
    }
    if (!hit) {
      ++pos;
      continue;
    }
    encode_bytes(text.substr(start, pos - start), out);
    out.push_back(hit->id);
    pos += hit->content.size();
    start = pos;
  }
  encode_bytes(text.substr(start), out);
  return out;
}

std::vector<std::string_view> Tokenizer::split(std::string_view text) const {
  K3_CHECK(valid_utf8_prefix(text) == text.size(), "tokenizer: split needs valid UTF-8");
  std::vector<std::string_view> pieces;
  MatchData md(regex_->code);
  size_t offset = 0;
  while (offset < text.size()) {
    size_t s = 0, e = 0;
    if (!regex_next(regex_->code, regex_->jit, md, text, offset, s, e)) break;
    if (e == s) {
      offset = s + utf8_char_len(static_cast<unsigned char>(text[s]));
      continue;
    }
    pieces.push_back(text.substr(s, e - s));
    offset = e;
  }
  return pieces;
}

std::vector<int32_t> Tokenizer::encode_ordinary(std::string_view text) const {
  std::vector<int32_t> out;
  encode_bytes(text, out);
  return out;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  return encode_with(text, [](const std::string&) { return true; });
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, const std::unordered_set<std::string>& allowed) const {
  if (allowed.empty()) return encode_ordinary(text);
  return encode_with(text, [&](const std::string& s) { return allowed.count(s) > 0; });
}

// ---- decoding

const std::string& Tokenizer::token_bytes(int32_t id) const {
  auto it = decoder_.find(id);
  K3_CHECK(it != decoder_.end(), "tokenizer: id {} is no token (vocabulary of {} ids)", id, n_vocab());
  return it->second;
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  for (int32_t id : ids) out += token_bytes(id);
  return out;
}

std::optional<int32_t> Tokenizer::special_id(std::string_view content) const {
  auto it = special_ids_.find(content);
  if (it == special_ids_.end()) return std::nullopt;
  return it->second;
}


// ---- the small tokenizer for synthetic checkpoints

namespace {

const char* const kTrainingText = R"(The model reads the prompt one token at a time and writes the next token.
Each layer mixes the hidden state of every position with the ones before it, then a mixture of experts
transforms it: a router picks a few experts for each token, and their outputs are added together.
A tokenizer turns text into tokens and tokens back into text. It splits the text into words, numbers,
punctuation and spaces, then merges the bytes of each piece into the longest tokens it knows.
Hello, world! How are you today? I'm fine, thanks. We're testing the decoder; it's small but it works.
There are 1024 tokens in this vocabulary, 256 of them single bytes and the rest learned merges.
int main(int argc, char** argv) { return argc > 1 ? 0 : 1; }
def generate(model, prompt, max_new=8):
    tokens = tokenizer.encode(prompt)
    for _ in range(max_new):
        tokens.append(model.step(tokens))
    return tokenizer.decode(tokens)
你好，世界。今天我们学习语言模型和分词器。模型生成文本，分词器把文本变成数字。
Kimi is a helpful assistant. The user asks a question and the assistant answers it clearly.
Attention, residuals, experts, routers, caches, kernels, ranks, tensors and layers.
The quick brown fox jumps over the lazy dog. The lazy dog sleeps in the sun all day long.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 365 2024 3.14159 65536; symbols: + - * / = < > ( ) [ ] { } # @ & % $ !
Once upon a time, a small program learned to speak. It counted words, remembered pairs of letters,
and slowly built a vocabulary of its own: "the", "and", "ing", "tion", "ment", "ness", "able".
Questions? Answers! Lists: apples, oranges, bananas; colours: red, green, blue, yellow, purple.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. January, February, March, April.
)";

}  // namespace

void write_small_tokenizer(const std::filesystem::path& dir, int vocab_size) {
  K3_CHECK(vocab_size >= 768,
           "tokenizer: a vocabulary of {} ids is too small for a tokenizer (256 bytes, merges and 256 special "
           "slots need at least 768)",
           vocab_size);
  const int n_base = vocab_size - 256;
  std::vector<std::string> vocab;  // by rank
  std::unordered_map<std::string, int32_t> index;
  for (int b = 0; b < 256; ++b) {
    vocab.emplace_back(1, static_cast<char>(b));
    index.emplace(vocab.back(), b);
  }
  // The training pieces: the built-in text split by Kimi's pattern (a tokenizer
  // of single bytes does the splitting), each as a sequence of token ids.
  std::vector<std::pair<std::string, int32_t>> bytes_only;
  for (int b = 0; b < 256; ++b) bytes_only.emplace_back(std::string(1, static_cast<char>(b)), b);
  Tokenizer splitter(bytes_only, {}, kKimiPattern);
  std::vector<std::vector<int32_t>> pieces;
  for (std::string_view piece : splitter.split(kTrainingText)) {
    std::vector<int32_t> ids;
    for (char c : piece) ids.push_back(static_cast<uint8_t>(c));
    pieces.push_back(std::move(ids));
  }
  while (static_cast<int>(vocab.size()) < n_base) {
    std::map<std::pair<int32_t, int32_t>, int> counts;
    for (const auto& p : pieces)
      for (size_t i = 0; i + 1 < p.size(); ++i) ++counts[{p[i], p[i + 1]}];
    K3_CHECK(!counts.empty(), "tokenizer: the built-in text yields only {} merges, {} wanted", vocab.size() - 256,
             n_base - 256);
    auto best = counts.begin();  // the most frequent pair, the smallest ids on ties
    for (auto it = counts.begin(); it != counts.end(); ++it)
      if (it->second > best->second) best = it;
    auto [a, b] = best->first;
    std::string joined = vocab[a] + vocab[b];
    int32_t id;
    if (auto it = index.find(joined); it != index.end()) {
      id = it->second;  // the same bytes reached another way: no new rank
    } else {
      id = static_cast<int32_t>(vocab.size());
      vocab.push_back(joined);
      index.emplace(joined, id);
    }
    for (auto& p : pieces) {
      std::vector<int32_t> merged;
      for (size_t i = 0; i < p.size(); ++i) {
        if (i + 1 < p.size() && p[i] == a && p[i + 1] == b) {
          merged.push_back(id);
          ++i;
        } else {
          merged.push_back(p[i]);
        }
      }
      p = std::move(merged);
    }
  }
  std::filesystem::create_directories(dir);
  {
    std::ofstream out(dir / "tiktoken.model", std::ios::binary);
    for (size_t r = 0; r < vocab.size(); ++r) out << base64_encode(vocab[r]) << ' ' << r << '\n';
    K3_CHECK(out.good(), "{}: cannot write", (dir / "tiktoken.model").string());
  }
  nlohmann::json decoder = nlohmann::json::object();
  for (const auto& [offset, name] : kKimiSpecials) {
    decoder[std::to_string(n_base + offset)] = {{"content", name},     {"lstrip", false}, {"normalized", false},
                                                {"rstrip", false},     {"single_word", false},
                                                {"special", true}};
  }
  nlohmann::json config = {{"added_tokens_decoder", decoder},
                           {"bos_token", "[BOS]"},
                           {"eos_token", "[EOS]"},
                           {"tokenizer_class", "TikTokenTokenizer"}};
  std::ofstream out(dir / "tokenizer_config.json");
  out << config.dump(2) << '\n';
  K3_CHECK(out.good(), "{}: cannot write", (dir / "tokenizer_config.json").string());
}

}  // namespace k3
