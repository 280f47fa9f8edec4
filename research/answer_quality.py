"""Are a model's answers worth comparing? Full prefill's 32-token greedy answers, the shipped
strategy's and the reversed-order full prefill's (the order noise), scored against the gold
answers of SQuAD and MuSiQue: "has answer" (a gold answer appears in the reply) and F1 of the
reply's first sentence.

Greedy-answer ROUGE-L against full prefill (``benchmarks.fidelity``) judges fusion by how far
its answers move from full prefill's. When full prefill itself rarely answers right, those
moves are between wrong answers, and the KL is the yardstick that remains.

    python -m research.answer_quality --models gemma3-270m smollm2 --sets squad:12 musique:6
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from benchmarks.common import (
    MUSIQUE,
    RUNS_DIR,
    SYSTEM,
    answer_contained,
    best_over_answers,
    command_line,
    extract_answer,
    f1_score,
    prompt_sets,
    write_report,
)
from benchmarks.models import MODELS, model_path
from ragblend import BlendEngine, Chunk, FullRecompute

ANSWERERS = ("full prefill", "shipped strategy", "order noise (full prefill, chunks reversed)")


def score(engine: BlendEngine, prompt, greedy_tokens: int) -> dict:
    """Each answerer's reply to one prompt, with its has-answer and F1 against the gold answers."""
    engine.precompute(prompt.chunks)
    in_order = [Chunk(c) for c in prompt.chunks] + [prompt.question]
    reversed_order = [Chunk(c) for c in reversed(prompt.chunks)] + [prompt.question]
    row = {}
    for name, segments, strategy in zip(ANSWERERS, (in_order, in_order, reversed_order),
                                        (FullRecompute(), None, FullRecompute())):
        text = engine.generate(segments, system=SYSTEM, strategy=strategy, max_new_tokens=greedy_tokens).text
        row[name] = {"text": text, "has_answer": best_over_answers(answer_contained, text, prompt.answers),
                     "f1": best_over_answers(f1_score, extract_answer(text), prompt.answers)}
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--sets", nargs="+", default=["squad:12", "musique:6"],
                        help="prompt sets with gold answers, as NAME:COUNT (squad, musique)")
    parser.add_argument("--greedy-tokens", type=int, default=32)
    parser.add_argument("--out", default=RUNS_DIR)
    parser.add_argument("--json", default=None, help="also write every reply and its scores here")
    args = parser.parse_args(argv)
    started, lines, raw = time.perf_counter(), ["| model, set (prompts) | answerer | has answer | F1 |",
                                                "|---|---|---:|---:|"], {}
    for model in args.models:
        engine = BlendEngine.from_pretrained(model_path(model), kv_dir=False)
        for set_name, prompts in prompt_sets(args.sets, MUSIQUE).items():
            if not all(p.answers for p in prompts):
                sys.exit(f"The {set_name} set has no gold answers; use squad or musique.")
            rows = raw[f"{model}/{set_name}"] = []
            for i, prompt in enumerate(prompts):
                rows.append(score(engine, prompt, args.greedy_tokens))
                print(f"[{model}/{set_name}] {i + 1}/{len(prompts)}", flush=True)
            for name in ANSWERERS:
                lines.append(f"| {model}, {set_name} ({len(rows)}) | {name} | "
                             f"{statistics.mean(r[name]['has_answer'] for r in rows):.2f} | "
                             f"{statistics.mean(r[name]['f1'] for r in rows):.2f} |")
            print("\n".join(lines[-len(ANSWERERS):]), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(raw, f, indent=1)
    write_report(args.out, "answer-quality.md", "Answers against the gold answers",
                 command_line("research.answer_quality", argv), time.perf_counter() - started, lines)


if __name__ == "__main__":
    main()
