// Collective checks shared by the local backend (tests/test_comm.cpp, ranks as
// threads) and the mpi backend (tests/comm_mpi_test.cpp, ranks as processes).
//
// run_rank_suite(...) is what one world rank runs: for its tp, dcp and world
// groups, every collective with data derived from (seed, contributor's world
// rank, element index), each result compared with an expectation computed
// here from the generators and the layout formula of comm.h (group members,
// rank order) - never from the code under test. A failed check is recorded
// in a Checker and the rank goes on calling the collectives, so its peers do
// not wait for it forever. Sums: exact data (small integers times powers of
// two, any order gives the same sum) and rounding data (mixed magnitudes:
// the result depends on the order, expected = FP32 accumulation in rank
// order, then round-to-nearest-even to BF16 written here).
#pragma once

#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "comm/comm.h"
#include "core/error.h"

namespace k3test {

using k3::DType;

struct Checker {
  std::string where;  // "world rank 3"
  int64_t checks = 0;
  std::vector<std::string> failures;

  void pass() { ++checks; }
  template <typename... A>
  void fail(fmt::format_string<A...> f, A&&... a) {
    ++checks;
    failures.push_back(where + ": " + fmt::format(f, std::forward<A>(a)...));
  }
  template <typename... A>
  void expect(bool ok, fmt::format_string<A...> f, A&&... a) {
    if (ok)
      pass();
    else
      fail(f, std::forward<A>(a)...);
  }
};

// What differs between backends.
struct SuiteOptions {
  uint64_t seed = 0x6b33636f6d6dULL;
  // mpi: every rank of the group raises the count-mismatch error of
  // all_to_all_v; local: the receiving rank does (the others may or may not).
  bool a2a_mismatch_throws_everywhere = false;
  // nccl: a count mismatch between ranks cannot be seen without a host round
  // trip (the calls are graph-capturable); the mismatch check is skipped.
  bool a2a_mismatch_detected = true;
  // mpi: calls beyond INT_MAX bytes are errors (raised before touching buffers).
  bool int_max_guards = false;
};

// ---- generators -----------------------------------------------------------

inline uint64_t mix(uint64_t h, uint64_t v) {
  uint64_t z = h ^ (v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
inline uint64_t hash(uint64_t seed, uint64_t a, uint64_t b, uint64_t c = 0, uint64_t d = 0) {
  return mix(mix(mix(mix(mix(0x243f6a8885a308d3ULL, seed), a), b), c), d);
}

// BF16 written here, independently of core/bf16.h.
inline float bf16_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_bf16_rne(float f) {  // finite f
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t hi = u >> 16;
  const uint32_t lo = u & 0xffffu;
  if (lo > 0x8000u || (lo == 0x8000u && (hi & 1u))) ++hi;
  return static_cast<uint16_t>(hi);
}

// Exact F32: an integer in [-1000, 1000] times 2^e, e in [-3, 3] shared by all
// ranks at element i: every sum of up to 64 of them is exact in FP32.
inline float exact_f32(uint64_t seed, int w, int64_t i) {
  const int v = static_cast<int>(hash(seed, w, i, 1) % 2001) - 1000;
  const int e = static_cast<int>(hash(seed, 0xe, i, 2) % 7) - 3;
  return std::ldexp(static_cast<float>(v), e);
}
// Exact BF16: an integer in [-15, 15] times 2^e: sums of up to 8 are exact in BF16.
inline uint16_t exact_bf16(uint64_t seed, int w, int64_t i) {
  const int v = static_cast<int>(hash(seed, w, i, 3) % 31) - 15;
  const int e = static_cast<int>(hash(seed, 0xe, i, 4) % 7) - 3;
  return float_to_bf16_rne(std::ldexp(static_cast<float>(v), e));  // exact
}
// Rounding F32: +-(1 + k / 2^23) 2^e, e in [-20, 20]: the sum depends on the order.
inline float round_f32(uint64_t seed, int w, int64_t i) {
  const uint64_t h = hash(seed, w, i, 5);
  const float m = 1.f + static_cast<float>(h & 0x7fffff) / 8388608.f;
  const float x = std::ldexp(m, static_cast<int>((h >> 23) % 41) - 20);
  return (h >> 40) & 1 ? -x : x;
}
// Rounding BF16 (BF16 values): at element i, each rank contributes +-B_i
// (B_i ~ 2^25, the same magnitude on every rank) with probability 3/8, else a
// small +-(1 + k / 128) 2^e, e in [-6, 6]. In FP32 a partial sum near B_i
// keeps small terms only to a multiple of 2 or 4, and the big terms cancel:
// the BF16 result depends on where the big terms stand in the order.
inline uint16_t round_bf16(uint64_t seed, int w, int64_t i) {
  const uint64_t h = hash(seed, w, i, 6), hb = hash(seed, 0xb, i, 6);
  const uint16_t sign = (h >> 20) & 1 ? 0x8000 : 0;
  if (h % 8 < 3) return static_cast<uint16_t>(sign | ((127 + 24 + hb % 3) << 7) | (hb >> 8 & 0x7f));
  const int e = static_cast<int>((h >> 7) % 13) - 6;
  return static_cast<uint16_t>(sign | ((127 + e) << 7) | (h >> 24 & 0x7f));
}

// The sum the interface prescribes: FP32, rank order, from +0.
template <typename Gen>
float rank_order_sum(const std::vector<int>& members, Gen gen, int64_t i) {
  float s = 0.f;
  for (int w : members) s += gen(w, i);
  return s;
}

// ---- group membership by the layout formula of comm.h -----------------------

// The layout of a test binary's command line: --tp G --dp N --dcp D (each optional). On a bad argument,
// prints the usage and returns false.
inline bool parse_layout_args(int argc, char** argv, k3::Layout* L) {
  auto parse_int = [](const char* s, int* out) {
    char* end = nullptr;
    const long v = std::strtol(s, &end, 10);
    if (end == s || *end != '\0' || v < -1000000 || v > 1000000) return false;
    *out = static_cast<int>(v);
    return true;
  };
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    int* dst = std::strcmp(a, "--tp") == 0 ? &L->tp : std::strcmp(a, "--dp") == 0 ? &L->dp
                                                 : std::strcmp(a, "--dcp") == 0  ? &L->dcp
                                                                                 : nullptr;
    if (!dst || i + 1 >= argc || !parse_int(argv[i + 1], dst)) {
      std::fprintf(stderr, "usage: %s --tp G --dp N --dcp D (bad argument '%s')\n", argv[0], a);
      return false;
    }
    ++i;
  }
  return true;
}

inline std::vector<int> tp_members(const k3::Layout& L, int w) {
  std::vector<int> m;
  for (int j = 0; j < L.tp; ++j) m.push_back(w / L.tp * L.tp + j);
  return m;
}
inline std::vector<int> dcp_members(const k3::Layout& L, int w) {
  const int t = w % L.tp, base = w / L.tp * L.tp + (t - t % L.dcp);
  std::vector<int> m;
  for (int j = 0; j < L.dcp; ++j) m.push_back(base + j);
  return m;
}
inline std::vector<int> world_members(const k3::Layout& L) {
  std::vector<int> m;
  for (int j = 0; j < L.tp * L.dp; ++j) m.push_back(j);
  return m;
}

// ---- comparison helpers ----------------------------------------------------

inline std::string show(float v) { return fmt::format("{} ({:a})", v, v); }
inline std::string show(uint16_t b) { return fmt::format("bf16 0x{:04x} = {}", b, bf16_to_float(b)); }
inline std::string show(int32_t v) { return fmt::format("{}", v); }
inline std::string show(uint8_t v) { return fmt::format("0x{:02x}", v); }

constexpr int64_t kPad = 8;  // canary elements after every output

template <typename T>
T canary() {
  T c;
  std::memset(&c, 0xA5, sizeof c);
  return c;
}

// Bitwise: got[0, n) == want[0, n), and got[n, n + kPad) still the canary.
template <typename T>
void expect_bits(Checker& ck, const std::string& what, const std::vector<T>& got, const std::vector<T>& want) {
  const int64_t n = static_cast<int64_t>(want.size());
  for (int64_t i = 0; i < n; ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0)
      return ck.fail("{}: element {} of {}: got {}, expected {}", what, i, n, show(got[i]), show(want[i]));
  const T c = canary<T>();
  for (int64_t i = n; i < static_cast<int64_t>(got.size()); ++i)
    if (std::memcmp(&got[i], &c, sizeof(T)) != 0)
      return ck.fail("{}: wrote past the end of its {} elements (element {})", what, n, i);
  ck.pass();
}

template <typename T>
std::vector<T> with_canary(int64_t n) {
  if (n < 0 || n > (int64_t{1} << 40)) throw std::length_error("with_canary: bad size");
  return std::vector<T>(static_cast<size_t>(n + kPad), canary<T>());
}

// Runs f; returns the k3::Error message ("" when nothing was thrown).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const k3::Error& e) {
    return e.what();
  }
  return {};
}

inline bool contains(const std::string& s, const std::string& sub) { return s.find(sub) != std::string::npos; }

// ---- the checks of one group -----------------------------------------------

struct Group {
  const char* name;            // "tp", "dcp", "world"
  k3::Comm* comm;
  std::vector<int> members;    // world ranks in group-rank order (layout formula)
  int me;                      // this rank's index in members
  int w;                       // this process's / thread's world rank
};

constexpr int64_t kSizes[] = {0, 1, 7, 1023};

inline void check_sums(Checker& ck, const Group& g, uint64_t seed, int64_t count) {
  k3::Comm& c = *g.comm;
  const auto& M = g.members;
  const int n = static_cast<int>(M.size());
  const std::string at = fmt::format("{} count {}", g.name, count);
  auto ef = [&](int w, int64_t i) { return exact_f32(seed, w, i); };
  auto rf = [&](int w, int64_t i) { return round_f32(seed, w, i); };
  auto eb = [&](int w, int64_t i) { return bf16_to_float(exact_bf16(seed, w, i)); };
  auto rb = [&](int w, int64_t i) { return bf16_to_float(round_bf16(seed, w, i)); };

  // all_reduce, F32 and BF16, exact and rounding data.
  {
    auto buf = with_canary<float>(count);
    std::vector<float> want(count);
    for (int64_t i = 0; i < count; ++i) {
      buf[i] = exact_f32(seed, g.w, i);
      double exact = 0;  // order-free: exact data
      for (int w : M) exact += exact_f32(seed, w, i);
      want[i] = static_cast<float>(exact);
    }
    c.all_reduce(buf.data(), count, DType::F32);
    expect_bits(ck, at + " all_reduce F32 exact", buf, want);
  }
  {
    auto buf = with_canary<float>(count);
    std::vector<float> want(count);
    for (int64_t i = 0; i < count; ++i) {
      buf[i] = round_f32(seed, g.w, i);
      want[i] = rank_order_sum(M, rf, i);
    }
    c.all_reduce(buf.data(), count, DType::F32);
    expect_bits(ck, at + " all_reduce F32 rank order", buf, want);
  }
  {
    auto buf = with_canary<uint16_t>(count);
    std::vector<uint16_t> want(count);
    for (int64_t i = 0; i < count; ++i) {
      buf[i] = exact_bf16(seed, g.w, i);
      double exact = 0;
      for (int w : M) exact += eb(w, i);
      want[i] = float_to_bf16_rne(static_cast<float>(exact));  // exact in BF16 (|sum| <= 120 x 2^e)
    }
    c.all_reduce(buf.data(), count, DType::BF16);
    expect_bits(ck, at + " all_reduce BF16 exact", buf, want);
  }
  {
    auto buf = with_canary<uint16_t>(count);
    std::vector<uint16_t> want(count);
    for (int64_t i = 0; i < count; ++i) {
      buf[i] = round_bf16(seed, g.w, i);
      want[i] = float_to_bf16_rne(rank_order_sum(M, rb, i));
    }
    c.all_reduce(buf.data(), count, DType::BF16);
    expect_bits(ck, at + " all_reduce BF16 rank order", buf, want);
  }

  // reduce_scatter: send [n, count], element (q, i) from (seed, w, q * count + i);
  // rank me gets sum over members p of their send[me].
  {
    auto send = with_canary<float>(n * count);
    for (int64_t j = 0; j < n * count; ++j) send[j] = round_f32(seed, g.w, j);
    auto recv = with_canary<float>(count);
    std::vector<float> want(count);
    for (int64_t i = 0; i < count; ++i) want[i] = rank_order_sum(M, rf, g.me * count + i);
    c.reduce_scatter(send.data(), recv.data(), count, DType::F32);
    expect_bits(ck, at + " reduce_scatter F32 rank order", recv, want);
  }
  {
    auto send = with_canary<uint16_t>(n * count);
    for (int64_t j = 0; j < n * count; ++j) send[j] = round_bf16(seed, g.w, j);
    auto recv = with_canary<uint16_t>(count);
    std::vector<uint16_t> want(count);
    for (int64_t i = 0; i < count; ++i) want[i] = float_to_bf16_rne(rank_order_sum(M, rb, g.me * count + i));
    c.reduce_scatter(send.data(), recv.data(), count, DType::BF16);
    expect_bits(ck, at + " reduce_scatter BF16 rank order", recv, want);
  }
  {
    auto send = with_canary<float>(n * count);
    for (int64_t j = 0; j < n * count; ++j) send[j] = exact_f32(seed, g.w, j);
    auto recv = with_canary<float>(count);
    std::vector<float> want(count);
    for (int64_t i = 0; i < count; ++i) want[i] = rank_order_sum(M, ef, g.me * count + i);
    c.reduce_scatter(send.data(), recv.data(), count, DType::F32);
    expect_bits(ck, at + " reduce_scatter F32 exact", recv, want);
  }
}

inline void check_gather_broadcast(Checker& ck, const Group& g, uint64_t seed, int64_t count) {
  k3::Comm& c = *g.comm;
  const auto& M = g.members;
  const int n = static_cast<int>(M.size());
  const std::string at = fmt::format("{} count {}", g.name, count);

  // all_gather, out of place (F32, I32) and in place (BF16, U8: odd byte counts).
  {
    std::vector<float> send(count);
    for (int64_t i = 0; i < count; ++i) send[i] = round_f32(seed, g.w, i);
    auto recv = with_canary<float>(n * count);
    std::vector<float> want(n * count);
    for (int p = 0; p < n; ++p)
      for (int64_t i = 0; i < count; ++i) want[p * count + i] = round_f32(seed, M[p], i);
    c.all_gather(send.data(), recv.data(), count, DType::F32);
    expect_bits(ck, at + " all_gather F32", recv, want);
  }
  {
    std::vector<int32_t> send(count);
    for (int64_t i = 0; i < count; ++i) send[i] = static_cast<int32_t>(hash(seed, g.w, i, 7));
    auto recv = with_canary<int32_t>(n * count);
    std::vector<int32_t> want(n * count);
    for (int p = 0; p < n; ++p)
      for (int64_t i = 0; i < count; ++i) want[p * count + i] = static_cast<int32_t>(hash(seed, M[p], i, 7));
    c.all_gather(send.data(), recv.data(), count, DType::I32);
    expect_bits(ck, at + " all_gather I32", recv, want);
  }
  {
    auto recv = with_canary<uint16_t>(n * count);
    for (int64_t j = 0; j < n * count; ++j) recv[j] = 0x7fc1;  // others' pieces: garbage (a NaN)
    for (int64_t i = 0; i < count; ++i) recv[g.me * count + i] = round_bf16(seed, g.w, i);
    std::vector<uint16_t> want(n * count);
    for (int p = 0; p < n; ++p)
      for (int64_t i = 0; i < count; ++i) want[p * count + i] = round_bf16(seed, M[p], i);
    c.all_gather(recv.data() + g.me * count, recv.data(), count, DType::BF16);
    expect_bits(ck, at + " all_gather BF16 in place", recv, want);
  }
  {
    auto recv = with_canary<uint8_t>(n * count);
    for (int64_t j = 0; j < n * count; ++j) recv[j] = 0x5a;
    for (int64_t i = 0; i < count; ++i) recv[g.me * count + i] = static_cast<uint8_t>(hash(seed, g.w, i, 8));
    std::vector<uint8_t> want(n * count);
    for (int p = 0; p < n; ++p)
      for (int64_t i = 0; i < count; ++i) want[p * count + i] = static_cast<uint8_t>(hash(seed, M[p], i, 8));
    c.all_gather(recv.data() + g.me * count, recv.data(), count, DType::U8);
    expect_bits(ck, at + " all_gather U8 in place", recv, want);
  }

  // broadcast from the last rank (non-zero when n > 1), rank 0 and the middle one.
  for (int root : {n - 1, 0, n / 2}) {
    auto buf = with_canary<uint16_t>(count);
    std::vector<uint16_t> want(count);
    for (int64_t i = 0; i < count; ++i) {
      buf[i] = g.me == root ? round_bf16(seed, g.w, i) : uint16_t{0xffff};
      want[i] = round_bf16(seed, M[root], i);
    }
    c.broadcast(buf.data(), count, DType::BF16, root);
    expect_bits(ck, fmt::format("{} broadcast BF16 from root {}", at, root), buf, want);
  }
  {
    auto buf = with_canary<uint8_t>(count);
    std::vector<uint8_t> want(count);
    const int root = n - 1;
    for (int64_t i = 0; i < count; ++i) {
      buf[i] = g.me == root ? static_cast<uint8_t>(hash(seed, g.w, i, 9)) : uint8_t{0};
      want[i] = static_cast<uint8_t>(hash(seed, M[root], i, 9));
    }
    c.broadcast(buf.data(), count, DType::U8, root);
    expect_bits(ck, fmt::format("{} broadcast U8 from root {}", at, root), buf, want);
  }
}

// all_to_all_v with counts(p, q) (group ranks) and element j of piece p -> q
// derived from (seed, M[p], M[q], j).
template <typename T, typename Counts>
void check_a2a(Checker& ck, const Group& g, uint64_t seed, DType dt, const std::string& what, Counts counts) {
  const auto& M = g.members;
  const int n = static_cast<int>(M.size());
  auto val = [&](int p, int q, int64_t j) { return static_cast<T>(hash(seed, M[p], M[q], j, 10)); };
  std::vector<int64_t> sc(n), rc(n);
  int64_t ns = 0, nr = 0;
  for (int q = 0; q < n; ++q) ns += (sc[q] = counts(g.me, q));
  for (int p = 0; p < n; ++p) nr += (rc[p] = counts(p, g.me));
  std::vector<T> send;
  for (int q = 0; q < n; ++q)
    for (int64_t j = 0; j < sc[q]; ++j) send.push_back(val(g.me, q, j));
  auto recv = with_canary<T>(nr);
  std::vector<T> want;
  for (int p = 0; p < n; ++p)
    for (int64_t j = 0; j < rc[p]; ++j) want.push_back(val(p, g.me, j));
  g.comm->all_to_all_v(ns ? send.data() : nullptr, sc.data(), recv.data(), rc.data(), dt);
  expect_bits(ck, fmt::format("{} all_to_all_v {} ({} sent, {} received)", g.name, what, ns, nr), recv, want);
}

inline void check_all_to_all(Checker& ck, const Group& g, uint64_t seed) {
  const auto& M = g.members;
  const int n = static_cast<int>(M.size());
  // Uneven, with zeros; the last rank sends nothing to anybody.
  auto uneven = [&](int p, int q) -> int64_t {
    if (p == n - 1) return 0;
    return static_cast<int64_t>(hash(seed, M[p], M[q], 11) % 6);
  };
  // Uneven, everybody sends, one piece of 1023 (rank 0 -> the last rank).
  auto big = [&](int p, int q) -> int64_t {
    if (p == 0 && q == n - 1) return 1023;
    return 1 + static_cast<int64_t>(hash(seed, M[p], M[q], 12) % 7);
  };
  check_a2a<int32_t>(ck, g, seed, DType::I32, "I32 uneven, last rank silent", uneven);
  check_a2a<uint16_t>(ck, g, seed, DType::BF16, "BF16 uneven, last rank silent", uneven);
  check_a2a<uint8_t>(ck, g, seed, DType::U8, "U8 uneven, one piece of 1023", big);
  check_a2a<float>(ck, g, seed, DType::F32, "F32 uneven, one piece of 1023", big);
  {
    // all zero counts, null buffers
    std::vector<int64_t> z(n, 0);
    g.comm->all_to_all_v(nullptr, z.data(), nullptr, z.data(), DType::F32);
    ck.pass();
  }
}

// Misuse that must be a k3::Error (on every rank unless said otherwise), never a hang.
inline void check_errors(Checker& ck, const Group& g, const SuiteOptions& o) {
  k3::Comm& c = *g.comm;
  const int n = static_cast<int>(g.members.size());
  std::vector<int32_t> i32(16 * n);
  std::vector<uint8_t> u8(16 * n);
  std::string e = error_of([&] { c.all_reduce(i32.data(), 4, DType::I32); });
  ck.expect(contains(e, "I32"), "{} all_reduce of I32: expected a k3::Error naming I32, got '{}'", g.name, e);
  e = error_of([&] { c.reduce_scatter(u8.data(), u8.data() + 4 * n, 4, DType::U8); });
  ck.expect(contains(e, "U8"), "{} reduce_scatter of U8: expected a k3::Error naming U8, got '{}'", g.name, e);
  e = error_of([&] { c.broadcast(u8.data(), 4, DType::U8, n); });
  ck.expect(contains(e, std::to_string(n)), "{} broadcast from root {}: expected a k3::Error naming it, got '{}'",
            g.name, n, e);

  // all_to_all_v count mismatch: the last rank sends 37 elements to rank 0,
  // which expects 41.
  if (o.a2a_mismatch_detected) {
    auto counts = [&](int p, int q) -> int64_t { return p == n - 1 && q == 0 ? 37 : 1 + (p + 2 * q) % 3; };
    std::vector<int64_t> sc(n), rc(n);
    int64_t ns = 0, nr = 0;
    for (int q = 0; q < n; ++q) ns += (sc[q] = counts(g.me, q));
    for (int p = 0; p < n; ++p) nr += (rc[p] = counts(p, g.me));
    if (g.me == 0) {
      nr += 41 - rc[n - 1];
      rc[n - 1] = 41;
    }
    std::vector<int32_t> send(ns, 1), recv(nr + kPad, 0);
    e = error_of([&] { c.all_to_all_v(send.data(), sc.data(), recv.data(), rc.data(), DType::I32); });
    const bool names_counts = contains(e, "37") && contains(e, "41");
    if (g.me == 0 || o.a2a_mismatch_throws_everywhere)
      ck.expect(names_counts, "{} all_to_all_v 37 sent vs 41 expected: expected a k3::Error naming both, got '{}'",
                g.name, e);
  }

  if (o.int_max_guards) {
    const int64_t two_g = int64_t{1} << 31;  // INT_MAX + 1 bytes
    e = error_of([&] { c.all_gather(u8.data(), u8.data(), two_g, DType::U8); });
    ck.expect(contains(e, "INT_MAX"), "{} all_gather of 2^31 bytes: expected a k3::Error, got '{}'", g.name, e);
    e = error_of([&] { c.all_reduce(u8.data(), two_g / 4, DType::F32); });
    ck.expect(contains(e, "INT_MAX"), "{} all_reduce of 2^31 bytes: expected a k3::Error, got '{}'", g.name, e);
    e = error_of([&] { c.broadcast(u8.data(), two_g, DType::U8, 0); });
    ck.expect(contains(e, "INT_MAX"), "{} broadcast of 2^31 bytes: expected a k3::Error, got '{}'", g.name, e);
    // one piece of 2^31 bytes from rank 0 to the last rank (which expects it)
    std::vector<int64_t> sc(n, 1), rc(n, 1);
    if (g.me == 0) sc[n - 1] = two_g;
    if (g.me == n - 1) rc[0] = two_g;
    e = error_of([&] { c.all_to_all_v(u8.data(), sc.data(), u8.data(), rc.data(), DType::U8); });
    ck.expect(contains(e, "INT_MAX"), "{} all_to_all_v of a 2^31-byte piece: expected a k3::Error, got '{}'", g.name,
              e);
  }
}

inline void check_group(Checker& ck, const Group& g, const SuiteOptions& o, uint64_t group_salt) {
  k3::Comm& c = *g.comm;
  const int n = static_cast<int>(g.members.size());
  if (c.rank() != g.me || c.size() != n) {
    ck.fail("{} group: rank {} of {}, the layout says {} of {}", g.name, c.rank(), c.size(), g.me, n);
    throw std::runtime_error("group shape differs from the layout: the checks cannot go on");
  }
  ck.pass();
  // Membership: everybody's world rank, in group-rank order.
  {
    auto got = with_canary<int32_t>(n);
    const int32_t mine = g.w;
    c.all_gather(&mine, got.data(), 1, DType::I32);
    std::vector<int32_t> want(g.members.begin(), g.members.end());
    expect_bits(ck, fmt::format("{} members (world ranks)", g.name), got, want);
  }
  const uint64_t seed = hash(o.seed, group_salt, 0);
  for (int64_t count : kSizes) {
    check_sums(ck, g, hash(seed, count, 1), count);
    check_gather_broadcast(ck, g, hash(seed, count, 2), count);
  }
  check_all_to_all(ck, g, hash(seed, 3, 3));
  check_errors(ck, g, o);
  c.barrier();
  c.barrier();
  ck.pass();
}

// CountingComm over a group: calls and bytes per kind, results passed through.
inline void check_counting(Checker& ck, std::unique_ptr<k3::Comm> inner, const std::vector<int>& M, int me, int w,
                           uint64_t seed) {
  using k3::CollKind;
  k3::CountingComm cc(std::move(inner));
  const int n = static_cast<int>(M.size());
  std::vector<float> f(7 * n);
  for (int i = 0; i < 7; ++i) f[i] = exact_f32(seed, w, i);
  cc.all_reduce(f.data(), 7, DType::F32);
  bool ok = true;
  for (int i = 0; i < 7; ++i) {
    double s = 0;
    for (int p : M) s += exact_f32(seed, p, i);
    ok = ok && f[i] == static_cast<float>(s);
  }
  ck.expect(ok, "CountingComm: all_reduce result not passed through");
  std::vector<uint16_t> b(3, 0x3f80);
  cc.all_reduce(b.data(), 3, DType::BF16);
  std::vector<int32_t> gi(5 * n), gs(5, w);
  cc.all_gather(gs.data(), gi.data(), 5, DType::I32);
  std::vector<float> rs_send(4 * n, 1.f), rs_recv(4);
  cc.reduce_scatter(rs_send.data(), rs_recv.data(), 4, DType::F32);
  std::vector<int64_t> sc(n), rc(n, me + 1);
  int64_t ns = 0;
  for (int q = 0; q < n; ++q) ns += (sc[q] = q + 1);
  std::vector<int32_t> a_send(ns), a_recv(n * (me + 1));
  cc.all_to_all_v(a_send.data(), sc.data(), a_recv.data(), rc.data(), DType::I32);
  std::vector<uint8_t> bc(9);
  cc.broadcast(bc.data(), 9, DType::U8, 0);
  cc.barrier();
  cc.barrier();
  const int64_t want_calls[6] = {2, 1, 1, 1, 1, 2};
  const int64_t want_bytes[6] = {7 * 4 + 3 * 2, 5 * 4, int64_t{4} * n * 4, int64_t{n} * (n + 1) / 2 * 4,
                                 me == 0 ? 9 : 0, 0};
  for (int k = 0; k < 6; ++k) {
    const auto kind = static_cast<CollKind>(k);
    ck.expect(cc.calls(kind) == want_calls[k], "CountingComm {}: {} calls, expected {}", k3::coll_kind_name(kind),
              cc.calls(kind), want_calls[k]);
    ck.expect(cc.bytes(kind) == want_bytes[k], "CountingComm {}: {} bytes, expected {}", k3::coll_kind_name(kind),
              cc.bytes(kind), want_bytes[k]);
  }
  cc.reset();
  int64_t left = 0;
  for (int k = 0; k < 6; ++k) left += cc.calls(static_cast<CollKind>(k)) + cc.bytes(static_cast<CollKind>(k));
  ck.expect(left == 0, "CountingComm: reset left {} calls + bytes", left);
  ck.expect(cc.size() == n && cc.rank() == me, "CountingComm: rank {} size {}, expected {} {}", cc.rank(), cc.size(),
            me, n);
}

// Everything one world rank w runs, on its groups (consumes groups.tp at the end).
inline void run_rank_suite(Checker& ck, const k3::Layout& L, int w, k3::RankGroups& groups, const SuiteOptions& o) {
  const int t = w % L.tp;
  const Group tp{"tp", groups.tp.get(), tp_members(L, w), t, w};
  const Group dcp{"dcp", groups.dcp.get(), dcp_members(L, w), t % L.dcp, w};
  const Group world{"world", groups.world.get(), world_members(L), w, w};
  check_group(ck, tp, o, 1);
  check_group(ck, dcp, o, 2);
  check_group(ck, world, o, 3);
  check_counting(ck, std::move(groups.tp), tp.members, tp.me, w, hash(o.seed, 4, 0));
}

}  // namespace k3test
