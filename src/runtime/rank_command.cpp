// RankCommand / RankReply (runtime/rank_command.h): what a rank runs for a facade call, and the byte encoding.
#include "runtime/rank_command.h"

#include <cstring>
#include <type_traits>

#include "runtime/steps.h"

namespace k3 {

RankInfo RankInfo::from(std::span<const int64_t> v) {
  K3_CHECK(v.size() == 8, "rank info: {} fields, expected 8", v.size());
  return {v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]};
}

namespace {

// The most tokens d.fits accepts, by bisection over 0..max_context (-1: not even an empty request).
int64_t fit_limit(const Decoder& d) {
  int64_t lo = -1, hi = d.max_context();
  if (d.fits(hi)) return hi;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (d.fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

template <typename T>
const std::vector<T>& part(const std::vector<std::vector<T>>& v, int p) {
  static const std::vector<T> none;
  return p < static_cast<int>(v.size()) ? v[static_cast<size_t>(p)] : none;
}

void run(const RankCommand& c, const Layout& L, int w, Decoder& d, RankReply& r) {
  using Op = RankCommand::Op;
  const int p = L.replica(w);
  const bool lead = L.tp_rank(w) == 0;
  const auto& slots = part(c.slots, p);
  switch (c.op) {
    case Op::Info:
      r.info = {d.world_rank(), d.layout().tp,  d.layout().dp,   d.layout().dcp,
                d.max_slots(),  d.max_q(),      d.max_context(), fit_limit(d)};
      return;
    case Op::Admit:
      if (p == c.replica) r.value = d.admit(c.reserve);
      return;
    case Op::CanAdmit:
      r.value = d.can_admit(c.reserve) ? 1 : 0;
      return;
    case Op::Release:
      if (p == c.replica) d.release(c.slot);
      return;
    case Op::Step: {
      // A replica without slots steps with B = 0 and q = 1 (generate()'s rule): the MoE exchange spans every rank.
      std::vector<float> out = slots.empty() ? d.step({}, 1, {}) : d.step(slots, c.q, part(c.tokens, p));
      if (lead) r.logits = std::move(out);
      return;
    }
    case Op::StepSample: {
      std::vector<ops::SampleResult> out = slots.empty() ? d.step_sample({}, 1, {}, {})
                                                         : d.step_sample(slots, c.q, part(c.tokens, p), part(c.specs, p));
      if (lead) r.samples = std::move(out);
      return;
    }
    case Op::Commit:
      if (!slots.empty()) d.commit(slots, part(c.counts, p));
      return;
    case Op::Quit:
      return;
  }
  fail("rank command: unknown op {}", static_cast<int>(c.op));
}

// Byte writer / reader of trivially copyable values and vectors of them.
struct Writer {
  std::vector<char> out;
  template <typename T>
  void put(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* b = reinterpret_cast<const char*>(&v);
    out.insert(out.end(), b, b + sizeof(T));
  }
  template <typename T>
  void put_vec(const std::vector<T>& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    put<int64_t>(static_cast<int64_t>(v.size()));
    const auto* b = reinterpret_cast<const char*>(v.data());
    out.insert(out.end(), b, b + v.size() * sizeof(T));
  }
  template <typename T>
  void put_nested(const std::vector<std::vector<T>>& v) {
    put<int64_t>(static_cast<int64_t>(v.size()));
    for (const auto& x : v) put_vec(x);
  }
};

struct Reader {
  std::span<const char> in;
  size_t at = 0;
  const char* what;
  void need(uint64_t n) const {
    K3_CHECK(n <= in.size() - at, "{}: message truncated ({} bytes at offset {} of {})", what, n, at, in.size());
  }
  template <typename T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, in.data() + at, sizeof(T));
    at += sizeof(T);
    return v;
  }
  int64_t count(size_t elem) {
    const auto n = get<int64_t>();
    K3_CHECK(n >= 0 && static_cast<uint64_t>(n) <= (in.size() - at) / (elem ? elem : 1), "{}: bad length {}", what,
             n);
    return n;
  }
  template <typename T>
  std::vector<T> get_vec() {
    const int64_t n = count(sizeof(T));
    std::vector<T> v(static_cast<size_t>(n));
    if (n > 0) std::memcpy(v.data(), in.data() + at, static_cast<size_t>(n) * sizeof(T));
    at += static_cast<size_t>(n) * sizeof(T);
    return v;
  }
  template <typename T>
  std::vector<std::vector<T>> get_nested() {
    const int64_t n = count(sizeof(int64_t));
    std::vector<std::vector<T>> v(static_cast<size_t>(n));
    for (auto& x : v) x = get_vec<T>();
    return v;
  }
  void end() const { K3_CHECK(at == in.size(), "{}: {} bytes left over", what, in.size() - at); }
};

}  // namespace

RankReply execute(const RankCommand& cmd, const Layout& L, int w, Decoder& d) {
  RankReply r;
  try {
    run(cmd, L, w, d, r);
  } catch (const PeerRejectedInput& e) {
    r = RankReply::failure(RankReply::Status::PeerRejected, e.what());
  } catch (const std::exception& e) {
    r = RankReply::failure(RankReply::Status::Error, e.what());
  } catch (...) {
    r = RankReply::failure(RankReply::Status::Error, "rank command: an unknown exception");
  }
  return r;
}

std::vector<char> encode(const RankCommand& c) {
  Writer w;
  w.put(c.op);
  w.put(c.replica);
  w.put(c.slot);
  w.put(c.q);
  w.put(c.reserve);
  w.put_nested(c.slots);
  w.put_nested(c.tokens);
  w.put_nested(c.counts);
  w.put_nested(c.specs);
  return std::move(w.out);
}

RankCommand decode_command(std::span<const char> bytes) {
  Reader r{bytes, 0, "rank command"};
  RankCommand c;
  c.op = r.get<RankCommand::Op>();
  K3_CHECK(static_cast<int32_t>(c.op) >= 0 && c.op <= RankCommand::Op::Quit, "rank command: unknown op {}",
           static_cast<int32_t>(c.op));
  c.replica = r.get<int32_t>();
  c.slot = r.get<int32_t>();
  c.q = r.get<int32_t>();
  c.reserve = r.get<int64_t>();
  c.slots = r.get_nested<int32_t>();
  c.tokens = r.get_nested<int32_t>();
  c.counts = r.get_nested<int32_t>();
  c.specs = r.get_nested<ops::SampleSpec>();
  r.end();
  return c;
}

std::vector<char> encode(const RankReply& x) {
  Writer w;
  w.put(x.status);
  w.put_vec(std::vector<char>(x.message.begin(), x.message.end()));
  w.put(x.value);
  w.put_vec(x.info);
  w.put_vec(x.logits);
  w.put_vec(x.samples);
  return std::move(w.out);
}

RankReply decode_reply(std::span<const char> bytes) {
  Reader r{bytes, 0, "rank reply"};
  RankReply x;
  x.status = r.get<RankReply::Status>();
  K3_CHECK(static_cast<int32_t>(x.status) >= 0 && x.status <= RankReply::Status::PeerRejected,
           "rank reply: unknown status {}", static_cast<int32_t>(x.status));
  const std::vector<char> msg = r.get_vec<char>();
  x.message.assign(msg.begin(), msg.end());
  x.value = r.get<int64_t>();
  x.info = r.get_vec<int64_t>();
  x.logits = r.get_vec<float>();
  x.samples = r.get_vec<ops::SampleResult>();
  r.end();
  return x;
}

}  // namespace k3
