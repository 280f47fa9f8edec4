"""ragblend beside what a user would run instead, on one prompt, in one run.

The benchmark prompt (6 chunks + question, ~3.1k tokens with SmolLM2's template) is answered
by each peer with the same token ids, for each ``--tokens`` length (32: a short answer; 256: a
paragraph, what RAG answers run to) greedy tokens (end-of-sequence suppressed, so every peer
decodes exactly that many), in two scenarios (``--scenarios``):

* **same prompt** — the chunks in the order seen before: prefix caches hit as far as they can;
* **reordered** — the same chunks in a new order every round, as retrieval returns them in
  real RAG: prefix caches hit only the system prompt; ragblend still reuses every chunk.

Peers (each skipped with a message when it cannot be loaded):

* ``transformers`` ``generate`` with a full prefill;
* ``transformers`` with the prompt's prefix up to the first chunk (template and system prompt)
  computed once and reused (a deep copy of the cache per call);
* ``llama-cpp-python`` on the same GGUF file, its RAM prompt cache on, threads = cores;
* ragblend's default (chunks precomputed), and the same with each ``--decode-dtypes`` setting
  (``float32``: decoding on the float32 weights; ``int4``/``int8``: every decoding matmul on
  4-/8-bit weights; the default, ``auto``, takes 4-bit where the GGUF's blocks are 4-bit and
  8-bit elsewhere, where each measures faster on the host).

Reported: TTFT, time to the whole answer and decoding tokens/s (after the first token),
medians of ``--runs`` interleaved rounds (after one warm-up round), each as a speed-up over
transformers' full prefill; the host's CPU heads the report.

    python -m benchmarks.peers --models smollm2 qwen2.5-0.5b --runs 5 --tokens 32 256 --scenarios reordered
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import time

import torch

from ragblend import BlendEngine, Chunk
from ragblend.core.model.loading import default_gguf_path
from ragblend.data import load_sample

from .common import RUNS_DIR, TokenClock, report_per_model
from .models import MODELS, model_path

SCENARIOS = ("same prompt", "reordered")


class HFPeer:
    """transformers ``generate``, optionally after a cached prefix."""

    def __init__(self, engine: BlendEngine, tokens: int, prefix_len: int = 0):
        self.model, self.tokens = engine.hf_model, tokens
        self.prefix_len, self.prefix_ids, self.prefix_cache = prefix_len, None, None

    def answer(self, token_ids: list[int]) -> tuple[float, float]:
        from transformers import DynamicCache

        ids = torch.tensor([token_ids])
        clock = TokenClock()
        t0 = time.perf_counter()
        with torch.inference_mode():
            kwargs = {}
            if self.prefix_len:
                if self.prefix_ids != token_ids[:self.prefix_len]:   # computed once, then reused
                    self.prefix_ids, self.prefix_cache = token_ids[:self.prefix_len], DynamicCache()
                    self.model(ids[:, :self.prefix_len], past_key_values=self.prefix_cache, use_cache=True)
                kwargs["past_key_values"] = copy.deepcopy(self.prefix_cache)
            self.model.generate(ids, max_new_tokens=self.tokens, min_new_tokens=self.tokens, do_sample=False,
                                streamer=clock, **kwargs)
        return clock.times[1] - t0, time.perf_counter() - t0


class LlamaCppPeer:
    """llama-cpp-python on the GGUF file, prompt cache in RAM, one thread per core."""

    def __init__(self, gguf: str, tokens: int, n_ctx: int):
        from llama_cpp import Llama, LlamaRAMCache

        threads = os.cpu_count() or 1
        self.llm = Llama(model_path=gguf, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                         seed=0, verbose=False)
        self.llm.set_cache(LlamaRAMCache(capacity_bytes=2 << 30))
        self.tokens = tokens
        # Every end-of-generation token is suppressed, so it decodes exactly `tokens` like the others.
        ends = {self.llm.token_eos()} | {t for text in (b"<|im_end|>", b"<|endoftext|>")
                                         for t in self.llm.tokenize(text, add_bos=False, special=True)[:1]}
        self.logit_bias = {t: -1e4 for t in ends}
        self.settings = (f"n_ctx={n_ctx}, n_threads={threads}, n_batch=512, LlamaRAMCache(2 GiB); runs the GGUF's "
                         "own quantized weights, where transformers and ragblend run them dequantized to float32")

    def answer(self, token_ids: list[int]) -> tuple[float, float]:
        t0, first, pieces = time.perf_counter(), None, 0
        for _ in self.llm.create_completion(token_ids, max_tokens=self.tokens, temperature=0.0, stream=True,
                                            logit_bias=self.logit_bias):
            first, pieces = first or time.perf_counter(), pieces + 1
        if pieces < self.tokens:
            print(f"llama-cpp-python streamed {pieces} pieces for {self.tokens} tokens", flush=True)
        return first - t0, time.perf_counter() - t0


class RagblendPeer:
    """ragblend's default strategy over chunks precomputed beforehand (ingestion)."""

    def __init__(self, engine: BlendEngine, chunks: list[str], tokens: int):
        self.engine, self.tokens = engine, tokens
        engine.precompute(chunks)
        engine.answers.eos_ids = frozenset()   # decode exactly `tokens`, like the other peers

    def answer(self, segments) -> tuple[float, float]:
        t0, first = time.perf_counter(), None
        for _ in self.engine.stream(segments, max_new_tokens=self.tokens):
            first = first or time.perf_counter()
        return first - t0, time.perf_counter() - t0


def gguf_file(model: str) -> str:
    return model_path(model) or str(default_gguf_path())


def make_peers(model: str, engine: BlendEngine, chunks: list[str], prefix_len: int, tokens: int,
               n_ctx: int, decode_dtypes=("int4",), decode_kv_dtypes=()) -> tuple[dict, dict[str, str]]:
    """The peers that load here, and a note per peer (its settings, or why it was skipped)."""
    peers = {"transformers, full prefill": HFPeer(engine, tokens),
             "transformers, cached system prefix": HFPeer(engine, tokens, prefix_len)}
    notes = {"transformers, full prefill": f"generate(do_sample=False), {torch.get_num_threads()} torch threads",
             "transformers, cached system prefix": f"the first {prefix_len} tokens' DynamicCache, deep-copied per call"}
    try:
        peer = LlamaCppPeer(gguf_file(model), tokens, n_ctx)
        peers["llama-cpp-python"], notes["llama-cpp-python"] = peer, peer.settings
    except ImportError:
        notes["llama-cpp-python"] = "skipped: not installed (pip install llama-cpp-python; it builds from source)"
        print(notes["llama-cpp-python"], flush=True)
    except Exception as err:   # a GGUF this llama.cpp cannot load: the peer is skipped, the run goes on
        notes["llama-cpp-python"] = f"skipped: {type(err).__name__}: {err}"
        print(notes["llama-cpp-python"], flush=True)
    peers["ragblend default"] = RagblendPeer(engine, chunks, tokens)
    strategy = engine.strategy
    notes["ragblend default"] = (f"{strategy.name}({getattr(strategy, 'ratio', '')}), decode_dtype="
                                 f"{engine.decode_dtype!r} (decoding step's linear layers: "
                                 f"{', '.join(f'{n} {kind}' for kind, n in engine.decode_weights.layer_counts().items())}; "
                                 f"K/V {str(engine.answers.kv_dtype).split('.')[-1]}), KV in memory")
    for dtype in decode_dtypes:
        if dtype == engine.decode_dtype:
            continue
        other = BlendEngine(engine.hf_model, engine.tokenizer, store=engine.store, decode_dtype=dtype)
        peers[f"ragblend, decode_dtype={dtype!r}"] = RagblendPeer(other, chunks, tokens)
        notes[f"ragblend, decode_dtype={dtype!r}"] = "the same strategy and store, other decoding matmuls"
    for kv in decode_kv_dtypes:
        other = BlendEngine(engine.hf_model, engine.tokenizer, store=engine.store, decode_kv_dtype=kv)
        peers[f"ragblend, decode_kv_dtype={kv!r}"] = RagblendPeer(other, chunks, tokens)
        notes[f"ragblend, decode_kv_dtype={kv!r}"] = "the same strategy, store and matmuls, K/V decoded over as named"
    return peers, notes


def measure(model: str, runs: int, tokens: int, scenarios=SCENARIOS, decode_dtypes=(),
            decode_kv_dtypes=()) -> list[str]:
    engine = BlendEngine.from_pretrained(model_path(model), kv_dir=False)
    sample = load_sample()
    chunks, question = sample["chunks"], sample["question"]
    layout = engine.build_prompt([Chunk(c) for c in chunks] + [question])
    prefix_len = layout.chunk_spans[0].start
    n_ctx = 1 << (len(layout.token_ids) + tokens).bit_length()
    peers, notes = make_peers(model, engine, chunks, prefix_len, tokens, n_ctx, list(decode_dtypes),
                              list(decode_kv_dtypes))
    rng = random.Random(0)
    times = {(s, p): [] for s in scenarios for p in peers}
    for round_ in range(runs + 1):                    # round 0 warms every peer up
        order = chunks[:]
        while order[0] == chunks[0]:       # another first chunk: prefix caches stop at the system prompt
            rng.shuffle(order)
        for scenario, texts in zip(SCENARIOS, (chunks, order)):
            if scenario not in scenarios:
                continue
            segments = [Chunk(c) for c in texts] + [question]
            token_ids = engine.build_prompt(segments).token_ids
            for name, peer in peers.items():
                result = peer.answer(segments if isinstance(peer, RagblendPeer) else token_ids)
                if round_:
                    times[scenario, name].append(result)
                print(f"round {round_} {scenario:11} {name:35} TTFT {result[0]:6.2f} s, answer {result[1]:6.2f} s",
                      flush=True)
    lines = [f"## {model}, {tokens}-token answers", "", f"{len(layout.token_ids)}-token prompt, {tokens}-token greedy "
             f"answers, median of {runs} interleaved rounds. Speed-up = transformers full prefill's time / the peer's; "
             f"decoding = tokens/s after the first token.", ""]

    def decode_rate(first_s: float, total_s: float) -> float:
        return (tokens - 1) / max(total_s - first_s, 1e-9)

    for scenario in scenarios:
        base = times[scenario, "transformers, full prefill"]
        base_ttft, base_total = statistics.median(t for t, _ in base), statistics.median(a for _, a in base)
        base_rate = statistics.median(decode_rate(t, a) for t, a in base)
        lines += [f"**{scenario}**", "", "| peer | TTFT s | answer s | decoding tokens/s | TTFT speed-up | "
                  "answer speed-up | decoding speed-up |", "|---|---:|---:|---:|---:|---:|---:|"]
        for name in peers:
            ttft = statistics.median(t for t, _ in times[scenario, name])
            total = statistics.median(a for _, a in times[scenario, name])
            rate = statistics.median(decode_rate(t, a) for t, a in times[scenario, name])
            lines.append(f"| {name} | {ttft:.2f} | {total:.2f} | {rate:.1f} | {base_ttft / ttft:.2f}x | "
                         f"{base_total / total:.2f}x | {rate / base_rate:.2f}x |")
        lines.append("")
    lines += ["Settings:", "", *[f"- {name}: {note}" for name, note in notes.items()], ""]
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2"], choices=MODELS)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument("--decode-dtypes", nargs="*", default=["int4"], choices=["float32", "float16", "int4", "int8"],
                        help="ragblend's decoding matmuls to compare beside the default")
    parser.add_argument("--decode-kv-dtypes", nargs="*", default=[], choices=["float32", "bfloat16", "float16"],
                        help="ragblend's decoding K/V dtypes to compare beside the default")
    parser.add_argument("--out", default=RUNS_DIR)
    args = parser.parse_args(argv)

    def measure_all(model: str) -> list[str]:
        return [line for tokens in args.tokens
                for line in measure(model, args.runs, tokens, args.scenarios, args.decode_dtypes,
                                    args.decode_kv_dtypes)]

    report_per_model(args.models, measure_all, args.out, "peers-run.md", "Peers", "benchmarks.peers", argv)


if __name__ == "__main__":
    main()
