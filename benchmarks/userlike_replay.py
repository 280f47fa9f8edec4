"""Replay a user-like run's prompts (``python -m benchmarks.userlike --replay ROWS.json``).

Each stored row names its set, chunk size, top-k and question: the same corpus split the same
way and retrieved the same way gives the same prompt (its token count is checked against the
row's). Only the default is measured again, through the query engine as the user gets it, and
beside it any ``--candidates`` selections; full prefill's and the order noise's answers are the
row's own (greedy, so deterministic), and full prefill's first-token logits are computed once
more for the KL. About a third of a full run's time, so rules can be judged on every prompt.

Per prompt it also says where the gold answer sits (which retrieved chunk, at which prompt
position) and how many of that chunk's tokens the default recomputed: the diagnosis of a lost
answer (issue 59).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from ragblend import BlendEngine, FullRecompute
from ragblend.core.calibration.metrics import first_token_kl
from ragblend.core.fusion.selection import QuestionAttention
from ragblend.core.fusion.strategies import PER_CHUNK, QueryAware

from .common import GREEDY_TOKENS, SQUAD_SHIFTS, answer_contained, best_over_answers, repeats


class Recorded(QuestionAttention):
    """QueryAware's selection (``QuestionAttention``'s arguments) remembering what it chose in ``last``."""

    def __init__(self, ratio: float, **settings):
        super().__init__(ratio, **settings)
        self.last = None

    @classmethod
    def like(cls, selection: QuestionAttention) -> "Recorded":
        return cls(selection.ratio, whole_chunks=selection.whole_chunks, query_tokens=selection.query_tokens,
                   cached_attention_scale=selection.cached_attention_scale,
                   neighbour_window=selection.neighbour_window, sentence_runs=selection.sentence_runs,
                   per_chunk=selection.per_chunk)

    spread = False   # each chunk's per_chunk most attended tokens first, the rest of the budget anywhere

    def first(self, prompt, probe):
        self.last = (self.spread_first(prompt, probe) if self.spread else super().first(prompt, probe)).cpu()
        return self.last

    def spread_first(self, prompt, probe):
        """A candidate: the question's attention falls mostly on the last chunk (recency), so the
        floor goes to each chunk's own most attended tokens before the rest goes anywhere."""
        budget = self.budget(prompt.num_reused, len(prompt.spans))
        relevance = self.scores(prompt, probe())
        chosen = torch.zeros(prompt.num_reused, dtype=torch.bool, device=relevance.device)
        each, start = min(self.per_chunk, budget // max(1, len(prompt.spans))), 0
        for span in prompt.spans:
            top = torch.topk(relevance[start:start + span.num_tokens], min(each, span.num_tokens)).indices
            chosen[start + top] = True
            start += span.num_tokens
        remaining = budget - int(chosen.sum())
        if remaining > 0:
            chosen[torch.topk(relevance.masked_fill(chosen, float("-inf")), remaining).indices] = True
        return prompt.with_reused(prompt.reused_pos[chosen])


def candidate(text: str) -> Recorded:
    """``"0.2"``: QueryAware(0.2) as shipped (its per-chunk floor :data:`PER_CHUNK`); ``"0.1/32"``:
    at least 32 tokens a chunk (``"0.1/0"``: the ratio alone); ``"0.1/24s"``: each chunk's 24 first."""
    ratio, _, per_chunk = text.partition("/")
    chosen = Recorded.like(QueryAware(float(ratio), per_chunk=int(per_chunk.rstrip("s") or PER_CHUNK)).selection())
    chosen.spread = per_chunk.endswith("s")
    return chosen


def gold_site(engine: BlendEngine, layout, texts: list[str], gold: list[str]) -> tuple[int | None, int | None]:
    """(retrieved chunk, prompt position) of the first gold answer found in the retrieved texts."""
    for answer in gold:
        for i, text in enumerate(texts):
            at = text.lower().find(answer.lower())
            if at >= 0 and i < len(layout.chunk_spans):
                return i, layout.chunk_spans[i].start + len(engine.tokenize(text[:at]))
    return None, None


def chunk_counts(layout, chosen: torch.Tensor | None) -> list[int]:
    """How many of each chunk's tokens ``chosen`` (bool over the prompt) recomputes."""
    if chosen is None:
        return []
    return [int(chosen[s.start:s.end].sum()) for s in layout.chunk_spans]


def replay_row(engine, llm, query_engine, row: dict, candidates: dict[str, Recorded], default: Recorded) -> dict:
    """One stored row again: the default through the query engine, full prefill's logits, the
    candidates' answers, and where the gold answer sits."""
    from llama_index.core.schema import MetadataMode

    response = query_engine.query(row["question"])
    call = llm.calls[-1]
    layout = call.layout if call.layout is not None else engine.find_chunks(call.prompt)
    full = engine.prefill(layout, strategy=FullRecompute())
    fused = engine.prefill(layout, strategy=default)
    texts = [n.node.get_content(metadata_mode=MetadataMode.LLM) for n in response.source_nodes]
    gold_chunk, gold_at = gold_site(engine, layout, texts, row["gold"])
    counts = chunk_counts(layout, default.last)
    answer = str(response)
    out = {"tokens_now": len(layout.token_ids), "same_prompt": len(layout.token_ids) == row["tokens"],
           "reproduced": answer == row["always_answer"], "chunk_tokens": [s.end - s.start for s in layout.chunk_spans],
           "gold_chunk": gold_chunk, "gold_at": gold_at, "recomputed_per_chunk": counts,
           "gold_recomputed": None if gold_at is None or default.last is None else bool(default.last[gold_at]),
           "full_ttft_now": full.stats.ttft_s,
           **measured("default", row, answer, first_token_kl(full.logits, fused.logits), call.stats)}
    out |= fallback_of(engine, layout, call.stats)
    for name, selection in candidates.items():
        gen = engine.generate(layout, strategy=selection, max_new_tokens=GREEDY_TOKENS)
        out |= measured(name, row, gen.text, first_token_kl(full.logits, gen.logits), gen.stats)
    return out


def fallback_of(engine, layout, stats) -> dict:
    """Whether the default's answer fell back to the exact path (a loop began: core.decode.repeats), and
    where it did, the answer it gave without that guard (greedy: what it gave before the guard existed)."""
    out = {"default_fallback": stats.fusion_fallback, "default_fallback_tokens": stats.fallback_tokens,
           "default_unguarded_answer": None, "default_unguarded_repeats": None}
    if stats.fusion_fallback:
        rule, engine.answers.repeat_rule = engine.answers.repeat_rule, None
        try:
            before = engine.generate(layout, max_new_tokens=GREEDY_TOKENS)
        finally:
            engine.answers.repeat_rule = rule
        out["default_unguarded_answer"], out["default_unguarded_repeats"] = before.text, repeats(before.text)
    return out


def measured(name: str, row: dict, text: str, kl: float, stats) -> dict:
    return {f"{name}_answer": text, f"{name}_right": best_over_answers(answer_contained, text, row["gold"]),
            f"{name}_repeats": repeats(text), f"{name}_kl": kl, f"{name}_ttft": stats.ttft_s,
            f"{name}_recomputed": stats.recomputed_tokens}


def replay(args, lock) -> list[dict]:
    """Every row of ``args.replay`` (in ``args.buckets``) replayed; written to ``args.json`` as they come."""
    from ragblend import BlendLLM
    from ragblend.integrations.local_index import default_embed_model

    from .models import model_path
    from .userlike import Index, sample_corpus, squad_corpus

    saved = json.loads(Path(args.replay).read_text())["rows"]
    rows = [r for r in saved if any(low <= r["tokens"] < high for low, high in args.buckets)][args.first:args.last]
    candidates = {text: candidate(text) for text in args.candidates}
    started, out = time.monotonic(), []
    with lock.hold():
        engine = BlendEngine.from_pretrained(model_path(rows[0]["model"]), kv_dir=False, prefix_cache_bytes=0)
    default = Recorded.like(engine.resolve().selection)   # the engine's own, remembering what it chose
    llm, embed = BlendLLM(engine=engine, max_new_tokens=GREEDY_TOKENS), default_embed_model()
    corpora = {"sample": sample_corpus()[0],
               **{path.stem.split("_v")[0]: squad_corpus(path, args.questions)[0] for path in SQUAD_SHIFTS if path.exists()}}
    indexes: dict = {}
    for i, row in enumerate(rows):
        key = row["set"], row["chunk_size"]
        with lock.hold():
            if key not in indexes:
                indexes[key] = Index(engine, corpora[row["set"]], row["chunk_size"], embed)
            if i == 0:   # a process's first prefills pay its warm-up
                replay_row(engine, llm, indexes[key].query_engine(llm, row["top_k"]), row, {}, default)
            new = replay_row(engine, llm, indexes[key].query_engine(llm, row["top_k"]), row, candidates, default)
        out.append(row | new)
        print(json.dumps({k: new[k] for k in ("tokens_now", "same_prompt", "reproduced", "chunk_tokens", "gold_chunk",
                                              "gold_at", "recomputed_per_chunk")}
                         | {f"{n}_right": new[f"{n}_right"] for n in ["default", *candidates]}
                         | {"default_fallback": new["default_fallback"], "default_repeats": new["default_repeats"]}
                         | {"full_right": row["full_right"], "minutes": round((time.monotonic() - started) / 60, 2)}),
              flush=True)
        if args.json:
            args.json.write_text(json.dumps({"rows": out, "candidates": list(candidates)}, indent=1))
    return out


def replay_table(rows: list[dict], names: list[str], buckets) -> list[str]:
    """Per bucket and setting (the default replayed, each candidate): gold accuracy against full
    prefill's (lost / gained), first-token KL against the order noise, new repeats, TTFT ratio and
    share of reused tokens recomputed."""
    lines = [f"Replayed {len(rows)} prompts: {sum(r['same_prompt'] for r in rows)} the same prompt (token count), "
             f"{sum(r['reproduced'] for r in rows)} with the stored default answer.", "",
             "| prompt tokens | prompts | setting | right / full (lost, gained) | order noise right | KL mean / median | "
             "noise KL mean / median | new repeats | TTFT full / setting (median) | recomputed (median) |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for low, high in buckets:
        bucket = [r for r in rows if low <= r["tokens"] < high]
        if not bucket:
            continue
        noise = [r["noise_kl"] for r in bucket if r["noise_kl"] is not None]
        for name in ["default", *names]:
            right = [r[f"{name}_right"] for r in bucket]
            lost = sum(bool(r["full_right"] and not r[f"{name}_right"]) for r in bucket)
            gained = sum(bool(r[f"{name}_right"] and not r["full_right"]) for r in bucket)
            kl = [r[f"{name}_kl"] for r in bucket]
            lines.append(
                f"| {low}-{high} | {len(bucket)} | {name} | {sum(right):g} / {sum(r['full_right'] for r in bucket):g} "
                f"({lost}, {gained}) | {sum(r['noise_right'] or 0 for r in bucket):g} | "
                f"{statistics.mean(kl):.4f} / {statistics.median(kl):.4f} | "
                f"{statistics.mean(noise):.4f} / {statistics.median(noise):.4f} | "
                f"{sum(r[f'{name}_repeats'] and not r['full_repeats'] for r in bucket)} | "
                f"{statistics.median(r['full_ttft_now'] / r[f'{name}_ttft'] for r in bucket):.2f}x | "
                f"{statistics.median(r[f'{name}_recomputed'] / r['tokens'] for r in bucket):.1%} |")
    return lines + fallback_lines(rows, buckets)


def fallback_lines(rows: list[dict], buckets) -> list[str]:
    """Per bucket: the default's answers that fell back to the exact path (a loop began), and how many of
    them repeated (benchmarks.common.repeats) without the guard, with it, and in full prefill's answer."""
    lines = []
    for low, high in buckets:
        fell = [r for r in rows if low <= r["tokens"] < high and r.get("default_fallback")]
        if fell:
            lines.append(f"{low}-{high}: {len(fell)} default answer(s) fell back to the exact path; repeating without "
                         f"the guard {sum(bool(r['default_unguarded_repeats']) for r in fell)}, with it "
                         f"{sum(r['default_repeats'] for r in fell)}, full prefill's {sum(r['full_repeats'] for r in fell)}")
    return ["", *lines] if lines else []
