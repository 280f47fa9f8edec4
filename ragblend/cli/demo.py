"""`ragblend demo`: ingest the sample documents, ask the sample questions both ways."""

from __future__ import annotations

from ragblend.core import options as engine_options

from .args import add_answer_options, add_engine_options, check_options
from .ask import compare_answers


def run(args) -> int:
    from ragblend.core.extras import require
    from ragblend.core.paths import cache_dir
    from ragblend.data import load_sample, sample_dir
    from ragblend.integrations.compare import FULL_PREFILL, SpeedRatio, fusion_only, warm_up, warm_up_note

    require("llamaindex", "ragblend demo")
    check_options(args)
    from ragblend.integrations.local_index import LocalIndex

    # ragblend's own cache, not a fixed name in a shared /tmp that another user could create first
    folder = args.index or str(cache_dir() / "demo-index")
    model = "the default model" if args.model is None else args.model
    print(f"Loading {model} and the index in {folder}...", flush=True)
    rag = LocalIndex(folder, options=engine_options.from_args(args))
    report = rag.ingest([sample_dir()])
    print(f"Ingested {len(report.files)} sample documents from {sample_dir()} "
          f"({len(rag)} chunks in the index, KV precomputed for each).\n")
    questions = load_sample()["demo"]
    # Both paths are warmed up before the first timed answer (ragblend.integrations.compare), on
    # a sample question the demo does not time where there is one, so that the timed answers
    # read their chunks' KV as a new question does (the chunks they share with it excepted: each
    # answer's line names the tiers).
    spare = questions[args.questions:] or questions
    with fusion_only():
        note = warm_up_note(warm_up(rag, spare[-1]["question"], ("default", FULL_PREFILL), ratio=args.ratio,
                                    top_k=args.top_k))
    if note:
        print(note + "\n")
    ratios = []
    for item in questions[: args.questions]:
        print(f"Q: {item['question']}   (the documents say: {item['answer']})")
        ratio = compare_answers(rag, item["question"], "BlendLLM", "default", ratio=args.ratio, top_k=args.top_k,
                         max_new_tokens=args.max_new_tokens)
        if ratio is not None:
            ratios.append(ratio)
    if len(ratios) > 1:
        from statistics import median

        shown = SpeedRatio.of(median(ratios))   # worded like each question's
        print(f"Over {len(ratios)} questions, median: {shown.text} (each path warmed up first, untimed).")
    return 0


def add_parser(sub) -> None:
    demo = sub.add_parser("demo", help="ingest the sample documents and answer sample questions, "
                                       "with fusion and with a full prefill")
    demo.add_argument("--questions", type=int, default=3, help="how many sample questions to ask")
    add_engine_options(demo, "model", "dtype")
    add_answer_options(demo)
    demo.add_argument("--index", default=None, help="index folder (default: <user cache>/ragblend/demo-index)")
    demo.set_defaults(func=run)
