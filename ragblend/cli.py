"""Command line: ``ragblend demo``.

``ragblend demo`` loads the embedded default model, precomputes the KV of the six sample
passages, and answers the sample question twice, with CacheBlend fusion and with a full
prefill, printing both answers and their time to first token.
"""

from __future__ import annotations

import argparse
import sys


def _demo(args) -> int:
    from ragblend import BlendEngine, CacheBlend, Chunk, FullRecompute
    from ragblend.data import load_sample

    print("Loading the default model (the first run converts it once, ~20 s)...", flush=True)
    engine = BlendEngine.from_pretrained(args.model)
    sample = load_sample()
    chunks = sample["chunks"]
    question = args.question or sample["question"]
    engine.precompute(chunks, progress=True)
    segments = [Chunk(c) for c in chunks] + [question]
    print(f"\n{question}\n")
    for label, strategy in (("CacheBlend(ratio=%.2f)" % args.ratio, CacheBlend(args.ratio)),
                            ("full prefill", FullRecompute())):
        out = engine.generate(segments, strategy=strategy, max_new_tokens=args.max_new_tokens)
        s = out.stats
        print(f"[{label}] TTFT {s.ttft_s:.2f} s | {s.prompt_tokens} prompt tokens: "
              f"{s.reused_tokens} reused, {s.recomputed_tokens} recomputed")
        print(f"  {out.text.strip()}\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ragblend", description="Fast RAG on local models (CacheBlend).")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="answer the sample question with fusion and with a full prefill")
    demo.add_argument("--model", default=None, help="HF model dir or .gguf file (default: embedded SmolLM2)")
    demo.add_argument("--question", default=None, help="ask this instead of the sample question")
    demo.add_argument("--ratio", type=float, default=0.15, help="CacheBlend recompute ratio")
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ragblend import RagblendError

    try:
        return args.func(args)
    except RagblendError as err:
        print(f"ragblend: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
