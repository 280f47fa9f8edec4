"""Fidelity of the fused prefill against the model's own order noise, per strategy and budget.

For every prompt: a full prefill (the reference), a full prefill of the same chunks in reversed
order (the order noise: how far the model itself moves when nothing but the chunk order
changes), and each strategy. Per strategy it reports the compute used (token-layers computed,
as a share of a full prefill's, choosing included), first-token KL to the reference (mean and
median), and ROUGE-L of the greedy answer against the reference's. A strategy whose numbers
stay within the order noise answers like a full prefill.

Prompt sets: ``fidelity`` (the project's 6 ~500-token passages, rotated, ~3.1k tokens),
``squad`` (SQuAD-format: a SQuAD-shifts Reddit question, its paragraph and 5 others, ~1k tokens) and
``musique`` (the CacheBlend paper's workload: 10 passages, ~5.5k tokens; read from ``--musique-file``,
skipped when absent).

    python -m benchmarks.fidelity --models smollm2 --sets fidelity:3 squad:32
    python -m benchmarks.fidelity --device cuda --sets fidelity:6 squad:48 musique:16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ragblend import BlendEngine, CacheBlend, Chunk, FullRecompute, FullReuse, QueryAware
from ragblend.core.calibration.metrics import answer_kls, answer_logits, first_token_kl
from ragblend.core.fusion.selection import QuestionAttention

from .common import (
    MUSIQUE,
    RUNS_DIR,
    SYSTEM,
    Prompt,
    answer_contained,
    best_over_answers,
    command_line,
    first_token_and_answer,
    in_every,
    pool_by_set,
    prefix_options,
    prompt_sets,
    repeats,
    rouge_l,
    write_report,
)
from .models import MODELS, model_path


class QuestionAttentionInRuns(QuestionAttention):
    """QueryAware's selection with the question's relevance pooled over a window along each
    chunk before the top ``ratio`` are chosen (the library's ``neighbour_window``, here also
    as a fixed number of tokens, and max-pooled), so that the recomputed tokens come in runs
    with their neighbours: a study of the outliers where recomputing single tokens answered
    further from full prefill than recomputing none (docs/benchmarks.md).

    ``run``: the window in tokens (an int) or as a fraction of each chunk (a float below 1).
    ``pool``: ``"mean"`` ranks a token by its window's average (where relevance is dense);
    ``"max"`` by the highest relevance in its window, so that the budget goes to the strongest
    single tokens each with its neighbours (the peak first); ``"half"`` by half its own relevance
    plus half its window's average, so that a strong token alone and a dense run both rank."""

    def __init__(self, ratio: float, run: int | float, pool: str = "mean", cached_attention_scale: float = 0.7):
        # a window in tokens still needs pooling switched on (any nonzero neighbour_window);
        # window() below then sizes it from ``run`` instead of the chunk's length
        super().__init__(ratio, cached_attention_scale=cached_attention_scale,
                         neighbour_window=run if isinstance(run, float) else 1.0)
        self.run, self.pooling = run, pool

    def window(self, num_tokens):
        return super().window(num_tokens) if isinstance(self.run, float) else self.run | 1

    def pool(self, claims, window):
        if self.pooling == "max":   # a peak's whole window ties; its own claim breaks the tie, peak first
            return F.max_pool1d(claims[None, None], window, stride=1, padding=window // 2)[0, 0, :claims.numel()] + 1e-3 * claims
        if self.pooling == "half":
            return 0.5 * claims + 0.5 * super().pool(claims, window)
        return super().pool(claims, window)


class QuestionAttentionWithHeads(QuestionAttention):
    """QueryAware's selection plus the first ``head`` tokens of every chunk but the first (Epic's
    LegoLink heads): on top of the ``ratio`` the question's attention chooses, or, ``within_budget``,
    out of it (each chunk its head first, an equal share where the budget cannot give each that
    many; the question's attention chooses the rest, so the compute is the ratio's). Issue 59's lost
    ferry answer came back with heads on top of 0.1 (docs/runs/userlike.md); held out, neither form
    beat QueryAware at its compute (docs/notes/answers-by-size.md)."""

    def __init__(self, ratio: float, head: int, within_budget: bool = False, cached_attention_scale: float = 0.7):
        super().__init__(ratio, cached_attention_scale=cached_attention_scale)
        self.head, self.within_budget = head, within_budget

    def heads(self, prompt, budget: int | None) -> list[int]:
        """Prompt positions of each chunk's head (a span starting inside its chunk counts the tokens before it)."""
        spans = prompt.spans[1:]
        each = self.head if budget is None or not spans else min(self.head, budget // len(spans))
        return [p for span in spans for p in range(span.start, span.start + min(max(0, each - span.offset), span.num_tokens))]

    def first(self, prompt, probe):
        if not self.within_budget:
            selected = super().first(prompt, probe)
            selected[self.heads(prompt, None)] = True
            return selected
        budget = self.budget(prompt.num_reused)
        if budget == 0:
            return prompt.with_reused(prompt.reused_pos[:0])
        relevance = self.scores(prompt, probe())
        rows = torch.searchsorted(prompt.reused_pos, torch.tensor(self.heads(prompt, budget), dtype=torch.long,
                                                                  device=prompt.reused_pos.device))
        chosen = torch.zeros(prompt.num_reused, dtype=torch.bool, device=relevance.device)
        chosen[rows] = True
        remaining = budget - int(chosen.sum())
        if remaining > 0:
            chosen[torch.topk(relevance.masked_fill(chosen, float("-inf")), remaining, sorted=False).indices] = True
        return prompt.with_reused(prompt.reused_pos[chosen])


VARIANTS = {
    "FullReuse": FullReuse(),
    "CacheBlend(0.15)": CacheBlend(0.15),
    "CacheBlend(0.30)": CacheBlend(0.30),
    "CacheBlend(0.50)": CacheBlend(0.50),
    "QueryAware(0.05)": QueryAware(0.05),
    "QueryAware(0.10)": QueryAware(0.10),
    "QueryAware(0.15)": QueryAware(0.15),
    "QueryAware(0.20)": QueryAware(0.20),
    "QueryAware(0.30)": QueryAware(0.30),
    "QueryAware(0.50)": QueryAware(0.50),
    **{f"QueryAware({r:.2f}, whole chunks)": QueryAware(r, whole_chunks=True) for r in (0.10, 0.15, 0.20, 0.30)},
    "QueryAware(0.15, last 4 tokens)": QueryAware(0.15, query_tokens=4),
    "QueryAware(0.20, last 4 tokens)": QueryAware(0.20, query_tokens=4),
    "QueryAware(0.30, last 4 tokens)": QueryAware(0.30, query_tokens=4),
    # APE's scaling of the attention paid to the reused tokens left out (cached_attention_scale)
    **{f"QueryAware({r:.2f}, cached x{s})": QueryAware(r, cached_attention_scale=s)
       for r in (0.05, 0.10, 0.15, 0.20, 0.30) for s in (1.0, 0.8, 0.7, 0.6, 0.5, 0.4)},
    # ... and in the answer's decoding too (scaled), or in the fused prefill only (unscaled)
    **{f"QueryAware({r:.2f}, decoding {'scaled' if scaled else 'unscaled'})": QueryAware(r, scale_in_decoding=scaled)
       for r in (0.10, 0.20) for scaled in (True, False)},
    # the recomputed tokens in runs of neighbours (QuestionAttentionInRuns)
    **{f"QueryAware({r:.2f}, runs of {n})": QuestionAttentionInRuns(r, n) for r in (0.10, 0.20) for n in (9, 17, 33)},
    **{f"QueryAware({r:.2f}, runs of 1/{d} chunk)": QuestionAttentionInRuns(r, 1 / d) for r in (0.10, 0.20) for d in (8, 16, 32)},
    # ... or half each token alone, half its run
    **{f"QueryAware({r:.2f}, half runs of 1/{d} chunk)": QuestionAttentionInRuns(r, 1 / d, pool="half")
       for r in (0.10, 0.20) for d in (16, 32)},
    # ... or by sentence (QueryAware's sentence_runs)
    **{f"QueryAware({r:.2f}, sentence runs)": QueryAware(r, sentence_runs=True) for r in (0.10, 0.20)},
    # ... or around the strongest single tokens (max-pooled: each peak with its neighbours)
    **{f"QueryAware({r:.2f}, peaks with {n})": QuestionAttentionInRuns(r, n, pool="max") for r in (0.10, 0.20) for n in (5, 9, 17, 33)},
    # the engine's own choice (its calibration's, else the safe default), as a user gets it
    "default": QueryAware(),
    # the ratio alone, without QueryAware.per_chunk's floor for each chunk (issue 59: docs/notes/answers-by-size.md)
    **{f"QueryAware({r:.2f}, ratio alone)": QueryAware(r, per_chunk=0) for r in (0.10, 0.20, 0.30)},
    # ... and the first tokens of every chunk but the first recomputed beside the chosen ones (issue 59's
    # lost ferry answer came back so: docs/runs/userlike.md)
    **{f"QueryAware({r:.2f}) + heads of {k}": QuestionAttentionWithHeads(r, k) for r in (0.10, 0.15) for k in (16, 32)},
    # ... or out of the budget (the ratio's compute)
    **{f"QueryAware({r:.2f}, chunk starts {k})": QuestionAttentionWithHeads(r, k, within_budget=True)
       for r in (0.10, 0.15, 0.20, 0.30) for k in (16, 32)},
}
NOISE = "order noise (full prefill, chunks reversed)"
PREFILL_ONLY = ", scale in the prefill only"
FADING = ", scale fading over the answer"
FADE_STEPS = 16   # the fading scale's bias shrinks linearly to none over the answer's first 16 tokens


def fading(step: int) -> float:
    """The factor on the cached-attention bias at answer step ``step`` (the FADING rows)."""
    return max(0.0, 1.0 - step / FADE_STEPS)


def measure(engine: BlendEngine, prompt: Prompt, variants: dict, greedy_tokens: int,
            answer_level: bool = False, kl_only: dict | None = None, logits: dict | None = None,
            prefills: dict | None = None) -> dict:
    """{variant: {"kl", "rouge", "compute", "same_first"}} for one prompt, order noise included.
    ``answer_level`` adds "answer_kl" (mean KL over the full prefill's greedy answer, teacher-forced:
    :func:`ragblend.core.calibration.metrics.answer_kl`) and "same_answer" (identical greedy answer), and
    for a strategy that scales the cached attention, rows with the scale in the prefill only and
    fading over the answer. ``kl_only``: more variants measured without a greedy answer of their
    own (KL and compute only; ROUGE-L nan). ``logits``, when given, receives each row's first-token
    logits (the reference's under "reference"); ``prefills`` (answer level), the Prefill of each
    row named in it already (its value is replaced)."""
    engine.precompute(prompt.chunks)
    segments = [Chunk(c) for c in prompt.chunks] + [prompt.question]
    reversed_segments = [Chunk(c) for c in reversed(prompt.chunks)] + [prompt.question]
    logits = {} if logits is None else logits

    def run(strategy, segs=segments):
        return first_token_and_answer(engine, segs, strategy, greedy_tokens)

    if answer_level:
        reference = engine.generate(segments, system=SYSTEM, strategy=FullRecompute(), max_new_tokens=greedy_tokens)
        answer_ids = reference.token_ids
        ref_steps = answer_logits(engine, engine.prefill(segments, system=SYSTEM, strategy=FullRecompute()),
                                  answer_ids)
        ref_logits, ref_text = reference.logits, reference.text
    else:
        ref_logits, _, ref_text = run(FullRecompute())
    logits["reference"] = ref_logits
    rows = {}
    runs = [*((name, strategy, True) for name, strategy in variants.items()), (NOISE, FullRecompute(), True),
            *((name, strategy, False) for name, strategy in (kl_only or {}).items())]
    for name, strategy, answers in runs:
        segs = reversed_segments if name == NOISE else segments
        if answers:
            out, stats, text = run(strategy, segs)
        else:
            pre = engine.prefill(segs, system=SYSTEM, strategy=strategy)
            out, stats, text = pre.logits, pre.stats, None
        logits[name] = out
        rows[name] = {"kl": first_token_kl(ref_logits, out), "compute": stats.compute_fraction,
                      "rouge": rouge_l(text, ref_text) if text is not None else float("nan"),
                      # the gold answer in the greedy answer, and whether it repeats itself (issue 59's rule)
                      "gold": gold_in(text, prompt.answers), "repeats": float(bool(text) and repeats(text)),
                      "same_first": float(out.argmax() == ref_logits.argmax()),
                      # fusion would have computed more than a prefill: its KL of 0 judges no fusion
                      "full_prefill": float(stats.fusion_skipped)}
        if name == NOISE:   # the reference's own answer, judged alike (beside the noise's row)
            rows[name] |= {"reference_gold": gold_in(ref_text, prompt.answers),
                           "reference_repeats": float(bool(ref_text) and repeats(ref_text))}
        if answer_level:
            if answers:
                pre = engine.prefill(segs, system=SYSTEM, strategy=strategy)
            if prefills is not None and name in prefills:
                prefills[name] = pre
            rows[name].update(answer_kls(ref_steps, answer_logits(engine, pre, answer_ids)),
                              same_answer=float(text == ref_text) if text is not None else float("nan"))
            if pre.key_bias is not None and answers:   # the attention scale kept out of the answer's steps
                unanswered = {**rows[name], "rouge": float("nan"), "same_answer": float("nan")}
                rows[name + PREFILL_ONLY] = {**unanswered, **answer_kls(
                    ref_steps, answer_logits(engine, pre, answer_ids, decoding_bias=False))}
                rows[name + FADING] = {**unanswered, **answer_kls(
                    ref_steps, answer_logits(engine, pre, answer_ids, decoding_bias=fading))}
    return rows


def gold_in(text: str | None, answers: list[str]) -> float:
    """1.0 when a gold answer is in ``text`` (nan without an answer or gold answers)."""
    if text is None or not answers:
        return float("nan")
    return best_over_answers(answer_contained, text, answers)


def table(results: list[dict], greedy_tokens: int) -> list[str]:
    """One row per strategy: means and medians over the prompts; with answer-level rows, also how
    many prompts' answer-level KL exceeds 3x the order noise's median (issue 29's outlier bound)."""
    answer_level = "answer_kl" in results[0][NOISE]
    peaks = "answer_kl_peak" in results[0][NOISE]   # runs before it was measured lack it
    head = "| strategy | compute | KL mean | KL median | first token same | ROUGE-L vs full |"
    rule = "|---|---:|---:|---:|---:|---:|"
    if answer_level:
        head += " answer KL mean | answer KL median | answer same | answer KL > 3x noise median |"
        rule += "---:|---:|---:|---:|"
        bound = 3 * statistics.median(r[NOISE]["answer_kl"] for r in results)
    if peaks:
        head += " largest step KL mean | largest step KL median |"
        rule += "---:|---:|"
    gold = "gold" in results[0][NOISE] and results[0][NOISE]["gold"] == results[0][NOISE]["gold"]
    if gold:   # runs before these columns lack them; fidelity prompts have no gold answers
        head += " gold answer | repeating answers |"
        rule += "---:|---:|"
    lines = [head, rule]
    for name in results[0]:
        col = {k: [r[name][k] for r in results] for k in results[0][name]}
        rouge = f"{statistics.mean(col['rouge']):.2f}" if greedy_tokens and col["rouge"][0] == col["rouge"][0] else "-"
        line = (f"| {name} | {statistics.mean(col['compute']):.1%} | {statistics.mean(col['kl']):.4f} | "
                f"{statistics.median(col['kl']):.4f} | {statistics.mean(col['same_first']):.0%} | {rouge} |")
        if answer_level:
            same = col["same_answer"]
            line += (f" {statistics.mean(col['answer_kl']):.4f} | {statistics.median(col['answer_kl']):.4f} | "
                     f"{f'{statistics.mean(same):.0%}' if same[0] == same[0] else '-'} | "
                     f"{sum(k > bound for k in col['answer_kl'])} |")
        if peaks:
            line += f" {statistics.mean(col['answer_kl_peak']):.3f} | {statistics.median(col['answer_kl_peak']):.3f} |"
        if gold:
            hits = [g for g in col.get("gold", []) if g == g]
            line += (f" {statistics.mean(hits):.0%} | {sum(col['repeats']):.0f} |" if hits else " - | - |")
        lines.append(line)
    if gold and "reference_gold" in results[0][NOISE]:
        lines += ["", f"Full prefill (the reference): gold answer "
                      f"{statistics.mean(r[NOISE]['reference_gold'] for r in results):.0%}, repeating answers "
                      f"{sum(r[NOISE]['reference_repeats'] for r in results):.0f}."]
    return lines + full_prefill_notes(results)


def full_prefill_notes(results: list[dict]) -> list[str]:
    """A line for each strategy that ran some prompts as exact full prefills (its chunks too short
    beside the rest of the prompt for fusion to save compute): those prompts' KL of 0 and compute
    of 100% judge no fusion, and a reader should know how many there were."""
    notes = []
    for name in results[0]:
        if name == NOISE:
            continue
        skipped = sum(r[name].get("full_prefill", 0.0) > 0 for r in results)
        if skipped:
            notes.append(f"{name}: {skipped} of {len(results)} prompts ran as a full prefill "
                         "(fusing would have computed more); their KL of 0 judges no fusion.")
    return ["", *notes] if notes else []


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--sets", nargs="+", default=["fidelity:3", "squad:32"],
                        help="prompt sets as NAME:COUNT (fidelity, squad, musique)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), help="strategies by their table name")
    parser.add_argument("--greedy-tokens", type=int, default=32, help="answer length for ROUGE-L (0: KL only)")
    parser.add_argument("--answer-level", action="store_true",
                        help="also answer-level KL (teacher-forced over the full prefill's greedy answer) and "
                             "identical answers; slower: one more prefill per strategy")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--musique-file", type=Path, default=MUSIQUE)
    parser.add_argument("--out", default=RUNS_DIR)
    parser.add_argument("--json", type=Path, help="also write every per-prompt row here")
    parser.add_argument("--from-json", type=Path, nargs="+",
                        help="tables of earlier --json files instead of a run, a set's prompts from several "
                             "runs pooled (e.g. musique:8 and musique:8-16)")
    parser.add_argument("--no-chunk-context", action="store_true",
                        help="precompute chunks right after the template's opening (chunk_context=''), as before")
    parser.add_argument("--no-lead-entries", action="store_true",
                        help="the first chunk fused from its own entry too (lead_chunk_kv=False), as before")
    args = parser.parse_args(argv)
    variants = {name: VARIANTS[name] for name in args.variants}
    t0 = time.perf_counter()
    lines, raw = [], {}
    if args.from_json:
        raw = pool_by_set(json.loads(path.read_text()) for path in args.from_json)
        for key, results in raw.items():
            common = in_every(results)   # the variants every run measured
            results = [{name: r[name] for name in results[0] if name in common} for r in results]
            lines += [f"## {key} ({len(results)} prompts, pooled)", "", *table(results, args.greedy_tokens), ""]
        print("\n".join(lines))
        write_report(args.out, "fidelity-run.md", "Fidelity against order noise",
                     command_line("benchmarks.fidelity", argv), time.perf_counter() - t0, lines)
        return
    for model in args.models:
        engine = BlendEngine.from_pretrained(model_path(model), kv_dir=False, device=args.device,
                                             **prefix_options(args))
        for set_name, prompts in prompt_sets(args.sets, args.musique_file).items():
            if not prompts:
                continue
            results = raw[f"{model}/{set_name}"] = []
            for i, prompt in enumerate(prompts):
                results.append(measure(engine, prompt, variants, args.greedy_tokens, args.answer_level))
                print(f"[{model}/{set_name}] {i + 1}/{len(prompts)}", flush=True)
                if args.json:   # after each prompt, so a run that is stopped keeps its rows
                    args.json.write_text(json.dumps(raw))
            lines += [f"## {model}: {set_name} ({len(prompts)} prompts)", "", *table(results, args.greedy_tokens), ""]
            print("\n".join(lines[-len(results[0]) - 4:]), flush=True)
            # Written after each set, so a long run that is stopped keeps what it measured.
            write_report(args.out, "fidelity-run.md", "Fidelity against order noise",
                         command_line("benchmarks.fidelity", argv), time.perf_counter() - t0, lines)
            if args.json:
                args.json.write_text(json.dumps(raw))
        del engine


if __name__ == "__main__":
    main()
