"""Fidelity of the fused prefill against the model's own order noise, per strategy and budget.

For every prompt: a full prefill (the reference), a full prefill of the same chunks in reversed
order (the order noise: how far the model itself moves when nothing but the chunk order
changes), and each strategy. Per strategy it reports the compute used (token-layers computed,
as a share of a full prefill's, choosing included), first-token KL to the reference (mean and
median), and ROUGE-L of the greedy answer against the reference's. A strategy whose numbers
stay within the order noise answers like a full prefill.

Prompt sets: ``fidelity`` (the project's 6 ~500-token passages, rotated, ~3.1k tokens),
``squad`` (SQuAD v1.1 dev, 6 paragraphs, ~1k tokens) and ``musique`` (the CacheBlend paper's
workload: 10 passages, ~5.5k tokens; read from ``--musique-file``, skipped when absent).

    python -m benchmarks.fidelity --models smollm2 --sets fidelity:3 squad:32
    python -m benchmarks.fidelity --device cuda --sets fidelity:6 squad:48 musique:16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from ragblend import BlendEngine, CacheBlend, Chunk, FullRecompute, FullReuse, QueryAware
from ragblend.core.calibration import first_token_kl

from .common import (
    MUSIQUE,
    RUNS_DIR,
    Prompt,
    command_line,
    first_token_and_answer,
    prompt_sets,
    rouge_l,
    write_report,
)
from .models import MODELS, model_path

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
    "QueryAware(0.15, whole chunks)": QueryAware(0.15, whole_chunks=True),
    "QueryAware(0.15, last 4 tokens)": QueryAware(0.15, query_tokens=4),
    "QueryAware(0.20, last 4 tokens)": QueryAware(0.20, query_tokens=4),
    "QueryAware(0.30, last 4 tokens)": QueryAware(0.30, query_tokens=4),
    # APE's scaling of the attention paid to the reused tokens left out (cached_attention_scale)
    **{f"QueryAware({r:.2f}, cached x{s})": QueryAware(r, cached_attention_scale=s)
       for r in (0.05, 0.10, 0.15, 0.20, 0.30) for s in (1.0, 0.8, 0.7, 0.6, 0.5, 0.4)},
}
NOISE = "order noise (full prefill, chunks reversed)"


def measure(engine: BlendEngine, prompt: Prompt, variants: dict, greedy_tokens: int) -> dict:
    """{variant: {"kl", "rouge", "compute", "same_first"}} for one prompt, order noise included."""
    engine.precompute(prompt.chunks)
    segments = [Chunk(c) for c in prompt.chunks] + [prompt.question]
    reversed_segments = [Chunk(c) for c in reversed(prompt.chunks)] + [prompt.question]

    def run(strategy, segs=segments):
        return first_token_and_answer(engine, segs, strategy, greedy_tokens)

    ref_logits, _, ref_text = run(FullRecompute())
    rows = {}
    for name, strategy in [*variants.items(), (NOISE, FullRecompute())]:
        logits, stats, text = run(strategy, reversed_segments if name == NOISE else segments)
        rows[name] = {"kl": first_token_kl(ref_logits, logits), "rouge": rouge_l(text, ref_text),
                      "compute": stats.compute_fraction, "same_first": float(logits.argmax() == ref_logits.argmax())}
    return rows


def table(results: list[dict], greedy_tokens: int) -> list[str]:
    lines = ["| strategy | compute | KL mean | KL median | first token same | ROUGE-L vs full |",
             "|---|---:|---:|---:|---:|---:|"]
    for name in results[0]:
        col = {k: [r[name][k] for r in results] for k in results[0][name]}
        rouge = f"{statistics.mean(col['rouge']):.2f}" if greedy_tokens else "-"
        lines.append(f"| {name} | {statistics.mean(col['compute']):.1%} | {statistics.mean(col['kl']):.4f} | "
                     f"{statistics.median(col['kl']):.4f} | {statistics.mean(col['same_first']):.0%} | {rouge} |")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--sets", nargs="+", default=["fidelity:3", "squad:32"],
                        help="prompt sets as NAME:COUNT (fidelity, squad, musique)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), help="strategies by their table name")
    parser.add_argument("--greedy-tokens", type=int, default=32, help="answer length for ROUGE-L (0: KL only)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--musique-file", type=Path, default=MUSIQUE)
    parser.add_argument("--out", default=RUNS_DIR)
    parser.add_argument("--json", type=Path, help="also write every per-prompt row here")
    parser.add_argument("--no-chunk-context", action="store_true",
                        help="precompute chunks right after the template's opening (chunk_context=''), as before")
    args = parser.parse_args(argv)
    variants = {name: VARIANTS[name] for name in args.variants}
    t0 = time.perf_counter()
    lines, raw = [], {}
    for model in args.models:
        engine = BlendEngine.from_pretrained(model_path(model), kv_dir=False, device=args.device,
                                             **({"chunk_context": ""} if args.no_chunk_context else {}))
        for set_name, prompts in prompt_sets(args.sets, args.musique_file).items():
            if not prompts:
                continue
            results = []
            for i, prompt in enumerate(prompts):
                results.append(measure(engine, prompt, variants, args.greedy_tokens))
                print(f"[{model}/{set_name}] {i + 1}/{len(prompts)}", flush=True)
            raw[f"{model}/{set_name}"] = results
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
