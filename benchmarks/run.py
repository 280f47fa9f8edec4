"""The trade-off study: TTFT, fidelity and answer quality for every strategy on two models.

For each model (SmolLM2-135M-Instruct, Qwen2.5-Coder-0.5B-Instruct) and strategy it measures,
per prompt and then averaged:

* TTFT (median over repeats) and speed-up versus the model's own ``forward`` (sdpa,
  ``logits_to_keep=1``) on the same token ids;
* the fraction of prompt tokens recomputed;
* fidelity to a full prefill: first-token KL, and ROUGE-L between the 32-token greedy answers;
* answer quality on SQuAD RAG samples: F1 / exact match against the gold answers, and F1
  relative to the full prefill's;

plus TTFT versus context length (2K, 4K, 8K tokens) for full prefill and CacheBlend(0.15).
Results go to ``docs/runs/benchmarks-run.md`` and PNG plots beside it.

    python -m benchmarks.run --quick        # a reduced run, under 15 minutes on a 2-core CPU
    python -m benchmarks.run                # the full run (longer)
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from ragblend import BlendEngine, CacheBlend, Chunk, FullRecompute, FullReuse, LegoLink
from ragblend.core.calibration.metrics import first_token_kl

from .common import (
    GREEDY_TOKENS,
    RUNS_DIR,
    SYSTEM,
    Prompt,
    answer_contained,
    best_over_answers,
    command_line,
    exact_match,
    extract_answer,
    f1_score,
    fidelity_prompts,
    hf_forward_s,
    rag_samples,
    rouge_l,
    squad_prompts,
)
from .models import MODELS, model_path

STRATEGIES = {
    "FullRecompute": FullRecompute(),
    "FullReuse": FullReuse(),
    "LegoLink(8)": LegoLink(8),
    "LegoLink(16)": LegoLink(16),
    "LegoLink(32)": LegoLink(32),
    # The paper's selection (V deviation, ragblend's default) at four ratios, then K deviation.
    "CacheBlend(0.05)": CacheBlend(0.05),
    "CacheBlend(0.15)": CacheBlend(0.15),
    "CacheBlend(0.30)": CacheBlend(0.30),
    "CacheBlend(0.50)": CacheBlend(0.50),
    "CacheBlend(0.15, K deviation)": CacheBlend(0.15, deviation="key"),
}


def measure_prompt(engine: BlendEngine, prompt: Prompt, repeats: int) -> dict:
    """Every strategy on one prompt: {strategy: {ttft, speedup, recomputed, kl, rouge, f1, em}}.

    One greedy generation per strategy gives its TTFT, first-token logits and answer;
    ``repeats`` > 1 adds plain prefills for a steadier TTFT median.
    """
    engine.precompute(prompt.chunks)
    segments = [Chunk(c) for c in prompt.chunks] + [prompt.question]

    def run(strategy):
        out = engine.generate(segments, system=SYSTEM, strategy=strategy, max_new_tokens=GREEDY_TOKENS)
        ttfts = [out.stats.ttft_s] + [engine.prefill(segments, system=SYSTEM, strategy=strategy).stats.ttft_s
                                      for _ in range(repeats - 1)]
        return out, statistics.median(ttfts)

    ref, _ = run(FullRecompute())
    base = statistics.median(hf_forward_s(engine, ref.prompt_token_ids) for _ in range(repeats))
    out = {}
    for name, strategy in STRATEGIES.items():
        gen, ttft = run(strategy)
        row = {"ttft": ttft, "speedup": base / ttft, "recomputed": gen.stats.recompute_fraction,
               "kl": first_token_kl(ref.logits, gen.logits), "rouge": rouge_l(gen.text, ref.text)}
        if prompt.answers:
            answer = extract_answer(gen.text)
            row["f1"] = best_over_answers(f1_score, answer, prompt.answers)
            row["em"] = best_over_answers(exact_match, answer, prompt.answers)
            row["has_answer"] = best_over_answers(answer_contained, answer, prompt.answers)
        out[name] = row
    return out


def average(rows: list[dict]) -> dict:
    keys = rows[0].keys()
    return {k: statistics.mean(r[k] for r in rows) for k in keys}


def context_sweep(engine: BlendEngine, lengths: list[int], repeats: int) -> list[dict]:
    """TTFT of full prefill and CacheBlend(0.15) for prompts of about ``lengths`` tokens,
    built from SQuAD paragraphs as chunks."""
    paragraphs = [c for s in rag_samples(200) for c in s["chunks"]]
    results = []
    for target in lengths:
        target = min(target, engine.context_window - 128)  # room for the template and the question
        chunks, total = [], 0
        for p in paragraphs:
            if total >= target - 64:
                break
            chunks.append(p)
            total += engine.count_tokens(p) + 2
        engine.precompute(chunks)
        segments = [Chunk(c) for c in chunks] + ["Question: what are these passages about?"]
        n = len(engine.prefill(segments, strategy=FullReuse()).token_ids)
        full = statistics.median(engine.prefill(segments, strategy=FullRecompute()).stats.ttft_s for _ in range(repeats))
        blend = statistics.median(engine.prefill(segments, strategy=CacheBlend(0.15)).stats.ttft_s
                                  for _ in range(repeats))
        results.append({"tokens": n, "full": full, "cacheblend": blend})
    return results


def plots(results: dict, sweeps: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for model, table in results.items():
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        for name, row in table["fidelity"].items():
            ax.scatter(row["speedup"], row["kl"], s=40)
            ax.annotate(name, (row["speedup"], row["kl"]), fontsize=7, xytext=(4, 3), textcoords="offset points")
        ax.set_xlabel("TTFT speed-up vs the model's own forward (x)")
        ax.set_ylabel("first-token KL to full prefill (lower is better)")
        ax.set_title(f"{model}: speed vs fidelity")
        ax.grid(alpha=0.3)
        path = out_dir / f"pareto-{model}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        files.append(path)
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for model, rows in sweeps.items():
        xs = [r["tokens"] for r in rows]
        ax.plot(xs, [r["full"] for r in rows], "o-", label=f"{model} full prefill")
        ax.plot(xs, [r["cacheblend"] for r in rows], "s--", label=f"{model} CacheBlend(0.15)")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("TTFT vs context length")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    path = out_dir / "ttft-vs-context.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return files + [path]


def report(results: dict, sweeps: dict, figures: list[Path], args, seconds: float) -> str:
    lines = ["# Benchmark run: strategies on two models", "",
             f"Command: `{args.command}` "
             f"({seconds / 60:.1f} min on this machine, {torch.get_num_threads()} threads, KV stored as float16).", ""]
    for model, table in results.items():
        fid, squad = table["fidelity"], table["squad"]
        lines += [f"## {model}", "",
                  f"Fidelity: {table['n_fidelity']} prompt(s) of 6 ~500-token passages written for the project; "
                  f"answer quality: {table['n_squad']} SQuAD-format RAG sample(s) (SQuAD-shifts Reddit, 6 paragraphs). "
                  f"Means over prompts; TTFT is the median of {args.repeats} run(s) per prompt.", "",
                  "| strategy | TTFT (s) | speed-up | recomputed | first-token KL | ROUGE-L vs full | SQuAD F1 | EM | has answer | F1 vs full |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        full_f1 = squad["FullRecompute"]["f1"] or 1e-9
        for name in STRATEGIES:
            f, q = fid[name], squad[name]
            lines.append(f"| {name} | {f['ttft']:.2f} | {f['speedup']:.2f}x | {f['recomputed']:.1%} | {f['kl']:.4f} | "
                         f"{f['rouge']:.2f} | {q['f1']:.2f} | {q['em']:.2f} | {q['has_answer']:.2f} | {q['f1'] / full_f1:.2f} |")
        lines.append("")
    lines += ["## TTFT vs context length", "", "| model | prompt tokens | full prefill (s) | CacheBlend(0.15) (s) | speed-up |",
              "|---|---:|---:|---:|---:|"]
    for model, rows in sweeps.items():
        for r in rows:
            lines.append(f"| {model} | {r['tokens']} | {r['full']:.2f} | {r['cacheblend']:.2f} | {r['full'] / r['cacheblend']:.2f}x |")
    lines += ["", *[f"![{p.stem}]({p.name})" for p in figures], ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer prompts and repeats (under 15 min)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--out", default=RUNS_DIR, help="folder for benchmarks-run.md and the plots")
    parser.add_argument("--fidelity", type=int, help="fidelity prompts per model (overrides the plan)")
    parser.add_argument("--squad", type=int, help="SQuAD samples per model (overrides the plan)")
    parser.add_argument("--lengths", type=int, nargs="+", help="context lengths to sweep (overrides the plan)")
    parser.add_argument("--repeats", type=int, help="TTFT runs per prompt and strategy (median)")
    parser.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)  # harness check: 1 tiny prompt each
    args = parser.parse_args(argv)
    args.command = command_line("benchmarks.run", argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick or args.smoke else 3
    plan = {  # (fidelity prompts, SQuAD samples, context lengths) per model
        "smollm2": (2, 8, [2048, 4096, 8192]) if args.quick else (6, 48, [2048, 4096, 8192]),
        "qwen2.5-0.5b": (1, 3, [2048]) if args.quick else (6, 48, [2048, 4096, 8192]),
    }
    if args.smoke:
        plan = {m: (0, 1, [1024]) for m in plan}
    for model, (n_fid, n_squad, lengths) in plan.items():
        plan[model] = (n_fid if args.fidelity is None else args.fidelity,
                       n_squad if args.squad is None else args.squad, args.lengths or lengths)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results, sweeps = {}, {}
    for model in args.models:
        n_fid, n_squad, lengths = plan[model]
        engine = BlendEngine.from_pretrained(model_path(model), kv_dir=False)
        print(f"[{model}] {n_fid} fidelity prompt(s), {n_squad} SQuAD sample(s)...", flush=True)
        fid = [measure_prompt(engine, p, args.repeats) for p in fidelity_prompts(n_fid)]
        squad = [measure_prompt(engine, p, args.repeats) for p in squad_prompts(n_squad)]
        fid = fid or squad  # smoke runs have no fidelity prompt
        results[model] = {"fidelity": {s: average([r[s] for r in fid]) for s in STRATEGIES},
                          "squad": {s: average([r[s] for r in squad]) for s in STRATEGIES},
                          "n_fidelity": n_fid, "n_squad": n_squad}
        print(f"[{model}] context sweep {lengths}...", flush=True)
        sweeps[model] = context_sweep(engine, lengths, args.repeats)
        del engine
    figures = plots(results, sweeps, out_dir)
    text = report(results, sweeps, figures, args, time.perf_counter() - t0)
    (out_dir / "benchmarks-run.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
