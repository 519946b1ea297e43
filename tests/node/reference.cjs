// Reference token ids for tests/test_tokenizer.cpp, from tiktoken (npm: the
// wasm build of OpenAI's tiktoken, which ships the real cl100k_base and
// o200k_base ranks). Usage: node reference.cjs OUTDIR
//
// Writes into OUTDIR:
//   cl100k_base.tiktoken, o200k_base.tiktoken  the ranks, one "base64 rank" line each
//   kimi/tiktoken.model, kimi/tokenizer_config.json
//                    o200k's ranks with Kimi-style special tokens (a Kimi model dir)
//   reference.json   per encoding: its pat_str, special tokens and, for every
//                    corpus text (hex of its bytes), the ids of encode_ordinary
//                    and of encode(allowed_special = "all")
// The ids come from tiktoken itself (Kimi: a tiktoken.Tiktoken built from the
// upstream pat_str of tokenization_kimi.py, with its `&&` class intersections).
// For bytes that are not valid UTF-8 (tiktoken's _encode_bytes, not reachable
// from JS) the expected ids are assembled here from tiktoken's ids for the valid
// prefix and a plain byte-pair merge written below (see invalid_cases).
"use strict";
const fs = require("fs");
const path = require("path");
const { Tiktoken } = require("tiktoken");

const out = process.argv[2];
if (!out) { console.error("usage: node reference.cjs OUTDIR"); process.exit(2); }
fs.mkdirSync(path.join(out, "kimi"), { recursive: true });

// Kimi's pattern exactly as tokenization_kimi.py writes it.
const KIMI_PAT = [
  String.raw`[\p{Han}]+`,
  String.raw`[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?`,
  String.raw`[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?`,
  String.raw`\p{N}{1,3}`,
  String.raw` ?[^\s\p{L}\p{N}]+[\r\n]*`,
  String.raw`\s*[\r\n]+`,
  String.raw`\s+(?!\S)`,
  String.raw`\s+`,
].join("|");

// bpe_ranks in the package: "! FIRST_RANK b64 b64 ..." (consecutive ranks per line).
function ranks_lines(bpe_ranks) {
  const lines = [];
  for (const line of bpe_ranks.split("\n")) {
    if (!line) continue;
    const f = line.split(" ");
    const first = Number(f[1]);
    for (let i = 2; i < f.length; ++i) lines.push(`${f[i]} ${first + i - 2}`);
  }
  return lines;
}

// ---- corpus
const fixed = [
  "", "a", " ", "Hello, world!", "Hello world", "The quick brown fox jumps over the lazy dog.",
  "I'm here, you're there; it's ours. They'll go, we'd stay, I've seen, don't.",
  "SHOUTING'S LOUD'RE 'S 'll 'LL IT'ſ ſ", "MixedCASE camelCase snake_case PascalCase XMLHttpRequest",
  "12345678901234567890", "3.14159 2,718 1,000,000 -42 +7 1e-9 0x1F 007", "٣٤٥ ५६७ ①②③ ½ Ⅻ",
  "a  b   c    d", "trailing spaces   ", "   leading spaces", "\t\ttabs\t and\tspaces \t",
  "line1\nline2\r\nline3\n\n\nline4\r\r", "  \n  \n\n   \n", "x\u00a0y\u3000z\u2028w\u2029v\u0085u\u000b\f",
  "中文English混合", "你好，世界！我们今天学习自然语言处理。", "汉字abc北京市 Pascal", "你好、世界。我们〃々〆〇・ー㐀𠀀", "他说。在这里、大家好。因此《凤凰大参考》的", "中文，标点：“引号”（括号）【方括号】", "日本語のテキスト、カタカナとひらがな。",
  "한국어 텍스트입니다.", "Ünïcödé naïve café façade Æsir Øre straße", "Ελληνικά κείμενα ΑΒΓ", "Русский текст, Ёжик!",
  "مرحبا بالعالم", "नमस्ते दुनिया क्षत्रिय", "ǅemal ǈubljana ǋ Lt titlecase", "modifier ʰʲʷ ˈstress ꜀",
  "emoji 😀😃😄 👨‍👩‍👧‍👦 🤗 🇫🇷🇯🇵 ✔️ ❤️‍🔥 👍🏽", "🤖🤖🤖🤖🤖", "math ∑∫√∞ ≠ ≤ ≥ → ⇒ ∀x∃y",
  "int main() {\n    std::vector<int> v{1, 2, 3};\n    return v.size() > 2 ? 0 : 1;\n}\n",
  "def f(x):\n\tif x >= 10:\n\t\treturn x ** 2  # square\n\treturn None\n",
  "https://example.com/path?q=1&r=two#frag user@example.org C:\\Windows\\System32",
  "<html><body class=\"x\">&amp; &lt;tag&gt;</body></html>", "!!!???...,,,;;;:::---___===+++***",
  "$100.00 €50 ¥1000 £3 ₿0.001", "\"quoted\" 'single' «guillemets» „low“ ‘curly’",
  "a".repeat(300), "ab".repeat(257) + "!", " ".repeat(100) + "x", "9".repeat(50), "\n".repeat(20) + "end",
  "<|endoftext|> between <|endoftext|>text<|fim_prefix|><|endofprompt|>",
  "[BOS]Hello<|im_end|><|im_user|>user<|im_middle|>hi<|im_assistant|>assistant<|im_middle|>ok[EOS]",
  "<|reserved_token_200003|> [EOT] <|im_system|>system",
  "zero\u200bwidth\u200djoiner\u200c nonjoiner \ufeffbom", "combining e\u0301 a\u0308 n\u0303 \u0301alone",
];
// A seeded random mix of characters from many scripts and classes.
let seed = 12345;
const rnd = () => { seed = (seed * 1103515245 + 12345) % 2147483648; return seed / 2147483648; };
const pool = Array.from(
  "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789" +
  "     \t\n\n\r'''\"\".,;:!?-_()[]{}<>/\\|@#$%^&*+=~`" +
  "中文汉字北京语言模型日本語ひらがなカタカナ한국어ÜéçñßøÆΩαβγДжЁ" +
  "مرحبنمस्तेǅʰ\u0301\u0308\u00a0\u3000\u0085\u2028①½٣५");
const emoji = ["😀", "👨‍👩‍👧‍👦", "🇫🇷", "👍🏽", "🤗", "❤️"];
const randoms = [];
for (let n = 0; n < 300; ++n) {
  const len = 1 + Math.floor(rnd() * 60);
  let s = "";
  for (let i = 0; i < len; ++i) s += rnd() < 0.04 ? emoji[Math.floor(rnd() * emoji.length)] : pool[Math.floor(rnd() * pool.length)];
  randoms.push(s);
}
const corpus = fixed.concat(randoms);

// ---- byte strings that are not valid UTF-8: [stable prefix, last regex piece
// of the valid prefix, the bytes from the first invalid one on]. tiktoken's
// _encode_bytes encodes the valid prefix, then re-merges its last piece together
// with the rest as one byte-pair piece. Only prefixes whose last piece does not
// end in whitespace (tiktoken widens a whitespace last piece) are listed.
const invalid_cases = [
  ["hello", " wor", [0xff]],
  ["", "abc", [0x80, 0x61, 0x62]],
  ["", "你好", [0xe4, 0xbd]],                        // a truncated CJK character
  ["x = ", "1", [0xc0, 0xaf, 0x20, 0x79]],           // overlong encoding
  ["The", " end", [0xed, 0xa0, 0x80]],               // a UTF-16 surrogate
  ["ok", ".", [0xf8, 0x88, 0x80, 0x80, 0x80]],       // 5-byte form
  ["", "ab", [0xfe, 0x20, 0x63, 0x64, 0x20, 0x65, 0x66, 0x0a]],
  ["emoji", " 😀", [0xf0, 0x9f, 0x98]],              // emoji cut short
];

function byte_pair_merge(bytes, rank_of) {
  // The reference merge: repeatedly join the adjacent pair whose bytes have the
  // lowest rank (leftmost on ties) until no adjacent pair is a token.
  let parts = Array.from(bytes, (b) => [b]);
  for (;;) {
    let best = -1, best_rank = Infinity;
    for (let i = 0; i + 1 < parts.length; ++i) {
      const r = rank_of(parts[i].concat(parts[i + 1]));
      if (r !== undefined && r < best_rank) { best_rank = r; best = i; }
    }
    if (best < 0) break;
    parts.splice(best, 2, parts[best].concat(parts[best + 1]));
  }
  return parts.map((p) => {
    const r = rank_of(p);
    if (r === undefined) throw new Error("byte missing from the ranks");
    return r;
  });
}

const hex = (bytes) => Buffer.from(bytes).toString("hex");
const utf8 = (s) => Array.from(Buffer.from(s, "utf8"));

function run(name, enc_json, pat_str, specials, ranks_path) {
  const lines = ranks_lines(enc_json.bpe_ranks);
  fs.writeFileSync(ranks_path, lines.join("\n") + "\n");
  const rank_map = new Map();
  for (const l of lines) {
    const [b64, r] = l.split(" ");
    rank_map.set(Buffer.from(b64, "base64").toString("latin1"), Number(r));
  }
  const rank_of = (arr) => rank_map.get(Buffer.from(arr).toString("latin1"));
  const enc = new Tiktoken(enc_json.bpe_ranks, specials, pat_str);
  const cases = corpus.map((text) => ({
    hex: hex(utf8(text)),
    ordinary: Array.from(enc.encode_ordinary(text)),
    all: Array.from(enc.encode(text, "all")),
  }));
  const invalid = invalid_cases.map(([stable, last, tail]) => {
    const bytes = utf8(stable).concat(utf8(last), tail);
    const ids = Array.from(enc.encode_ordinary(stable)).concat(byte_pair_merge(utf8(last).concat(tail), rank_of));
    return { hex: hex(bytes), ordinary: ids };
  });
  enc.free();
  return { name, pat_str, special_tokens: specials, n_ranks: lines.length, cases, invalid };
}

const cl100k = require("tiktoken/encoders/cl100k_base.json");
const o200k = require("tiktoken/encoders/o200k_base.json");
const result = { encodings: [] };
result.encodings.push(run("cl100k_base", cl100k, cl100k.pat_str, cl100k.special_tokens, path.join(out, "cl100k_base.tiktoken")));
result.encodings.push(run("o200k_base", o200k, o200k.pat_str, o200k.special_tokens, path.join(out, "o200k_base.tiktoken")));

// Kimi: the names of Kimi K2's tokenizer_config.json at the same offsets past
// the base vocabulary; every other id of the 256 + 2 reserved is named
// <|reserved_token_ID|> (tokenization_kimi.py's rule).
const n_base = ranks_lines(o200k.bpe_ranks).length;
const kimi_named = { 0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
  6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>", 17: "<|im_middle|>",
  254: "[UNK]", 255: "[PAD]" };
const decoder = {};
for (const [off, content] of Object.entries(kimi_named)) {
  decoder[String(n_base + Number(off))] = { content, lstrip: false, normalized: false, rstrip: false, single_word: false, special: true };
}
const kimi_specials = {};
for (let i = n_base; i < n_base + 256 + 2; ++i) kimi_specials[decoder[i] ? decoder[i].content : `<|reserved_token_${i}|>`] = i;
fs.writeFileSync(path.join(out, "kimi", "tokenizer_config.json"),
  JSON.stringify({ added_tokens_decoder: decoder, bos_token: "[BOS]", eos_token: "[EOS]", tokenizer_class: "TikTokenTokenizer" }, null, 2));
result.encodings.push(run("kimi", o200k, KIMI_PAT, kimi_specials, path.join(out, "kimi", "tiktoken.model")));

fs.writeFileSync(path.join(out, "reference.json"), JSON.stringify(result));
console.log(`reference: ${corpus.length} texts, ${invalid_cases.length} invalid byte strings x ${result.encodings.length} encodings -> ${out}`);
