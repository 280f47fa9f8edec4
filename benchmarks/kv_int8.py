"""int8 KV storage against float16: bytes, fidelity and disk TTFT.

Per prompt, with the engine's default strategy, the fused prefill from a float16 store and
from an int8 store (``kv_dtype="int8"``: K per channel, V per token, float16 scales) are both
compared with a full prefill: first-token KL and ROUGE-L of the 32-token greedy answer. The
model's order noise (full prefill with the chunks reversed) is the yardstick: int8 passes
when its mean KL moves by less than 10% of the order-noise KL. Also reported: the two fused
prefills against each other (KL, identical greedy answers), bytes per token, and the TTFT of
the benchmark prompt read from disk with the OS page cache dropped (medians of ``--runs``).

    python -m benchmarks.kv_int8 --models smollm2 qwen2.5-0.5b --sets fidelity:3 squad:32
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from ragblend import BlendEngine, Chunk, FullRecompute
from ragblend.core.calibration import first_token_kl
from ragblend.core.controller import drop_page_cache
from ragblend.core.model import cache_dir
from ragblend.core.store import DiskStore
from ragblend.data import load_sample

from .common import MUSIQUE, RUNS_DIR, first_token_and_answer, prompt_sets, report_per_model, rouge_l
from .models import MODELS, model_path


def fidelity(engines: dict[str, BlendEngine], prompts, tokens: int) -> dict[str, list[float]]:
    """Per-prompt measures of each storage dtype against a full prefill (and each other)."""
    reference = next(iter(engines.values()))
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
            logits, stats, text = first_token_and_answer(engine, segments, None, tokens)
            fused[name] = logits, text
            add(f"{name} KL", first_token_kl(full_logits, logits))
            add(f"{name} ROUGE-L", rouge_l(text, full_text))
        (l16, t16), (l8, t8) = fused["float16"], fused["int8"]
        add("int8 vs float16 KL", first_token_kl(l16, l8))
        add("int8 vs float16 same answer", float(t16 == t8))
    return rows


def disk_ttft(engines: dict[str, BlendEngine], runs: int) -> dict[str, tuple[float, float]]:
    """(median TTFT in s, KV bytes per token) of the benchmark prompt, read from a disk store
    with the page cache dropped before each run."""
    sample = load_sample()
    segments = [Chunk(c) for c in sample["chunks"]] + [sample["question"]]
    out = {}
    with tempfile.TemporaryDirectory(prefix="int8-", dir=cache_dir()) as tmp:   # the store's device, not tmpfs
        for name, engine in engines.items():
            engine.store = DiskStore(Path(tmp) / name, engine.entry_spec)
            engine.write_back = False
            refs = engine.precompute(sample["chunks"])
            files = list((Path(tmp) / name).rglob("*.val"))
            times = []
            for _ in range(runs):
                for path in files:
                    drop_page_cache(path)
                t0 = time.perf_counter()
                engine.prefill(segments)
                times.append(time.perf_counter() - t0)
            stored = sum(p.stat().st_size for p in files)
            out[name] = statistics.median(times), stored / sum(r.num_tokens for r in refs)
            engine.store.close()
    return out


def report(model: str, engines, sets, tokens: int, runs: int) -> list[str]:
    strategy = next(iter(engines.values())).strategy
    lines = [f"## {model}", "", f"Default strategy: {strategy.name}({getattr(strategy, 'ratio', '')}), "
             f"{tokens}-token greedy answers.", "", "| set | prompts | order noise KL mean / median | float16 store KL mean / median | "
             "int8 store KL mean / median | KL change / order noise | order noise ROUGE-L | float16 ROUGE-L | "
             "int8 ROUGE-L | int8 vs float16: KL mean, same answer |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, prompts in sets.items():
        if not prompts:
            continue
        rows = fidelity(engines, prompts, tokens)
        mean, med = statistics.mean, statistics.median
        change = (mean(rows["int8 KL"]) - mean(rows["float16 KL"])) / mean(rows["order noise KL"])
        lines.append(
            f"| {name} | {len(prompts)} | {mean(rows['order noise KL']):.4f} / {med(rows['order noise KL']):.4f} | "
            f"{mean(rows['float16 KL']):.4f} / {med(rows['float16 KL']):.4f} | "
            f"{mean(rows['int8 KL']):.4f} / {med(rows['int8 KL']):.4f} | {change:+.1%} | "
            f"{mean(rows['order noise ROUGE-L']):.3f} | {mean(rows['float16 ROUGE-L']):.3f} | "
            f"{mean(rows['int8 ROUGE-L']):.3f} | {mean(rows['int8 vs float16 KL']):.2e}, "
            f"{sum(rows['int8 vs float16 same answer']):.0f}/{len(prompts)} |")
        print(lines[-1], flush=True)
    ttft = disk_ttft(engines, runs)
    lines += ["", f"Benchmark prompt from a disk store, page cache dropped, median of {runs}:", "",
              "| kv_dtype | bytes per token | TTFT s |", "|---|---:|---:|"]
    lines += [f"| {name} | {per_token:,.0f} | {seconds:.3f} |" for name, (seconds, per_token) in ttft.items()]
    return lines + [""]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2"], choices=MODELS)
    parser.add_argument("--sets", nargs="+", default=["fidelity:3", "squad:32"])
    parser.add_argument("--tokens", type=int, default=32, help="greedy answer tokens")
    parser.add_argument("--runs", type=int, default=5, help="disk TTFT rounds")
    parser.add_argument("--out", default=RUNS_DIR)
    args = parser.parse_args(argv)

    def measure(model: str) -> list[str]:
        base = BlendEngine.from_pretrained(model_path(model), kv_dir=False)
        engines = {"float16": base,
                   "int8": BlendEngine(base.hf_model, base.tokenizer, kv_dtype="int8", name=base.name)}
        return report(model, engines, prompt_sets(args.sets, MUSIQUE), args.tokens, args.runs)

    report_per_model(args.models, measure, args.out, "kv-int8-run.md", "int8 KV storage", "benchmarks.kv_int8", argv)

if __name__ == "__main__":
    main()
