// `k3decode serve` driven by the official openai client (run by serve_test.sh).
// argv: SMALL_URL (model with a tokenizer, drafting on) TINY_URL (embedded tiny model, ids only) K3DECODE MODEL_DIR
// SMALL_PID. Every token result is compared with `k3decode generate` on the same prompt (greedy).
import OpenAI from 'openai';
import { execFileSync } from 'node:child_process';
import assert from 'node:assert/strict';

const [smallUrl, tinyUrl, k3, modelDir, smallPid] = process.argv.slice(2);
const small = new OpenAI({ baseURL: `${smallUrl}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 120000 });
const tiny = new OpenAI({ baseURL: `${tinyUrl}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 120000 });
let checks = 0;
const ok = (what) => { checks++; console.log(`ok ${checks} - ${what}`); };

// generate's tokens: one run per prompt list (--prompt ids or --text), greedy.
function generate(args, maxNew) {
  const out = execFileSync(k3, ['generate', ...args, '--max-new', String(maxNew), '--max-slots', '64', '--json'],
                           { encoding: 'utf8' });
  return JSON.parse(out).requests.map((r) => r.tokens);
}
const modelArgs = ['--model', modelDir];

async function metrics(url) {
  const text = await (await fetch(`${url}/metrics`)).text();
  const m = {};
  for (const line of text.split('\n')) {
    if (!line || line.startsWith('#')) continue;
    const [k, v] = line.split(' ');
    m[k] = Number(v);
  }
  return m;
}
async function health(url) {
  const r = await fetch(`${url}/health`);
  return { http: r.status, ...(await r.json()) };
}
// /health once no request holds a slot, or after 10 s.
async function untilIdle(url) {
  for (const t0 = Date.now(); ; await new Promise((r) => setTimeout(r, 50))) {
    const h = await health(url);
    if (h.running === 0 || Date.now() - t0 > 10000) return h;
  }
}

// --- models
const models = await small.models.list();
assert.equal(models.data.length, 1);
assert.equal(models.data[0].chat, true);
ok(`models: ${models.data[0].id}`);

// --- completions: text prompts against generate --text (drafting on in the server, off in generate)
const texts = ['Hello, world! Hello, world! Hello, world!', 'The quick brown fox', '分词器 tokenizer 分词器 tokenizer',
               'def f(x):\n    return x\ndef f(x):\n    return x\n'];
const refText = generate([...modelArgs, ...texts.flatMap((t) => ['--text', t])], 24);
const nonStream = [], promptTokens = [];
for (let i = 0; i < texts.length; i++) {
  const r = await small.completions.create({ model: 'x', prompt: texts[i], max_tokens: 24, temperature: 0 });
  assert.deepEqual(r.choices[0].token_ids, refText[i], `completion ${i}`);
  assert.equal(typeof r.choices[0].text, 'string');
  assert.ok(['length', 'stop'].includes(r.choices[0].finish_reason));
  assert.equal(r.usage.completion_tokens, refText[i].length);
  nonStream.push(r.choices[0]);
  promptTokens.push(r.usage.prompt_tokens);
}
ok('completions (text) equal generate --text');

// a list of prompts: one choice each
{
  const r = await small.completions.create({ model: 'x', prompt: texts.slice(0, 3), max_tokens: 24, temperature: 0 });
  assert.equal(r.choices.length, 3);
  for (const c of r.choices) assert.deepEqual(c.token_ids, refText[c.index]);
  ok('completions (a list of prompts)');
}

// --- streaming
for (let i = 0; i < texts.length; i++) {
  const stream = await small.completions.create({ model: 'x', prompt: texts[i], max_tokens: 24, temperature: 0,
                                                  stream: true });
  let ids = [], text = '', finish = null, chunks = 0;
  for await (const chunk of stream) {
    chunks++;
    ids = ids.concat(chunk.choices[0].token_ids);
    text += chunk.choices[0].text;
    if (chunk.choices[0].finish_reason) finish = chunk.choices[0].finish_reason;
  }
  assert.deepEqual(ids, refText[i], `stream ${i}`);
  assert.equal(finish, nonStream[i].finish_reason);
  assert.ok(chunks >= 2, 'streamed in several events');
  if (!text.includes('\ufffd')) assert.equal(text, nonStream[i].text);
}
ok('streaming completions equal the non-streamed ones');

// --- stream_options.include_usage: a last chunk without choices carries the usage (two prompts, n = 2)
{
  const stream = await small.completions.create({ model: 'x', prompt: [texts[0], texts[1]], max_tokens: 24,
                                                  temperature: 0, n: 2, stream: true,
                                                  stream_options: { include_usage: true } });
  let ids = 0, usageChunk = null, after = 0;
  for await (const chunk of stream) {
    if (usageChunk) after++;
    if (chunk.usage) usageChunk = chunk;
    else ids += chunk.choices[0].token_ids.length;
  }
  assert.ok(usageChunk, 'no usage chunk');
  assert.equal(after, 0, 'the usage chunk is the last one');
  assert.deepEqual(usageChunk.choices, []);
  assert.equal(usageChunk.usage.completion_tokens, ids);
  assert.equal(usageChunk.usage.completion_tokens, 2 * (refText[0].length + refText[1].length));
  assert.equal(usageChunk.usage.prompt_tokens, promptTokens[0] + promptTokens[1]);
  assert.equal(usageChunk.usage.total_tokens, usageChunk.usage.prompt_tokens + ids);
  ok('stream_options.include_usage: the usage in a last chunk');
}

// --- logprobs and seeded sampling
{
  const r = await small.completions.create({ model: 'x', prompt: texts[0], max_tokens: 8, temperature: 0, logprobs: 1 });
  assert.equal(r.choices[0].logprobs.token_logprobs.length, 8);
  for (const lp of r.choices[0].logprobs.token_logprobs) assert.ok(lp <= 0 && Number.isFinite(lp));
  const a = await small.completions.create({ model: 'x', prompt: texts[1], max_tokens: 16, temperature: 1.2, seed: 7 });
  const b = await small.completions.create({ model: 'x', prompt: texts[1], max_tokens: 16, temperature: 1.2, seed: 7 });
  assert.deepEqual(a.choices[0].token_ids, b.choices[0].token_ids);
  ok('logprobs; seeded sampling repeats');
  // Top log-probs: logprobs N gives each position's N most likely tokens; greedy, so the sampled one leads
  // with its own log-prob; streamed, the same lists.
  const t = await small.completions.create({ model: 'x', prompt: texts[0], max_tokens: 8, temperature: 0, logprobs: 3 });
  const lp = t.choices[0].logprobs;
  assert.deepEqual(t.choices[0].token_ids, r.choices[0].token_ids, 'top log-probs change no token');
  assert.equal(lp.top_logprobs.length, 8);
  assert.equal(lp.top_token_ids.length, 8);
  for (let k = 0; k < 8; ++k) {
    const ids = lp.top_token_ids[k], alts = lp.top_logprobs[k];
    assert.equal(ids.length, 3);
    assert.equal(ids[0], t.choices[0].token_ids[k]);
    const vals = Object.values(alts);
    assert.ok(vals.length >= 1 && vals.length <= 3 && vals.every((v) => v <= 0 && Number.isFinite(v)));
    assert.equal(Math.max(...vals), lp.token_logprobs[k]);
  }
  const ts = await small.completions.create({ model: 'x', prompt: texts[0], max_tokens: 8, temperature: 0, logprobs: 3,
                                             stream: true });
  let streamedIds = [];
  for await (const chunk of ts) streamedIds = streamedIds.concat(chunk.choices[0].logprobs.top_token_ids);
  assert.deepEqual(streamedIds, lp.top_token_ids);
  const c = await small.chat.completions.create({ model: 'x', messages: [{ role: 'user', content: texts[0] }],
                                                 max_tokens: 8, temperature: 0, logprobs: true, top_logprobs: 20 });
  let highBytes = 0;
  for (const e of c.choices[0].logprobs.content) {
    for (const x of [e, ...e.top_logprobs]) {
      assert.ok(x.bytes.every((b) => Number.isInteger(b) && b >= 0 && b <= 255), JSON.stringify(x.bytes));
      highBytes += x.bytes.filter((b) => b >= 128).length;
    }
    assert.equal(e.top_logprobs.length, 20);
    assert.equal(e.top_logprobs[0].token, e.token);
    assert.equal(e.top_logprobs[0].logprob, e.logprob);
    assert.ok(e.top_logprobs[1].logprob <= e.top_logprobs[0].logprob);
  }
  assert.ok(highBytes > 0, 'no byte >= 128 among the tokens: the bytes check would not see a sign error');
  for (const [path, body, param] of [
    ['/v1/completions', { prompt: [1, 2], logprobs: 21 }, 'logprobs'],
    ['/v1/chat/completions', { messages: [{ role: 'user', content: 'x' }], top_logprobs: 2 }, 'top_logprobs'],
    ['/v1/chat/completions', { messages: [{ role: 'user', content: 'x' }], logprobs: 3 }, 'logprobs']]) {
    const res = await fetch(`${smallUrl}${path}`, { method: 'POST', headers: { 'content-type': 'application/json' },
                                                    body: JSON.stringify(body) });
    assert.equal(res.status, 400, JSON.stringify(body));
    assert.equal((await res.json()).error.param, param);
  }
  ok('top log-probs: completions logprobs N and chat top_logprobs, streamed and not; out of range refused');
  // n choices: choice j samples with seed + j, so choice 0 is the n = 1 answer and choice 2 is seed + 2's.
  const many = await small.completions.create({ model: 'x', prompt: texts[1], max_tokens: 16, temperature: 1.2,
                                                seed: 7, n: 3 });
  assert.equal(many.choices.length, 3);
  assert.deepEqual(many.choices.map((c) => c.index), [0, 1, 2]);
  assert.deepEqual(many.choices[0].token_ids, a.choices[0].token_ids);
  const c9 = await small.completions.create({ model: 'x', prompt: texts[1], max_tokens: 16, temperature: 1.2, seed: 9 });
  assert.deepEqual(many.choices[2].token_ids, c9.choices[0].token_ids);
  assert.notDeepEqual(many.choices[0].token_ids, many.choices[1].token_ids, 'the choices must differ to bite');
  assert.equal(many.usage.prompt_tokens, a.usage.prompt_tokens, 'the prompt counted once');
  const greedy2 = await small.completions.create({ model: 'x', prompt: texts[0], max_tokens: 24, temperature: 0, n: 2 });
  for (const c of greedy2.choices) assert.deepEqual(c.token_ids, refText[0]);
  ok('n choices per prompt (seed + j each; greedy ones equal generate)');
}

// --- stop: a stop string cuts the output before it (token-level match of its encoding)
{
  const full = nonStream[1];
  const stopIds = full.token_ids.slice(5, 7);
  const r = await small.completions.create({ model: 'x', prompt: texts[1], max_tokens: 24, temperature: 0,
                                            stop: [stopIds] });
  let cut = -1;
  for (let e = 2; e <= full.token_ids.length && cut < 0; e++)
    if (full.token_ids[e - 2] === stopIds[0] && full.token_ids[e - 1] === stopIds[1]) cut = e - 2;
  assert.deepEqual(r.choices[0].token_ids, full.token_ids.slice(0, cut));
  assert.equal(r.choices[0].finish_reason, 'stop');
  ok('stop sequence');
}

// --- chat: the Kimi template; tokens are generate's on the same template written out as text
{
  const msgs = [{ role: 'system', content: 'You are terse.' }, { role: 'user', content: 'Hello there, hello there' }];
  const templ = '<|im_system|>system<|im_middle|>You are terse.<|im_end|><|im_user|>user<|im_middle|>' +
                'Hello there, hello there<|im_end|><|im_assistant|>assistant<|im_middle|>';
  const ref = generate([...modelArgs, '--text', templ, '--ignore-eos'], 16)[0];
  const r = await small.chat.completions.create({ model: 'x', messages: msgs, max_tokens: 16, temperature: 0 });
  const got = r.choices[0].token_ids;
  assert.equal(r.choices[0].message.role, 'assistant');
  assert.deepEqual(got, ref.slice(0, got.length), 'chat tokens are a prefix of generate\'s');
  if (r.choices[0].finish_reason === 'length') assert.equal(got.length, 16);
  else assert.ok(got.length < ref.length, 'stopped at <|im_end|> or eos');
  const stream = await small.chat.completions.create({ model: 'x', messages: msgs, max_tokens: 16, temperature: 0,
                                                       stream: true });
  let ids = [], role = null;
  for await (const chunk of stream) {
    ids = ids.concat(chunk.choices[0].token_ids);
    if (chunk.choices[0].delta.role) role = chunk.choices[0].delta.role;
  }
  assert.deepEqual(ids, got);
  assert.equal(role, 'assistant');
  ok(`chat completions (${r.choices[0].finish_reason}), streamed and not`);
}

// --- 32 concurrent clients (8 slots: the rest wait), ids against one generate run
{
  const prompts = Array.from({ length: 32 }, (_, i) => Array.from({ length: 3 + (i % 7) }, (_, j) => (i * 31 + j * 7) % 1000));
  const ref = generate([...modelArgs, ...prompts.flatMap((p) => ['--prompt', p.join(',')])], 12);
  const res = await Promise.all(prompts.map((p, i) => i % 2
    ? small.completions.create({ model: 'x', prompt: p, max_tokens: 12, temperature: 0 }).then((r) => r.choices[0].token_ids)
    : (async () => {
        const s = await small.completions.create({ model: 'x', prompt: p, max_tokens: 12, temperature: 0, stream: true });
        let ids = [];
        for await (const c of s) ids = ids.concat(c.choices[0].token_ids);
        return ids;
      })()));
  for (let i = 0; i < 32; i++) assert.deepEqual(res[i], ref[i], `concurrent client ${i}`);
  const m = await metrics(smallUrl);
  assert.ok(m.k3_batch_size_mean > 1, 'requests were batched');
  ok(`32 concurrent clients equal generate (mean batch ${m.k3_batch_size_mean.toFixed(2)})`);
}

// --- cancellation mid-stream: the slot is freed long before max_tokens would be reached
{
  const before = await metrics(smallUrl);
  const stream = await small.completions.create({ model: 'x', prompt: [1, 2, 3], max_tokens: 3000, temperature: 0,
                                                  stream: true, ignore_eos: true });
  let n = 0;
  for await (const chunk of stream) {
    n += chunk.choices[0].token_ids.length;
    if (n >= 5) break;  // leaving the loop aborts the HTTP request
  }
  const t0 = Date.now();
  const h = await untilIdle(smallUrl);
  assert.equal(h.running, 0, 'the cancelled request still holds a slot');
  assert.equal(h.free_slots, h.max_slots);
  const after = await metrics(smallUrl);
  assert.equal(after['k3_requests_finished_total{reason="cancelled"}'],
               before['k3_requests_finished_total{reason="cancelled"}'] + 1);
  assert.ok(after.k3_generated_tokens_total - before.k3_generated_tokens_total < 3000);
  ok(`cancel mid-stream frees the slot (${Date.now() - t0} ms)`);
}

// --- cancellation of a non-streaming request: the client aborts while the server is generating
{
  const before = await metrics(smallUrl);
  const ctl = new AbortController();
  const pending = small.completions.create({ model: 'x', prompt: [1, 2, 3], max_tokens: 3000, temperature: 0,
                                             ignore_eos: true }, { signal: ctl.signal });
  let started = 0;
  for (const t0 = Date.now(); Date.now() - t0 < 10000; await new Promise((r) => setTimeout(r, 20))) {
    const m = await metrics(smallUrl);
    started = m.k3_generated_tokens_total - before.k3_generated_tokens_total;
    if (started >= 5) break;
  }
  assert.ok(started >= 5, 'the non-streaming request never started generating');
  ctl.abort();
  await assert.rejects(pending);
  const t0 = Date.now();
  const h = await untilIdle(smallUrl);
  assert.equal(h.running, 0, 'the aborted non-streaming request still holds a slot');
  assert.equal(h.free_slots, h.max_slots);
  const after = await metrics(smallUrl);
  assert.equal(after['k3_requests_finished_total{reason="cancelled"}'],
               before['k3_requests_finished_total{reason="cancelled"}'] + 1);
  assert.equal(after.k3_client_disconnects_total, before.k3_client_disconnects_total + 1);
  assert.ok(after.k3_generated_tokens_total - before.k3_generated_tokens_total < 3000);
  ok(`an aborted non-streaming request is cancelled and frees its slot (${Date.now() - t0} ms)`);
}

// --- bad requests: 4xx with an OpenAI error, and the server goes on
async function raw(url, path, body) {
  const r = await fetch(`${url}${path}`, { method: 'POST', headers: { 'content-type': 'application/json' }, body });
  const j = await r.json();
  return { status: r.status, j };
}
const bads = [
  [smallUrl, '/v1/completions', '{"prompt": "abc", ', 'malformed JSON'],
  [smallUrl, '/v1/completions', '[1, 2]', 'not an object'],
  [smallUrl, '/v1/completions', '{"prompt": 5}', 'prompt of the wrong type'],
  [smallUrl, '/v1/completions', '{"prompt": "abc", "max_tokens": "ten"}', 'max_tokens of the wrong type'],
  [smallUrl, '/v1/completions', '{"prompt": "abc", "max_tokens": 0}', 'max_tokens < 1'],
  [smallUrl, '/v1/completions', '{"prompt": "abc", "temperature": "hot"}', 'temperature of the wrong type'],
  [smallUrl, '/v1/completions', '{"prompt": "abc", "stream": "yes"}', 'stream of the wrong type'],
  [smallUrl, '/v1/completions', JSON.stringify({ prompt: Array(5000).fill(1), max_tokens: 4 }), 'prompt over the context'],
  [smallUrl, '/v1/completions', '{"prompt": "abc", "max_tokens": 100000}', 'max_tokens over the context'],
  [smallUrl, '/v1/completions', '{"prompt": [1, 2, 1024]}', 'token id out of range'],
  [smallUrl, '/v1/completions', '{"prompt": [1, -2]}', 'negative token id'],
  [smallUrl, '/v1/completions', '{"prompt": [1, 2], "n": 0}', 'n < 1'],
  [smallUrl, '/v1/completions', '{"prompt": [1, 2], "n": 17}', 'n over 16'],
  [smallUrl, '/v1/completions', '{"prompt": [1, 2], "n": 1.5}', 'n not an integer'],
  [smallUrl, '/v1/completions', '{"prompt": [1, 2], "stream_options": {"include_usage": true}}', 'stream_options without stream'],
  [smallUrl, '/v1/completions', '{"prompt": [1, 2], "stream": true, "stream_options": {"include_usage": 1}}',
   'include_usage of the wrong type'],
  [smallUrl, '/v1/chat/completions', '{"messages": "hi"}', 'messages of the wrong type'],
  [smallUrl, '/v1/chat/completions', '{"messages": [{"role": "wizard", "content": "x"}]}', 'unknown role'],
  [tinyUrl, '/v1/completions', '{"prompt": [1, 2], "frequency_penalty": 0.5}', 'a penalty not implemented'],
  [tinyUrl, '/v1/completions', '{"prompt": [1, 2], "logit_bias": {"5": 10}}', 'logit_bias not implemented'],
  [tinyUrl, '/v1/completions', '{"prompt": [1, 2], "echo": true}', 'echo not implemented'],
  [smallUrl, '/v1/chat/completions', '{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}',
   'tools not implemented'],
  [tinyUrl, '/v1/completions', '{"prompt": "text without a tokenizer"}', 'text prompt without a tokenizer'],
  [tinyUrl, '/v1/chat/completions', '{"messages": [{"role": "user", "content": "x"}]}', 'chat without a template'],
];
for (const [url, path, body, what] of bads) {
  const { status, j } = await raw(url, path, body);
  assert.ok(status >= 400 && status < 500, `${what}: status ${status}`);
  assert.equal(typeof j.error.message, 'string', what);
  assert.ok('type' in j.error && 'param' in j.error && 'code' in j.error, what);
  assert.equal((await health(url)).http, 200, `${what}: the server stopped answering`);
}
await assert.rejects(small.completions.create({ model: 'x', prompt: 'abc', max_tokens: 0 }),
                     (e) => e instanceof OpenAI.APIError && e.status === 400);
await assert.rejects(tiny.completions.create({ model: 'x', prompt: 'abc' }),
                     (e) => e instanceof OpenAI.APIError && e.status === 400 && /tokenizer/.test(e.message));
for (const [param, body] of [['frequency_penalty', '{"prompt": [1, 2], "frequency_penalty": 0.5}'],
                             ['logit_bias', '{"prompt": [1, 2], "logit_bias": {"5": 10}}']]) {
  const { status, j } = await raw(tinyUrl, '/v1/completions', body);
  assert.equal(status, 400);
  assert.equal(j.error.param, param);
  assert.equal(j.error.code, 'unsupported_parameter');
}
{  // their neutral values, as clients send them by default, are accepted
  const body = JSON.stringify({ prompt: [1, 2], max_tokens: 2, frequency_penalty: 0, presence_penalty: 0,
                                logit_bias: {}, echo: false, best_of: 1, top_k: -1, user: 'u' });
  const r = await fetch(`${tinyUrl}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body });
  assert.equal(r.status, 200, await r.text());
}
{  // max_tokens past the context: the value sent, and the code clients look for
  const { status, j } = await raw(smallUrl, '/v1/completions', '{"prompt": "abc", "max_tokens": 100000}');
  assert.equal(status, 400);
  assert.equal(j.error.code, 'context_length_exceeded');
  assert.equal(j.error.param, 'max_tokens');
  assert.match(j.error.message, /max_tokens 100000 exceeds the context of \d+ tokens/);
}
ok(`${bads.length + 2} bad requests answered 4xx with an OpenAI error; the servers go on; unimplemented parameters refused, their neutral values accepted`);

// --- fuzzed requests: valid ones with 1-3 fields replaced by values of every JSON type (seeded), and raw
// bodies cut, nested or padded. Each answer is a 200 (JSON with choices, or an event stream ending in [DONE])
// or a 4xx OpenAI error, never a 5xx or a dropped connection, and the servers stay healthy.
{
  let state = 0x9e3779b9;
  const rand = (n) => {  // xorshift32: the same requests on every run
    state ^= state << 13; state >>>= 0; state ^= state >>> 17; state ^= state << 5; state >>>= 0;
    return state % n;
  };
  const pick = (a) => a[rand(a.length)];
  const values = [null, true, false, 0, -1, 1, 2, 2.5, -0.5, 1e308, -1e308, 2 ** 31, 2 ** 53, '', 'x', '1', 'abc',
                  [], [1], [-1], [1e9], [1, 'a'], [[1, 2]], [[]], ['a', 'b'], {}, { a: 1 }, { include_usage: true },
                  'z'.repeat(5000), Array(300).fill(7)];
  const completionFields = ['prompt', 'max_tokens', 'temperature', 'top_p', 'seed', 'stop', 'stream', 'logprobs',
                            'n', 'ignore_eos', 'stream_options', 'model', 'unknown_field'];
  const chatFields = ['messages', 'max_tokens', 'temperature', 'top_p', 'seed', 'stop', 'stream', 'n', 'logprobs',
                      'top_logprobs'];
  const raws = ['', '{', '{"prompt": [1, 2]', 'null', '"text"', '[' .repeat(20000) + ']'.repeat(20000),
                `{"prompt": [1, 2], "max_tokens": 1, "x": ${'['.repeat(5000)}${']'.repeat(5000)}}`,
                '{"prompt": [1, 2], "max_tokens": 1}' + ' '.repeat(100000), '{"prompt": "\\ud800"}',
                '{"prompt": [1, 2], "max_tokens": 1, "max_tokens": 2}', '\u0000\u0001\u0002'];
  const N = Number(process.env.K3_FUZZ_REQUESTS || 200);
  const counts = { ok: 0, refused: 0 };
  for (let i = 0; i < N + raws.length; ++i) {
    const chat = i < N && rand(4) === 0;
    const url = chat ? smallUrl : tinyUrl;
    const path = chat ? '/v1/chat/completions' : '/v1/completions';
    let body;
    if (i >= N) {
      body = raws[i - N];
    } else {
      const req = chat ? { messages: [{ role: 'user', content: 'hi' }], max_tokens: 2 }
                       : { prompt: [1, 2, 3], max_tokens: 2 };
      for (let f = 1 + rand(3); f > 0; --f) req[pick(chat ? chatFields : completionFields)] = pick(values);
      body = JSON.stringify(req);
    }
    const what = `fuzz ${i} ${path} ${body.length > 200 ? body.slice(0, 200) + '...' : body}`;
    const r = await fetch(`${url}${path}`, { method: 'POST', headers: { 'content-type': 'application/json' }, body });
    const text = await r.text();
    if (r.status === 200) {
      if ((r.headers.get('content-type') || '').startsWith('text/event-stream')) {
        assert.ok(text.trimEnd().endsWith('data: [DONE]'), `${what}: stream without [DONE]`);
      } else {
        assert.ok(Array.isArray(JSON.parse(text).choices), `${what}: 200 without choices`);
      }
      counts.ok++;
    } else {
      assert.ok(r.status >= 400 && r.status < 500, `${what}: status ${r.status}`);
      assert.equal(typeof JSON.parse(text).error.message, 'string', `${what}: no OpenAI error`);
      counts.refused++;
    }
  }
  for (const url of [smallUrl, tinyUrl]) assert.equal((await health(url)).http, 200, 'a server stopped answering');
  assert.ok(counts.ok > 10 && counts.refused > 10, JSON.stringify(counts));
  ok(`${N + raws.length} fuzzed requests: ${counts.ok} answered, ${counts.refused} refused with a 4xx; no 5xx`);
}

// --- the tiny model: ids in, ids out, equal generate's; drafting off here
{
  const p = [[5, 6, 7], [9, 9, 9, 9, 9]];
  const ref = generate(p.flatMap((x) => ['--prompt', x.join(',')]), 16);
  const r = await tiny.completions.create({ model: 'x', prompt: p, max_tokens: 16, temperature: 0 });
  for (const c of r.choices) {
    assert.deepEqual(c.token_ids, ref[c.index]);
    assert.equal(c.text, '');
  }
  ok('tiny model: token ids equal generate');
}

// --- load test: N requests, 16 at a time, short outputs; none lost
{
  const N = Number(process.env.K3_LOAD_REQUESTS || 300), C = 16, maxTokens = 8;
  let next = 0, done = 0, tokens = 0;
  const t0 = performance.now();
  const worker = async () => {
    for (let i = next++; i < N; i = next++) {
      const prompt = [1 + (i % 200), 2 + (i % 97), 3 + (i % 13)];
      const r = await small.completions.create({ model: 'x', prompt, max_tokens: maxTokens, temperature: 0 });
      const c = r.choices[0];
      assert.ok(c.token_ids.length >= 1 && c.token_ids.length <= maxTokens && c.finish_reason);
      tokens += c.token_ids.length;
      done++;
    }
  };
  await Promise.all(Array.from({ length: C }, worker));
  const secs = (performance.now() - t0) / 1000;
  assert.equal(done, N, 'requests lost');
  const m = await metrics(smallUrl);
  console.log(`load: ${N} requests, ${C} at a time, ${maxTokens} tokens max: ${secs.toFixed(2)} s, ` +
              `${(N / secs).toFixed(1)} requests/s, ${(tokens / secs).toFixed(1)} tokens/s; mean batch ` +
              `${m.k3_batch_size_mean.toFixed(2)}, mean step ${(m.k3_step_seconds_mean * 1000).toFixed(2)} ms, draft ` +
              `acceptance ${m.k3_draft_acceptance_rate.toFixed(3)}, tokens per decode step ${m.k3_tokens_per_step.toFixed(3)}`);
  ok('load test lost no request');
}

// --- drafting happened on the small server (greedy results above equal generate, which does not draft)
{
  const m = await metrics(smallUrl);
  assert.ok(m.k3_draft_accepted_total > 0, 'no draft token was accepted: the drafting comparison is vacuous');
  ok(`drafting: acceptance ${m.k3_draft_acceptance_rate.toFixed(3)}, tokens per step ${m.k3_tokens_per_step.toFixed(3)}`);
}

// --- SIGTERM mid-stream: the stream still completes, then the server exits (serve_test.sh checks exit code 0)
{
  const stream = await small.completions.create({ model: 'x', prompt: [4, 5, 6], max_tokens: 64, temperature: 0,
                                                  stream: true, ignore_eos: true });
  let ids = [], sent = false, finish = null;
  for await (const chunk of stream) {
    ids = ids.concat(chunk.choices[0].token_ids);
    if (chunk.choices[0].finish_reason) finish = chunk.choices[0].finish_reason;
    if (!sent) { process.kill(Number(smallPid), 'SIGTERM'); sent = true; }
  }
  assert.equal(ids.length, 64, 'the stream in flight was cut by the shutdown');
  assert.equal(finish, 'length');
  ok('SIGTERM drains the stream in flight');
}
console.log(`serve_client: ${checks} checks passed`);
