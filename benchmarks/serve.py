"""Load test of ``ragblend serve`` over loopback: concurrent RAG clients, then a small queue.

Starts ``ragblend serve`` (a subprocess, the embedded model, a fresh KV folder), precomputes
the benchmark's 6 chunks through ``POST /v1/chunks``, then runs one client alone (5 requests,
the baseline) and ``--clients`` threads that each send ``--requests`` streaming chat requests: 3 of the chunks in a random order, marked with
``cache_control``, and a question. Reported: TTFT measured by the client (request sent to first
content delta) at p50/p95, whole-answer latency, throughput, cached-token share, and requests
lost (anything but a complete 200 answer). A second server with ``--queue-size 2`` then takes a
burst of ``--clients`` × 3 requests and shows the 429 behaviour: how many were refused, that
each refusal carried ``Retry-After``, and that every accepted request was answered.

    python -m benchmarks.serve                    # 8 clients x 10 requests; a few minutes on 2 cores
    python -m benchmarks.serve --clients 4 --requests 3
    python -m benchmarks.serve --reuse            # reuse with no setup: plain-text asks, nothing registered
    python -m benchmarks.serve --concurrency      # batched decoding: 1, 4 and 8 openai clients at once

``--concurrency`` measures batched decoding (continuous batching, ``serving.worker``): one
``ragblend serve`` (subprocess, embedded model, a fresh KV folder), ``--levels`` of concurrent
clients (official openai SDK, streaming, short distinct questions, ``--max-tokens`` each, greedy),
``--requests`` per client. For each level: requests answered and lost, aggregate answer tokens/s
(all answers' tokens over the level's wall time), client latency p50/p95 and TTFT p50, and the
ratios to the single client's (one request at a time): the targets are >= 4x the tokens/s and
<= 2x the p50 latency at 8 clients, 0 lost.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time

import httpx

from ragblend.data import load_sample

from .common import RUNS_DIR, ServedProcess, command_line, percentile, write_report


def rag_request(chunks: list[str], question: str, rng: random.Random, max_tokens: int) -> dict:
    content = []
    for chunk in rng.sample(chunks, 3):
        content += [{"type": "text", "text": chunk, "cache_control": {"type": "ephemeral"}},
                    {"type": "text", "text": "\n\n"}]
    content.append({"type": "text", "text": question})
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}


def one_request(url: str, body: dict) -> dict:
    """Send one streaming request; what the client saw."""
    started, first, tokens, usage, engine_stats = time.perf_counter(), None, 0, None, {}
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
            if response.status_code != 200:
                response.read()
                return {"status": response.status_code, "retry_after": response.headers.get("retry-after")}
            done = False
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                for choice in event.get("choices") or ():
                    if choice.get("delta", {}).get("content"):
                        first = first or time.perf_counter()
                        tokens += 1
                usage = event.get("usage") or usage
                engine_stats = event.get("ragblend") or engine_stats
    except httpx.HTTPError as err:
        return {"status": type(err).__name__}
    end = time.perf_counter()
    return {"status": 200 if done and usage else "incomplete", "ttft": (first or end) - started,
            "latency": end - started, "deltas": tokens, "usage": usage, "engine_ttft": engine_stats.get("ttft_s")}


def run_threads(clients: int, requests: int, send) -> tuple[list[dict], float]:
    """``clients`` threads each making ``requests`` calls ``send(client, request) -> outcome``;
    the outcomes and the wall-clock seconds of the whole run."""
    results, lock = [], threading.Lock()

    def client(index: int) -> None:
        for r in range(requests):
            outcome = send(index, r)
            with lock:
                results.append(outcome)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - started


def run_clients(url: str, clients: int, requests: int, make_body) -> tuple[list[dict], float]:
    rngs = [random.Random(index) for index in range(clients)]
    return run_threads(clients, requests, lambda index, _: one_request(url, make_body(rngs[index])))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=10, help="per client")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", default=RUNS_DIR)
    parser.add_argument("--concurrency", action="store_true",
                        help="only measure batched decoding: --levels concurrent openai clients (serve-batching-run.md)")
    parser.add_argument("--levels", default="1,4,8", help="with --concurrency: client counts, the first the baseline")
    parser.add_argument("--reuse", action="store_true",
                        help="only measure reuse with no setup (plain-text prompts, no /v1/chunks): serve-reuse-run.md")
    args = parser.parse_args(argv)
    if args.reuse:
        return reuse_main(args, argv)
    if args.concurrency:
        return concurrency_main(args, argv)
    sample = load_sample()
    chunks, question = sample["chunks"], sample["question"]
    started = time.perf_counter()
    lines = []
    with tempfile.TemporaryDirectory() as kv_dir:
        server = ServedProcess(kv_dir)
        try:
            refs = httpx.post(f"{server.url}/v1/chunks", json={"texts": chunks}, timeout=600).json()["data"]
            chunk_tokens = {c: r["tokens"] for c, r in zip(chunks, refs)}
            one_request(server.url, rag_request(chunks, question, random.Random(-1), 2))   # warm-up
            runs = [(1, 5), (args.clients, args.requests)]
            measured = [(clients, requests, *run_clients(
                server.url, clients, requests, lambda rng: rag_request(chunks, question, rng, args.max_tokens)))
                for clients, requests in runs]
        finally:
            server.stop()
        lines += [f"Streaming requests over loopback to one `ragblend serve` (embedded SmolLM2, default strategy, "
                  f"queue 16); each request: 3 of the 6 benchmark chunks (~{int(3 * statistics.mean(chunk_tokens.values()))} "
                  f"tokens) in a random order + question, {args.max_tokens} answer tokens at most. Client TTFT is "
                  "from sending the request to the first content delta (time queued behind other clients "
                  "included); engine TTFT is the server's own prefill time (`ragblend.ttft_s`).", "",
                  "| clients x requests | answered | lost | client TTFT p50 / p95 (s) | engine TTFT p50 (s) | "
                  "latency p50 / p95 (s) | requests/s | answer tokens/s | cached / chunk tokens |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for clients, requests, results, seconds in measured:
            answered = [r for r in results if r["status"] == 200]
            ttfts = [r["ttft"] for r in answered]
            latencies = [r["latency"] for r in answered]
            generated = sum(r["usage"]["completion_tokens"] for r in answered)
            cached = statistics.mean(r["usage"]["prompt_tokens_details"]["cached_tokens"] / (3 * statistics.mean(
                chunk_tokens.values())) for r in answered) if answered else 0.0
            lines.append(f"| {clients} x {requests} | {len(answered)} | {len(results) - len(answered)} | "
                         f"{percentile(ttfts, 0.5):.2f} / {percentile(ttfts, 0.95):.2f} | "
                         f"{statistics.median(r['engine_ttft'] for r in answered):.2f} | "
                         f"{percentile(latencies, 0.5):.2f} / {percentile(latencies, 0.95):.2f} | "
                         f"{len(answered) / seconds:.2f} | {generated / seconds:.1f} | {cached:.0%} |")
        lines.append("")

        burst = ServedProcess(kv_dir, "--queue-size", "2")
        try:
            results, seconds = run_clients(burst.url, args.clients, 3,
                                           lambda rng: rag_request(chunks, question, rng, args.max_tokens))
        finally:
            burst.stop()
        refused = [r for r in results if r["status"] == 429]
        answered = [r for r in results if r["status"] == 200]
        other = len(results) - len(refused) - len(answered)
        lines += [f"Burst against a server started with `--queue-size 2`: {args.clients} clients x 3 requests at once.",
                  "", "| requests | answered | refused with 429 | 429s with Retry-After | other outcomes |",
                  "|---:|---:|---:|---:|---:|",
                  f"| {len(results)} | {len(answered)} | {len(refused)} | "
                  f"{sum(1 for r in refused if r.get('retry_after'))} | {other} |"]
    print("\n".join(lines))
    write_report(args.out, "serve-run.md", "Serving under load", command_line("benchmarks.serve", argv),
                 time.perf_counter() - started, lines)


def plain_request(chunks: list[str], question: str, max_tokens: int) -> dict:
    """A prompt as a framework's stuff chain sends it: the documents joined by blank lines, no marks."""
    return {"messages": [{"role": "system", "content": "Answer using only this context:\n\n" + "\n\n".join(chunks)},
                         {"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


def reuse_main(args, argv) -> None:
    """Reuse with no setup: a fresh memory-only server, nothing registered; the same plain-text RAG
    prompt asked three times, then its chunks in another order and with a new one."""
    started = time.perf_counter()
    sample = load_sample()
    chunks, question = sample["chunks"], sample["question"]
    asks = [("first ask", chunks[:3]), ("same question again", chunks[:3]), ("and again", chunks[:3]),
            ("chunks reordered", [chunks[2], chunks[0], chunks[1]]), ("two seen, one new", chunks[1:4])]
    server = ServedProcess("none")
    try:
        rows = []
        for label, docs in asks:
            result = one_request(server.url, plain_request(docs, question, args.max_tokens))
            assert result["status"] == 200, result
            chunk_tokens = sum(len(httpx.post(f"{server.url}/tokenize", json={"prompt": d, "add_special_tokens": False},
                                              timeout=60).json()["tokens"]) for d in docs)
            cached = result["usage"]["prompt_tokens_details"]["cached_tokens"]
            rows.append(f"| {label} | {result['usage']['prompt_tokens']} | {chunk_tokens} | {cached} | "
                        f"{cached / chunk_tokens:.0%} | {result['engine_ttft']:.2f} | {result['ttft']:.2f} |")
    finally:
        server.stop()
    lines = ["Plain-text RAG prompts (system: the 3 benchmark chunks joined by blank lines; user: the question), "
             "as LangChain's stuff chain sends them, to a fresh `ragblend serve --kv-dir none` with nothing registered. "
             f"{args.max_tokens} answer tokens each, one request at a time.", "",
             "| ask | prompt tokens | chunk tokens | cached tokens | cached / chunk tokens | server TTFT (s) | "
             "client TTFT (s) |", "|---|---:|---:|---:|---:|---:|---:|", *rows]
    print("\n".join(lines))
    write_report(args.out, "serve-reuse-run.md", "Reuse with no setup", command_line("benchmarks.serve", argv),
                 time.perf_counter() - started, lines)



# ---------------------------------------------------------------------------- batched decoding

QUESTIONS = [
    "Name three uses of a lighthouse.", "Why do bakers proof dough overnight?", "What does a ferry captain do?",
    "Explain what a steel bridge is.", "Give two reasons to visit an island.", "What is whale oil?",
    "Describe a village council meeting.", "How are rye loaves different from wheat loaves?",
    "What makes a harbour safe?", "List some kinds of boats.", "Why do towns replace old bridges?",
    "What is a linen basket used for?",
]


def openai_request(url: str, question: str, max_tokens: int) -> dict:
    """One streaming chat request through the official openai client; what it saw."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    started, first, usage = time.perf_counter(), None, None
    try:
        stream = client.chat.completions.create(
            model="ragblend", messages=[{"role": "user", "content": question}], max_tokens=max_tokens,
            temperature=0, stream=True, stream_options={"include_usage": True})
        for event in stream:
            if event.choices and event.choices[0].delta.content:
                first = first or time.perf_counter()
            usage = event.usage or usage
    except openai.APIError as err:
        return {"status": type(err).__name__}
    end = time.perf_counter()
    if usage is None:
        return {"status": "no usage"}
    return {"status": 200, "ttft": (first or end) - started, "latency": end - started,
            "tokens": usage.completion_tokens}


def concurrency_level(url: str, clients: int, requests: int, max_tokens: int) -> dict:
    results, seconds = run_threads(clients, requests, lambda index, r: openai_request(
        url, QUESTIONS[(index * requests + r) % len(QUESTIONS)], max_tokens))
    answered = [r for r in results if r["status"] == 200]
    latencies = [r["latency"] for r in answered] or [float("nan")]
    return {"clients": clients, "requests": len(results), "answered": len(answered),
            "lost": len(results) - len(answered), "tokens": sum(r["tokens"] for r in answered),
            "tokens_s": sum(r["tokens"] for r in answered) / seconds, "seconds": seconds,
            "p50": percentile(latencies, 0.5), "p95": percentile(latencies, 0.95),
            "ttft50": percentile([r["ttft"] for r in answered] or [float("nan")], 0.5)}


def concurrency_main(args, argv) -> None:
    levels = [int(n) for n in args.levels.split(",")]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as kv_dir:
        server = ServedProcess(kv_dir)
        try:
            openai_request(server.url, "Hello.", 4)   # warm-up: first-call allocations, kernel choices
            measured = [concurrency_level(server.url, n, args.requests, args.max_tokens) for n in levels]
        finally:
            server.stop()
    base = measured[0]
    lines = [f"Streaming chat requests over loopback to one `ragblend serve` (embedded SmolLM2, answers decoded "
             f"together: continuous batching, up to 8 per step), sent with the official openai client: each client "
             f"sends {args.requests} requests one after another, short distinct questions, at most "
             f"{args.max_tokens} answer tokens, greedy. Tokens/s: all answers' tokens over the level's wall time. "
             f"Ratios are to the {base['clients']}-client level (one request at a time).", "",
             "| clients | answered | lost | answer tokens | tokens/s | x tokens/s | latency p50 / p95 (s) | "
             "x p50 | TTFT p50 (s) |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m in measured:
        lines.append(f"| {m['clients']} | {m['answered']} | {m['lost']} | {m['tokens']} | {m['tokens_s']:.1f} | "
                     f"{m['tokens_s'] / base['tokens_s']:.2f} | {m['p50']:.2f} / {m['p95']:.2f} | "
                     f"{m['p50'] / base['p50']:.2f} | {m['ttft50']:.2f} |")
    print("\n".join(lines))
    write_report(args.out, "serve-batching-run.md", "Batched decoding under concurrent clients",
                 command_line("benchmarks.serve", argv), time.perf_counter() - started, lines)


if __name__ == "__main__":
    main()
