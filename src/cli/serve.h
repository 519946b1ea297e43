// `k3decode serve`: an OpenAI-compatible HTTP server over the Scheduler (runtime/scheduler.h).
//
// The calling thread runs the scheduler, which drives the Decoder; HTTP handler threads (cpp-httplib's
// pool) parse a request, submit it and wait for its tokens. Endpoints:
//   POST /v1/completions        prompt: text, token ids, or a list of either (`n` choices each, 1..16:
//                               choice j samples with seed + j)
//   POST /v1/chat/completions   when the tokenizer has Kimi's role markers
//   GET  /v1/models, /health, /metrics (Prometheus text)
// Every choice carries `token_ids`. `stream: true` answers with server-sent
// events (`data: {...}` per new tokens, then `data: [DONE]`; with
// stream_options.include_usage a last chunk without choices carries the usage); a streaming
// client that goes away cancels its requests (the write fails). Bad requests
// get a 4xx with {"error": {"message", "type", "param", "code"}}. SIGINT /
// SIGTERM: stop accepting, finish the requests in flight, return 0.
#pragma once

#include <signal.h>

#include <optional>
#include <string>

#include "io/tokenizer.h"
#include "runtime/scheduler.h"

namespace k3 {

struct ServeOptions {
  std::string host = "127.0.0.1";
  int port = 8000;             // 0: any free port (printed on stderr)
  std::string model_name = "k3";
  int http_threads = 0;        // 0: enough for every slot and queued request
};

// Blocks SIGINT and SIGTERM in the calling thread (and the threads it starts from now on), so that serve()'s
// signal thread is the one that gets them: call it before a library starts threads of its own (MPI).
sigset_t block_stop_signals();

// Serves until SIGINT / SIGTERM; returns the exit code.
int serve(Decoder& decoder, std::optional<Tokenizer> tokenizer, const SchedulerOptions& sched,
          const ServeOptions& options);

}  // namespace k3
