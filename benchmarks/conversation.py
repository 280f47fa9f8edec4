"""Conversations and exact repeats: the prefix tier's TTFT (issue 60), in one short run.

* **conversation**: ``--turns`` turns through LlamaIndex's ``condense_plus_context`` chat engine
  with :class:`~ragblend.BlendLLM`, over the same ``--chunks`` retrieved chunks every turn (the
  benchmark's ~500-token passages, precomputed as at ingestion; a fixed retriever, so that every
  mode sees the same context), greedy, ``--tokens`` per answer. Reported per turn: the TTFT of the
  answer call (the last LLM call of the turn; the condense call before it is not counted), its
  prompt tokens and the tokens the prefix tier served, for ragblend's default, the same with the
  prefix tier off (what it did before), and its full prefill (``strategy="full_recompute"``,
  which reads no tier).
* **exact repeat**: the benchmark prompt (6 chunks + question, ~3.1k tokens) answered twice: the
  TTFT of the first (fused) and of the repeat, and the largest difference between their
  first-token logits; the full prefill; llama-cpp-python on the same GGUF with its RAM prompt
  cache, first and repeat (skipped where it is not installed).

    python -m benchmarks.conversation --turns 5 --tokens 32
"""

from __future__ import annotations

import argparse
import tempfile
import time

from ragblend import BlendEngine, Chunk, FullRecompute
from ragblend.core.kernels import cpu_summary
from ragblend.data import load_sample

from .common import SYSTEM

QUESTIONS = ["Who runs public transport in Lowenmark?", "When was the first breakwater built?",
             "What happens on the first Saturday of September?", "Which of those would a visitor see first?",
             "Summarise our conversation in one sentence."]


def fixed_retriever(texts: list[str]):
    """A LlamaIndex retriever that returns ``texts`` whatever the question."""
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import NodeWithScore, TextNode

    class Fixed(BaseRetriever):
        def _retrieve(self, query_bundle):
            return [NodeWithScore(node=TextNode(text=text), score=1.0) for text in texts]

    return Fixed()


def conversation(engine: BlendEngine, chunks: list[str], turns: int, tokens: int, mode: str) -> list[tuple]:
    """``(ttft_s, prompt_tokens, prefix_tokens)`` of each turn's answer call in ``mode``."""
    from llama_index.core.chat_engine import CondensePlusContextChatEngine

    from ragblend import BlendLLM

    strategy = "full_recompute" if mode == "full prefill" else "default"
    llm = BlendLLM(engine=engine, max_new_tokens=tokens, strategy=strategy)
    chat = CondensePlusContextChatEngine.from_defaults(fixed_retriever(chunks), llm=llm)
    tier = engine.runner.prefix
    engine.runner.prefix = None if mode == "default, prefix tier off" else tier
    try:
        rows = []
        for question in (QUESTIONS * turns)[:turns]:
            chat.chat(question)
            stats = engine.last_stats
            rows.append((stats.ttft_s, stats.prompt_tokens, stats.prefix_tokens))
        return rows
    finally:
        engine.runner.prefix = tier


def llama_cpp_repeat(token_ids: list[int], tokens: int) -> tuple[float, float] | None:
    """llama-cpp-python's TTFT for ``token_ids``, first and repeated (prompt cache on); None when absent."""
    try:
        from .peers import LlamaCppPeer, gguf_file
        peer = LlamaCppPeer(gguf_file("smollm2"), tokens, n_ctx=8192)
    except Exception as err:   # not installed, or no GGUF: reported as skipped
        print(f"llama-cpp-python skipped: {type(err).__name__}: {err}", flush=True)
        return None
    return peer.answer(token_ids)[0], peer.answer(token_ids)[0]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32, help="answer tokens per turn")
    parser.add_argument("--chunks", type=int, default=3, help="retrieved chunks in every turn")
    args = parser.parse_args(argv)
    sample = load_sample()
    started = time.perf_counter()
    lines = [f"Host: {cpu_summary()}."]
    with tempfile.TemporaryDirectory() as kv_dir:
        engine = BlendEngine.from_pretrained(kv_dir=kv_dir)
        engine.precompute(sample["chunks"])
        engine.flush()
        modes = ("full prefill", "default, prefix tier off", "default")
        results = {}
        for mode in modes:
            engine.prefix.clear()
            results[mode] = conversation(engine, sample["chunks"][:args.chunks], args.turns, args.tokens, mode)
        lines += ["", f"Conversation ({args.turns} turns, {args.chunks} chunks, {args.tokens}-token answers): "
                  "TTFT of each turn's answer in s (prompt tokens / prefix-tier tokens)", "",
                  "| turn | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
        for turn in range(args.turns):
            cells = [f"{results[m][turn][0]:.2f} ({results[m][turn][1]} / {results[m][turn][2]})" for m in modes]
            lines.append(f"| {turn + 1} | " + " | ".join(cells) + " |")

        engine.prefix.clear()
        segments = [Chunk(c) for c in sample["chunks"]] + [sample["question"]]
        first = engine.generate(segments, system=SYSTEM, max_new_tokens=1)
        repeat = engine.generate(segments, system=SYSTEM, max_new_tokens=1)
        full = engine.generate(segments, system=SYSTEM, max_new_tokens=1, strategy=FullRecompute())
        difference = (first.logits - repeat.logits).abs().max().item()
        lines += ["", f"Exact repeat of the benchmark prompt ({len(first.prompt_token_ids)} tokens): TTFT in s", "",
                  "| run | first | repeat |", "|---|---|---|",
                  f"| ragblend default | {first.stats.ttft_s:.2f} | {repeat.stats.ttft_s:.2f} "
                  f"({repeat.stats.prefix_tokens} tokens from the prefix tier; logits within {difference:.1e}) |",
                  f"| ragblend full prefill | {full.stats.ttft_s:.2f} | - |"]
        peer = llama_cpp_repeat(first.prompt_token_ids, 1)
        if peer is not None:
            lines.append(f"| llama-cpp-python, RAM prompt cache | {peer[0]:.2f} | {peer[1]:.2f} |")
        lines += ["", f"Prefix tier after the run: {engine.prefix_info()}",
                  f"({(time.perf_counter() - started) / 60:.1f} min)"]
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
