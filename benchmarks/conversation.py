"""Conversations and exact repeats: the prefix tier's and the history pieces' TTFT (issue 60), in one run.

* **conversation**, two settings: ``--turns`` turns over the **same** ``--chunks`` retrieved chunks
  every turn, and over **new** chunks each turn (a window of ``--chunks`` of the sample's 6 chunks
  moved on by one each turn, so the prompt's front, where chat engines put the context, changes
  every turn). Each setting is asked two ways:

  - through LlamaIndex's ``condense_plus_context`` chat engine with :class:`~ragblend.BlendLLM`
    (a fixed retriever, the chunks precomputed as at ingestion). TTFT of the answer call (the last
    LLM call of a turn; the condense call before it is not counted) for ragblend's default, the
    same with history pieces off (the prefix tier alone), and its full prefill
    (``strategy="full_recompute"``, which reads no tier and keeps no piece). For the default, per
    turn: the first-token KL to the full prefill of the same prompt, against the *order noise*
    (the full prefill with the prompt's chunks reversed), and the greedy answer's ROUGE-L to the
    full prefill's (and the reversed order's, the noise);
  - through ``ragblend serve`` (a subprocess on 127.0.0.1) with the official openai client,
    streaming; a system message holding the chunks, the earlier turns, the question; TTFT as the
    client sees it (request to first content delta), default and full prefill (the request's
    ``ragblend.strategy``), each run in its own ``cache_salt``.

  llama-cpp-python on the same GGUF with its RAM prompt cache (a fresh one per conversation)
  is sent the token ids of the default's answer prompts, in order: the same rendered prompts; for
  the served setting as ragblend is asked, ``--pause`` s after each turn, one conversation after
  each round of ragblend's (interleaved), each turn the median of ``--repeats`` conversations.
  Between turns, the engine's background work (storing the pieces of the turn just answered)
  finishes first, as while a user reads the answer: its time is reported (``bg s``), never hidden.

* **exact repeat**: the benchmark prompt (6 chunks + question, ~3.1k tokens) answered twice: the
  TTFT of the first (fused) and of the repeat, and the largest difference between their
  first-token logits; the full prefill; llama-cpp-python, first and repeat.

    python -m benchmarks.conversation --turns 5 --tokens 32
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from ragblend import BlendEngine, Chunk, FullRecompute
from ragblend.core.calibration.metrics import first_token_kl
from ragblend.core.description import settle_kernels
from ragblend.core.model.kernels import cpu_summary
from ragblend.core.prompt import PromptLayout
from ragblend.data import load_sample

from .common import SYSTEM, ServedProcess, rouge_l

QUESTIONS = ["Who runs public transport in Lowenmark?", "When was the first breakwater built?",
             "What happens on the first Saturday of September?", "Which of those would a visitor see first?",
             "Summarise our conversation in one sentence."]
SETTINGS = ("same chunks", "new chunks")


def retrieved(chunks: list[str], setting: str, turn: int, k: int) -> list[str]:
    """The chunks a turn retrieves: the first ``k`` every turn, or a window moved on by ``turn``."""
    start = 0 if setting == "same chunks" else turn
    return [chunks[(start + i) % len(chunks)] for i in range(k)]


def fixed_retriever(texts_of_turn):
    """A LlamaIndex retriever that returns ``texts_of_turn()`` whatever the question."""
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import NodeWithScore, TextNode

    class Fixed(BaseRetriever):
        def _retrieve(self, query_bundle):
            return [NodeWithScore(node=TextNode(text=text), score=1.0) for text in texts_of_turn()]

    return Fixed()


def timed_flush(engine: BlendEngine) -> float:
    t = time.perf_counter()
    engine.flush()
    return time.perf_counter() - t


def llamaindex_conversation(engine: BlendEngine, chunks, setting: str, args, mode: str) -> list[dict]:
    """Each turn's answer call in ``mode``: ttft, prompt tokens, prefix-tier and history-piece
    tokens, the prompt's ids and the answer; background time after the turn's calls."""
    from llama_index.core.chat_engine import CondensePlusContextChatEngine

    from ragblend import BlendLLM

    turn = {"n": 0}
    llm = BlendLLM(engine=engine, max_new_tokens=args.tokens, strategy="full_recompute" if mode == "full prefill"
                   else "default")
    chat = CondensePlusContextChatEngine.from_defaults(
        fixed_retriever(lambda: retrieved(chunks, setting, turn["n"], args.chunks)), llm=llm)
    finish, background, logits = engine.finish, [0.0], [None]

    def finish_then_flush(decoding):   # each LLM call's background work done before the next call
        stats = finish(decoding)
        background[0] += timed_flush(engine)
        logits[0] = decoding.prefill.logits
        return stats

    engine.finish = finish_then_flush
    engine.runner.pieces = mode == "default"
    rows = []
    try:
        for t in range(args.turns):
            turn["n"], background[0] = t, 0.0
            response = chat.chat(QUESTIONS[t % len(QUESTIONS)])
            call = llm.calls[-1]
            rows.append({"ttft": call.stats.ttft_s, "tokens": call.stats.prompt_tokens,
                         "prefix": call.stats.prefix_tokens, "history": call.stats.history_tokens,
                         "ids": list(call.layout.token_ids), "answer": response.response, "bg": background[0],
                         "logits": logits[0]})
    finally:
        del engine.finish
        engine.runner.pieces = engine.options.history_pieces
    return rows


def fidelity(engine: BlendEngine, rows: list[dict], tokens: int) -> list[dict]:
    """Per turn of a default conversation: first-token KL to the full prefill, the order noise, and
    whether the greedy answer is the full prefill's."""
    out = []
    for row in rows:
        ids = row["ids"]
        full = engine.generate(PromptLayout(ids, []), strategy=FullRecompute(), max_new_tokens=tokens)
        spans = [s for s in engine.find_chunks_in_ids(ids).chunk_spans if s.offset == 0
                 and s.end - s.start == len(s.token_ids)]
        noise = None
        if len(spans) >= 2:   # the chunks reversed, the rest in place
            reordered, last = [], 0
            for span, chunk in zip(spans, reversed(spans)):
                reordered += ids[last:span.start] + list(chunk.token_ids)
                last = span.end
            reordered += ids[last:]
            reverse = engine.generate(PromptLayout(reordered, []), strategy=FullRecompute(), max_new_tokens=tokens)
            noise = (first_token_kl(full.logits, reverse.logits), rouge_l(reverse.text, full.text))
        out.append({"kl": first_token_kl(full.logits, row["logits"]), "noise": noise and noise[0],
                    "same": full.text.strip() == row["answer"].strip(), "rouge": rouge_l(row["answer"], full.text),
                    "noise_rouge": noise and noise[1]})
    return out


def served_setting(url: str, chunks, setting: str, args, prompts) -> tuple[dict, list[float] | None]:
    """``args.repeats`` rounds, each of one conversation per mode through the server (its own cache
    salt: nothing of another's reused) and then llama-cpp-python over the default's prompts: interleaved,
    so that a shared host that slows down or speeds up over the minutes favours none of them. Each
    turn's TTFT is the median over the rounds (one conversation's turn is a single timing)."""
    runs: dict[str, list[list[dict]]] = {"full prefill": [], "default": []}
    peer_runs = []
    for rep in range(args.repeats):
        for mode, done in runs.items():
            done.append(served_conversation(url, chunks, setting, args, mode, salt=str(rep)))
        # as ragblend's turns: a pause after each
        peer = llama_cpp_turns([prompts.chat_ids(r["messages"]) for r in runs["default"][-1]], args.tokens, args.pause)
        if peer is not None:
            peer_runs.append(peer)
    results = {mode: [{**turns[0], "ttft": statistics.median(r["ttft"] for r in turns)} for turns in zip(*done)]
               for mode, done in runs.items()}
    return results, [statistics.median(turn) for turn in zip(*peer_runs)] if peer_runs else None


def served_conversation(url: str, chunks, setting: str, args, mode: str, salt: str = "") -> list[dict]:
    """Each turn through ``ragblend serve`` with the openai client: ttft, stats, the messages."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    extra = {"cache_salt": f"{setting}-{mode}-{salt}".replace(" ", "-").replace(",", "")}
    if mode == "full prefill":
        extra["ragblend"] = {"strategy": "full_recompute"}
    history, rows = [], []
    for t in range(args.turns):
        context = "\n\n".join(retrieved(chunks, setting, t, args.chunks))
        messages = [{"role": "system", "content": f"{SYSTEM}\n\nContext:\n\n{context}"}, *history,
                    {"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]}]
        started, first, text, stats = time.perf_counter(), None, "", {}
        stream = client.chat.completions.create(model="ragblend", messages=messages, max_tokens=args.tokens,
                                                temperature=0, stream=True, extra_body=extra)
        for event in stream:
            if event.choices and event.choices[0].delta.content:
                first = first or time.perf_counter()
                text += event.choices[0].delta.content
            stats = (event.model_extra or {}).get("ragblend") or stats
        rows.append({"ttft": first - started, "tokens": stats.get("prompt_tokens"), "prefix": stats.get("prefix_tokens"),
                     "history": stats.get("history_tokens"), "messages": messages, "answer": text, "bg": None})
        history += [messages[-1], {"role": "assistant", "content": text}]
        time.sleep(args.pause)   # the user reads the answer: the server stores its pieces meanwhile
    return rows


def served_warm_up(url: str) -> None:
    """One short request, then a pause: a new server's first-call allocations and kernel choices
    are not any turn's."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    client.chat.completions.create(model="ragblend", messages=[{"role": "user", "content": "Hello."}], max_tokens=4,
                                   extra_body={"cache_salt": "warm-up"})
    time.sleep(5)


def llama_cpp_turns(prompts: list[list[int]], tokens: int, pause: float = 0.0) -> list[float] | None:
    """llama-cpp-python's TTFT for each prompt in order, one Llama with its RAM prompt cache for the
    conversation, ``pause`` s after each turn (as the served conversations pause); None when absent."""
    try:
        from .peers import LlamaCppPeer, gguf_file
        peer = LlamaCppPeer(gguf_file("smollm2"), tokens, n_ctx=8192)
    except Exception as err:   # not installed, or no GGUF: reported as skipped
        print(f"llama-cpp-python skipped: {type(err).__name__}: {err}", flush=True)
        return None
    ttfts = []
    for ids in prompts:
        ttfts.append(peer.answer(ids)[0])
        time.sleep(pause)
    return ttfts


def table(title: str, results: dict, peer: list[float] | None, turns: int) -> list[str]:
    """Per turn: each mode's TTFT (prompt tokens / prefix-tier / history-piece tokens), llama.cpp's, and the ratios."""
    modes = list(results)
    head = ["turn", *modes] + (["llama-cpp-python", "default / llama.cpp"] if peer else [])
    lines = ["", title, "", "| " + " | ".join(head) + " |", "|---|" + "---|" * (len(head) - 1)]
    for t in range(turns):
        cells = []
        for m in modes:
            r = results[m][t]
            bg = f", bg {r['bg']:.2f}" if r.get("bg") else ""
            cells.append(f"{r['ttft']:.2f} ({r['tokens']} / {r['prefix']} / {r['history']}{bg})")
        if peer:
            cells += [f"{peer[t]:.2f}", f"{results['default'][t]['ttft'] / peer[t]:.2f}"]
        lines.append(f"| {t + 1} | " + " | ".join(cells) + " |")
    ratios = [f"{m}: {results[m][-1]['ttft'] / results[m][0]['ttft']:.2f}x" for m in modes]
    if peer:
        ratios.append(f"llama-cpp-python: {peer[-1] / peer[0]:.2f}x")
    lines += ["", f"Turn {turns} / turn 1: " + ", ".join(ratios) + "."]
    return lines


def exact_repeat(engine: BlendEngine, sample: dict) -> list[str]:
    """The benchmark prompt answered twice (the repeat from the prefix tier), its full prefill, llama.cpp's."""
    engine.prefix.clear()
    segments = [Chunk(c) for c in sample["chunks"]] + [sample["question"]]
    first = engine.generate(segments, system=SYSTEM, max_new_tokens=1)
    repeat = engine.generate(segments, system=SYSTEM, max_new_tokens=1)
    full = engine.generate(segments, system=SYSTEM, max_new_tokens=1, strategy=FullRecompute())
    difference = (first.logits - repeat.logits).abs().max().item()
    lines = ["", f"Exact repeat of the benchmark prompt ({len(first.prompt_token_ids)} tokens): TTFT in s", "",
             "| run | first | repeat |", "|---|---|---|",
             f"| ragblend default | {first.stats.ttft_s:.2f} | {repeat.stats.ttft_s:.3f} "
             f"({repeat.stats.prefix_tokens} tokens from the prefix tier; logits within {difference:.1e}) |",
             f"| ragblend full prefill | {full.stats.ttft_s:.2f} | - |"]
    peer = llama_cpp_turns([first.prompt_token_ids] * 2, 1)
    if peer is not None:
        lines.append(f"| llama-cpp-python, RAM prompt cache | {peer[0]:.2f} | {peer[1]:.3f} |")
    return lines


def settled_kernels(engine: BlendEngine) -> str:
    """The kernel choice once settled, before anything is timed: a measurement running in the
    background (none cached yet, or one taken on a busy machine) takes a workload whenever the
    model is idle, which would land in some turns' TTFT, and the server started later would
    measure again. One still unsettled after it is measured again now (the benchmark holds the host)."""
    def say(line: str) -> None:
        print(line, flush=True)

    settle_kernels(engine, False, say=say)
    plan = engine.kernel_plan
    if plan is not None and plan.measured is not None and not plan.measured.settled:
        settle_kernels(engine, True, say=say)
    return "none (fixed)" if plan is None else plan.state()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32, help="answer tokens per turn")
    parser.add_argument("--chunks", type=int, default=3, help="retrieved chunks in every turn")
    parser.add_argument("--pause", type=float, default=5.0, help="seconds between a served turn and the next")
    parser.add_argument("--repeats", type=int, default=3,
                        help="served conversations per setting and mode; each turn's TTFT is their median")
    parser.add_argument("--skip-server", action="store_true")
    parser.add_argument("--repeat-only", action="store_true", help="only the exact repeat of the benchmark prompt")
    parser.add_argument("--server-only", action="store_true", help="only the conversations through `ragblend serve`")
    args = parser.parse_args(argv)
    sample = load_sample()
    chunks = sample["chunks"]
    started = time.perf_counter()
    lines = [f"Host: {cpu_summary()}."]
    with tempfile.TemporaryDirectory() as kv_dir:
        base = BlendEngine.from_pretrained(kv_dir=kv_dir)
        lines.append(f"Kernels: {settled_kernels(base)}.")
        base.precompute(chunks)
        base.flush()
        for setting in [] if args.repeat_only or args.server_only else SETTINGS:
            # A fresh engine (the same weights, memory-only store) per setting: no piece of the other's.
            engine = BlendEngine(base.hf_model, base.tokenizer, options=base.options)
            engine.precompute(chunks)
            results = {}
            for mode in ("full prefill", "default, pieces off", "default"):
                engine.prefix.clear()
                results[mode] = llamaindex_conversation(engine, chunks, setting, args, mode)
            peer = llama_cpp_turns([r["ids"] for r in results["default"]], args.tokens)
            lines += table(f"LlamaIndex condense_plus_context, {setting} ({args.turns} turns, {args.chunks} chunks, "
                           f"{args.tokens}-token answers): TTFT of each turn's answer call in s (prompt tokens / "
                           "prefix-tier tokens / history-piece tokens, background s after the turn)",
                           results, peer, args.turns)
            checks = fidelity(engine, results["default"], args.tokens)
            kls = [c["kl"] for c in checks]
            noises = [c["noise"] for c in checks if c["noise"] is not None]
            lines += ["", "Default vs full prefill per turn: first-token KL " +
                      ", ".join(f"{c['kl']:.4f}" for c in checks) + "; order noise " +
                      ", ".join("-" if c["noise"] is None else f"{c['noise']:.4f}" for c in checks) +
                      f"; mean {statistics.mean(kls):.4f} vs {statistics.mean(noises):.4f}, median "
                      f"{statistics.median(kls):.4f} vs {statistics.median(noises):.4f}; greedy answer equal to the "
                      f"full prefill's on {sum(c['same'] for c in checks)}/{len(checks)} turns; ROUGE-L to the full prefill's "
                      f"answer {', '.join(format(c['rouge'], '.2f') for c in checks)} (mean "
                      f"{statistics.mean(c['rouge'] for c in checks):.2f}), the chunks reversed "
                      f"{', '.join('-' if c['noise'] is None else format(c['noise_rouge'], '.2f') for c in checks)}."]
            print("\n".join(lines), flush=True)
        if not (args.skip_server or args.repeat_only):
            server = ServedProcess(kv_dir)
            try:
                served_warm_up(server.url)
                for setting in SETTINGS:
                    results, peer = served_setting(server.url, chunks, setting, args, base.prompts)
                    lines += table(f"`ragblend serve` + openai client, {setting}: client TTFT in s, median of "
                                   f"{args.repeats} conversations (prompt tokens / "
                                   "prefix-tier tokens / history-piece tokens)", results, peer, args.turns)
                    print("\n".join(lines[-args.turns - 6:]), flush=True)
            finally:
                server.stop()

        if not args.server_only:
            lines += exact_repeat(base, sample)
        engine = base
        lines += ["", f"Prefix tier after the run: {engine.prefix_info()}",
                  f"({(time.perf_counter() - started) / 60:.1f} min)"]
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
