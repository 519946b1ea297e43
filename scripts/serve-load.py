#!/usr/bin/env python3
"""A bounded load test of `k3decode serve` (standard library only; for machines without node).

usage: scripts/serve-load.py --url http://127.0.0.1:8000 [--concurrency 1 8 32 64] [--requests N]
                             [--max-tokens T] [--prompt-len L] [--vocab V] [--repetitive] [--json OUT]
                             [--temperature T] [--dump IDS]

For each concurrency c: N requests (token-id prompts, greedy or with --temperature seeded top-p
sampling, streamed), c in flight at a time.
Reports per c: requests/s, output tokens/s, time per output token (median over requests of
(last token - first token) / (tokens - 1), from the stream), time to the first token (median),
and the share of the wall time the server spent in decode steps (k3_step_seconds_total from
/metrics, before and after). A request that fails or comes back without tokens is counted lost;
any lost request makes the exit code 1. --repetitive: prompts that repeat one passage (where
n-gram drafting finds matches).
"""
import argparse
import http.client
import json
import random
import re
import statistics
import sys
import threading
import time
import urllib.parse


def metrics(url):
    u = urllib.parse.urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(k3_[a-z_]+)(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", line)
        if m:
            out[m[1]] = float(m[2])
    return out


def one(url, prompt, max_tokens, temperature=0.0, seed=0):
    """Streams one completion; returns (tokens, t_first, t_last, t_start) or raises."""
    u = urllib.parse.urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    req = {"model": "k3", "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
           "stream": True, "ignore_eos": True}
    if temperature > 0:
        req.update({"top_p": 0.9, "seed": seed})
    body = json.dumps(req)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
    tokens, first, last = [], None, None
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            break
        ev = json.loads(data)
        ids = ev["choices"][0].get("token_ids") or []
        if ids:
            now = time.perf_counter()
            first = first or now
            last = now
            tokens += ids
    return tokens, first, last, t0


def run(url, conc, prompts, max_tokens, temperature=0.0):
    before = metrics(url)
    results, lost = [], []
    lock = threading.Lock()
    it = iter(range(len(prompts)))

    def worker():
        while True:
            with lock:
                i = next(it, None)
            if i is None:
                return
            try:
                toks, first, last, t0 = one(url, prompts[i], max_tokens, temperature, i)
                if not toks:
                    raise RuntimeError("no tokens")
                with lock:
                    results.append((len(toks), first - t0, (last - first) / max(1, len(toks) - 1)))
            except Exception as e:  # noqa: BLE001 - every failure is a lost request
                with lock:
                    lost.append(f"request {i}: {e}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(conc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    after = metrics(url)
    toks = sum(r[0] for r in results)
    step = after.get("k3_step_seconds_total", 0) - before.get("k3_step_seconds_total", 0)
    steps = after.get("k3_steps_total", 0) - before.get("k3_steps_total", 0)
    prop = after.get("k3_draft_proposed_total", 0) - before.get("k3_draft_proposed_total", 0)
    acc = after.get("k3_draft_accepted_total", 0) - before.get("k3_draft_accepted_total", 0)
    return {"concurrency": conc, "requests": len(prompts), "lost": len(lost), "lost_detail": lost[:5],
            "wall_s": wall, "requests_per_s": len(results) / wall, "tokens_per_s": toks / wall,
            "tpot_ms_median": 1e3 * statistics.median(r[2] for r in results) if results else None,
            "ttft_ms_median": 1e3 * statistics.median(r[1] for r in results) if results else None,
            "step_share": step / wall if wall > 0 else None, "steps": steps,
            "tokens_per_step": toks / steps if steps else None,
            "draft_acceptance": acc / prop if prop else None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--repetitive", action="store_true")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0: seeded top-p 0.9 sampling (request i seeds i) instead of greedy")
    ap.add_argument("--dump", help="after the load: the greedy token ids of 8 fixed prompts, one JSON line each")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    out = []
    for conc in a.concurrency:
        n = max(a.requests, conc)
        if a.repetitive:
            passage = [rng.randrange(1, a.vocab) for _ in range(max(4, a.prompt_len // 4))]
            prompts = [(passage * (a.prompt_len // len(passage) + 1))[:a.prompt_len] for _ in range(n)]
        else:
            prompts = [[rng.randrange(1, a.vocab) for _ in range(a.prompt_len)] for _ in range(n)]
        r = run(a.url, conc, prompts, a.max_tokens, a.temperature)
        out.append(r)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    if a.dump:
        # Fixed prompts (a repeated passage and random ids): servers that decode alike write the same file.
        fixed = random.Random(7)
        passage = [fixed.randrange(1, a.vocab) for _ in range(6)]
        with open(a.dump, "w") as f:
            for i in range(8):
                p = passage * 4 if i % 2 == 0 else [fixed.randrange(1, a.vocab) for _ in range(a.prompt_len)]
                toks, _, _, _ = one(a.url, p, a.max_tokens)
                f.write(json.dumps(toks) + "\n")
    sys.exit(1 if any(r["lost"] for r in out) else 0)


if __name__ == "__main__":
    main()
