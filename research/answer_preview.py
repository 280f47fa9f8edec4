"""Would the answer's own attention choose better tokens to recompute than the question's?

QueryAware ranks each reused token by the question's attention to it in a first pass over the
cached chunks. The answer's tokens may look elsewhere (where the answer's facts are), and the
outliers of issue 29 drift over the answer, not at its first token. This study adds the
attention of the answer's first ``k`` tokens, placed after the prompt in that first pass, to
the question's, then fuses with the same budget:

* ``oracle k``: full prefill's own greedy answer (what a selection cannot know);
* ``preview k``: the greedy answer of the first pass itself (FullReuse: cheap, knowable).

Per prompt: answer-level KL over full prefill's 32-token answer (teacher-forced), its largest
step, and first-token KL, against the shipped ``QueryAware(ratio)``. The compute of the rows with
a given relevance leaves out the first pass that measured it (run apart here).

    python -m research.answer_preview --model qwen2.5-0.5b --set fidelity:2-3 --ratio 0.20 --k 4 8 16
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from benchmarks.common import MUSIQUE, RUNS_DIR, SYSTEM, command_line, prompt_sets, write_report
from benchmarks.models import MODELS, model_path
from ragblend import BlendEngine, Chunk, FullRecompute, FullReuse, QueryAware
from ragblend.core.calibration.metrics import answer_kls, answer_logits, first_token_kl
from ragblend.core.fusion.selection import QuestionAttention


class GivenRelevance(QuestionAttention):
    """QueryAware's selection (at QueryAware's default attention scale) on a relevance given in
    advance instead of its first pass's. With ``relevance=None`` it runs as QueryAware and keeps
    the relevance its pass measured: one prompt per instance."""

    def __init__(self, ratio: float, relevance=None):
        super().__init__(ratio, cached_attention_scale=QueryAware(ratio).cached_attention_scale)
        self.relevance = relevance

    def first(self, prompt, probe):
        if self.relevance is None:
            self.relevance = probe()
        return super().first(prompt, lambda: self.relevance)


def relevance_with_answer(engine: BlendEngine, layout, answer_ids: list[int], ratio: float):
    """The first pass's relevance over the prompt followed by ``answer_ids``: the attention of
    the question and of those answer tokens (every token after the last chunk counts). A whole
    fused prefill runs to get it (its result is not used: a study, not a selection to ship)."""
    recorder = GivenRelevance(ratio)
    engine.prefill(dataclasses.replace(layout, token_ids=list(layout.token_ids) + list(answer_ids)), strategy=recorder)
    return recorder.relevance


def measure(engine: BlendEngine, prompt, ratio: float, ks: list[int]) -> dict:
    engine.precompute(prompt.chunks)
    segments = [Chunk(c) for c in prompt.chunks] + [prompt.question]
    reference = engine.generate(segments, system=SYSTEM, strategy=FullRecompute(), max_new_tokens=32)
    answer = reference.token_ids
    ref_steps = answer_logits(engine, engine.prefill(segments, system=SYSTEM, strategy=FullRecompute()), answer)
    layout = engine.prompts.build(segments, SYSTEM)
    rows = {}

    def row(name, strategy):
        pre = engine.prefill(layout, strategy=strategy)
        rows[name] = {**answer_kls(ref_steps, answer_logits(engine, pre, answer)),
                      "kl": first_token_kl(reference.logits, pre.logits), "compute": pre.stats.compute_fraction}

    row("shipped", QueryAware(ratio))
    preview = engine.generate(segments, system=SYSTEM, strategy=FullReuse(), max_new_tokens=max(ks)).token_ids
    for k in ks:
        row(f"oracle {k}", GivenRelevance(ratio, relevance_with_answer(engine, layout, answer[:k], ratio)))
        row(f"preview {k}", GivenRelevance(ratio, relevance_with_answer(engine, layout, preview[:k], ratio)))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-0.5b", choices=MODELS)
    parser.add_argument("--set", default="fidelity:6", help="a prompt set as NAME:COUNT or NAME:FROM-TO")
    parser.add_argument("--ratio", type=float, default=0.20)
    parser.add_argument("--k", type=int, nargs="+", default=[4, 8, 16], help="answer tokens whose attention counts")
    parser.add_argument("--out", default=RUNS_DIR)
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    engine = BlendEngine.from_pretrained(model_path(args.model), kv_dir=False)
    lines = [f"## {args.model}, {args.set}, QueryAware({args.ratio})", "",
             "| prompt | selection | answer KL | largest step | first-token KL | compute |", "|---|---|---:|---:|---:|---:|"]
    results = []
    count = args.set.partition(":")[2]
    first = int(count.split("-")[0]) if "-" in count else 0   # fidelity:2-3 starts at the set's third prompt
    for set_name, prompts in prompt_sets([args.set], MUSIQUE).items():
        for i, prompt in enumerate(prompts, start=first):
            results.append(measure(engine, prompt, args.ratio, args.k))
            lines += [f"| {set_name} {i + 1} | {name} | {r['answer_kl']:.4f} | {r['answer_kl_peak']:.3f} | "
                      f"{r['kl']:.4f} | {r['compute']:.1%} |" for name, r in results[-1].items()]
            print("\n".join(lines[-len(results[-1]):]), flush=True)
    if len(results) > 1:
        lines += ["", "| selection | answer KL mean / median |", "|---|---:|"]
        for name in results[0]:
            values = [r[name]["answer_kl"] for r in results]
            lines.append(f"| {name} | {statistics.mean(values):.4f} / {statistics.median(values):.4f} |")
    print("\n".join(lines))
    write_report(args.out, "answer-preview-run.md", "Answer preview", command_line("research.answer_preview", argv),
                 time.perf_counter() - t0, lines)


if __name__ == "__main__":
    main()
