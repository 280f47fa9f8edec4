"""`ragblend ask "question"`: an answer from the index (--compare: also with a full prefill)."""

from __future__ import annotations

from ragblend.core.errors import InvalidInputError
from ragblend.core.fusion.strategies import STRATEGY_NAMES

from .args import add_answer_options, add_engine_options, add_index, check_options, open_index


def print_answer(label: str, answer) -> None:
    s = answer.stats
    if s is None:
        print(f"[{label}] {answer.text}\n  (no chunk was retrieved, so the model was not called)")
        return
    strategy = s.strategy if s.ratio is None else f"{s.strategy} {s.ratio:g}"   # what ran, not what was asked
    # chunks missing from the store are computed alone now (and stored): their tokens are neither
    # reused from the store nor recomputed in the prompt, so the line names them
    computed = f", {s.chunks_computed} computed now and stored" if s.chunks_computed else ""
    # which tier the reused chunks came from: a process reads a chunk from disk once, then from memory
    tiers = ": " + ", ".join(f"{tier} {n}" for tier, n in sorted(s.tiers.items())) if s.tiers else ""
    print(f"[{label}] TTFT {s.ttft_s:.2f} s | {strategy} | {s.prompt_tokens} prompt tokens: {s.reused_tokens} "
          f"reused, {s.recomputed_tokens} recomputed ({s.chunks_reused} chunk{'' if s.chunks_reused == 1 else 's'} "
          f"from the KV store{tiers}{computed})")
    if s.fusion_skipped:   # say why nothing was reused
        print("  (a full prefill: too few of the prompt's tokens are in cached chunks for fusion to save work; "
              "stats.strategy_reason says more)")
    if s.fusion_fallback:   # the answer's end came from the exact path: say so, and what it cost
        print(f"  (the fused answer began to loop, so it went on from a full prefill of the prompt and the answer "
              f"kept, {s.fallback_tokens} tokens: {s.fusion_fallback})")
    print(f"  {answer.text}\n")


def print_sources(sources, width: int = 100) -> None:
    """The retrieved chunks an answer was given (``Answer.sources``, best first): file, score, start."""
    from ragblend.integrations.local_index import printable

    print(f"Sources ({len(sources)} retrieved chunk{'' if len(sources) == 1 else 's'}, best first):")
    for rank, source in enumerate(sources, 1):
        node = source.node
        # Escaped: a hostile file name or document must not drive the terminal (as ingest prints them).
        name = printable(node.metadata.get("file_name") or node.ref_doc_id or "(no file)")
        score = "" if source.score is None else f" (score {source.score:.2f})"
        text = printable(" ".join(node.get_content().split()))   # one line: newlines and spaces as one space
        start = text if len(text) <= width else text[:width].rstrip() + "..."
        print(f"  {rank}. {name}{score}: {start}")
    print()


def run(args) -> int:
    from ragblend.core.prompt import check_text

    check_options(args)
    try:
        check_text(args.question, "the question")
    except InvalidInputError:
        raise InvalidInputError("the question is not valid UTF-8 text; set your terminal to UTF-8 (e.g. "
                                "LANG=C.UTF-8) or pass the question in UTF-8.") from None
    if not args.question.strip():   # LocalIndex.ask says the same, but only once the model has loaded
        raise InvalidInputError("Ask a non-empty question.")
    from ragblend.core.extras import require

    require("llamaindex", "ragblend ask")   # a missing extra says so before a missing index does
    if not args.chroma_url:
        from ragblend.integrations.local_index import index_folder

        index = index_folder(args.index)
        if not index.is_dir():
            where = f" --index {args.index}" if args.index else ""
            raise InvalidInputError(f"There is no index at {index}; make one first with "
                                    f"`ragblend ingest <files or folders>{where}`.")
    rag = open_index(args)   # --model, --decode-dtype
    options = dict(mode=args.mode, top_k=args.top_k, max_new_tokens=args.max_new_tokens, ratio=args.ratio)
    if not args.compare:
        answer = rag.ask(args.question, strategy=args.strategy, **options)
        print_answer(args.strategy, answer)
        if args.sources:
            print_sources(answer.sources)
        return 0
    compare_answers(rag, args.question, args.strategy, args.strategy, sources=args.sources, **options)
    return 0


def compare_answers(rag, question: str, label: str, strategy: str, *, ratio=None, sources: bool = False,
                    **options) -> float | None:
    """Answer ``question`` with ``strategy`` and with a full prefill, each path warmed up first
    (untimed, see ragblend.integrations.compare), and print both and how they compare; returns
    full prefill's TTFT over the fused one (None when either answer had no model call)."""
    from ragblend.integrations.compare import FULL_PREFILL, fusion_only, warm_up, warm_up_note

    with fusion_only():
        note = warm_up_note(warm_up(rag, question, (strategy, FULL_PREFILL), ratio=ratio, **options))
        if note:
            print(note + "\n")
        fused = rag.ask(question, strategy=strategy, ratio=ratio, **options)
        print_answer(label, fused)
        full = rag.ask(question, strategy=FULL_PREFILL, ratio=None, **options)   # --ratio is not a full prefill's
        print_answer("full prefill", full)
    speed = print_comparison(fused.stats, full.stats)
    if sources:   # both answers were given the same retrieved chunks
        print_sources(fused.sources)
    return speed.ratio if speed is not None else None


def print_comparison(fused, full):
    """The line under the two answers: their TTFTs compared, and what a fused answer's fallback
    cost after its first token (:func:`fallback_line`). The comparison (None: no line, when
    either answer made no model call)."""
    from ragblend.integrations.compare import compare, compare_line

    speed = compare(fused, full)
    if speed is not None:
        cost = fallback_line(fused, full)
        print(compare_line(speed) + (f"\n   {cost}" if cost else "") + "\n")
    return speed


def fallback_line(fused, full) -> str:
    """What the TTFT comparison leaves out when the fused answer fell back to the exact path (it
    began to loop): the full prefill of prompt and kept answer it then ran, after its first token.
    Compared instead: the whole answers' times, TTFT and decoding (where that prefill ran). ""
    when the fused answer did not fall back (or its fallback failed, and computed nothing)."""
    from ragblend.integrations.compare import speed_ratio

    if fused is None or full is None or not fused.fallback_tokens:
        return ""
    fused_s, full_s = fused.ttft_s + fused.decode_s, full.ttft_s + full.decode_s
    whole = speed_ratio(fused_s, full_s)   # worded as the TTFT's: never a slowdown called a gain
    return (f"but the fused answer began to loop and fell back to a full prefill of {fused.fallback_tokens} tokens "
            f"after its first token, which its TTFT leaves out; whole answers: {whole.text + ' ' if whole else ''}"
            f"({fused_s:.2f} s against {full_s:.2f} s, {fused.generated_tokens} and {full.generated_tokens} "
            "tokens generated)")


def add_parser(sub) -> None:
    ask = sub.add_parser("ask", help="answer a question from the index")
    ask.add_argument("question", help="the question to answer from the index")
    ask.add_argument("--strategy", default="default", choices=STRATEGY_NAMES,
                     help="fusion strategy (default: QueryAware at the model's calibrated ratio)")
    ask.add_argument("--mode", default="compact", choices=["compact", "refine", "tree_summarize", "blend"],
                     help="LlamaIndex response mode, or blend for BlendSynthesizer (default: %(default)s)")
    ask.add_argument("--compare", action="store_true", help="also answer with a full prefill")
    ask.add_argument("--sources", "--show-sources", action="store_true",
                     help="after the answer, print the retrieved chunks it was given: file, score, first 100 "
                          "characters")
    add_engine_options(ask, "model", "dtype", "kv_dtype", "disk_bytes", "memory_bytes", "decode_dtype", "decode_kv_dtype")
    add_answer_options(ask)
    add_index(ask)
    ask.set_defaults(func=run)
