"""Per-query adaptive recompute (issue 29, item 2): does a cheap signal of the fused prefill
predict the prompts it fuses badly, and what would escalating on it cost?

For every prompt it runs :func:`benchmarks.fidelity.measure` at the answer level: full prefill
(the reference), the order noise, the model's shipped strategy (its calibrated
``QueryAware`` ratio, scale 0.7) with its greedy answer, and a ladder of higher ratios (KL
only). The shipped strategy runs through a selection that keeps what the question pass saw, so
that each prompt also gets the candidate signals:

* ``left_mass``: the share of the question's attention (summed over layers) on reused tokens
  left cached; known *before* the fused pass, so escalating on it wastes nothing;
* ``left_mass_deep``: the same over the deeper half of the layers;
* ``relevance_entropy``: how spread the question's attention over the reused tokens is (0-1);
* ``probe_kl``: first-token KL between the question pass (the cached chunks as they are, what
  :class:`~ragblend.FullReuse` computes) and the fused result: how far recomputing moved it;
* ``fused_entropy`` and ``fused_margin`` (1 - top-1 + top-2 probability) of the fused logits;
* ``probe_flip``: the question pass's top token differs from the fused one;
* ``selected_deviation``: how far the recomputed reused tokens' K/V moved from their cache
  (squared distance over squared norm, all layers), CacheBlend's score on the tokens chosen;
* ``reused_tokens``: the prompt's reused tokens (a baseline that knows nothing of the prompt).

Then: each signal's AUROC for "answer KL above the set's order-noise median" (and for first-token
KL above the noise's median, and answer KL above 3x it), per set and pooled; and escalation
policies: a threshold chosen on one set (``--tune``) so that the average compute matches a fixed
ratio's there, tested on the other sets against that fixed ratio.

    python -m research.adaptive --models smollm2 --sets squad:12 musique:8 fidelity:6 --json /tmp/a.json
    python -m research.adaptive --from-json /tmp/a.json     # the analysis again, no model run
    python -m research.adaptive --from-json /tmp/a.json /tmp/b.json   # b.json: more prompts (--sets musique:8-12)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import MUSIQUE, RUNS_DIR, command_line, in_every, pool_by_set, prompt_sets, write_report
from benchmarks.fidelity import NOISE, measure, table
from benchmarks.models import MODELS, model_path
from ragblend import BlendEngine, FullReuse, QueryAware
from ragblend.core.calibration.metrics import first_token_kl
from ragblend.core.fusion.selection import QuestionAttention

SIGNALS = ("left_mass", "left_mass_deep", "relevance_entropy", "probe_kl", "fused_entropy", "fused_margin",
           "probe_flip", "selected_deviation", "reused_tokens")
POLICY_SIGNALS = ("left_mass", "probe_kl", "selected_deviation", "fused_margin", "reused_tokens")   # the escalation tables' signals
PROBE = "FullReuse (the question pass)"


class RecordingQuestionAttention(QuestionAttention):
    """QueryAware's selection, keeping what its question pass saw: the relevance of each reused
    token at each layer and the tokens chosen (for the signals; it selects exactly as QueryAware)."""

    def first(self, prompt, probe):
        seen = {}

        def recording_probe():
            seen["relevance"] = probe()
            return seen["relevance"]

        selected = super().first(prompt, recording_probe)
        self.relevance = seen.get("relevance")
        self.left_out = ~selected[prompt.reused_pos]   # per reused token: left cached
        return selected


def signals(recorder: RecordingQuestionAttention, fused, probe) -> dict:
    """The candidate signals of one prompt (module docstring) from the shipped strategy's
    Prefill ``fused`` and the question pass's (FullReuse) ``probe``; higher means riskier."""
    relevance, left = recorder.relevance.float(), recorder.left_out
    layers = relevance.sum(dim=1) > 0                  # layers where the question attended
    per_layer_left = (relevance[:, left].sum(dim=1))[layers]
    total = relevance.sum(dim=0)
    p = total / total.sum().clamp_min(1e-12)
    entropy = -(p * p.clamp_min(1e-12).log()).sum().item() / math.log(max(2, p.numel()))
    probs = torch.softmax(fused.logits.float(), -1)
    top = torch.topk(probs, 2).values
    # The recomputed reused tokens: FullReuse keeps their cached K/V (rotated alike, so distances hold).
    reused = probe.recomputed.logical_not()
    chosen = fused.recomputed & reused
    moved = sum((fk[:, chosen] - pk[:, chosen]).float().pow(2).sum() + (fv[:, chosen] - pv[:, chosen]).float().pow(2).sum()
                for fk, fv, pk, pv in zip(fused.keys, fused.values, probe.keys, probe.values))
    size = sum(pk[:, chosen].float().pow(2).sum() + pv[:, chosen].float().pow(2).sum()
               for pk, pv in zip(probe.keys, probe.values))
    return {"left_mass": per_layer_left.mean().item(),
            "left_mass_deep": per_layer_left[per_layer_left.numel() // 2:].mean().item(),
            "relevance_entropy": entropy,
            "probe_kl": first_token_kl(fused.logits, probe.logits),
            "fused_entropy": -(probs * probs.clamp_min(1e-12).log()).sum().item(),
            "fused_margin": 1.0 - (top[0] - top[1]).item(),
            "probe_flip": float(fused.logits.argmax() != probe.logits.argmax()),
            "selected_deviation": (moved / size.clamp_min(1e-12)).item() if bool(chosen.any()) else 0.0,
            "reused_tokens": float(left.numel())}


def auroc(scores: list[float], labels: list[bool]) -> float:
    """Probability that a random positive scores above a random negative (ties count half);
    nan without both classes. Prompts without the signal (None: an older run) are left out."""
    pos = [s for s, y in zip(scores, labels) if y and s is not None]
    neg = [s for s, y in zip(scores, labels) if not y and s is not None]
    if not pos or not neg:
        return float("nan")
    wins = sum((a > b) + 0.5 * (a == b) for a in pos for b in neg)
    return wins / (len(pos) * len(neg))


LABELS = {
    "answer": "answer KL above the set's order-noise median",
    "first": "first-token KL above the set's order-noise median",
    "prompt": "answer KL above the same prompt's order noise",
    "top": "answer KL in the set's top quarter",
}


def labels(rows: list[dict], shipped: str, kind: str) -> list[bool]:
    """Per prompt: is the shipped strategy a bad fusion, as ``kind`` (a key of LABELS, or
    "outlier": answer KL above 3x the set's order-noise median) says?"""
    answer = [r["rows"][shipped]["answer_kl"] for r in rows]
    if kind == "prompt":
        return [a > r["rows"][NOISE]["answer_kl"] for a, r in zip(answer, rows)]
    if kind == "top":
        cut = sorted(answer, reverse=True)[max(0, math.ceil(len(answer) / 4) - 1)]
        return [a >= cut for a in answer]
    key, factor = {"answer": ("answer_kl", 1), "first": ("kl", 1), "outlier": ("answer_kl", 3)}[kind]
    bound = factor * statistics.median(r["rows"][NOISE][key] for r in rows)
    return [r["rows"][shipped][key] > bound for r in rows]


def spearman(xs: list[float], ys: list[float]) -> float:
    """Rank correlation (average ranks for ties); pairs without the signal (None) left out."""
    pairs = [(x, y) for x, y in zip(xs, ys) if x is not None]
    xs, ys = [x for x, _ in pairs], [y for _, y in pairs]
    if len(pairs) < 3:
        return float("nan")
    def ranks(values):
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    norm = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / norm if norm else float("nan")


def auroc_table(raw: dict, shipped_of: dict) -> list[str]:
    """Per set: each signal's AUROC for each label, and its rank correlation with the answer KL."""
    lines = ["| model/set (prompts) | label (positives) | " + " | ".join(SIGNALS) + " |",
             "|---|---|" + "---:|" * len(SIGNALS)]
    for key, rows in raw.items():
        shipped = shipped_of[key.split("/")[0]]
        for kind in LABELS:
            ys = labels(rows, shipped, kind)
            cells = [f"{auroc([r['signals'][s] for r in rows], ys):.2f}" for s in SIGNALS]
            lines.append(f"| {key} ({len(rows)}) | {kind} ({sum(ys)}) | " + " | ".join(cells) + " |")
        answer = [r["rows"][shipped]["answer_kl"] for r in rows]
        cells = [f"{spearman([r['signals'][s] for r in rows], answer):.2f}" for s in SIGNALS]
        lines.append(f"| {key} ({len(rows)}) | Spearman with answer KL | " + " | ".join(cells) + " |")
    return lines


def pooled_auroc(raw: dict, shipped_of: dict) -> list[str]:
    """AUROC over every prompt of each model and of all (labels still per set)."""
    lines = ["| model (prompts) | label (positives) | " + " | ".join(SIGNALS) + " |",
             "|---|---|" + "---:|" * len(SIGNALS)]
    models = dict.fromkeys(key.split("/")[0] for key in raw)
    for model in [*models, "all"]:
        keys = [k for k in raw if model == "all" or k.split("/")[0] == model]
        for kind in LABELS:
            scores = {s: [] for s in SIGNALS}
            ys = []
            for key in keys:
                rows = raw[key]
                ys += labels(rows, shipped_of[key.split("/")[0]], kind)
                for s in SIGNALS:
                    scores[s] += [r["signals"][s] for r in rows]
            cells = [f"{auroc(scores[s], ys):.2f}" for s in SIGNALS]
            lines.append(f"| {model} ({len(ys)}) | {kind} ({sum(ys)}) | " + " | ".join(cells) + " |")
    return lines


LENGTH_SCALED = ("left_mass", "selected_deviation", "probe_kl")   # signals also tried scaled by log(prompt length)


def length_scaled_auroc(raw: dict, shipped_of: dict) -> list[str]:
    """Pooled AUROC per model ("answer" label) of signals times and over log(reused tokens):
    a signal whose scale shifts with prompt length might rank across sets once scaled."""
    def log_n(r):
        return math.log(max(2.0, r["signals"]["reused_tokens"] or 2.0))

    variants = {}
    for s in LENGTH_SCALED:
        variants[s] = lambda r, s=s: r["signals"][s]
        variants[f"{s} x log n"] = lambda r, s=s: None if r["signals"][s] is None else r["signals"][s] * log_n(r)
        variants[f"{s} / log n"] = lambda r, s=s: None if r["signals"][s] is None else r["signals"][s] / log_n(r)
    lines = ["| model (prompts, positives) | " + " | ".join(variants) + " |", "|---|" + "---:|" * len(variants)]
    for model in dict.fromkeys(key.split("/")[0] for key in raw):
        rows, ys = [], []
        for key in (k for k in raw if k.split("/")[0] == model):
            rows += raw[key]
            ys += labels(raw[key], shipped_of[model], "answer")
        cells = [f"{auroc([f(r) for r in rows], ys):.2f}" for f in variants.values()]
        lines.append(f"| {model} ({len(rows)}, {sum(ys)}) | " + " | ".join(cells) + " |")
    return lines


def escalated(row: dict, signal: str, threshold: float) -> bool:
    """Whether a prompt's ``signal`` passes ``threshold``; a missing one (None: the prompt ran as a
    full prefill, already exact, or its run predates the signal) never does."""
    score = row["signals"][signal]
    return score is not None and score > threshold


def escalate(rows: list[dict], shipped: str, target: str, signal: str, threshold: float) -> list[tuple[float, dict]]:
    """Per prompt (compute, row) when the shipped strategy escalates to ``target`` (a row name,
    or "full" for a full prefill) where ``signal`` > ``threshold``. A signal known before the
    fused pass (left_mass...) spends the target's compute only; one read off the fused result
    spends the shipped pass too (less the question pass, which the target reuses)."""
    before_fusion = signal.startswith(("left_mass", "relevance", "reused"))
    out = []
    for r in rows:
        base = r["rows"][shipped]
        if not escalated(r, signal, threshold):
            out.append((base["compute"], base))
            continue
        row = {"kl": 0.0, "answer_kl": 0.0, "compute": 1.0} if target == "full" else r["rows"][target]
        extra = 0.0 if before_fusion else base["compute"] - r["rows"][PROBE]["compute"]
        out.append((row["compute"] + extra, row))
    return out


def summary(results: list[tuple[float, dict]], bound: float) -> str:
    compute = statistics.mean(c for c, _ in results)
    kl = [row["kl"] for _, row in results]
    akl = [row["answer_kl"] for _, row in results]
    return (f"{compute:.1%} | {statistics.mean(kl):.4f} / {statistics.median(kl):.4f} | "
            f"{statistics.mean(akl):.4f} / {statistics.median(akl):.4f} | {sum(k > bound for k in akl)}")


def tuned_threshold(rows: list[dict], shipped: str, target: str, signal: str, budget: float) -> float:
    """The lowest threshold on ``signal`` whose escalation to ``target`` keeps the mean compute
    over ``rows`` within ``budget`` (inf: none does)."""
    threshold = math.inf
    for t in sorted({r["signals"][signal] for r in rows} - {None}, reverse=True):
        if statistics.mean(c for c, _ in escalate(rows, shipped, target, signal, t)) > budget + 1e-9:
            break
        threshold = t
    return threshold


def policy_tables(raw: dict, shipped_of: dict, tune: str, fixed_of: dict, targets_of: dict) -> list[str]:
    """Per model: thresholds chosen on the ``tune`` set so that escalating matches the fixed
    ratio's mean compute there (the largest threshold that reaches it), tested on every set."""
    lines = []
    models = dict.fromkeys(key.split("/")[0] for key in raw)
    for model in models:
        shipped, fixed = shipped_of[model], fixed_of[model]
        tune_rows = raw.get(f"{model}/{tune}")
        if not tune_rows or fixed not in tune_rows[0]["rows"]:
            continue
        budget = statistics.mean(r["rows"][fixed]["compute"] for r in tune_rows)
        lines += [f"### {model}: thresholds tuned on {tune} to {fixed}'s compute there ({budget:.1%})", "",
                  "| set | policy | compute | first-token KL mean / median | answer KL mean / median | "
                  "answer KL > 3x noise median |", "|---|---|---:|---:|---:|---:|"]
        chosen = {(target, signal): tuned_threshold(tune_rows, shipped, target, signal, budget)
                  for target in targets_of[model] if target == "full" or target in tune_rows[0]["rows"]
                  for signal in POLICY_SIGNALS}
        for key, rows in raw.items():
            if key.split("/")[0] != model:
                continue
            bound = 3 * statistics.median(r["rows"][NOISE]["answer_kl"] for r in rows)
            name = key.split("/")[1] + (" (tuning)" if key.endswith("/" + tune) else "")
            lines.append(f"| {name} | order noise | - | " + summary(
                [(1.0, r["rows"][NOISE]) for r in rows], bound).split(" | ", 1)[1] + " |")
            for row_name in (shipped, fixed):
                lines.append(f"| {name} | fixed {row_name} | " + summary(
                    [(r["rows"][row_name]["compute"], r["rows"][row_name]) for r in rows], bound) + " |")
            for (target, signal), threshold in chosen.items():
                results = escalate(rows, shipped, target, signal, threshold)
                share = sum(escalated(r, signal, threshold) for r in rows) / len(rows)
                lines.append(f"| {name} | {signal} > {threshold:.4g} -> {target} ({share:.0%} escalated) | "
                             + summary(results, bound) + " |")
        lines.append("")
    return lines


def shipped_table(raw: dict, shipped_of: dict) -> list[str]:
    """One table for every model and set: the shipped strategy (the scale kept in decoding, in
    the prefill only, fading over the answer), the ladder above it and the order noise."""
    lines = ["| model, set (prompts) | strategy | compute | first-token KL mean / median | "
             "answer KL mean / median | answer identical | answer KL > 3x noise median | ROUGE-L |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for key, rows in raw.items():
        shipped = shipped_of[key.split("/")[0]]
        bound = 3 * statistics.median(r["rows"][NOISE]["answer_kl"] for r in rows)
        names = [n for n in rows[0]["rows"] if n != PROBE and n != NOISE] + [NOISE]
        for name in names:
            col = {k: [r["rows"][name][k] for r in rows] for k in ("compute", "kl", "answer_kl", "same_answer", "rouge")}
            label = name.replace(shipped, "shipped").replace(NOISE, "order noise")
            same = f"{statistics.mean(col['same_answer']):.0%}" if col["same_answer"][0] == col["same_answer"][0] else "-"
            rouge = f"{statistics.mean(col['rouge']):.2f}" if col["rouge"][0] == col["rouge"][0] else "-"
            lines.append(f"| {key} ({len(rows)}) | {label if name != shipped else shipped} | "
                         f"{statistics.mean(col['compute']):.1%} | "
                         f"{statistics.mean(col['kl']):.4f} / {statistics.median(col['kl']):.4f} | "
                         f"{statistics.mean(col['answer_kl']):.4f} / {statistics.median(col['answer_kl']):.4f} | "
                         f"{same} | {sum(k > bound for k in col['answer_kl'])} | {rouge} |")
    return lines


def load_runs(paths: list[Path]) -> tuple[dict, dict]:
    """``(raw, shipped_of)`` of earlier ``--json`` files, pooled: a set's prompts from several
    runs (e.g. musique:2-5) go together; a strategy keeps its column only where every prompt of
    the set has it (runs of other ladders); a signal added after a run is None (left out of its AUROC)."""
    runs = [json.loads(path.read_text()) for path in paths]
    raw, shipped_of = pool_by_set(run["raw"] for run in runs), {}
    for run in runs:
        shipped_of.update(run["shipped"])
    for rows in raw.values():
        common = in_every([r["rows"] for r in rows])
        for r in rows:
            r["signals"] = {s: r["signals"].get(s) for s in SIGNALS}
            r["rows"] = {name: row for name, row in r["rows"].items() if name in common}
    return raw, shipped_of


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--sets", nargs="+", default=["squad:12", "musique:8", "fidelity:6"],
                        help="prompt sets as NAME:COUNT (fidelity, squad, musique)")
    parser.add_argument("--ladder", nargs="+", type=float, default=[0.2, 0.3, 0.5],
                        help="QueryAware ratios measured (KL only) above the shipped one, for the escalation")
    parser.add_argument("--greedy-tokens", type=int, default=32)
    parser.add_argument("--tune", default="squad", help="the set whose prompts choose the thresholds")
    parser.add_argument("--musique-file", type=Path, default=MUSIQUE)
    parser.add_argument("--json", type=Path, help="write every per-prompt row and signal here (after each prompt)")
    parser.add_argument("--from-json", type=Path, nargs="+", help="analyse earlier --json files instead of running")
    parser.add_argument("--out", default=RUNS_DIR)
    parser.add_argument("--device", default="cpu", help="where the model runs (cuda where a GPU exists)")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    raw, shipped_of = {}, {}
    if args.from_json:
        raw, shipped_of = load_runs(args.from_json)
    else:
        for model in args.models:
            engine = BlendEngine.from_pretrained(model_path(model), kv_dir=False, device=args.device)
            ratio = engine.strategy.ratio
            shipped = f"QueryAware({ratio:.2f}) (shipped)"
            shipped_of[model] = shipped
            recorder = RecordingQuestionAttention(ratio, cached_attention_scale=engine.strategy.cached_attention_scale,
                                                  per_chunk=engine.strategy.per_chunk)
            ladder = {f"QueryAware({r:.2f})": QueryAware(r) for r in args.ladder if r > ratio}
            for set_name, prompts in prompt_sets(args.sets, args.musique_file).items():
                if not prompts:
                    print(f"[{model}/{set_name}] no prompts (MuSiQue needs --musique-file)", flush=True)
                    continue
                rows = raw.setdefault(f"{model}/{set_name}", [])
                for i, prompt in enumerate(prompts):
                    tp = time.perf_counter()
                    prefills = {shipped: None, PROBE: None}
                    result = measure(engine, prompt, {shipped: recorder}, args.greedy_tokens, answer_level=True,
                                     kl_only={**ladder, PROBE: FullReuse()}, prefills=prefills)
                    fused = prefills[shipped]
                    # A prompt run as a full prefill has no question pass (the recorder still holds the
                    # last prompt's): no signals, left out of the AUROCs.
                    rows.append({"rows": result, "signals": dict.fromkeys(SIGNALS) if fused.stats.fusion_skipped
                                 else signals(recorder, fused, prefills[PROBE])})
                    del prefills
                    print(f"[{model}/{set_name}] {i + 1}/{len(prompts)} {time.perf_counter() - tp:.0f}s "
                          f"answer KL {result[shipped]['answer_kl']:.4f} noise {result[NOISE]['answer_kl']:.4f}",
                          flush=True)
                    if args.json:
                        args.json.write_text(json.dumps({"raw": raw, "shipped": shipped_of}))
            del engine
    lines = []
    raw = {key: rows for key, rows in raw.items() if rows}
    for key, rows in raw.items():
        lines += [f"## {key} ({len(rows)} prompts)", "", *table([r["rows"] for r in rows], 32), ""]
    lines += ["## Answer level at the shipped defaults", "", *shipped_table(raw, shipped_of), "",
              "## AUROC of each signal, per set", "", "Labels: " + "; ".join(
        f"*{k}*: {v}" for k, v in LABELS.items()) + ".", "", *auroc_table(raw, shipped_of), "",
              "## AUROC pooled over the sets", "", *pooled_auroc(raw, shipped_of), "",
              "## Scaled by prompt length (pooled, label *answer*)", "", *length_scaled_auroc(raw, shipped_of), "",
              "## Escalation", ""]
    fixed_of = {m: ("QueryAware(0.20)" if "0.10" in s else "QueryAware(0.30)") for m, s in shipped_of.items()}
    targets_of = {m: ("QueryAware(0.30)", "QueryAware(0.50)", "full") for m in shipped_of}
    lines += policy_tables(raw, shipped_of, args.tune, fixed_of, targets_of)
    print("\n".join(lines))
    write_report(args.out, "adaptive-run.md", "Per-query adaptive recompute: signals and escalation",
                 command_line("research.adaptive", argv), time.perf_counter() - t0, lines)


if __name__ == "__main__":
    main()
