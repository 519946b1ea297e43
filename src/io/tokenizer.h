// Kimi's tokenizer: byte-level BPE with tiktoken semantics, read from a model
// directory's `tiktoken.model` (one "base64-of-the-token-bytes rank" line per
// token) and `tokenizer_config.json` (`added_tokens_decoder`: special tokens).
//
// Encoding (as tiktoken's CoreBPE): the text is cut at allowed special tokens;
// every stretch between them is split into pieces by the pre-tokenizer regex
// (PCRE2, UTF + UCP, JIT when available) and each piece is encoded on its own:
// a piece that is a token is that token, else its bytes are merged pairwise,
// always the adjacent pair whose concatenation has the lowest rank (leftmost on
// ties), until no adjacent pair is a token. Decoding concatenates token bytes.
// Bytes that are not valid UTF-8 are encoded as tiktoken's `_encode_bytes` does
// (tokenizer.cpp says how); decode(encode(x)) == x for every byte string.
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace k3 {

// Pre-tokenizer patterns, in PCRE2 syntax.
// Kimi's pat_str (tokenization_kimi.py) with its class intersections translated
// (tokenizer.cpp, file top); the default of Tokenizer::load.
extern const char* const kKimiPattern;
// OpenAI's cl100k_base and o200k_base pat_str, verbatim.
extern const char* const kCl100kPattern;
extern const char* const kO200kPattern;

struct SpecialToken {
  std::string content;
  int32_t id = 0;
};

class Tokenizer {
 public:
  // ranks[i]: the bytes of a token and its id. Every single byte must be a token;
  // ranks and special ids must be unique. Error otherwise, or on a bad pattern.
  Tokenizer(std::vector<std::pair<std::string, int32_t>> ranks, std::vector<SpecialToken> specials,
            const std::string& pattern);
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  // A model directory: tiktoken.model, plus tokenizer_config.json when present
  // (its added_tokens_decoder; the ids of the 258 slots after the ranks that it
  // does not name are <|reserved_token_ID|>, as in tokenization_kimi.py), with
  // Kimi's pattern. Error naming the file (and line) on a malformed file.
  static Tokenizer load(const std::filesystem::path& dir);
  static bool present(const std::filesystem::path& dir);  // dir/tiktoken.model exists
  // One tiktoken-format ranks file ("base64 rank" lines; blank lines skipped).
  static std::vector<std::pair<std::string, int32_t>> read_ranks(const std::filesystem::path& file);

  // No special tokens: their text is encoded as ordinary text.
  std::vector<int32_t> encode_ordinary(std::string_view text) const;
  // Special tokens recognized wherever they occur (tokenization_kimi.py's default).
  std::vector<int32_t> encode(std::string_view text) const;
  // Only the special tokens named in `allowed` are recognized.
  std::vector<int32_t> encode(std::string_view text, const std::unordered_set<std::string>& allowed) const;

  // The pre-tokenizer's pieces of valid UTF-8 text (no special tokens).
  std::vector<std::string_view> split(std::string_view text) const;

  // The bytes of the tokens, concatenated. Error on an id that is no token.
  std::string decode(std::span<const int32_t> ids) const;
  const std::string& token_bytes(int32_t id) const;

  std::optional<int32_t> special_id(std::string_view content) const;
  const std::vector<SpecialToken>& specials() const { return specials_; }
  size_t n_ranks() const { return n_ranks_; }
  int32_t n_vocab() const { return n_vocab_; }  // largest id + 1

 private:
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
  };
  using RankMap = std::unordered_map<std::string, int32_t, Hash, std::equal_to<>>;
  struct Regex;

  int32_t rank_of(std::string_view bytes) const;  // -1 when no token
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;
  // Encodes text without specials; returns the token count of the last regex piece.
  size_t encode_segment(std::string_view text, std::vector<int32_t>& out) const;
  void encode_bytes(std::string_view bytes, std::vector<int32_t>& out) const;
  template <typename Allowed>
  std::vector<int32_t> encode_with(std::string_view text, const Allowed& allowed) const;

  RankMap encoder_;
  std::unordered_map<int32_t, std::string> decoder_;
  std::vector<SpecialToken> specials_;
  std::unordered_map<std::string, int32_t, Hash, std::equal_to<>> special_ids_;
  std::array<bool, 256> special_first_{};  // first bytes of special tokens
  size_t n_ranks_ = 0;
  int32_t n_vocab_ = 0;
  std::unique_ptr<Regex> regex_;
};

// A small Kimi-format tokenizer for synthetic checkpoints, written into dir as
// tiktoken.model + tokenizer_config.json: the 256 single bytes, byte-pair merges
// learned from a built-in text (Kimi's pattern) up to vocab_size - 256 ranks,
// then the 256 special slots with Kimi's names ([BOS], [EOS], <|im_end|>,
// <|im_user|>, <|im_assistant|>, ...). vocab_size >= 768. Deterministic.
void write_small_tokenizer(const std::filesystem::path& dir, int vocab_size);

}  // namespace k3
