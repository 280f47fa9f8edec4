"""Which tokens to recompute: CacheBlend's selection variants compared at equal compute.

The study behind keeping the paper's V score as ragblend's default (``docs/notes/selection-bounds.md``).

For each model and variant, over fidelity prompts (6 project passages) and SQuAD RAG samples:
first-token KL to a full prefill, whether the first token matches, ROUGE-L of the 32-token
greedy answer against full prefill's, and the compute used (token-layers computed, as a share
of a full prefill's). Results go to ``docs/runs/selection-run.md``.

    python -m research.selection --prompts 6 12 --greedy-tokens 0   # the table in docs/notes/selection-bounds.md
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import (
    GREEDY_TOKENS,
    RUNS_DIR,
    command_line,
    fidelity_prompts,
    first_token_and_answer,
    rouge_l,
    squad_prompts,
    write_report,
)
from benchmarks.models import MODELS, model_path
from ragblend import BlendEngine, CacheBlend, Chunk, FullRecompute
from ragblend.core.calibration.metrics import first_token_kl

VARIANTS = {  # CacheBlend selections; "compute" in the report makes them comparable
    "V deviation, r=0.15 (paper; ragblend default)": CacheBlend(0.15, deviation="value"),
    "V deviation, r=0.20": CacheBlend(0.20, deviation="value"),
    "V deviation, check at layer 2": CacheBlend(0.15, check_layer=2, deviation="value"),
    "V deviation, gradual 0.3@1 then 0.15@2": CacheBlend(0.30, gradual=((2, 0.15),), deviation="value"),
    "K+V deviation, r=0.15": CacheBlend(0.15, deviation="key_value"),
    "K deviation, r=0.15": CacheBlend(0.15, deviation="key"),
}


def measure(engine: BlendEngine, prompt, greedy_tokens: int) -> dict:
    engine.precompute(prompt.chunks)
    segments = [Chunk(c) for c in prompt.chunks] + [prompt.question]

    def run(strategy):
        return first_token_and_answer(engine, segments, strategy, greedy_tokens)

    ref_logits, _, ref_text = run(FullRecompute())
    rows = {}
    for name, strategy in VARIANTS.items():
        logits, stats, text = run(strategy)
        rows[name] = {"compute": stats.compute_fraction, "recomputed": stats.recompute_fraction,
                      "kl": first_token_kl(ref_logits, logits), "top1": float(logits.argmax() == ref_logits.argmax()),
                      "rouge": rouge_l(text, ref_text), "ttft": stats.ttft_s}
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--prompts", nargs=2, type=int, default=[6, 12], metavar=("FIDELITY", "SQUAD"))
    parser.add_argument("--greedy-tokens", type=int, default=GREEDY_TOKENS, help="0: first token only (no ROUGE-L)")
    parser.add_argument("--out", default=RUNS_DIR)
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    lines = []
    for model in args.models:
        engine = BlendEngine.from_pretrained(model_path(model), kv_dir=False)
        sets = {"fidelity": fidelity_prompts(args.prompts[0]), "SQuAD": squad_prompts(args.prompts[1])}
        results = {name: [] for name in sets}
        for set_name, prompts in sets.items():
            for i, p in enumerate(prompts):
                results[set_name].append(measure(engine, p, args.greedy_tokens))
                print(f"[{model}] {set_name} prompt {i + 1}/{len(prompts)} done", flush=True)
        lines += [f"## {model}", "", f"{len(sets['fidelity'])} fidelity prompts (~3.1K tokens), "
                  f"{len(sets['SQuAD'])} SQuAD samples (~1K tokens). KL: first-token KL to full prefill, "
                  "mean / median over prompts; top-1 and ROUGE-L over all prompts.", "",
                  "| variant | compute | KL fidelity | KL SQuAD | top-1 = full | ROUGE-L vs full |",
                  "|---|---:|---:|---:|---:|---:|"]
        for name in VARIANTS:
            def kl(set_name, name=name):
                values = [r[name]["kl"] for r in results[set_name]]
                return f"{statistics.mean(values):.4f} / {statistics.median(values):.4f}" if values else "-"
            rows = [r[name] for rs in results.values() for r in rs]
            def mean(key, rows=rows):
                return statistics.mean(r[key] for r in rows)
            rouge = f"{mean('rouge'):.2f}" if args.greedy_tokens else "-"
            lines.append(f"| {name} | {mean('compute'):.1%} | {kl('fidelity')} | {kl('SQuAD')} | "
                         f"{mean('top1'):.2f} | {rouge} |")
        lines.append("")
        print("\n".join(lines), flush=True)
        del engine
    write_report(args.out, "selection-run.md", "Selection variants", command_line("research.selection", argv),
                 time.perf_counter() - t0, lines)


if __name__ == "__main__":
    main()
