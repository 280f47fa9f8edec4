"""Stored KV dtypes (float16, int8, uint4) judged against the model's own order noise.

Per prompt, with the engine's default strategy, the fused prefill from a store in each dtype is
compared with a full prefill: first-token KL and ROUGE-L of the greedy answer. The yardstick is
the model's order noise (a full prefill with the chunks reversed), and the rule is one for every
dtype (:func:`verdict`): on every prompt set, a quantized dtype's mean and median KL to the full
prefill move from float16's by less than 10% of the order noise's mean and median KL, and its
ROUGE-L drops from float16's by less than 10% of the order noise's distance (1 - its ROUGE-L).
Also reported: each dtype against float16 (KL, identical greedy answers), bytes per token, and
the TTFT of the benchmark prompt read from disk with the OS page cache dropped (medians of
``--runs``: decoding a layer back to float16 is on the TTFT path).

    python -m benchmarks.kv_dtypes --models smollm2 qwen2.5-0.5b gemma3-270m --sets squad:12
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from ragblend import BlendEngine, Chunk, FullRecompute
from ragblend.core.calibration.metrics import first_token_kl
from ragblend.core.fusion.controller import drop_page_cache
from ragblend.core.paths import cache_dir
from ragblend.core.store.tiers import DiskStore
from ragblend.data import load_sample

from .common import MUSIQUE, RUNS_DIR, first_token_and_answer, prompt_sets, report_per_model, rouge_l
from .models import MODELS, model_path

DTYPES = ("float16", "int8", "uint4")
SHARE_OF_NOISE = 0.10   # a quantized dtype may move the measures by less than this share of the order noise


def fidelity(engines: dict[str, BlendEngine], prompts, tokens: int) -> dict[str, list[float]]:
    """Per-prompt measures of each storage dtype against a full prefill (and against float16)."""
    reference = engines["float16"]
    rows: dict[str, list[float]] = {}

    def add(name, value):
        rows.setdefault(name, []).append(value)

    for prompt in prompts:
        segments = [Chunk(c) for c in prompt.chunks] + [prompt.question]
        full_logits, _, full_text = first_token_and_answer(reference, segments, FullRecompute(), tokens)
        reversed_segments = segments[:-1][::-1] + segments[-1:]
        noise_logits, _, noise_text = first_token_and_answer(reference, reversed_segments, FullRecompute(), tokens)
        add("order noise KL", first_token_kl(full_logits, noise_logits))
        add("order noise ROUGE-L", rouge_l(noise_text, full_text))
        fused = {}
        for name, engine in engines.items():
            engine.precompute(prompt.chunks)
            logits, _, text = first_token_and_answer(engine, segments, None, tokens)
            fused[name] = logits, text
            add(f"{name} KL", first_token_kl(full_logits, logits))
            add(f"{name} ROUGE-L", rouge_l(text, full_text))
        for name in engines:
            if name != "float16":
                add(f"{name} vs float16 KL", first_token_kl(fused["float16"][0], fused[name][0]))
                add(f"{name} vs float16 same answer", float(fused["float16"][1] == fused[name][1]))
    return rows


def verdict(rows: dict[str, list[float]], name: str) -> tuple[bool, str]:
    """Whether dtype ``name`` stays within the order noise on one prompt set (the module's rule), and
    the three measures as shares of the noise."""
    mean, med = statistics.mean, statistics.median
    kl_mean = (mean(rows[f"{name} KL"]) - mean(rows["float16 KL"])) / mean(rows["order noise KL"])
    kl_median = (med(rows[f"{name} KL"]) - med(rows["float16 KL"])) / med(rows["order noise KL"])
    rouge_drop = (mean(rows["float16 ROUGE-L"]) - mean(rows[f"{name} ROUGE-L"])) / max(
        1 - mean(rows["order noise ROUGE-L"]), 1e-9)
    ok = max(kl_mean, kl_median, rouge_drop) < SHARE_OF_NOISE
    return ok, f"{kl_mean:+.1%} / {kl_median:+.1%} / {rouge_drop:+.1%}"


def disk_ttft(engines: dict[str, BlendEngine], runs: int) -> dict[str, tuple[float, float]]:
    """(median TTFT in s, KV bytes per token) of the benchmark prompt, read from a disk store
    with the page cache dropped before each run."""
    sample = load_sample()
    segments = [Chunk(c) for c in sample["chunks"]] + [sample["question"]]
    out = {}
    with tempfile.TemporaryDirectory(prefix="kvdtypes-", dir=cache_dir()) as tmp:   # the store's device, not tmpfs
        for name, engine in engines.items():
            engine.store = DiskStore(Path(tmp) / name, engine.entry_spec)
            engine.write_back = False
            refs = engine.precompute(sample["chunks"])
            engine.prefill(segments)   # once first: the loading controller's first probe of a dtype is not timed
            times = []
            for _ in range(runs):
                for path in (Path(tmp) / name).rglob("*.val"):
                    drop_page_cache(path)
                t0 = time.perf_counter()
                engine.prefill(segments)
                times.append(time.perf_counter() - t0)
            stored = engine.store.nbytes
            # every chunk has its own entry and (by default) a lead entry: count the tokens of both
            out[name] = statistics.median(times), stored / (len(engine.ingestion.variants) * sum(r.num_tokens for r in refs))
            engine.store.close()
    return out


def report(model: str, engines, sets, tokens: int, runs: int) -> list[str]:
    strategy = engines["float16"].strategy
    quantized = [n for n in engines if n != "float16"]
    lines = [f"## {model}", "", f"Default strategy: {strategy.name}({getattr(strategy, 'ratio', '')}), "
             f"{tokens}-token greedy answers. Change / noise: KL mean / KL median / ROUGE-L drop, each as a share "
             f"of the order noise's; within the noise when all three are under {SHARE_OF_NOISE:.0%}.", "",
             "| set | prompts | dtype | KL mean / median | ROUGE-L | change / noise | within noise | "
             "vs float16: KL mean, same answer |", "|---|---:|---|---:|---:|---:|---|---:|"]
    passed = dict.fromkeys(quantized, True)
    mean, med = statistics.mean, statistics.median
    for set_name, prompts in sets.items():
        if not prompts:
            continue
        rows = fidelity(engines, prompts, tokens)
        lines.append(f"| {set_name} | {len(prompts)} | order noise | {mean(rows['order noise KL']):.4f} / "
                     f"{med(rows['order noise KL']):.4f} | {mean(rows['order noise ROUGE-L']):.3f} | | | |")
        for name in engines:
            cells = ["", "", ""]
            if name != "float16":
                ok, shares = verdict(rows, name)
                passed[name] &= ok
                cells = [shares, "yes" if ok else "no", f"{mean(rows[f'{name} vs float16 KL']):.2e}, "
                         f"{sum(rows[f'{name} vs float16 same answer']):.0f}/{len(prompts)}"]
            lines.append(f"| {set_name} | {len(prompts)} | {name} | {mean(rows[f'{name} KL']):.4f} / "
                         f"{med(rows[f'{name} KL']):.4f} | {mean(rows[f'{name} ROUGE-L']):.3f} | {' | '.join(cells)} |")
        print("\n".join(lines[-len(engines) - 1:]), flush=True)
    lines += ["", "Within the order noise on every set: " + ", ".join(
        f"{name} {'yes' if ok else 'no'}" for name, ok in passed.items()) + "."]
    if runs:
        ttft = disk_ttft(engines, runs)
        lines += ["", f"Benchmark prompt from a disk store, page cache dropped, median of {runs}:", "",
                  "| kv_dtype | bytes per token stored | TTFT s |", "|---|---:|---:|"]
        lines += [f"| {name} | {per_token:,.0f} | {seconds:.3f} |" for name, (seconds, per_token) in ttft.items()]
    return lines + [""]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2"], choices=MODELS)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES[1:]), choices=DTYPES[1:],
                        help="quantized dtypes judged against float16")
    parser.add_argument("--sets", nargs="+", default=["squad:12"])
    parser.add_argument("--tokens", type=int, default=32, help="greedy answer tokens")
    parser.add_argument("--runs", type=int, default=3, help="disk TTFT rounds (0: none)")
    parser.add_argument("--out", default=RUNS_DIR)
    args = parser.parse_args(argv)

    def measure(model: str) -> list[str]:
        base = BlendEngine.from_pretrained(model_path(model), kv_dir=False, kv_dtype="float16", prefix_cache_bytes=0)
        engines = {"float16": base, **{name: BlendEngine(base.hf_model, base.tokenizer, kv_dtype=name, name=base.name,
                                                   prefix_cache_bytes=0)
                                       for name in args.dtypes}}
        return report(model, engines, prompt_sets(args.sets, MUSIQUE), args.tokens, args.runs)

    report_per_model(args.models, measure, args.out, "kv-dtypes-run.md", "Stored KV dtypes", "benchmarks.kv_dtypes",
                     argv)


if __name__ == "__main__":
    main()
