"""What each chunk is precomputed after, the prompt's first chunk apart: the study behind lead
entries (``lead_chunk_kv``, docs/notes/lead-entries.md).

Each candidate names what chunks are precomputed after: a ``chunk_context`` for every chunk
(``passage``: the shipped ``CHUNK_CONTEXT``; ``opening``: nothing, the template's opening alone;
the others: variants of the passage), or ``FIRST/REST`` for the prompt's first chunk and the
others apart (``opening/passage`` is what lead entries do; ``passage/opening`` the control).
Every candidate's entries are staged in its engine's store before each prompt, so that the
fused prefill reads exactly them.

Two prompt sets, QueryAware at one ratio: the sample documents' 8 questions as a user asks them
(``research.sample_questions``: LocalIndex, top-4, LlamaIndex's template; gold answer held,
answer KL over full prefill's 32-token answer, its largest step), and SQuAD (first-token KL and
answer KL). The order noise (full prefill, chunks reversed) is the yardstick.

    python -m research.first_chunk --model smollm2 --ratio 0.10
    python -m research.first_chunk --model gemma3-270m --ratio 0.10 --candidates passage opening/passage opening
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time

from benchmarks.common import GREEDY_TOKENS, RUNS_DIR, SYSTEM, command_line, squad_prompts, write_report
from benchmarks.models import MODELS, model_path
from ragblend import BlendEngine, Chunk, FullRecompute, QueryAware
from ragblend.core.calibration.metrics import answer_kls, answer_logits, first_token_kl
from ragblend.core.prompt import CHUNK_CONTEXT
from ragblend.data import sample_dir

from .sample_questions import questions, reversed_chunks, user_prompt

PLAIN_PASSAGE = (   # CHUNK_CONTEXT without its numbers and centuries
    "The river rises in a range of low hills and flows a long way before it reaches the sea. In its upper "
    "course it runs quickly through narrow valleys, where small mills were built long ago; further down it "
    "widens and slows, and the plain on either side has been farmed for generations. Several towns grew up at "
    "places where the river could be crossed, and some of them became regional markets. Later a canal was cut "
    "to link the river with a neighbouring valley, and a railway followed the same route. Today the lower "
    "valley is known for its orchards and for a wetland reserve near the estuary, which is visited by "
    "migrating birds in spring and autumn.")
LLAMAINDEX_HEADER = "Context information is below.\n---------------------"
CONTEXTS = {
    "passage": CHUNK_CONTEXT,
    "opening": "",
    "passage without numbers": PLAIN_PASSAGE,
    "LlamaIndex header + passage": LLAMAINDEX_HEADER + "\n" + CHUNK_CONTEXT,
    "two passages": CHUNK_CONTEXT + "\n\n" + PLAIN_PASSAGE,
    "first sentence": CHUNK_CONTEXT.split(". ")[0] + ".",
    "first three sentences": ". ".join(CHUNK_CONTEXT.split(". ")[:3]) + ".",
    "LlamaIndex header": LLAMAINDEX_HEADER,
}
CANDIDATES = [*CONTEXTS, "opening/passage", "passage/opening"]


class Candidates:
    """One engine per chunk context (memory-only stores, no lead entries of their own)."""

    def __init__(self, path):
        self.path, self.engines = path, {}

    def engine(self, context: str) -> BlendEngine:
        if context not in self.engines:
            self.engines[context] = BlendEngine.from_pretrained(self.path, kv_dir=False, lead_chunk_kv=False,
                                                                chunk_context=CONTEXTS[context])
        return self.engines[context]

    def staged(self, candidate: str, chunks: list[list[int]]) -> BlendEngine:
        """The engine to fuse with, its store holding each chunk's entry as ``candidate`` says."""
        first, _, rest = candidate.partition("/")
        engine = self.engine(rest or first)
        for i, ids in enumerate(chunks):   # every time: an earlier candidate may have staged others
            source = self.engine(first if i == 0 else rest or first)
            key = engine.ingestion.key_for(ids)
            engine.store.delete(key)
            engine.store.put(dataclasses.replace(source.ingestion.compute_entry(list(ids)), key=key))
        return engine


def reference(engine, prompt, noise_prompt, system: dict, gold: str | None = None) -> dict:
    """Full prefill's first-token logits and answer, and the order noise's scores against them."""
    full = engine.prefill(prompt, strategy=FullRecompute(), **system)
    answer = engine.generate(prompt, strategy=FullRecompute(), max_new_tokens=GREEDY_TOKENS, **system)
    ref = {"logits": full.logits, "answer": answer.token_ids, "steps": answer_logits(engine, full, answer.token_ids)}
    ref["noise"] = score(engine, noise_prompt, FullRecompute(), ref, system, gold)
    return ref


def score(engine, prompt, strategy, ref, system, gold: str | None = None) -> dict:
    pre = engine.prefill(prompt, strategy=strategy, **system)
    kls = answer_kls(ref["steps"], answer_logits(engine, pre, ref["answer"]))
    row = {"first": first_token_kl(ref["logits"], pre.logits), "answer": kls["answer_kl"], "peak": kls["answer_kl_peak"]}
    if gold is not None:
        text = engine.generate(prompt, strategy=strategy, max_new_tokens=GREEDY_TOKENS, **system).text
        row["has"] = gold.lower() in text.lower()
    return row


def summary(rows: list[dict], key: str) -> str:
    values = [r[key] for r in rows]
    return f"{statistics.mean(values):.4f} / {statistics.median(values):.4f}"


def main(argv=None) -> None:
    from ragblend.integrations.local_index import LocalIndex

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=MODELS)
    parser.add_argument("--ratio", type=float, default=0.10)
    parser.add_argument("--candidates", nargs="+", default=CANDIDATES, choices=CANDIDATES)
    parser.add_argument("--squad", type=int, default=12, help="SQuAD prompts")
    parser.add_argument("--out", default=RUNS_DIR)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    candidates = Candidates(model_path(args.model))
    base = candidates.engine("passage")
    with tempfile.TemporaryDirectory() as folder:
        rag = LocalIndex(folder, engine=base)
        rag.ingest([sample_dir()], show_progress=False)
        user = [(user_prompt(rag, q), gold) for q, gold in questions()]
    user = [(p, gold, reference(base, p, reversed_chunks(p), {}, gold)) for p, gold in user]
    squad = []
    for prompt in squad_prompts(args.squad):
        segments = [Chunk(c) for c in prompt.chunks] + [prompt.question]
        squad.append((segments, reference(base, segments, segments[-2::-1] + segments[-1:], {"system": SYSTEM})))
    lines = [f"SQuAD: {args.squad} prompts; user path: the 8 sample questions. QueryAware({args.ratio:.2f}); "
             "KL mean / median.", "",
             "| chunks precomputed after | user path: has the answer | answer KL | largest step | "
             "SQuAD first-token KL | SQuAD answer KL |", "|---|---:|---:|---:|---:|---:|"]

    def line(name, user_rows, squad_rows):
        lines.append(f"| {name} | {sum(r['has'] for r in user_rows)} of {len(user_rows)} | {summary(user_rows, 'answer')} | "
                     f"{summary(user_rows, 'peak')} | {summary(squad_rows, 'first')} | {summary(squad_rows, 'answer')} |")
        print(lines[-1], flush=True)

    line("order noise (full prefill, chunks reversed)", [ref["noise"] for _, _, ref in user],
         [ref["noise"] for _, ref in squad])
    for name in args.candidates:
        strategy = QueryAware(args.ratio)
        user_rows = [score(candidates.staged(name, [s.token_ids for s in p.chunk_spans]), p, strategy, ref, {}, gold)
                     for p, gold, ref in user]
        squad_rows = [score(candidates.staged(name, [base.tokenize(s.text) for s in segments[:-1]]), segments,
                            strategy, ref, {"system": SYSTEM}) for segments, ref in squad]
        line(name, user_rows, squad_rows)
    write_report(args.out, f"first-chunk-{args.model}.md", f"What chunks are precomputed after, the first apart, {args.model}",
                 command_line("research.first_chunk", argv), time.perf_counter() - started, lines)


if __name__ == "__main__":
    main()
