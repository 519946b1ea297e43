// `k3decode serve` (cli/serve.h): the HTTP layer over the Scheduler.
#include "cli/serve.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <httplib.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <ctime>
#include <deque>
#include <functional>
#include <iostream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

namespace k3 {

namespace {

using json = nlohmann::json;

constexpr int kMaxChoices = 16;  // `n`: choices per prompt

// An OpenAI-style error.
struct HttpError {
  int status;
  std::string message, type, param, code;
};

[[noreturn]] void bad(const std::string& message, const std::string& param = {}, const std::string& code = {}) {
  throw HttpError{400, message, "invalid_request_error", param, code};
}

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }
// t as the client reads it: each invalid UTF-8 byte replaced (U+FFFD) as dump() writes it. Object keys are
// compared so (two token texts that differ only in such bytes are one key on the wire).
std::string as_sent(const std::string& t) { return json::parse(dump(json(t))).get<std::string>(); }

void send_error(httplib::Response& res, const HttpError& e) {
  json err = {{"message", e.message},
              {"type", e.type},
              {"param", e.param.empty() ? json(nullptr) : json(e.param)},
              {"code", e.code.empty() ? json(nullptr) : json(e.code)}};
  res.status = e.status;
  res.set_content(dump({{"error", err}}), "application/json");
}

// The longest prefix of s that does not end inside a UTF-8 sequence (the rest waits for more bytes).
size_t utf8_complete(const std::string& s) {
  const size_t n = s.size();
  for (size_t back = 1; back <= 4 && back <= n; ++back) {
    const auto c = static_cast<unsigned char>(s[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // continuation byte: look further back
    const size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    return len > back ? n - back : n;
  }
  return n;
}

// One choice's output, gathered for a whole answer.
struct Choice {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  std::vector<std::vector<ops::TokenLogprob>> top_logprobs;
  FinishReason reason = FinishReason::None;
  std::string error;
};

// One streamed choice: what has been sent of it.
struct StreamedChoice {
  size_t tokens = 0;          // generated tokens sent (the usage)
  std::string pending_bytes;  // decoded bytes not yet sent (an incomplete UTF-8 sequence)
};

// The events of one HTTP request's choices, filled on the scheduler thread.
struct Inbox {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::pair<size_t, RequestEvent>> events;  // (choice, event)
  size_t open = 0;                                     // choices not done
};

struct Server {
  Scheduler& sched;
  Decoder& dec;
  std::optional<Tokenizer> tok;
  ServeOptions opt;
  std::atomic<int64_t> next_id{1};
  std::atomic<int64_t> http_errors{0}, disconnects{0};
  std::atomic<int64_t> in_flight{0};  // generation requests not yet answered (a stream: until its last write)
  std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();
  std::optional<int32_t> im_end, im_user, im_assistant, im_system, im_middle;

  bool has_chat() const { return im_end && im_user && im_assistant && im_system && im_middle; }

  // The bytes of the tokens that have text: eos and ids the tokenizer lacks give none.
  std::string text_of(std::span<const int32_t> ids) const {
    std::string s;
    if (!tok) return s;
    for (int32_t t : ids) {
      if (t == dec.config().eos_token_id || t < 0 || t >= tok->n_vocab()) continue;
      try {
        s += tok->token_bytes(t);
      } catch (const std::exception&) {
      }
    }
    return s;
  }
  std::string token_text(int32_t t) const {
    std::string s = text_of(std::span<const int32_t>(&t, 1));
    return s;
  }
};

// ---- the client's connection

// httplib 0.11 (Debian's) tells a handler nothing about its connection, so a
// non-streaming request could not notice that its client went away. PeerWatch
// finds the connection's socket among the process's descriptors by its two
// ends (the request's local and remote address and port) and polls it: a
// peer that closed (or reset) the connection makes closed() true. The ends are
// checked again at every poll, so a descriptor reused by another connection
// reads as closed, never as someone else's socket.
class PeerWatch {
 public:
  explicit PeerWatch(const httplib::Request& r)
      : local_addr_(r.local_addr), remote_addr_(r.remote_addr), local_port_(r.local_port),
        remote_port_(r.remote_port) {
    if (local_port_ < 0 || remote_port_ < 0) return;
    DIR* d = opendir("/proc/self/fd");
    if (!d) return;
    while (dirent* e = readdir(d)) {
      const int fd = std::atoi(e->d_name);
      if (fd <= 2 || fd == dirfd(d)) continue;
      if (ends_match(fd)) {
        fd_ = fd;
        break;
      }
    }
    closedir(d);
  }
  bool found() const { return fd_ >= 0; }
  // True once the client closed or reset the connection (false when the socket was never found).
  bool closed() const {
    if (fd_ < 0) return false;
    if (!ends_match(fd_)) return true;
    pollfd p{fd_, static_cast<short>(POLLIN | POLLRDHUP), 0};
    if (::poll(&p, 1, 0) <= 0) return false;
    if (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) return true;
    if (p.revents & POLLIN) {  // readable: a next pipelined request (open) or end of stream (closed)
      char c;
      return ::recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
    }
    return false;
  }

 private:
  static bool same(const sockaddr_storage& a, const std::string& addr, int port) {
    char buf[INET6_ADDRSTRLEN] = {};
    int p = -1;
    if (a.ss_family == AF_INET) {
      const auto& v = reinterpret_cast<const sockaddr_in&>(a);
      inet_ntop(AF_INET, &v.sin_addr, buf, sizeof buf);
      p = ntohs(v.sin_port);
    } else if (a.ss_family == AF_INET6) {
      const auto& v = reinterpret_cast<const sockaddr_in6&>(a);
      inet_ntop(AF_INET6, &v.sin6_addr, buf, sizeof buf);
      p = ntohs(v.sin6_port);
    } else {
      return false;
    }
    return p == port && addr == buf;
  }
  bool ends_match(int fd) const {
    struct stat st {};
    if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return false;
    sockaddr_storage a{};
    socklen_t n = sizeof a;
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n) != 0 || !same(a, local_addr_, local_port_)) return false;
    n = sizeof a;
    return getpeername(fd, reinterpret_cast<sockaddr*>(&a), &n) == 0 && same(a, remote_addr_, remote_port_);
  }
  std::string local_addr_, remote_addr_;
  int local_port_, remote_port_;
  int fd_ = -1;
};

// ---- request parsing

const json* field(const json& body, const char* name) {
  auto it = body.find(name);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

std::vector<int32_t> parse_ids(const json& a, const char* param) {
  std::vector<int32_t> ids;
  for (const json& v : a) {
    if (!v.is_number_integer()) bad(fmt::format("{}: token ids must be integers", param), param);
    const int64_t x = v.get<int64_t>();
    if (x < INT32_MIN || x > INT32_MAX) bad(fmt::format("{}: token id {} out of range", param, x), param);
    ids.push_back(static_cast<int32_t>(x));
  }
  return ids;
}

std::vector<int32_t> encode_text(const Server& s, const std::string& text, const char* param) {
  if (!s.tok)
    bad(fmt::format("{}: this model has no tokenizer (no tiktoken.model in its directory): send token ids", param),
        param, "no_tokenizer");
  return s.tok->encode(text);
}

// OpenAI (and vLLM) parameters this server does not implement: refused with a 400 when they would change the
// answer (a client that sends a penalty expects it applied), accepted at their neutral values, which clients
// often send as defaults.
void refuse_unsupported(const json& body) {
  const auto number_is = [](double neutral) {
    return [neutral](const json& v) { return v.is_number() && v.get<double>() == neutral; };
  };
  struct Rule {
    const char* name;
    const char* neutral;
    std::function<bool(const json&)> is_neutral;
  };
  const Rule rules[] = {
      {"frequency_penalty", "0", number_is(0)},
      {"presence_penalty", "0", number_is(0)},
      {"repetition_penalty", "1", number_is(1)},
      {"min_p", "0", number_is(0)},
      {"best_of", "1", number_is(1)},
      {"top_k", "-1 or 0", [](const json& v) { return v.is_number_integer() && v.get<int64_t>() <= 0; }},
      {"logit_bias", "{}", [](const json& v) { return v.is_object() && v.empty(); }},
      {"echo", "false", [](const json& v) { return v.is_boolean() && !v.get<bool>(); }},
      {"suffix", "\"\"", [](const json& v) { return v.is_string() && v.get<std::string>().empty(); }},
      {"tools", "[]", [](const json& v) { return v.is_array() && v.empty(); }},
      {"response_format", "{\"type\": \"text\"}",
       [](const json& v) { return v.is_object() && v.contains("type") && v["type"] == "text"; }},
  };
  for (const Rule& rule : rules)
    if (const json* v = field(body, rule.name); v && !rule.is_neutral(*v))
      bad(fmt::format("{} is not supported by this server (only its neutral value, {})", rule.name, rule.neutral),
          rule.name, "unsupported_parameter");
}

// Common sampling fields of both endpoints.
Request parse_common(const Server& s, const json& body, bool chat) {
  refuse_unsupported(body);
  Request r;
  if (const json* m = field(body, "model"); m && !m->is_string()) bad("model must be a string", "model");
  const char* mt = chat && field(body, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  if (const json* v = field(body, mt)) {
    if (!v->is_number_integer()) bad(fmt::format("{} must be an integer", mt), mt);
    const int64_t x = v->get<int64_t>();
    if (x < 1) bad(fmt::format("{} must be >= 1 (got {})", mt, x), mt);
    // (The scheduler refuses a prompt + max_tokens past the context; one past it alone is refused here, where
    // its value is still the one the client sent.)
    if (x > s.dec.max_context())
      bad(fmt::format("{} {} exceeds the context of {} tokens", mt, x, s.dec.max_context()), mt,
          "context_length_exceeded");
    r.max_tokens = static_cast<int>(x);
  } else {
    r.max_tokens = 16;
  }
  float temperature = 1.0f, top_p = 1.0f;
  if (const json* v = field(body, "temperature")) {
    if (!v->is_number()) bad("temperature must be a number", "temperature");
    temperature = v->get<float>();
    if (!(temperature >= 0 && temperature <= 100)) bad("temperature must be in [0, 100]", "temperature");
  }
  if (const json* v = field(body, "top_p")) {
    if (!v->is_number()) bad("top_p must be a number", "top_p");
    top_p = v->get<float>();
    if (!(top_p > 0 && top_p <= 1)) bad("top_p must be in (0, 1]", "top_p");
  }
  r.sampling.greedy = temperature == 0;
  r.sampling.temperature = temperature;
  r.sampling.top_p = top_p;
  if (const json* v = field(body, "seed")) {
    if (!v->is_number_integer()) bad("seed must be an integer", "seed");
    r.sampling.seed = static_cast<uint64_t>(v->get<int64_t>());
  } else {
    r.sampling.seed = std::random_device{}();
  }
  if (const json* v = field(body, "ignore_eos")) {
    if (!v->is_boolean()) bad("ignore_eos must be a boolean", "ignore_eos");
    r.sampling.stop_at_eos = !v->get<bool>();
  }
  if (const json* v = field(body, "stop")) {
    auto one = [&](const json& x) {
      if (x.is_string()) {
        if (x.get<std::string>().empty()) bad("stop: an empty stop string", "stop");
        r.stop.push_back(encode_text(s, x.get<std::string>(), "stop"));
      } else if (x.is_array()) {
        r.stop.push_back(parse_ids(x, "stop"));
        if (r.stop.back().empty()) bad("stop: an empty stop sequence", "stop");
      } else {
        bad("stop must be a string, a list of strings or a list of token-id lists", "stop");
      }
    };
    if (v->is_string()) {
      one(*v);
    } else if (v->is_array()) {
      if (v->size() > 8) bad("stop: at most 8 sequences", "stop");
      for (const json& x : *v) one(x);
    } else {
      bad("stop must be a string or a list", "stop");
    }
  }
  if (const json* v = field(body, "stream"); v && !v->is_boolean()) bad("stream must be a boolean", "stream");
  // Completions: logprobs N (an integer) asks for the sampled token's log-probability and the N most likely
  // tokens at each position. Chat: logprobs true, and top_logprobs N for the N most likely.
  const auto top_n = [](const json& v, const char* name) {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > kMaxTopLogprobs)
      bad(fmt::format("{} must be an integer in 0..{}", name, kMaxTopLogprobs), name);
    return static_cast<int>(v.get<int64_t>());
  };
  if (const json* v = field(body, "logprobs")) {
    if (v->is_boolean()) {
      r.logprobs = v->get<bool>();
    } else if (!chat && v->is_number_integer()) {
      r.logprobs = true;
      r.top_logprobs = top_n(*v, "logprobs");
    } else {
      bad(chat ? "logprobs must be a boolean" : fmt::format("logprobs must be a boolean or an integer in 0..{}",
                                                           kMaxTopLogprobs),
          "logprobs");
    }
  }
  if (const json* v = field(body, "top_logprobs"); v && chat) {
    r.top_logprobs = top_n(*v, "top_logprobs");
    if (r.top_logprobs > 0 && !r.logprobs) bad("top_logprobs needs logprobs: true", "top_logprobs");
  }
  return r;
}

std::vector<std::vector<int32_t>> parse_prompts(const Server& s, const json& body) {
  const json* p = field(body, "prompt");
  if (!p) bad("prompt is required", "prompt");
  std::vector<std::vector<int32_t>> out;
  if (p->is_string()) {
    out.push_back(encode_text(s, p->get<std::string>(), "prompt"));
  } else if (p->is_array()) {
    if (p->empty()) bad("prompt is empty", "prompt");
    if ((*p)[0].is_number_integer()) {
      out.push_back(parse_ids(*p, "prompt"));
    } else {
      for (const json& x : *p) {
        if (x.is_string())
          out.push_back(encode_text(s, x.get<std::string>(), "prompt"));
        else if (x.is_array())
          out.push_back(parse_ids(x, "prompt"));
        else
          bad("prompt must be a string, a token-id list, or a list of either", "prompt");
      }
    }
    if (out.size() > 64) bad("prompt: at most 64 prompts per request", "prompt");
  } else {
    bad("prompt must be a string, a token-id list, or a list of either", "prompt");
  }
  return out;
}

// Kimi's chat format: <|im_ROLE|>NAME<|im_middle|>CONTENT<|im_end|> per message, then the assistant's header.
std::vector<int32_t> chat_prompt(const Server& s, const json& body) {
  const json* msgs = field(body, "messages");
  if (!msgs || !msgs->is_array() || msgs->empty()) bad("messages must be a non-empty list", "messages");
  std::vector<int32_t> ids;
  auto text = [&](const std::string& t) {
    auto e = s.tok->encode_ordinary(t);  // message text never becomes a special token
    ids.insert(ids.end(), e.begin(), e.end());
  };
  for (const json& m : *msgs) {
    if (!m.is_object()) bad("each message must be an object", "messages");
    const json* role = field(m, "role");
    if (!role || !role->is_string()) bad("message role must be a string", "messages");
    const std::string r = role->get<std::string>();
    int32_t marker;
    if (r == "user")
      marker = *s.im_user;
    else if (r == "assistant")
      marker = *s.im_assistant;
    else if (r == "system" || r == "tool" || r == "developer")
      marker = *s.im_system;
    else
      bad(fmt::format("unknown message role \"{}\"", r), "messages");
    std::string content;
    if (const json* c = field(m, "content")) {
      if (c->is_string()) {
        content = c->get<std::string>();
      } else if (c->is_array()) {
        for (const json& part : *c) {
          if (!part.is_object() || !part.contains("text") || !part["text"].is_string())
            bad("message content parts must be {\"type\": \"text\", \"text\": ...}", "messages");
          content += part["text"].get<std::string>();
        }
      } else {
        bad("message content must be a string or a list of text parts", "messages");
      }
    }
    std::string name = r;
    if (const json* n = field(m, "name")) {
      if (!n->is_string()) bad("message name must be a string", "messages");
      name = n->get<std::string>();
    }
    ids.push_back(marker);
    text(name);
    ids.push_back(*s.im_middle);
    text(content);
    ids.push_back(*s.im_end);
  }
  ids.push_back(*s.im_assistant);
  text("assistant");
  ids.push_back(*s.im_middle);
  return ids;
}

json finish_name(FinishReason r) {
  switch (r) {
    case FinishReason::Length: return "length";
    case FinishReason::Stop:
    case FinishReason::Eos: return "stop";
    case FinishReason::Cancelled: return "cancelled";
    case FinishReason::Error: return "error";
    default: return nullptr;
  }
}

// Submits every prompt; on a refusal cancels the ones already in and throws.
std::vector<int64_t> submit_all(Server& s, std::vector<Request>& reqs, const std::shared_ptr<Inbox>& box) {
  std::vector<int64_t> ids;
  {
    std::lock_guard<std::mutex> lock(box->mu);
    box->open = reqs.size();
  }
  for (size_t i = 0; i < reqs.size(); ++i) {
    try {
      ids.push_back(s.sched.submit(reqs[i], [box, i](const RequestEvent& ev) {
        std::lock_guard<std::mutex> lock(box->mu);
        box->events.emplace_back(i, ev);
        if (ev.done) --box->open;
        box->cv.notify_all();
      }));
    } catch (const SubmitError& e) {
      for (int64_t id : ids) s.sched.cancel(id);
      const std::string what = e.what();
      const bool context = what.find("exceeds the context") != std::string::npos;
      const std::string param = what.find("stop sequence") != std::string::npos ? "stop"
                                : what.find("prompt") != std::string::npos     ? "prompt"
                                                                               : "";
      switch (e.kind) {
        case SubmitError::Kind::QueueFull: throw HttpError{429, e.what(), "rate_limit_error", "", "queue_full"};
        case SubmitError::Kind::ShuttingDown: throw HttpError{503, e.what(), "server_error", "", "shutting_down"};
        default:
          throw HttpError{400, e.what(), "invalid_request_error", param,
                          context ? "context_length_exceeded" : "invalid_request"};
      }
    }
  }
  return ids;
}

json usage(size_t prompt, size_t completion) {
  return {{"prompt_tokens", prompt}, {"completion_tokens", completion}, {"total_tokens", prompt + completion}};
}

void handle_generation(Server& s, const httplib::Request& hreq, httplib::Response& res, bool chat) {
  ++s.in_flight;
  struct Done {
    Server& s;
    bool handed_over = false;  // to the stream's releaser
    ~Done() {
      if (!handed_over) --s.in_flight;
    }
  } done{s};
  json body;
  try {
    body = json::parse(hreq.body);
  } catch (const std::exception& e) {
    bad(fmt::format("the body is not valid JSON: {}", e.what()), "", "invalid_json");
  }
  if (!body.is_object()) bad("the body must be a JSON object");
  std::vector<std::vector<int32_t>> prompts;
  if (chat) {
    if (!s.tok || !s.has_chat())
      throw HttpError{404, "this model has no chat template (its directory needs a tokenizer with Kimi's role markers)",
                      "invalid_request_error", "", "no_chat_template"};
    prompts.push_back(chat_prompt(s, body));
  } else {
    prompts = parse_prompts(s, body);
  }
  Request base = parse_common(s, body, chat);
  if (chat) base.stop.push_back({*s.im_end});  // the assistant's turn ends at <|im_end|>
  const bool stream = field(body, "stream") && body["stream"].get<bool>();
  // stream_options.include_usage: a last chunk (no choices) carries the usage, as OpenAI's API sends it.
  bool include_usage = false;
  if (const json* v = field(body, "stream_options")) {
    if (!v->is_object()) bad("stream_options must be an object", "stream_options");
    if (!stream) bad("stream_options is only allowed with stream: true", "stream_options");
    if (const json* u = field(*v, "include_usage")) {
      if (!u->is_boolean()) bad("stream_options.include_usage must be a boolean", "stream_options");
      include_usage = u->get<bool>();
    }
  }
  // n choices per prompt: choice i n + j is prompt i's with seed + j (so choice i n is the n = 1 answer).
  int n = 1;
  if (const json* v = field(body, "n")) {
    if (!v->is_number_integer() || v->get<int64_t>() < 1 || v->get<int64_t>() > kMaxChoices)
      bad(fmt::format("n must be an integer in 1..{}", kMaxChoices), "n");
    n = static_cast<int>(v->get<int64_t>());
  }
  std::vector<Request> reqs;
  for (auto& p : prompts) {
    for (int j = 0; j < n; ++j) {
      Request r = base;
      r.prompt = p;
      r.sampling.seed = base.sampling.seed + static_cast<uint64_t>(j);
      reqs.push_back(std::move(r));
    }
  }
  auto box = std::make_shared<Inbox>();
  std::vector<int64_t> ids = submit_all(s, reqs, box);
  const std::string id = fmt::format("{}-{}", chat ? "chatcmpl" : "cmpl", s.next_id++);
  const int64_t created = static_cast<int64_t>(std::time(nullptr));
  const std::string object = chat ? "chat.completion" : "text_completion";
  const bool logprobs = base.logprobs;
  size_t prompt_tokens = 0;  // each prompt once (its n choices share it), as OpenAI counts
  for (size_t i = 0; i < reqs.size(); i += static_cast<size_t>(n)) prompt_tokens += reqs[i].prompt.size();

  // tops: with top_logprobs, one list per token (else empty).
  auto logprob_json = [&s, chat, logprobs](std::span<const int32_t> toks, std::span<const float> lps,
                                           std::span<const std::vector<ops::TokenLogprob>> tops) -> json {
    if (!logprobs) return nullptr;
    const auto bytes = [](const std::string& t) {  // 0..255 each (char may be signed)
      std::vector<int> b;
      for (char ch : t) b.push_back(static_cast<unsigned char>(ch));
      return b;
    };
    if (chat) {
      json content = json::array();
      for (size_t k = 0; k < toks.size(); ++k) {
        const std::string t = s.token_text(toks[k]);
        json alts = json::array();
        if (k < tops.size())
          for (const ops::TokenLogprob& a : tops[k]) {
            const std::string at = s.token_text(a.token);
            alts.push_back({{"token", at}, {"logprob", a.logprob}, {"bytes", bytes(at)}});
          }
        content.push_back({{"token", t}, {"logprob", lps[k]}, {"bytes", bytes(t)}, {"top_logprobs", alts}});
      }
      return {{"content", content}};
    }
    json tokens = json::array();
    for (int32_t t : toks) tokens.push_back(s.token_text(t));
    // Completions: a {text: log p} object per position (two ids of one text keep the likelier), and
    // top_token_ids: the ids themselves, most likely first.
    json top = nullptr, top_ids = nullptr;
    if (!tops.empty()) {
      top = json::array();
      top_ids = json::array();
      for (const auto& list : tops) {
        json o = json::object(), ids = json::array();
        for (const ops::TokenLogprob& a : list) {
          const std::string key = as_sent(s.token_text(a.token));
          if (!o.contains(key)) o[key] = a.logprob;
          ids.push_back(a.token);
        }
        top.push_back(o);
        top_ids.push_back(ids);
      }
    }
    json out = {{"tokens", tokens}, {"token_logprobs", std::vector<float>(lps.begin(), lps.end())},
                {"top_logprobs", top}};
    if (!tops.empty()) out["top_token_ids"] = top_ids;
    return out;
  };

  if (!stream) {
    std::vector<Choice> choices(reqs.size());
    {
      // Waits for every choice; a client that goes away meanwhile cancels them (their slots free at once).
      const PeerWatch peer(hreq);
      bool gone = false;
      std::unique_lock<std::mutex> lock(box->mu);
      while (!box->cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return box->open == 0; })) {
        if (gone || !peer.closed()) continue;
        gone = true;
        ++s.disconnects;
        lock.unlock();
        for (int64_t i : ids) s.sched.cancel(i);
        lock.lock();
      }
      if (gone) return;  // nobody to answer
      for (auto& [i, ev] : box->events) {
        choices[i].tokens.insert(choices[i].tokens.end(), ev.tokens.begin(), ev.tokens.end());
        choices[i].logprobs.insert(choices[i].logprobs.end(), ev.logprobs.begin(), ev.logprobs.end());
        choices[i].top_logprobs.insert(choices[i].top_logprobs.end(), ev.top_logprobs.begin(), ev.top_logprobs.end());
        if (ev.done) {
          choices[i].reason = ev.reason;
          choices[i].error = ev.error;
        }
      }
    }
    json out = json::array();
    size_t completion = 0;
    for (size_t i = 0; i < choices.size(); ++i) {
      const Choice& c = choices[i];
      if (c.reason == FinishReason::Error) throw HttpError{500, c.error, "server_error", "", "step_failed"};
      completion += c.tokens.size();
      json ch = {{"index", i}, {"token_ids", c.tokens}, {"finish_reason", finish_name(c.reason)},
                 {"logprobs", logprob_json(c.tokens, c.logprobs, c.top_logprobs)}};
      const std::string text = s.text_of(c.tokens);
      if (chat)
        ch["message"] = {{"role", "assistant"}, {"content", text}};
      else
        ch["text"] = text;
      out.push_back(ch);
    }
    res.set_content(dump({{"id", id},
                          {"object", object},
                          {"created", created},
                          {"model", s.opt.model_name},
                          {"choices", out},
                          {"usage", usage(prompt_tokens, completion)}}),
                    "application/json");
    return;
  }

  // Streaming: one SSE event per batch of new tokens per choice; a failed write cancels every choice.
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  auto cancel_all = [&s, ids, cancelled] {
    if (cancelled->exchange(true)) return;
    for (int64_t i : ids) s.sched.cancel(i);
  };
  auto states = std::make_shared<std::vector<StreamedChoice>>(reqs.size());
  auto sent_role = std::make_shared<std::vector<bool>>(reqs.size(), false);
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [&s, box, states, sent_role, cancel_all, id, created, chat, logprob_json, include_usage, prompt_tokens](
          size_t, httplib::DataSink& sink) mutable -> bool {
        std::deque<std::pair<size_t, RequestEvent>> evs;
        bool finished;
        {
          std::unique_lock<std::mutex> lock(box->mu);
          box->cv.wait_for(lock, std::chrono::seconds(1), [&] { return !box->events.empty() || box->open == 0; });
          evs.swap(box->events);
          finished = box->open == 0;
        }
        auto write = [&](const std::string& data) {
          if (!sink.is_writable() || !sink.write(data.data(), data.size())) {
            cancel_all();
            return false;
          }
          return true;
        };
        if (evs.empty() && !finished) return write(": waiting\n\n");  // a comment: detects a gone client
        for (auto& [i, ev] : evs) {
          StreamedChoice& c = (*states)[i];
          c.tokens += ev.tokens.size();
          std::string bytes = c.pending_bytes + s.text_of(ev.tokens);
          size_t cut = ev.done ? bytes.size() : utf8_complete(bytes);
          c.pending_bytes = bytes.substr(cut);
          const std::string text = bytes.substr(0, cut);
          json ch = {{"index", i}, {"token_ids", ev.tokens}, {"finish_reason", ev.done ? finish_name(ev.reason) : json(nullptr)},
                     {"logprobs", logprob_json(ev.tokens, ev.logprobs, ev.top_logprobs)}};
          if (chat) {
            json delta = json::object();
            if (!(*sent_role)[i]) {
              delta["role"] = "assistant";
              (*sent_role)[i] = true;
            }
            if (!text.empty() || !ev.done) delta["content"] = text;
            ch["delta"] = delta;
          } else {
            ch["text"] = text;
          }
          json chunk = {{"id", id},
                        {"object", chat ? "chat.completion.chunk" : "text_completion"},
                        {"created", created},
                        {"model", s.opt.model_name},
                        {"choices", json::array({ch})}};
          if (ev.done && ev.reason == FinishReason::Error) chunk["error"] = {{"message", ev.error}, {"type", "server_error"}};
          if (!write("data: " + dump(chunk) + "\n\n")) return false;
        }
        if (finished) {
          if (include_usage) {
            size_t completion = 0;
            for (const StreamedChoice& c : *states) completion += c.tokens;
            const json chunk = {{"id", id},
                                {"object", chat ? "chat.completion.chunk" : "text_completion"},
                                {"created", created},
                                {"model", s.opt.model_name},
                                {"choices", json::array()},
                                {"usage", usage(prompt_tokens, completion)}};
            if (!write("data: " + dump(chunk) + "\n\n")) return false;
          }
          if (!write("data: [DONE]\n\n")) return false;
          sink.done();
        }
        return true;
      },
      [&s, cancel_all](bool success) mutable {
        if (!success) {
          ++s.disconnects;
          cancel_all();  // the client went away before the end: free its slots
        }
        --s.in_flight;
      });
  done.handed_over = true;
}

std::string metrics_text(Server& s) {
  const SchedulerMetrics m = s.sched.metrics();
  const double up = std::chrono::duration<double>(std::chrono::steady_clock::now() - s.started).count();
  std::string o;
  auto metric = [&](const char* name, const char* type, const char* help, const std::vector<std::pair<std::string, double>>& v) {
    o += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
    for (const auto& [labels, x] : v) o += fmt::format("{}{} {}\n", name, labels, x);
  };
  auto ratio = [](double a, double b) { return b > 0 ? a / b : 0.0; };
  metric("k3_requests_submitted_total", "counter", "requests admitted to the queue", {{"", double(m.requests_submitted)}});
  metric("k3_requests_rejected_total", "counter", "requests refused (invalid, queue full, shutting down)",
         {{"", double(m.requests_rejected)}});
  metric("k3_requests_finished_total", "counter", "finished requests by reason",
         {{"{reason=\"length\"}", double(m.finished_length)},
          {"{reason=\"stop\"}", double(m.finished_stop)},
          {"{reason=\"eos\"}", double(m.finished_eos)},
          {"{reason=\"cancelled\"}", double(m.finished_cancelled)},
          {"{reason=\"error\"}", double(m.finished_error)}});
  metric("k3_queue_depth", "gauge", "requests waiting for a slot", {{"", double(m.queue_depth)}});
  metric("k3_running_requests", "gauge", "requests holding a slot", {{"", double(m.running)}});
  metric("k3_free_slots", "gauge", "free request slots", {{"", double(m.free_slots)}});
  metric("k3_max_slots", "gauge", "request slots", {{"", double(s.dec.max_slots())}});
  metric("k3_steps_total", "counter", "decoder steps",
         {{"{kind=\"prefill\"}", double(m.prefill_steps)}, {"{kind=\"decode\"}", double(m.decode_steps)}});
  metric("k3_batch_size", "gauge", "requests in the last step", {{"", double(m.last_batch)}});
  metric("k3_batch_size_mean", "gauge", "mean requests per step", {{"", ratio(double(m.batch_requests), double(m.steps))}});
  metric("k3_batch_rows_mean", "gauge", "mean rows (requests x q) per step", {{"", ratio(double(m.batch_rows), double(m.steps))}});
  metric("k3_prompt_tokens_total", "counter", "prompt tokens prefilled", {{"", double(m.prompt_tokens)}});
  metric("k3_generated_tokens_total", "counter", "tokens generated", {{"", double(m.generated_tokens)}});
  metric("k3_step_seconds_total", "counter", "time in the decoder's step and commit", {{"", m.step_seconds}});
  metric("k3_step_seconds_mean", "gauge", "mean step time", {{"", ratio(m.step_seconds, double(m.steps))}});
  metric("k3_tokens_per_second", "gauge", "generated tokens per second since start", {{"", ratio(double(m.generated_tokens), up)}});
  metric("k3_draft_proposed_total", "counter", "n-gram draft tokens proposed", {{"", double(m.draft_proposed)}});
  metric("k3_draft_accepted_total", "counter", "n-gram draft tokens accepted", {{"", double(m.draft_accepted)}});
  metric("k3_draft_acceptance_rate", "gauge", "accepted / proposed draft tokens",
         {{"", ratio(double(m.draft_accepted), double(m.draft_proposed))}});
  metric("k3_tokens_per_step", "gauge", "tokens per request per decode step (1 without drafting)",
         {{"", ratio(double(m.decode_tokens), double(m.decode_request_steps))}});
  metric("k3_http_errors_total", "counter", "requests answered with an error status", {{"", double(s.http_errors.load())}});
  metric("k3_client_disconnects_total", "counter", "requests whose client went away before the answer", {{"", double(s.disconnects.load())}});
  metric("k3_uptime_seconds", "gauge", "seconds since start", {{"", up}});
  return o;
}

}  // namespace

sigset_t block_stop_signals() {
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  return sigs;
}

int serve(Decoder& decoder, std::optional<Tokenizer> tokenizer, const SchedulerOptions& sched_opts,
          const ServeOptions& options) {
  // SIGINT / SIGTERM go to one thread (sigwait); every other thread inherits the mask.
  const sigset_t sigs = block_stop_signals();
  signal(SIGPIPE, SIG_IGN);

  Scheduler sched(decoder, sched_opts);
  Server s{sched, decoder, std::move(tokenizer), options};
  if (s.tok) {
    s.im_end = s.tok->special_id("<|im_end|>");
    s.im_user = s.tok->special_id("<|im_user|>");
    s.im_assistant = s.tok->special_id("<|im_assistant|>");
    s.im_system = s.tok->special_id("<|im_system|>");
    s.im_middle = s.tok->special_id("<|im_middle|>");
  }

  httplib::Server http;
  const int threads = options.http_threads > 0 ? options.http_threads
                                               : std::max(64, 2 * (decoder.max_slots() + sched_opts.max_queue) + 16);
  http.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  http.set_payload_max_length(16 << 20);
  // One request per connection (the response says Connection: close). A kept-alive connection that the
  // server closes when idle races a client sending on it ("socket hang up" on a loaded machine), and idle
  // connections would hold a drain back. A loaded machine can also stall a peer for seconds: httplib's
  // 5 s read / write timeouts would cut it, so slow peers get 300 s.
  http.set_keep_alive_max_count(1);
  http.set_read_timeout(300, 0);
  http.set_write_timeout(300, 0);
  auto guarded = [&s](auto fn) {
    return [&s, fn](const httplib::Request& req, httplib::Response& res) {
      try {
        fn(req, res);
      } catch (const HttpError& e) {
        ++s.http_errors;
        send_error(res, e);
      } catch (const std::exception& e) {
        ++s.http_errors;
        send_error(res, {400, e.what(), "invalid_request_error", "", ""});
      }
    };
  };
  http.Post("/v1/completions", guarded([&s](const httplib::Request& q, httplib::Response& r) {
              handle_generation(s, q, r, false);
            }));
  http.Post("/v1/chat/completions", guarded([&s](const httplib::Request& q, httplib::Response& r) {
              handle_generation(s, q, r, true);
            }));
  http.Get("/v1/models", [&s](const httplib::Request&, httplib::Response& res) {
    json m = {{"id", s.opt.model_name},
              {"object", "model"},
              {"created", 0},
              {"owned_by", "k3decode"},
              {"max_model_len", s.dec.max_context()},
              {"vocab_size", s.dec.config().vocab_size},
              {"tokenizer", s.tok.has_value()},
              {"chat", s.tok.has_value() && s.has_chat()}};
    res.set_content(dump({{"object", "list"}, {"data", json::array({m})}}), "application/json");
  });
  std::atomic<bool> draining{false};
  http.Get("/health", [&s, &draining](const httplib::Request&, httplib::Response& res) {
    const SchedulerMetrics m = s.sched.metrics();
    res.status = draining ? 503 : 200;
    res.set_content(dump({{"status", draining ? "draining" : "ok"},
                          {"running", m.running},
                          {"queue_depth", m.queue_depth},
                          {"free_slots", m.free_slots},
                          {"max_slots", s.dec.max_slots()}}),
                    "application/json");
  });
  http.Get("/metrics", [&s](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_text(s), "text/plain; version=0.0.4");
  });
  http.set_error_handler([&s](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    const bool known = req.path == "/v1/completions" || req.path == "/v1/chat/completions" || req.path == "/v1/models" ||
                       req.path == "/health" || req.path == "/metrics";
    send_error(res, {res.status, known ? fmt::format("{} is not allowed on {}", req.method, req.path)
                                       : fmt::format("no route {} {}", req.method, req.path),
                     "invalid_request_error", "", res.status == 404 ? "not_found" : ""});
    (void)s;
  });

  int port = options.port;
  if (port == 0) {
    port = http.bind_to_any_port(options.host);
    K3_CHECK(port > 0, "serve: cannot bind {} on any port", options.host);
  } else {
    K3_CHECK(http.bind_to_port(options.host, port), "serve: cannot bind {}:{} (in use?)", options.host, port);
  }

  std::atomic<bool> finished{false};
  std::thread waiter([&] {
    int sig = 0;
    sigwait(&sigs, &sig);
    if (finished) return;  // our own wake-up at the end
    std::cerr << fmt::format("k3decode serve: signal {}: draining\n", sig);
    draining = true;
    sched.stop_accepting();  // new requests: 503
    // Drain: every admitted request finishes and every answer (a stream: its last event) is written; then stop
    // listening (httplib's stop cuts the streams still being written).
    for (;;) {
      const SchedulerMetrics m = sched.metrics();
      if (finished || (m.running == 0 && m.queue_depth == 0 && s.in_flight == 0)) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    http.stop();
  });
  const Layout& L = decoder.layout();
  std::cerr << fmt::format("k3decode serve: listening on http://{}:{} (pid {}, model {}, {} slots, tokenizer {}, "
                           "chat {}, layout tp {} dp {} dcp {})\n",
                           options.host, port, getpid(), options.model_name, decoder.max_slots(), s.tok ? "yes" : "no",
                           s.tok && s.has_chat() ? "yes" : "no", L.tp, L.dp, L.dcp)
            << std::flush;
  bool ok = false;
  std::thread listener([&] {
    ok = http.listen_after_bind();
    sched.stop();  // drains whatever is still queued
  });
  auto join = [&] {
    listener.join();
    finished = true;
    if (!draining) pthread_kill(waiter.native_handle(), SIGTERM);  // wakes the signal thread's sigwait
    waiter.join();
  };
  // The scheduler runs on the caller's thread: every Decoder call comes from it (an mpi job's command channel
  // must be driven by the thread that initialised MPI).
  try {
    sched.run();
  } catch (...) {
    http.stop();
    join();
    throw;
  }
  join();
  const SchedulerMetrics m = sched.metrics();
  std::cerr << fmt::format("k3decode serve: stopped ({} requests, {} tokens generated)\n", m.requests_finished,
                           m.generated_tokens);
  return ok || draining ? 0 : 1;
}

}  // namespace k3
