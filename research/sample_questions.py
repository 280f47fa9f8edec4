"""The questions a new user asks first: the sample documents' questions (``ragblend demo``, the
benchmark question) and the docs' own examples, asked as a user asks them (``LocalIndex`` over
the sample documents, top-4 retrieval, LlamaIndex's prompt), answered by full prefill, by the
order noise (full prefill with the retrieved chunks reversed) and by QueryAware at each ratio.

Per answerer: how many replies hold the gold answer, and, over full prefill's own 32-token
greedy answer (teacher-forced), the mean KL, the largest KL at any one step, and the share of
steps whose top token is full prefill's. A short factual answer turns on one or two tokens (a
year's digits): the mean over 32 steps dilutes them, the largest step does not.

    python -m research.sample_questions --ratios 0.1 0.2 0.3
    python -m research.sample_questions --model qwen2.5-0.5b --ratios 0.2 0.3 0.5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from benchmarks.common import GREEDY_TOKENS, RUNS_DIR, command_line, prefix_options, write_report
from benchmarks.models import MODELS, model_path
from ragblend import FullRecompute, QueryAware
from ragblend.core.calibration.metrics import answer_kls, answer_logits
from ragblend.core.prompt import ChunkSpan, PromptLayout
from ragblend.data import load_sample, sample_dir

# The docs' own example questions (README, docs/quickstart.md, docs/serving.md), with the answer
# the sample documents give.
DOCS_QUESTIONS = [("Which ferry goes to Hallow Holm?", "Sanderling"), ("When was the lighthouse first lit?", "1873")]
NOISE = "order noise"


def questions() -> list[tuple[str, str]]:
    sample = load_sample()
    return [(sample["question"], sample["answer"]), *((d["question"], d["answer"]) for d in sample["demo"]),
            *DOCS_QUESTIONS]


def reversed_chunks(layout: PromptLayout) -> PromptLayout:
    """``layout`` with its chunks in the reverse order, everything between them in place."""
    spans, ids, moved, pos = layout.chunk_spans, [], [], 0
    for slot, chunk in zip(spans, reversed(spans)):
        ids += layout.token_ids[pos:slot.start]
        start = len(ids)
        ids += chunk.token_ids[chunk.offset:chunk.offset + chunk.end - chunk.start]
        moved.append(ChunkSpan(start, len(ids), chunk.token_ids, chunk.offset))
        pos = slot.end
    return PromptLayout(ids + layout.token_ids[pos:], moved)


def user_prompt(rag, question: str) -> PromptLayout:
    """The prompt ``rag.ask(question)`` gives the engine (retrieval, LlamaIndex's template)."""
    seen = {}
    stream = rag.engine.stream

    def spy(prompt, **options):
        seen["prompt"] = prompt
        return stream(prompt, **options)

    rag.engine.stream = spy
    try:
        rag.ask(question, max_new_tokens=1)
    finally:
        rag.engine.stream = stream
    return seen["prompt"]


def measure(rag, question: str, gold: str, ratios: list[float]) -> dict:
    """{answerer: {"has_answer", "kl_mean", "kl_max", "agree", "text"}} for one question."""
    engine = rag.engine
    prompt = user_prompt(rag, question)
    full = engine.prefill(prompt, strategy=FullRecompute())
    answer = engine.generate(prompt, strategy=FullRecompute(), max_new_tokens=GREEDY_TOKENS).token_ids
    reference = answer_logits(engine, full, answer)
    answerers = [("full prefill", prompt, FullRecompute()), (NOISE, reversed_chunks(prompt), FullRecompute()),
                 *((f"QueryAware({r:.2f})", prompt, QueryAware(r)) for r in ratios)]
    row = {}
    for name, layout, strategy in answerers:
        text = engine.generate(layout, strategy=strategy, max_new_tokens=GREEDY_TOKENS).text
        logits = answer_logits(engine, engine.prefill(layout, strategy=strategy), answer)
        kls = answer_kls(reference, logits)
        row[name] = {"has_answer": gold.lower() in text.lower(), "kl_mean": kls["answer_kl"],
                     "kl_max": kls["answer_kl_peak"],
                     "agree": (logits.argmax(-1) == torch.tensor(answer)).float().mean().item(), "text": text}
    return row


def table(rows: list[dict]) -> list[str]:
    lines = ["| answerer | has the answer | answer KL mean / median | largest step KL mean / median | steps agreeing |",
             "|---|---:|---:|---:|---:|"]
    for name in rows[0]:
        col = {key: [row[name][key] for row in rows] for key in ("has_answer", "kl_mean", "kl_max", "agree")}
        lines.append(f"| {name} | {sum(col['has_answer'])} of {len(rows)} | "
                     f"{statistics.mean(col['kl_mean']):.4f} / {statistics.median(col['kl_mean']):.4f} | "
                     f"{statistics.mean(col['kl_max']):.3f} / {statistics.median(col['kl_max']):.3f} | "
                     f"{statistics.mean(col['agree']):.0%} |")
    return lines


def main(argv=None) -> None:
    from ragblend import BlendEngine
    from ragblend.integrations.local_index import LocalIndex

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=MODELS, help="with its shipped calibration")
    parser.add_argument("--ratios", nargs="+", type=float, default=[0.1, 0.2, 0.3])
    parser.add_argument("--no-chunk-context", action="store_true",
                        help="precompute chunks right after the template's opening (chunk_context='')")
    parser.add_argument("--no-lead-entries", action="store_true",
                        help="the first chunk fused from its own entry too (lead_chunk_kv=False), as before")
    parser.add_argument("--out", default=RUNS_DIR)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        engine = BlendEngine.from_pretrained(model_path(args.model), kv_dir=f"{folder}/kv", **prefix_options(args))
        rag = LocalIndex(folder, engine=engine)
        rag.ingest([sample_dir()], show_progress=False)
        rows, lines = [], []
        for question, gold in questions():
            row = measure(rag, question, gold, args.ratios)
            rows.append(row)
            lines.append(f"- {question} (gold: {gold})")
            lines += [f"  - {name}: {'has it' if r['has_answer'] else 'not'}, KL mean {r['kl_mean']:.3f}, "
                      f"largest {r['kl_max']:.2f}, agree {r['agree']:.0%}: {r['text'][:80]!r}" for name, r in row.items()]
            print("\n".join(lines[-len(row) - 1:]), flush=True)
    summary = table(rows)
    print("\n".join(summary))
    suffix = "-no-chunk-context" * args.no_chunk_context + "-no-lead-entries" * args.no_lead_entries
    write_report(args.out, f"sample-questions-{args.model}{suffix}.md", f"Sample questions through LocalIndex, {args.model}",
                 command_line("research.sample_questions", argv), time.perf_counter() - started,
                 [*summary, "", *lines])


if __name__ == "__main__":
    main()
